"""The response cache in front of the workers: hits are answered at once, only the misses are
classified, and their answers kept for next time."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

from service.http.base.departure import Departure
from service.http.cache.response_cache import ResponseCache
from service.metrics import metrics
from service.repository.table import VersionRoute
from service.tracing import stage_span
from service.wire import Answer

# The stage a hit's ``timings_ms`` (and so its Server-Timing header) holds: the lookup's milliseconds.
CACHE_STAGE = "cache"

Classify = Callable[[Sequence[bytes], int, VersionRoute, "Departure | None"], Awaitable[tuple[list[Answer], float]]]


def from_cache(answer: Answer) -> bool:
    """Whether ``answer`` came from the cache (``X-Cache: hit``)."""
    return CACHE_STAGE in answer.timings_ms


async def classify_through(
    cache: ResponseCache,
    classify: Classify,
    images: Sequence[bytes],
    top_k: int,
    route: VersionRoute,
    departure: Departure | None,
) -> tuple[list[Answer], float]:
    """Each image's ``Answer``, from the cache where it has one, else from ``classify`` (then kept);
    and the milliseconds to the last one. A request of hits only is never admitted nor queued."""
    started = time.monotonic()
    keys = cache.keys(images, route, top_k)
    with stage_span(CACHE_STAGE):  # traced requests (service/tracing/)
        answers = await cache.lookup(keys)
    lookup_ms = (time.monotonic() - started) * 1e3
    missing = []
    for index, answer in enumerate(answers):
        if answer is None:
            missing.append(index)
        else:
            answer.timings_ms[CACHE_STAGE] = lookup_ms
    hits = len(images) - len(missing)
    if hits:
        metrics().count_model_answers(route.name, route.version, [200] * hits)
    if not missing:
        metrics().observe_stages({"total": lookup_ms})
        return answers, lookup_ms  # type: ignore[return-value]  (no None left)
    ran, total_ms = await classify([images[index] for index in missing], top_k, route, departure)
    for index, answer in zip(missing, ran, strict=True):
        answers[index] = answer
        cache.store(keys[index], answer)  # only a 200 is kept
    return answers, lookup_ms + total_ms  # type: ignore[return-value]
