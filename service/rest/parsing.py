"""Turn an HTTP request into an ``ImageRequest``; runs in the HTTP server processes.

Accepted bodies for ``POST /predict``:
- raw image bytes (``image/*``, ``application/octet-stream`` or no content type), ``?top_k=``;
- ``multipart/form-data`` with a file field ``image`` and an optional field ``top_k``; several
  ``image`` fields make a request of many images;
- JSON ``{"image": "<base64 or data: URL>", "top_k": 5}``, or ``{"images": [...], "top_k": 5}``.
Malformed requests are answered here with a 4xx, and so are images whose header is bad or too
large: only well-formed requests take a queue slot. In a request of many images, a bad one gets its
own error and the others are still classified.
"""

from __future__ import annotations

import base64
import binascii
import json
import reprlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import HTTPException, Request
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect

from preprocessing.base import ImageDecodeError
from preprocessing.probe import check_image_header as check_header
from service import _defaults
from service.wire import Answer, error_answer

# The form has an image and maybe top_k; a few more fields are tolerated, thousands are not.
MAX_FORM_FIELDS = 16


@dataclass(frozen=True)
class ImageRequest:
    """What travels from the HTTP process to the inference worker: plain, picklable data."""

    image: bytes
    top_k: int = _defaults.TOP_K
    # time.monotonic() when the HTTP process queued it (system-wide on Linux, so the worker can
    # subtract it from its own clock): the start of the queue wait reported in Server-Timing.
    queued_at: float | None = None
    request_id: str | None = None  # for the worker's logs (service/frontend/observer.py)


def parse_top_k(raw: object) -> int:
    value = None
    # True/False are ints in Python, and int() also reads "1_0" and non-ASCII digits: none is a top_k.
    # The length check comes first: int() of a 5,000-digit string raises (Python's digit limit).
    text = raw.strip() if isinstance(raw, str) else ""
    if text and len(text) <= len(str(_defaults.MAX_TOP_K)) and text.isascii() and text.isdigit():
        value = int(text)
    elif isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    elif isinstance(raw, float) and raw.is_integer():
        value = int(raw)
    if value is None or not 1 <= value <= _defaults.MAX_TOP_K:
        raise HTTPException(422, f"top_k must be an integer from 1 to {_defaults.MAX_TOP_K}, got {reprlib.repr(raw)}.")
    return value


def decode_base64_image(text: object, what: str = 'JSON field "image"') -> bytes:
    """The bytes of a base64 string or data: URL; ``what`` names it in the 400's detail."""
    if not isinstance(text, str) or not text:
        raise HTTPException(400, f"{what} must be a non-empty base64 string of the image file.")
    if text.startswith("data:"):
        _, sep, text = text.partition(",")  # data:image/jpeg;base64,<payload>
        if not sep:
            raise HTTPException(400, f'{what} is a data: URL without a "," before the payload.')
    text = "".join(text.split())  # `base64` wraps its output at 76 columns; the breaks carry nothing
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise HTTPException(
            400, f"{what} is not valid base64. Encode the file bytes, e.g. base64.b64encode(data)."
        ) from None


@dataclass(frozen=True)
class RequestLimits:
    """What the HTTP process accepts before a request may be queued (flags --max-body-bytes etc.)."""

    max_body_bytes: int = _defaults.MAX_BODY_BYTES
    max_image_pixels: int = _defaults.MAX_IMAGE_PIXELS
    max_images_per_request: int = _defaults.MAX_IMAGES_PER_REQUEST


@dataclass(frozen=True)
class PredictRequest:
    """A parsed ``POST /predict``: its images in order, each the file's bytes or its own error."""

    images: list[bytes | Answer]
    top_k: int = _defaults.TOP_K
    many: bool = False  # sent as several images (answered {"results": [...]}), even if only one came


