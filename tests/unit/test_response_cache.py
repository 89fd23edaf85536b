"""The response cache (service/http/cache/) without Redis: its keys' scope, its value codec, the
memory tier's byte bound and order, what is stored, and what a hit gives back."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pickle
import random
import re
import subprocess
import sys

import pytest

from service.http.cache import ResponseCache, codec
from service.http.cache import keys as cache_keys
from service.http.cache.breaker import Breaker
from service.http.cache.keys import cache_key, model_fingerprint
from service.http.cache.memory import ENTRY_OVERHEAD_BYTES, MemoryCache
from service.http.cache.redis_store import RedisStore, redacted_url
from service.metrics import metrics
from service.model_info import ModelInfo
from service.repository.table import VersionRoute
from service.settings import ServeSettings
from service.wire import Answer

PREDICTIONS = ((281, "tabby", 0.625), (285, "Egyptian cat", 0.25), (282, "tiger cat", 0.125))
ANSWER = Answer(200, predictions=PREDICTIONS, model="resnet18", engine="onnxruntime", batch_size=4, timings_ms={"x": 1})


def model_info(**artifact: object) -> ModelInfo:
    return ModelInfo(
        model="resnet18",
        weights="IMAGENET1K_V1",
        engine="onnxruntime",
        preprocess="pil",
        preprocess_reason="default",
        preprocess_spec={"resize": 256, "crop": 224},
        labels_source="imagenet",
        device="cpu",
        max_batch_size=8,
        batch_timeout_ms=5.0,
        artifact={"compiled_at": "2026-01-01T00:00:00Z", "weights_sha256": "ab" * 32, **artifact},
    )


def route(name: str = "resnet18", version: int = 1, info: ModelInfo | None = None) -> VersionRoute:
    return VersionRoute(name=name, version=version, workers=(0, 1), model=info or model_info())


def key_of(image: bytes = b"image", top_k: int = 5, **route_fields: object) -> str:
    return cache_key(image, model_fingerprint(route(**route_fields)), top_k)


# -- keys ----------------------------------------------------------------------------------------------


def test_the_same_image_model_and_top_k_give_the_same_key() -> None:
    key = key_of()
    assert key == key_of(), "an equal route (another object) must give the same key"
    assert re.fullmatch(r"vs1:[0-9a-f]{32}:5:[0-9a-f]{64}", key), key


@pytest.mark.parametrize(
    "changed",
    [
        {"image": b"image2"},
        {"top_k": 3},
        {"version": 2},
        {"name": "resnet18-b"},
        {"info": model_info(compiled_at="2026-02-02T00:00:00Z")},  # rebuilt under the same name and version
        {"info": model_info(weights_sha256="cd" * 32)},
        {"info": dataclasses.replace(model_info(), preprocess_spec={"resize": 232, "crop": 224})},
    ],
)
def test_any_change_of_image_top_k_or_model_changes_the_key(changed: dict) -> None:
    assert key_of(**changed) != key_of()


@pytest.mark.parametrize(
    "same_answers",
    [
        {"max_batch_size": 32, "batch_timeout_ms": 0.0, "preprocess_reason": "--preprocess pil"},
        {"device": "cpu:0"},
        {"artifact": {**model_info().artifact, "directory": "/elsewhere/resnet18/1", "batch": {"max": 64}}},
    ],
)
def test_replicas_that_batch_or_lie_differently_share_keys(same_answers: dict) -> None:
    """What cannot change an answer (batching, where the files lie, which device of a kind) is no part
    of the key, so such replicas share Redis entries."""
    assert key_of(info=dataclasses.replace(model_info(), **same_answers)) == key_of()


def test_a_key_is_the_same_in_another_process() -> None:
    """Replicas share Redis entries only if every process computes the same key: nothing in it may
    depend on the process (hash seeds, ids, dict order)."""
    script = "from tests.unit.test_response_cache import key_of\nprint(key_of())\n"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == key_of()


def test_fingerprints_are_memoised_per_route_object_and_bounded() -> None:
    served = route()
    assert model_fingerprint(served) is model_fingerprint(served)
    routes = [route(version=version) for version in range(3 * cache_keys.MAX_MEMOISED_ROUTES)]
    fingerprints = {model_fingerprint(each) for each in routes}
    assert len(fingerprints) == len(routes)
    assert len(cache_keys._fingerprints) <= cache_keys.MAX_MEMOISED_ROUTES


def test_the_cache_names_the_keys_of_a_request() -> None:
    cache = ResponseCache(1 << 20)
    images = [b"a", b"b", b"a"]
    keys = cache.keys(images, route(), top_k=5)
    assert keys == [key_of(image) for image in images]
    assert keys[0] == keys[2] != keys[1]


# -- codec ---------------------------------------------------------------------------------------------


def test_the_codec_round_trips_an_answer_as_compact_json() -> None:
    value = codec.encode(ANSWER)
    assert json.loads(value)["p"][0] == [281, "tabby", 0.625]
    assert b", " not in value and b": " not in value
    decoded = codec.decode(value)
    assert decoded == Answer(200, predictions=PREDICTIONS, model="resnet18", engine="onnxruntime")
    assert decoded.batch_size == 0 and decoded.timings_ms == {}


def test_the_codec_keeps_a_probability_exactly_and_a_label_in_any_script() -> None:
    answer = Answer(200, predictions=((7, '猫 "ß"', 1 / 3),), model="m", engine="e")
    assert codec.decode(codec.encode(answer)).predictions == ((7, '猫 "ß"', 1 / 3),)


def test_the_codec_refuses_to_encode_an_error() -> None:
    with pytest.raises(ValueError):
        codec.encode(Answer(503, detail="busy"))


GARBAGE = [
    b"",
    b"\xff\xfe",
    b"null",
    b"[]",
    b"{}",
    b'{"v":2,"m":"m","e":"e","p":[]}',
    b'{"v":1,"m":1,"e":"e","p":[]}',
    b'{"v":1,"m":"m","e":"e","p":{}}',
    b'{"v":1,"m":"m","e":"e","p":[[1,"a"]]}',
    b'{"v":1,"m":"m","e":"e","p":[[true,"a",0.5]]}',
    b'{"v":1,"m":"m","e":"e","p":[[1.5,"a",0.5]]}',
    b'{"v":1,"m":"m","e":"e","p":[[1,2,0.5]]}',
    b'{"v":1,"m":"m","e":"e","p":[[1,"a","0.5"]]}',
    b'{"v":1,"m":"m","e":"e","p":[[1,"a",NaN]]}',
    b"[" * 100_000,
    b'{"v":1,"m":"' + b"x" * codec.MAX_VALUE_BYTES + b'","e":"e","p":[]}',
    pickle.dumps(ANSWER),
]


@pytest.mark.parametrize("value", GARBAGE, ids=range(len(GARBAGE)))
def test_a_value_the_codec_did_not_make_is_a_miss(value: bytes) -> None:
    assert codec.decode(value) is None


def test_random_bytes_never_make_the_codec_raise() -> None:
    rng = random.Random(0)
    valid = codec.encode(ANSWER)
    for _ in range(2000):
        mutated = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        decoded = codec.decode(bytes(mutated))
        assert decoded is None or decoded.status_code == 200
        assert codec.decode(rng.randbytes(rng.randint(0, 64))) is None


# -- memory tier ---------------------------------------------------------------------------------------


def entry_cost(key: str, value: bytes) -> int:
    return len(key) + len(value) + ENTRY_OVERHEAD_BYTES


def test_the_memory_tier_stays_within_its_bytes_and_evicts_the_least_recently_used() -> None:
    value = b"v" * 100
    memory = MemoryCache(3 * entry_cost("k0", value))
    for name in ("k0", "k1", "k2"):
        memory.put(name, value)
    assert memory.entries == 3 and memory.bytes_used == 3 * entry_cost("k0", value)
    assert memory.get("k0") == value  # k0 is now the most recently used: k1 goes first
    memory.put("k3", value)
    assert memory.get("k1") is None
    assert [memory.get(name) is not None for name in ("k0", "k2", "k3")] == [True, True, True]
    memory.put("k4", b"w" * 250)  # costs more than one entry: two go
    assert memory.get("k0") is None and memory.get("k2") is None
    assert memory.entries == 2 and memory.bytes_used <= memory.max_bytes
    assert memory.bytes_used == entry_cost("k3", value) + entry_cost("k4", b"w" * 250)


def test_the_memory_tier_replaces_a_key_and_refuses_an_entry_larger_than_itself() -> None:
    memory = MemoryCache(1000)
    memory.put("k", b"a" * 10)
    memory.put("k", b"b" * 20)
    assert memory.entries == 1 and memory.bytes_used == entry_cost("k", b"b" * 20)
    memory.put("big", b"x" * 1000)
    assert memory.get("big") is None
    assert memory.get("k") == b"b" * 20, "an entry too large to keep must not evict the others"


# -- the cache -----------------------------------------------------------------------------------------


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    return metrics().registry.get_sample_value(name, labels) or 0.0


def test_a_hit_is_a_new_answer_each_time() -> None:
    cache = ResponseCache(1 << 20)
    (key,) = cache.keys([b"photo"], route(), 5)
    cache.store(key, ANSWER)

    first, second = asyncio.run(cache.lookup([key])), asyncio.run(cache.lookup([key]))
    assert first[0] == second[0] == Answer(200, predictions=PREDICTIONS, model="resnet18", engine="onnxruntime")
    assert first[0] is not second[0]
    first[0].timings_ms["cache"] = 0.1  # what a caller does with its answer
    assert second[0].timings_ms == {}
    assert asyncio.run(cache.lookup([key]))[0].timings_ms == {}


@pytest.mark.parametrize(
    "answer",
    [
        Answer(503, detail="busy", retry_after_s=1),
        Answer(400, detail="not an image"),
        Answer(504, detail="deadline"),
        Answer(200, predictions=None),
    ],
)
def test_only_a_200_with_predictions_is_stored(answer: Answer) -> None:
    cache = ResponseCache(1 << 20)
    cache.store("k", answer)
    assert cache.memory.entries == 0
    assert asyncio.run(cache.lookup(["k"])) == [None]


def test_lookups_count_hits_by_tier_and_misses_per_image() -> None:
    cache = ResponseCache(1 << 20)
    cache.store("a", ANSWER)
    hits, misses = (
        sample("vision_serve_response_cache_hits_total", {"tier": "memory"}),
        sample("vision_serve_response_cache_misses_total"),
    )
    answers = asyncio.run(cache.lookup(["a", "b", "a", "c"]))
    assert [answer is not None for answer in answers] == [True, False, True, False]
    assert sample("vision_serve_response_cache_hits_total", {"tier": "memory"}) == hits + 2
    assert sample("vision_serve_response_cache_misses_total") == misses + 2
    stats = cache.stats()
    assert stats == {
        "max_mb": 1.0,
        "entries": 1,
        "bytes": cache.memory.bytes_used,
        "hits": 2,
        "misses": 2,
        "redis": None,
    }


def test_from_settings_makes_no_cache_at_0_mb_and_no_connection_ahead_of_use() -> None:
    assert ResponseCache.from_settings(ServeSettings()) is None
    cache = ResponseCache.from_settings(ServeSettings(response_cache_mb=3))
    assert cache is not None and cache.memory.max_bytes == 3 << 20 and cache.redis is None
    url = "redis://:s3cret@127.0.0.1:1/0"
    shared = ResponseCache.from_settings(
        ServeSettings(response_cache_mb=1, response_cache_redis=url, response_cache_redis_timeout_ms=15)
    )
    assert shared.redis is not None and shared.redis.timeout_s == pytest.approx(0.015)
    assert shared.redis._client is None, "the client is made in the HTTP process's loop, not before the fork"
    assert "s3cret" not in json.dumps(shared.stats())


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:pw@cache:6379/1", "redis://:***@cache:6379/1"),
        ("rediss://user:p%40ss@cache:6380", "rediss://user:***@cache:6380"),
        ("redis://token@cache", "redis://***@cache"),
        ("unix:///run/redis.sock?db=2&password=pw", "unix:///run/redis.sock?db=2&password=***"),
    ],
)
def test_the_redis_url_is_shown_without_its_password(url: str, shown: str) -> None:
    assert redacted_url(url) == shown
    assert RedisStore(url, timeout_s=0.02, ttl_s=60).describe() == {"url": shown, "healthy": True, "errors": 0}


def test_the_breaker_allows_one_trial_per_wait_while_open() -> None:
    now = [100.0]
    breaker = Breaker(5.0, clock=lambda: now[0])
    assert breaker.allows() and breaker.closed
    assert breaker.failed() is True, "the first failure opens it"
    assert not breaker.allows()
    now[0] += 4.9
    assert not breaker.allows()
    now[0] += 0.2
    assert breaker.allows(), "after the wait: one trial"
    assert not breaker.allows(), "and only one"
    assert breaker.failed() is False, "a failed trial is the same outage"
    now[0] += 5.1
    assert breaker.allows()
    assert breaker.succeeded() is True and breaker.closed and breaker.allows()
