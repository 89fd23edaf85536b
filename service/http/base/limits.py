"""The limits on what a client sends to an HTTP process (``/predict`` and the Open Inference
Protocol's REST routes alike), and reading a request body within them."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from service import _defaults
from service.errors import ClientClosed, PayloadTooLarge, ServiceError, error_of_status
from service.http.base.request_scope import BODY_CUT_OFF


@dataclass(frozen=True)
class RequestLimits:
    """What the HTTP process accepts before a request may be queued (flags --max-body-bytes etc.)."""

    max_body_bytes: int = _defaults.MAX_BODY_BYTES
    max_image_pixels: int = _defaults.MAX_IMAGE_PIXELS
    max_images_per_request: int = _defaults.MAX_IMAGES_PER_REQUEST


def _too_large(limit: int, n_bytes: int | None = None) -> ServiceError:
    size = f"{n_bytes:,} bytes" if n_bytes is not None else "larger than that"
    return PayloadTooLarge(f"The request body is {size}; the limit is {limit:,} bytes (server flag --max-body-bytes).")


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
            cut_off = request.scope.get(BODY_CUT_OFF)
            if cut_off is not None:  # the connection guard closed it (408, 400): counted as what it answered
                raise error_of_status(*cut_off)
            raise ClientClosed()
        chunk = message.get("body", b"")
        received += len(chunk)
        if received > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
