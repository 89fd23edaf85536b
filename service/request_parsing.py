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
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise HTTPException(
            400, 'JSON field "image" is not valid base64. Encode the file bytes, e.g. base64.b64encode(data).'
        ) from None


def _check_size(n_bytes: int) -> None:
    if n_bytes > _defaults.MAX_BODY_BYTES:
        raise HTTPException(413, f"The request body is {n_bytes:,} bytes; the limit is {_defaults.MAX_BODY_BYTES:,}.")


async def read_image_request(request: Request) -> ImageRequest:
    """FastAPI dependency: parse the body of ``POST /predict``."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit():
        _check_size(int(declared))
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    top_k_raw: object = request.query_params.get("top_k")

    if content_type == "multipart/form-data":
        async with request.form() as form:
            field = form.get("image")
            if not isinstance(field, UploadFile):
                raise HTTPException(
                    400, 'The multipart form needs a file field named "image" (curl -F image=@cat.jpg).'
                )
            image = await field.read()
            top_k_raw = form.get("top_k", top_k_raw)
    elif content_type == "application/json" or content_type.endswith("+json"):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise HTTPException(400, 'The body is not valid JSON. Send {"image": "<base64>", "top_k": 5}.') from None
        if not isinstance(body, dict) or "image" not in body:
            raise HTTPException(400, 'The JSON body needs a field "image" holding the base64-encoded image file.')
        image = decode_base64_image(body["image"])
        top_k_raw = body.get("top_k", top_k_raw)
    else:
        image = await request.body()

    _check_size(len(image))
    if not image:
        raise HTTPException(
            400,
            "The request has no image. Send the image bytes as the body (Content-Type: image/jpeg), "
            'a multipart file field "image", or JSON {"image": "<base64>"}.',
        )
    top_k = _defaults.TOP_K if top_k_raw is None else parse_top_k(top_k_raw)
    return ImageRequest(image=image, top_k=top_k)
