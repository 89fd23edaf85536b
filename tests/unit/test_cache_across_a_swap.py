"""A request with both cache hits and misses whose version is replaced while its lookup waits
(service/http/cache/front.py ``for_route``, issue 64). The e2e swap-race test sends only misses; here
the old version's hit must not be answered for the new version, and the new version's answers must be
kept under its own keys, not the old one's."""

from __future__ import annotations

import asyncio
import dataclasses

from service.http.cache import ResponseCache
from service.http.cache.front import for_route, keep, look_up
from service.wire import Answer
from tests.unit.test_response_cache import ANSWER, model_info, route

OLD = route(version=1, info=model_info(weights_sha256="01" * 32))
NEW = route(version=2, info=model_info(weights_sha256="02" * 32))
IMAGES = [b"cached by the old version", b"never seen"]


def answered_by(version: int) -> Answer:
    """The model's answer, told apart by version through its top probability."""
    (index, label, _), *rest = ANSWER.predictions
    return dataclasses.replace(ANSWER, predictions=((index, label, 0.5 + version / 100), *rest), timings_ms={})


def top_probability(answer: Answer | None) -> float | None:
    return None if answer is None else answer.predictions[0][2]


def test_a_lookup_made_for_the_old_version_gives_the_new_one_no_hits_and_its_own_keys() -> None:
    cache = ResponseCache(1 << 20)
    cache.store(cache.keys(IMAGES[:1], OLD, 3)[0], answered_by(1))
    lookup = asyncio.run(look_up(cache, IMAGES, 3, OLD))
    assert lookup.missing == [1], "the old version's answer is a hit for the old version"

    swapped = for_route(cache, lookup, IMAGES, 3, NEW)
    assert swapped.missing == [0, 1], "the old version's hit answered a request the new version serves"
    assert swapped.keys == cache.keys(IMAGES, NEW, 3)

    answers = keep(cache, swapped, swapped.missing, [answered_by(2), answered_by(2)])
    assert [top_probability(answer) for answer in answers] == [0.52, 0.52]
    new_hits = asyncio.run(cache.lookup(cache.keys(IMAGES, NEW, 3), NEW.model, 3))
    assert [top_probability(hit) for hit in new_hits] == [0.52, 0.52], "kept under the new version's keys"
    old_hits = asyncio.run(cache.lookup(cache.keys(IMAGES, OLD, 3), OLD.model, 3))
    assert [top_probability(hit) for hit in old_hits] == [0.51, None], "stored under the old version's keys"


def test_a_lookup_for_the_version_still_served_keeps_its_hits() -> None:
    cache = ResponseCache(1 << 20)
    cache.store(cache.keys(IMAGES[:1], OLD, 3)[0], answered_by(1))
    lookup = asyncio.run(look_up(cache, IMAGES, 3, OLD))
    assert for_route(cache, lookup, IMAGES, 3, OLD) is lookup
