"""The response cache in front of the workers: the steps of a request's way through an HTTP process
that ask it (service/http/pipeline/pipeline.py calls them, in order). ``look_up`` before admission
(hits are answered at once, before any decode), ``for_route`` once the version that answers the
misses is known, ``keep`` once they have run. Nothing here admits, submits or calls back up: the
pipeline does those in between."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from service.http.cache.keys import model_fingerprint
from service.http.cache.response_cache import ResponseCache
from service.metrics import metrics
from service.repository.table import VersionRoute
from service.tracing import stage_span
from service.wire import Answer

# The stage a hit's ``timings_ms`` (and so its Server-Timing header) holds: the lookup's milliseconds.
CACHE_STAGE = "cache"


def from_cache(answer: Answer) -> bool:
    """Whether ``answer`` came from the cache (``X-Cache: hit``)."""
    return CACHE_STAGE in answer.timings_ms


@dataclass
class Lookup:
    """What the cache had for a request's images: ``answers[i]`` for image ``i`` (``None``: a miss),
    under ``keys[i]`` of ``route``'s model; ``ms``: how long the lookup took."""

    route: VersionRoute
    keys: list[str]
    answers: list[Answer | None]
    ms: float

    @property
    def missing(self) -> list[int]:
        """The indices of the images the cache had no answer for, in input order."""
        return [index for index, answer in enumerate(self.answers) if answer is None]


async def look_up(cache: ResponseCache, images: Sequence[bytes], top_k: int, route: VersionRoute) -> Lookup:
    """Each image's answer from the cache where it has one (its ``timings_ms`` holds the lookup's
    milliseconds), counted as answered by ``route``'s model."""
    started = time.monotonic()
    keys = cache.keys(images, route, top_k)
    with stage_span(CACHE_STAGE):  # traced requests (service/tracing/)
        answers = await cache.lookup(keys, route.model, top_k)
    lookup_ms = (time.monotonic() - started) * 1e3
    hits = 0
    for answer in answers:
        if answer is not None:
            answer.timings_ms[CACHE_STAGE] = lookup_ms
            hits += 1
    if hits:
        metrics().count_model_answers(route.name, route.version, [200] * hits)
    return Lookup(route, keys, answers, lookup_ms)


def for_route(cache: ResponseCache, lookup: Lookup, images: Sequence[bytes], top_k: int, route: VersionRoute) -> Lookup:
    """``lookup`` if ``route`` serves the model it was made for; else (a load replaced the version while
    the cache was asked) a lookup that found nothing, under ``route``'s own keys: the old version's hits
    are not its answers, and its answers are kept under its keys."""
    if model_fingerprint(route) == model_fingerprint(lookup.route):
        return lookup
    return Lookup(route, cache.keys(images, route, top_k), [None] * len(images), lookup.ms)


def keep(cache: ResponseCache, lookup: Lookup, missing: Sequence[int], ran: Sequence[Answer]) -> list[Answer]:
    """Every image's answer in input order: the hits, and ``ran[j]`` for image ``missing[j]``, which is
    kept for next time (only a 200 is)."""
    answers = list(lookup.answers)
    for index, answer in zip(missing, ran, strict=True):
        answers[index] = answer
        cache.store(lookup.keys[index], answer)
    return answers  # type: ignore[return-value]  (no None left)
