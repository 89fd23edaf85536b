"""What a protocol hands the request pipeline and what it gets back: the model version asked for and
the client's departure (``Ask``), the request its parse made (``Parsed``), and every image's answer
with the version that gave them (``Outcome``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from service.http.base.deadlines import ClientDeadline
from service.http.base.request_scope import Departure
from service.http.cache.front import from_cache
from service.repository.table import VersionRoute
from service.wire import Answer


class Parsed(Protocol):
    """A request as a protocol's parse makes it (``/predict``'s ``PredictRequest``, the Open Inference
    Protocol's ``InferCall``)."""

    @property
    def images(self) -> Sequence[bytes | Answer]:
        """The image files in input order; an ``Answer`` in place of one that failed its parse."""

    @property
    def worker_top_k(self) -> int:
        """How many classes the workers return for each image."""

    @property
    def wants_logits(self) -> bool:
        """Whether the request asked for the model's whole output (each image's logits): the workers then
        send it, and the response cache is bypassed (it keeps top-k answers only)."""


P = TypeVar("P", bound=Parsed)


class Ask(NamedTuple):
    """What a protocol asks of the pipeline besides its parse. (A tuple: made once per request, and
    cheaper to make than a frozen dataclass.)"""

    model: str | None  # None or "": the default model
    version: str | None  # None or "": the model's latest; named, the request is pinned to it
    departure: Departure | None = None  # told when an HTTP client leaves (gRPC's leave by cancelling)
    # The protocol's rule for a request some of whose images were refused by their checks, given its
    # parsed request and each image's refusal (None where it may run): raise to fail the whole
    # request. None: a refused image is answered its own error and the others run (``/predict``'s
    # many images).
    on_refused: Callable[[Any, list[Answer | None]], None] | None = None
    # When the client stops waiting, as its request said (service/http/base/deadlines.py); a parse
    # may tighten it (the Open Inference Protocol's ``timeout`` parameter is in the body). None: the
    # server's own --request-timeout-s only.
    deadline: ClientDeadline | None = None

    @property
    def pinned(self) -> bool:
        """The request named its version: a version retired meanwhile is a 404, not the model's latest."""
        return bool(self.version)


@dataclass(slots=True)
class Outcome(Generic[P]):
    """A request through the pipeline: what its parse made, and every image's answer."""

    parsed: P
    answers: list[Answer]  # in input order, a refused image's refusal in its place
    ran: Sequence[int]  # the images that were not refused: answered by the cache or the workers
    total_ms: float  # from the cache lookup or admission to the last answer; 0 if none ran
    route: VersionRoute  # the version that answered
    cache_on: bool  # this HTTP process has a response cache (--response-cache-mb)
    load_ms: float = 0.0  # how long the request waited for its model to load (on demand); 0: it was resident

    def timings_ms(self) -> dict[str, float]:
        """The request's own stages for ``Server-Timing``: ``total``, and ``model_load`` when it waited for one."""
        if self.load_ms:
            return {"model_load": self.load_ms, "total": self.total_ms}
        return {"total": self.total_ms}

    @property
    def from_cache(self) -> bool:
        """Whether the cache answered every image that ran (``X-Cache: hit``); ``False`` if none ran."""
        return bool(self.ran) and all(from_cache(self.answers[index]) for index in self.ran)
