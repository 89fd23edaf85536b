"""``/predict``'s answers and errors as HTTP responses: JSON built in the HTTP process from the
workers' compact ``Answer`` values, with ``X-Batch-Size`` and ``Server-Timing`` headers.

The worker sends plain data (labels, probabilities, timings: a few hundred bytes pickled); building
the JSON here keeps that work off the loop that feeds the model.
"""

from __future__ import annotations

import json
import time
from array import array

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from service.errors import ServiceError, http_headers
from service.http.base.server_timing import server_timing
from service.wire import Answer

LOGITS_TYPECODE = "f"  # Answer.logits' float32 (service/wire.py LOGITS_DTYPE)

# What Starlette's JSONResponse writes (compact, UTF-8, NaN refused), made once.
_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
_JSON_CONTENT_TYPE = (b"content-type", b"application/json")


class AnswerResponse(Response):
    """A response whose body and raw headers are already built.

    Starlette's constructor would encode the headers again from a dict; at thousands of answers a
    second that is worth skipping. Everything else (``__call__``, ``headers``) is Starlette's own.
    """

    media_type = "application/json"

    def __init__(self, status_code: int, body: bytes, raw_headers: list[tuple[bytes, bytes]]) -> None:
        self.status_code = status_code
        self.body = body
        self.raw_headers = raw_headers
        self.background = None


def answer_content(answer: Answer, version: int | None = None) -> dict:
    """One answer's JSON object: ``{"predictions": [...], "model", "model_version", "engine"}`` (and
    ``"logits"``, every class's, when the request asked for them) or ``{"detail": ...}``."""
    if answer.predictions is None:
        return {"detail": answer.detail}
    content = {
        "predictions": [
            {"index": index, "label": label, "probability": probability}
            for index, label, probability in answer.predictions
        ],
        "model": answer.model,
        "engine": answer.engine,
    }
    if version is not None:
        content["model_version"] = str(version)
    if answer.logits is not None:
        content["logits"] = array(LOGITS_TYPECODE, answer.logits).tolist()
    return content


def render(answer: Answer, request_timings: dict[str, float] | None = None, version: int | None = None) -> Response:
    """The answer as JSON (``answer_content``) with its status.

    Adds ``X-Batch-Size`` and a ``Server-Timing`` header with the worker's stages, this rendering as
    ``postprocess`` and the request's own (``Outcome.timings_ms``: ``total``, and ``model_load`` when
    it waited for its model); ``answer.timings_ms`` gains ``postprocess`` too, for the stage metrics.
    """
    started = time.perf_counter()
    body = _JSON.encode(answer_content(answer, version)).encode()
    raw_headers = _raw_headers(body, http_headers(answer.status_code, answer.retry_after_s))
    if answer.batch_size:
        raw_headers.append((b"x-batch-size", str(answer.batch_size).encode()))
    if answer.timings_ms:
        answer.timings_ms["postprocess"] = (time.perf_counter() - started) * 1e3
    timings = answer.timings_ms if request_timings is None else {**answer.timings_ms, **request_timings}
    if timings:
        raw_headers.append((b"server-timing", server_timing(timings).encode("latin-1")))
    return AnswerResponse(answer.status_code, body, raw_headers)


def render_many(answers: list[Answer], request_timings: dict[str, float], version: int | None = None) -> Response:
    """Several images' answers: ``{"results": [...]}`` in input order, each ``answer_content`` plus
    its ``status_code``. The request itself is a 200: its items succeed or fail one by one."""
    results = [{"status_code": answer.status_code, **answer_content(answer, version)} for answer in answers]
    body = _JSON.encode({"results": results}).encode()
    headers: dict[str, str] = {}
    for answer in answers:
        headers.update(http_headers(answer.status_code, answer.retry_after_s))  # e.g. an item got 503
    raw_headers = _raw_headers(body, headers)
    raw_headers.append((b"server-timing", server_timing(request_timings).encode("latin-1")))
    return AnswerResponse(200, body, raw_headers)


def error_response(error: ServiceError) -> Response:
    """A ``ServiceError`` as ``/predict`` (and every other route of the native API) answers it:
    ``{"detail": message}``, the shape FastAPI gives its own errors."""
    return JSONResponse(
        {"detail": error.message}, status_code=error.status, headers=http_headers(error.status, error.retry_after_s)
    )


async def handle_service_error(request: Request, error: ServiceError) -> Response:
    """The app's exception handler for ``ServiceError`` (dependencies such as the API-key check)."""
    return error_response(error)


def _raw_headers(body: bytes, headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    raw_headers = [(b"content-length", str(len(body)).encode()), _JSON_CONTENT_TYPE]
    raw_headers += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]
    return raw_headers
