"""What a worker sends back for one image, and the one function that turns it into the HTTP answer.

The worker sends plain data (labels, probabilities, timings: a few hundred bytes pickled); the HTTP
process builds the JSON. That keeps JSON encoding off the loop that feeds the model, and the same
``render`` serves both vision-serve's own front end and a plain ``ls.LitServer``
(``ClassifierAPI.encode_response``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse

from service.server_timing import server_timing

Prediction = tuple[int, str, float]  # (class index, label, probability)


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


def render(answer: Answer) -> JSONResponse:
    """The answer as JSON: ``{"predictions": [...], "model", "engine"}`` or ``{"detail": ...}``.

    Adds ``X-Batch-Size`` and a ``Server-Timing`` header with the worker's stages and this
    rendering as ``postprocess``; ``answer.timings_ms`` gains it too, for the stage metrics.
    """
    started = time.perf_counter()
    headers = dict(answer.headers)
    if answer.batch_size:
        headers["X-Batch-Size"] = str(answer.batch_size)
    if answer.predictions is None:
        response = JSONResponse({"detail": answer.detail}, status_code=answer.status_code, headers=headers)
    else:
        body = {
            "predictions": [
                {"index": index, "label": label, "probability": probability}
                for index, label, probability in answer.predictions
            ],
            "model": answer.model,
            "engine": answer.engine,
        }
        response = JSONResponse(body, status_code=answer.status_code, headers=headers)
    if answer.timings_ms:
        answer.timings_ms["postprocess"] = (time.perf_counter() - started) * 1e3
        response.headers["Server-Timing"] = server_timing(answer.timings_ms)
    return response