def _too_large(limit: int, n_bytes: int | None = None) -> HTTPException:
    size = f"{n_bytes:,} bytes" if n_bytes is not None else "larger than that"
    return HTTPException(
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
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        received += len(chunk)
        if received > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _parse_multipart(request: Request, body: bytes, max_files: int) -> FormData:
    """Parse a multipart body already read within the limit.

    Starlette's ``request.form()`` would read the whole stream itself, unbounded for a chunked upload.
    """

    async def replay() -> AsyncIterator[bytes]:
        yield body

    try:
        return await MultiPartParser(request.headers, replay(), max_files=max_files, max_fields=MAX_FORM_FIELDS).parse()
    except MultiPartException as exc:
        if exc.message.startswith("Too many files"):
            raise too_many_images(f"more than {max_files}", max_files) from None
        raise HTTPException(400, f"The multipart form is malformed: {exc.message}") from None


def too_many_images(count: int | str, limit: int) -> HTTPException:
    return HTTPException(
        413,
        f"The request has {count} images; the limit is {limit} per request (server flag --max-images-per-request). "
        "Split the images over several requests.",
    )


def check_image_header(image: bytes, max_image_pixels: int) -> None:
    """Reject what no decoder should see (not an image, corrupt header, too many pixels) with its 4xx.

    Only the header is parsed, so a decompression bomb costs microseconds here and never reaches a
    decoder or a queue slot. The worker probes again (it may be fed by other callers).
    """
    error = header_error(image, max_image_pixels)
    if error is not None:
        raise HTTPException(error.status_code, error.detail)


def header_error(image: bytes, max_image_pixels: int) -> Answer | None:
    """The image's own 4xx ``Answer`` if its header is bad or too large, else ``None``: for requests of
    several images, where one bad image must not fail the others."""
    try:
        check_header(image, max_image_pixels)
    except ImageDecodeError as exc:
        return error_answer(exc.error.status_code, exc.error.detail)
    return None


async def read_predict_request(request: Request, limits: RequestLimits) -> PredictRequest:
    """Parse the body of ``POST /predict``; malformed requests raise ``HTTPException`` with a 4xx.

    A request of one image keeps the single-image answer; ``many`` is set for several ``image``
    fields or a JSON ``images`` list.
    """
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    top_k_raw: object = request.query_params.get("top_k")

    if content_type == "multipart/form-data":
        max_files = limits.max_images_per_request
        form = await _parse_multipart(request, await read_body(request, limits.max_body_bytes), max_files)
        try:
            fields = form.getlist("image")
            if not fields or not all(isinstance(f, UploadFile) for f in fields):
                raise HTTPException(
                    400, 'The multipart form needs a file field named "image" (curl -F image=@cat.jpg).'
                )
            stray = sorted(
                {name for name, value in form.multi_items() if name != "image" and isinstance(value, UploadFile)}
            )
            if stray:
                raise HTTPException(
                    400, f'Files go in fields named "image" (repeat it for several); got file field(s) {stray}.'
                )
            images = [await field.read() for field in fields]
            top_k_raw = form.get("top_k", top_k_raw)
        finally:
            await form.close()
        top_k = _top_k(top_k_raw)
        if len(images) == 1:
            return PredictRequest([_nonempty(images[0])], top_k)
        return PredictRequest([image or _no_image(index) for index, image in enumerate(images)], top_k, many=True)
    if content_type == "application/json" or content_type.endswith("+json"):
        try:
            body = json.loads(await read_body(request, limits.max_body_bytes))
        except (ValueError, RecursionError):  # bad JSON or UTF-8, 5000-digit integers, absurd nesting
            raise HTTPException(400, 'The body is not valid JSON. Send {"image": "<base64>", "top_k": 5}.') from None
        if isinstance(body, dict) and "images" in body:
            return _many_from_json(body, top_k_raw, limits.max_images_per_request)
        single = image_request_from_json(body, top_k_raw)
        return PredictRequest([single.image], single.top_k)
    return PredictRequest([_nonempty(await read_body(request, limits.max_body_bytes))], _top_k(top_k_raw))


def _many_from_json(body: dict, top_k_raw: object, limit: int) -> PredictRequest:
    """``{"images": ["<base64>", ...], "top_k": 5}``: an item that is not base64 gets its own 400."""
    if "image" in body:
        raise HTTPException(400, 'Send either "image" (one image) or "images" (a list), not both.')
    encoded = body["images"]
    if not isinstance(encoded, list) or not encoded:
        raise HTTPException(400, 'JSON field "images" must be a non-empty list of base64-encoded image files.')
    if len(encoded) > limit:
        raise too_many_images(len(encoded), limit)
    images: list[bytes | Answer] = []
    for index, text in enumerate(encoded):
        try:
            images.append(decode_base64_image(text, f'Item {index} of JSON field "images"'))
        except HTTPException as exc:
            images.append(error_answer(exc.status_code, exc.detail))
    return PredictRequest(images, _top_k(body.get("top_k", top_k_raw)), many=True)


def image_request_from_json(body: object, top_k_raw: object = None) -> ImageRequest:
    """``{"image": "<base64 or data: URL>", "top_k": 5}``, already parsed; 4xx ``HTTPException`` if malformed."""
    if not isinstance(body, dict) or "image" not in body:
        raise HTTPException(
            400,
            'The JSON body needs a field "image" holding the base64-encoded image file (or "images", a list of them).',
        )
    return ImageRequest(_nonempty(decode_base64_image(body["image"])), _top_k(body.get("top_k", top_k_raw)))


_NO_IMAGE = (
    "The request has no image. Send the image bytes as the body (Content-Type: image/jpeg), "
    'a multipart file field "image", or JSON {"image": "<base64>"}.'
)


def _nonempty(image: bytes) -> bytes:
    if not image:
        raise HTTPException(400, _NO_IMAGE)
    return image


def _no_image(index: int) -> Answer:
    return error_answer(400, f"Image {index} is empty: the file field has no bytes.")


def _top_k(top_k_raw: object) -> int:
    return _defaults.TOP_K if top_k_raw is None else parse_top_k(top_k_raw)
