"""Turn an HTTP request into an ``ImageRequest``; runs in the HTTP server processes.

Accepted bodies for ``POST /predict``:
- raw image bytes (``image/*``, ``application/octet-stream`` or no content type), ``?top_k=``;
- ``multipart/form-data`` with a file field ``image`` and an optional field ``top_k``;
- JSON ``{"image": "<base64 or data: URL>", "top_k": 5}``.
Malformed requests are answered here with a 4xx; only well-formed ones reach the batch.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

from fastapi import HTTPException, Request
from starlette.datastructures import UploadFile

from service import _defaults


@dataclass(frozen=True)
class ImageRequest:
    """What travels from the HTTP process to the inference worker: plain, picklable data."""

    image: bytes
    top_k: int = _defaults.TOP_K


def parse_top_k(raw: object) -> int:
    if isinstance(raw, bool):
        raw = None  # True/False are ints in Python; never a valid top_k
    try:
        value = int(raw) if not isinstance(raw, float) or raw.is_integer() else None
    except (TypeError, ValueError):
        value = None
    if value is None or not 1 <= value <= _defaults.MAX_TOP_K:
        raise HTTPException(422, f"top_k must be an integer from 1 to {_defaults.MAX_TOP_K}, got {raw!r}.")
    return value


def decode_base64_image(text: object) -> bytes:
    if not isinstance(text, str) or not text:
        raise HTTPException(400, 'JSON field "image" must be a non-empty base64 string of the image file.')
    if text.startswith("data:"):
        _, sep, text = text.partition(",")  # data:image/jpeg;base64,<payload>
        if not sep:
            raise HTTPException(400, 'JSON field "image" is a data: URL without a "," before the payload.')
    text = "".join(text.split())  # `base64` wraps its output at 76 columns; the breaks carry nothing
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise HTTPException(
            400, 'JSON field "image" is not valid base64. Encode the file bytes, e.g. base64.b64encode(data).'
        ) from None


def _too_large(n_bytes: int | None = None) -> HTTPException:
    size = f"{n_bytes:,} bytes" if n_bytes is not None else "larger than that"
    return HTTPException(413, f"The request body is {size}; the limit is {_defaults.MAX_BODY_BYTES:,} bytes.")


def check_declared_length(request: Request) -> None:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > _defaults.MAX_BODY_BYTES:
        raise _too_large(int(declared))


async def read_body(request: Request) -> bytes:
    """The body, read chunk by chunk and abandoned as soon as it passes the limit.

    Content-Length alone is not enough: a chunked upload has none.
    """
    check_declared_length(request)
    chunks, received = [], 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > _defaults.MAX_BODY_BYTES:
            raise _too_large()
        chunks.append(chunk)
    return b"".join(chunks)


async def read_image_request(request: Request) -> ImageRequest:
    """FastAPI dependency: parse the body of ``POST /predict``."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    top_k_raw: object = request.query_params.get("top_k")

    if content_type == "multipart/form-data":
        check_declared_length(request)
        async with request.form() as form:
            field = form.get("image")
            if not isinstance(field, UploadFile):
                raise HTTPException(
                    400, 'The multipart form needs a file field named "image" (curl -F image=@cat.jpg).'
                )
            if field.size is not None and field.size > _defaults.MAX_BODY_BYTES:
                raise _too_large(field.size)
            image = await field.read()
            top_k_raw = form.get("top_k", top_k_raw)
    elif content_type == "application/json" or content_type.endswith("+json"):
        try:
            body = json.loads(await read_body(request))
        except (ValueError, RecursionError):  # bad JSON or UTF-8, 5000-digit integers, absurd nesting
            raise HTTPException(400, 'The body is not valid JSON. Send {"image": "<base64>", "top_k": 5}.') from None
        if not isinstance(body, dict) or "image" not in body:
            raise HTTPException(400, 'The JSON body needs a field "image" holding the base64-encoded image file.')
        image = decode_base64_image(body["image"])
        top_k_raw = body.get("top_k", top_k_raw)
    else:
        image = await read_body(request)

    if not image:
        raise HTTPException(
            400,
            "The request has no image. Send the image bytes as the body (Content-Type: image/jpeg), "
            'a multipart file field "image", or JSON {"image": "<base64>"}.',
        )
    top_k = _defaults.TOP_K if top_k_raw is None else parse_top_k(top_k_raw)
    return ImageRequest(image=image, top_k=top_k)
