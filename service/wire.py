"""The contract between the HTTP processes and the inference workers: what travels over the channels
(service/transport/channels.py), pickled, in both directions. Plain data, no framework types: both
sides import it, and neither imports the other's modules.

HTTP process -> worker: a ``RequestBatch`` (the images one HTTP process queued for one worker in one
turn of its event loop); the worker takes them one by one as ``QueuedRequest``. ``AbandonedRequests``
names those whose client left, on a channel of its own. Worker -> HTTP
process: an ``AnswerBatch`` (a batch's answers for that process). One message, and one typed object,
per batch rather than per image: pickling an object per image is what would cost. The HTTP process
renders each ``Answer`` in its protocol's form (service/http/predict/render.py, service/http/oip/).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from service import _defaults
from service.errors import ServiceError

Prediction = tuple[int, str, float]  # (class index, label, score: the activation's, e.g. a probability)
# Byte order and type of ``Answer.logits``: little-endian float32, one per class (``array('f')`` and
# numpy's ``<f4`` read it on the machines vision-serve runs on).
LOGITS_DTYPE = "<f4"


@dataclass(frozen=True)
class ImageRequest:
    """One image to classify, as the worker receives it."""

    image: bytes
    top_k: int = _defaults.TOP_K
    # time.monotonic() when the HTTP process admitted it (system-wide on Linux, so the worker can
    # subtract it from its own clock): the deadline counts from it, and Server-Timing's queue stage.
    # None: made by the worker itself (warm-up).
    queued_at: float | None = None
    request_id: str | None = None  # for the worker's logs (service/http/base/observer.py)
    # The W3C traceparent of the HTTP process's span for this image when the request is traced
    # (service/tracing/), so the worker's spans join its trace; None when not traced.
    trace_parent: str | None = None
    # time.monotonic() after which nobody waits for the answer (the client's deadline or the server's
    # --request-timeout-s, whichever ends first): the worker drops the image unrun. None: never.
    deadline: float | None = None
    # The request asked for the model's whole output (OIP's LOGITS, /predict?logits=true): the answer
    # then carries every class's logit. False (the default): only the top-k cross back.
    logits: bool = False

    def expired(self, now: float) -> bool:
        """Whether the deadline passed by ``now`` (``time.monotonic()``)."""
        return self.deadline is not None and now > self.deadline


@dataclass(frozen=True)
class Answer:
    """One image's outcome: ``predictions`` for a 200, else ``status_code`` and ``detail`` (and
    ``retry_after_s`` where retrying may succeed), as a ``ServiceError`` would say it."""

    status_code: int = 200
    predictions: tuple[Prediction, ...] | None = None
    detail: str = ""
    model: str = ""
    engine: str = ""
    batch_size: int = 0  # 0: the image never reached a batch
    timings_ms: dict[str, float] = field(default_factory=dict)
    retry_after_s: int | None = None
    # The model's output before its activation, one float32 per class (``LOGITS_DTYPE``), only when the
    # request asked for it (``ImageRequest.logits``); None otherwise.
    logits: bytes | None = None


def answer_for(error: ServiceError) -> Answer:
    """The ``Answer`` of one image that met ``error``: it fails alone among the others."""
    return Answer(status_code=error.status, detail=error.message, retry_after_s=error.retry_after_s)


class RequestBatch(NamedTuple):
    """HTTP process -> worker: admitted images, ``uids[i]`` for ``requests[i]``."""

    api_server: int  # the HTTP process that waits for the answers
    uids: list[int]  # each unique within that HTTP process
    requests: list[ImageRequest]
    # The last message this HTTP process sends the worker: its version was replaced or unloaded
    # (service/repository/table.py). A worker that has one from every HTTP process and has answered
    # everything before them exits.
    final: bool = False


class AbandonedRequests(NamedTuple):
    """HTTP process -> worker, on a socket of its own (so it overtakes the requests queued before
    it): these requests' clients left; drop them unrun if they are still queued."""

    api_server: int
    uids: list[int]


class QueuedRequest(NamedTuple):
    """One image of a ``RequestBatch``, as the worker's loop takes it."""

    api_server: int
    uid: int
    request: ImageRequest


class AnswerBatch(NamedTuple):
    """Worker -> HTTP process: the answers to some of its requests, ``answers[i]`` for ``uids[i]``."""

    uids: list[int]
    answers: list[Answer]
