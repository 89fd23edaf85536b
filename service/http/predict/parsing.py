"""Read and parse the body of ``POST /predict``; runs in the HTTP processes.

Accepted bodies for ``POST /predict``:
- raw image bytes (``image/*``, ``application/octet-stream`` or no content type), ``?top_k=``;
- ``multipart/form-data`` with a file field ``image`` and an optional field ``top_k``; several
  ``image`` fields make a request of many images;
- JSON ``{"image": "<base64 or data: URL>", "top_k": 5}``, or ``{"images": [...], "top_k": 5}``;
- with any of them ``?logits=true``: each answer also holds the model's whole output (its logits).
Malformed requests are refused here with a 4xx ``ServiceError``; the images' headers are checked
next (service/http/pipeline/checks.py), so only well-formed requests take a queue slot. In a request of many
images, a bad one gets its own error and the others are still classified.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import reprlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from service import _defaults
from service.errors import InvalidInput, PayloadTooLarge, ServiceError, UnprocessableContent
from service.http.base.limits import RequestLimits, read_body
from service.http.base.top_k import top_k_value
from service.wire import Answer, answer_for

# The form has an image and maybe top_k; a few more fields are tolerated, thousands are not.
MAX_FORM_FIELDS = 16


def predict_top_k(raw: object) -> int:
    value = top_k_value(raw, text_allowed=True)
    if value is None:
        raise UnprocessableContent(
            f"top_k must be an integer from 1 to {_defaults.MAX_TOP_K}, got {reprlib.repr(raw)}."
        )
    return value


def decode_base64_image(text: object, what: str = 'JSON field "image"') -> bytes:
    """The bytes of a base64 string or data: URL; ``what`` names it in the 400's detail."""
    if not isinstance(text, str) or not text:
        raise InvalidInput(f"{what} must be a non-empty base64 string of the image file.")
    if text.startswith("data:"):
        _, sep, text = text.partition(",")  # data:image/jpeg;base64,<payload>
        if not sep:
            raise InvalidInput(f'{what} is a data: URL without a "," before the payload.')
    text = "".join(text.split())  # `base64` wraps its output at 76 columns; the breaks carry nothing
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(f"{what} is not valid base64. Encode the file bytes, e.g. base64.b64encode(data).") from None


@dataclass(frozen=True)
class PredictRequest:
    """A parsed ``POST /predict``: its images in order, each the file's bytes or its own error."""

    images: list[bytes | Answer]
    top_k: int = _defaults.TOP_K
    many: bool = False  # sent as several images (answered {"results": [...]}), even if only one came
    logits: bool = False  # ?logits=true: each answer also holds the model's whole output

    @property
    def worker_top_k(self) -> int:
        """How many classes the workers return for each image: the request's ``top_k``."""
        return self.top_k

    @property
    def wants_logits(self) -> bool:
        return self.logits


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
        raise InvalidInput(f"The multipart form is malformed: {exc.message}") from None


def too_many_images(count: int | str, limit: int) -> ServiceError:
    return PayloadTooLarge(
        f"The request has {count} images; the limit is {limit} per request (server flag --max-images-per-request). "
        "Split the images over several requests.",
    )


LOGITS_PARAMETER = "logits"
_FLAG_VALUES = {"true": True, "1": True, "false": False, "0": False}


def logits_flag(raw: str | None) -> bool:
    """``?logits=``: true or 1 asks for each image's whole logits row; false, 0 or absent does not."""
    if raw is None:
        return False
    value = _FLAG_VALUES.get(raw.strip().lower())
    if value is None:
        raise UnprocessableContent(f"logits must be true or false, got {reprlib.repr(raw)}.")
    return value


async def read_predict_request(request: Request, limits: RequestLimits) -> PredictRequest:
    """Parse the body of ``POST /predict``; malformed requests raise ``ServiceError`` with a 4xx.

    A request of one image keeps the single-image answer; ``many`` is set for several ``image``
    fields or a JSON ``images`` list; ``logits`` by ``?logits=true``.
    """
    parsed = await _read_predict_body(request, limits)
    if request.scope.get("query_string") and logits_flag(request.query_params.get(LOGITS_PARAMETER)):
        return dataclasses.replace(parsed, logits=True)
    return parsed


async def _read_predict_body(request: Request, limits: RequestLimits) -> PredictRequest:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    top_k_raw: object = request.query_params.get("top_k")

    if content_type == "multipart/form-data":
        max_files = limits.max_images_per_request
        form = await _parse_multipart(request, await read_body(request, limits.max_body_bytes), max_files)
        try:
            fields = form.getlist("image")
            if not fields or not all(isinstance(f, UploadFile) for f in fields):
                raise InvalidInput('The multipart form needs a file field named "image" (curl -F image=@cat.jpg).')
            stray = sorted(
                {name for name, value in form.multi_items() if name != "image" and isinstance(value, UploadFile)}
            )
            if stray:
                raise InvalidInput(
                    f'Files go in fields named "image" (repeat it for several); got file field(s) {stray}.'
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
            raise InvalidInput('The body is not valid JSON. Send {"image": "<base64>", "top_k": 5}.') from None
        if isinstance(body, dict) and "images" in body:
            return _many_from_json(body, top_k_raw, limits.max_images_per_request)
        image, top_k = image_from_json(body, top_k_raw)
        return PredictRequest([image], top_k)
    return PredictRequest([_nonempty(await read_body(request, limits.max_body_bytes))], _top_k(top_k_raw))


def _many_from_json(body: dict, top_k_raw: object, limit: int) -> PredictRequest:
    """``{"images": ["<base64>", ...], "top_k": 5}``: an item that is not base64 gets its own 400."""
    if "image" in body:
        raise InvalidInput('Send either "image" (one image) or "images" (a list), not both.')
    encoded = body["images"]
    if not isinstance(encoded, list) or not encoded:
        raise InvalidInput('JSON field "images" must be a non-empty list of base64-encoded image files.')
    if len(encoded) > limit:
        raise too_many_images(len(encoded), limit)
    images: list[bytes | Answer] = []
    for index, text in enumerate(encoded):
        try:
            images.append(decode_base64_image(text, f'Item {index} of JSON field "images"'))
        except ServiceError as exc:
            images.append(answer_for(exc))
    return PredictRequest(images, _top_k(body.get("top_k", top_k_raw)), many=True)


def image_from_json(body: object, top_k_raw: object = None) -> tuple[bytes, int]:
    """``{"image": "<base64 or data: URL>", "top_k": 5}``, already parsed: the image and its top_k."""
    if not isinstance(body, dict) or "image" not in body:
        raise InvalidInput(
            'The JSON body needs a field "image" holding the base64-encoded image file (or "images", a list of them).',
        )
    return _nonempty(decode_base64_image(body["image"])), _top_k(body.get("top_k", top_k_raw))


_NO_IMAGE = (
    "The request has no image. Send the image bytes as the body (Content-Type: image/jpeg), "
    'a multipart file field "image", or JSON {"image": "<base64>"}.'
)


def _nonempty(image: bytes) -> bytes:
    if not image:
        raise InvalidInput(_NO_IMAGE)
    return image


def _no_image(index: int) -> Answer:
    return answer_for(InvalidInput(f"Image {index} is empty: the file field has no bytes."))


def _top_k(top_k_raw: object) -> int:
    return _defaults.TOP_K if top_k_raw is None else predict_top_k(top_k_raw)
