"""What a worker sends back for one image, and the one function that turns it into the HTTP answer.

The worker sends plain data (labels, probabilities, timings: a few hundred bytes pickled); the HTTP
process builds the JSON. That keeps JSON encoding off the loop that feeds the model, and the same
``render`` serves both vision-serve's own front end and a plain ``ls.LitServer``
(``ClassifierAPI.encode_response``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from starlette.responses import Response

from service._defaults import RETRY_AFTER_S
from service.rest.server_timing import server_timing

Prediction = tuple[int, str, float]  # (class index, label, probability)
# What Starlette's JSONResponse writes (compact, UTF-8, NaN refused), made once.
_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
_JSON_CONTENT_TYPE = (b"content-type", b"application/json")
# On every 503 a client may retry (overload, no ready worker, a worker that died).
RETRY_HEADERS = {"Retry-After": str(RETRY_AFTER_S)}


@dataclass(frozen=True)
class Answer:
    """One request's outcome: ``predictions`` for a 200, else ``status_code`` and ``detail``."""

    status_code: int = 200
    predictions: tuple[Prediction, ...] | None = None
    detail: str = ""
    model: str = ""
    engine: str = ""
    batch_size: int = 0  # 0: the request never reached a batch
    timings_ms: dict[str, float] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)


def error_answer(status_code: int, detail: str, headers: dict[str, str] | None = None) -> Answer:
    return Answer(status_code=status_code, detail=detail, headers=dict(headers or {}))


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


def answer_content(answer: Answer) -> dict:
    """One answer's JSON object: ``{"predictions": [...], "model", "engine"}`` or ``{"detail": ...}``."""
    if answer.predictions is None:
        return {"detail": answer.detail}
    return {
        "predictions": [
            {"index": index, "label": label, "probability": probability}
            for index, label, probability in answer.predictions
        ],
        "model": answer.model,
        "engine": answer.engine,
    }


def render(answer: Answer, total_ms: float | None = None) -> Response:
    """The answer as JSON (``answer_content``) with its status.

    Adds ``X-Batch-Size`` and a ``Server-Timing`` header with the worker's stages, this rendering as
    ``postprocess`` and ``total_ms`` as ``total``; ``answer.timings_ms`` gains ``postprocess`` too,
    for the stage metrics.
    """
    started = time.perf_counter()
    body = _JSON.encode(answer_content(answer)).encode()
    raw_headers = _raw_headers(body, answer.headers)
    if answer.batch_size:
        raw_headers.append((b"x-batch-size", str(answer.batch_size).encode()))
    if answer.timings_ms:
        answer.timings_ms["postprocess"] = (time.perf_counter() - started) * 1e3
    timings = answer.timings_ms if total_ms is None else {**answer.timings_ms, "total": total_ms}
    if timings:
        raw_headers.append((b"server-timing", server_timing(timings).encode("latin-1")))
    return AnswerResponse(answer.status_code, body, raw_headers)


def render_many(answers: list[Answer], total_ms: float) -> Response:
    """Several images' answers: ``{"results": [...]}`` in input order, each ``answer_content`` plus
    its ``status_code``. The request itself is a 200: its items succeed or fail one by one."""
    results = [{"status_code": answer.status_code, **answer_content(answer)} for answer in answers]
    body = _JSON.encode({"results": results}).encode()
    headers: dict[str, str] = {}
    for answer in answers:
        headers.update(answer.headers)  # e.g. Retry-After when an item got 503
    raw_headers = _raw_headers(body, headers)
    raw_headers.append((b"server-timing", server_timing({"total": total_ms}).encode("latin-1")))
    return AnswerResponse(200, body, raw_headers)


def _raw_headers(body: bytes, headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    raw_headers = [(b"content-length", str(len(body)).encode()), _JSON_CONTENT_TYPE]
    raw_headers += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]
    return raw_headers
