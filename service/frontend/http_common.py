"""What every HTTP protocol of an HTTP process shares (``/predict`` and the Open Inference Protocol's
REST routes): the limits on what a client sends, reading a body within them, the top_k rule, and the
``Server-Timing`` header."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from service import _defaults
from service.errors import ServiceError
from service.frontend.connection_guard import BODY_TIMED_OUT


@dataclass(frozen=True)
class RequestLimits:
    """What the HTTP process accepts before a request may be queued (flags --max-body-bytes etc.)."""

    max_body_bytes: int = _defaults.MAX_BODY_BYTES
    max_image_pixels: int = _defaults.MAX_IMAGE_PIXELS
    max_images_per_request: int = _defaults.MAX_IMAGES_PER_REQUEST


def _too_large(limit: int, n_bytes: int | None = None) -> ServiceError:
    size = f"{n_bytes:,} bytes" if n_bytes is not None else "larger than that"
    return ServiceError(
        413, f"The request body is {size}; the limit is {limit:,} bytes (server flag --max-body-bytes)."
    )


def check_declared_length(request: Request, limit: int) -> None:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit, int(declared))


async def read_body(request: Request, limit: int) -> bytes:
    """The body, read chunk by chunk and abandoned as soon as it passes the limit.

    Content-Length alone is not enough: a chunked upload has none. Reads the ASGI messages itself
    (``request.stream()`` is an async generator around the same loop, a few microseconds a request).
    """
    check_declared_length(request, limit)
    chunks, received = [], 0
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            if request.scope.get(BODY_TIMED_OUT):  # the connection guard closed it: counted as its 408
                raise ServiceError(408, "The request's body did not arrive in time (server flag --body-timeout-s).")
            raise ServiceError.client_closed()
        chunk = message.get("body", b"")
        received += len(chunk)
        if received > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def top_k_value(raw: object, text_allowed: bool) -> int | None:
    """``raw`` as a top_k (1..MAX_TOP_K), or ``None`` if it is not one. ``text_allowed``: digits in a
    string count (a query or form field); JSON values must be numbers. Each protocol words its own
    refusal (its status and message are part of its contract)."""
    value = None
    # True/False are ints in Python, and int() also reads "1_0" and non-ASCII digits: none is a top_k.
    # The length check comes first: int() of a 5,000-digit string raises (Python's digit limit).
    text = raw.strip() if text_allowed and isinstance(raw, str) else ""
    if text and len(text) <= len(str(_defaults.MAX_TOP_K)) and text.isascii() and text.isdigit():
        value = int(text)
    elif isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    elif text_allowed and isinstance(raw, float) and raw.is_integer():
        value = int(raw)
    return value if value is not None and 1 <= value <= _defaults.MAX_TOP_K else None


def server_timing(timings_ms: dict[str, float]) -> str:
    """The ``Server-Timing`` header (W3C), e.g. ``queue;dur=1.20, inference;dur=30.50``: the worker's
    stages (queue, preprocess, pipeline_wait when pipelined, inference), then postprocess (rendering)
    and total (admission to answer) from the HTTP process."""
    return ", ".join(f"{name};dur={ms:.2f}" for name, ms in timings_ms.items())
