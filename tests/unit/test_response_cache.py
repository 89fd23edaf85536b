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
LABELS = tuple({index: label for index, label, _ in PREDICTIONS}.get(i, f"class {i}") for i in range(1000))
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
        labels=LABELS,
    )


def route(name: str = "resnet18", version: int = 1, info: ModelInfo | None = None) -> VersionRoute:
    return VersionRoute(name=name, version=version, workers=(0, 1), model=info or model_info())


def key_of(image: bytes = b"image", top_k: int = 5, **route_fields: object) -> str:
    return cache_key(image, model_fingerprint(route(**route_fields)), top_k)


# -- keys ----------------------------------------------------------------------------------------------


def test_the_same_image_model_and_top_k_give_the_same_key() -> None:
    key = key_of()
    assert key == key_of(), "an equal route (another object) must give the same key"
    assert re.fullmatch(r"vs2:[0-9a-f]{32}:5:[0-9a-f]{64}", key), key


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
        {"sizing": {"workers_per_device": {"value": 16, "source": "auto"}, "usable_cores": 16}},  # a bigger host
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


def test_the_codec_round_trips_an_answer_as_compact_json_of_indices_and_probabilities() -> None:
    value = codec.encode(ANSWER)
    assert json.loads(value) == {"v": codec.VERSION, "p": [[281, 0.625], [285, 0.25], [282, 0.125]]}
    assert b", " not in value and b": " not in value and b"tabby" not in value  # labels come from the model
    decoded = codec.decode(value, model_info(), 3)
    assert decoded == Answer(200, predictions=PREDICTIONS, model="resnet18", engine="onnxruntime")
    assert decoded.batch_size == 0 and decoded.timings_ms == {}


def test_the_codec_keeps_a_probability_exactly_and_takes_the_label_from_the_model() -> None:
    labels = ("a", '猫 "ß"')
    answer = Answer(200, predictions=((1, "whatever the worker said", 1 / 3),), model="m", engine="e")
    decoded = codec.decode(codec.encode(answer), dataclasses.replace(model_info(), labels=labels), 1)
    assert decoded.predictions == ((1, '猫 "ß"', 1 / 3),)


def test_the_codec_refuses_to_encode_an_error() -> None:
    with pytest.raises(ValueError):
        codec.encode(Answer(503, detail="busy"))


def valid(pairs: list) -> bytes:
    return json.dumps({"v": codec.VERSION, "p": pairs}).encode()


# Each a value that is not an answer of model_info() (1,000 classes) to a request with top_k=3.
GARBAGE = {
    "empty": b"",
    "not utf-8": b"\xff\xfe",
    "null": b"null",
    "a list": b"[]",
    "no fields": b"{}",
    "another version": b'{"v":1,"p":[[281,0.5],[285,0.25],[282,0.1]]}',
    "the earlier format, with labels": b'{"v":1,"m":"m","e":"e","p":[[281,"pwned",0.5]]}',
    "an extra field": b'{"v":2,"p":[[281,0.5],[285,0.25],[282,0.1]],"l":["pwned"]}',
    "predictions not a list": b'{"v":2,"p":{}}',
    "fewer than top_k": valid([[281, 0.5], [285, 0.25]]),
    "more than top_k": valid([[i, 0.1] for i in range(7)]),
    "a pair of one": valid([[281], [285, 0.25], [282, 0.1]]),
    "a triple": valid([[281, "tabby", 0.5], [285, 0.25], [282, 0.1]]),
    "a boolean index": valid([[True, 0.5], [285, 0.25], [282, 0.1]]),
    "a float index": valid([[281.0, 0.5], [285, 0.25], [282, 0.1]]),
    "a 30-digit index": valid([[10**30, 0.5], [285, 0.25], [282, 0.1]]),
    "a negative index": valid([[-1, 0.5], [285, 0.25], [282, 0.1]]),
    "an index past the classes": valid([[1000, 0.5], [285, 0.25], [282, 0.1]]),
    "a repeated index": valid([[281, 0.5], [281, 0.25], [282, 0.1]]),
    "a probability as text": valid([[281, "0.5"], [285, 0.25], [282, 0.1]]),
    "a 400-digit probability": valid([[281, int("9" * 400)], [285, 0.25], [282, 0.1]]),
    "a probability above 1": valid([[281, 1.5], [285, 0.25], [282, 0.1]]),
    "a negative probability": valid([[281, 0.5], [285, 0.25], [282, -0.1]]),
    "probabilities rising": valid([[281, 0.1], [285, 0.25], [282, 0.5]]),
    "NaN": b'{"v":2,"p":[[281,NaN],[285,0.25],[282,0.1]]}',
    "Infinity": b'{"v":2,"p":[[281,Infinity],[285,0.25],[282,0.1]]}',
    "deep nesting": b"[" * 100_000,
    "too large": b'{"v":2,"p":[' + b"[1,0.1]," * (codec.MAX_VALUE_BYTES // 8) + b"]}",
    "pickle": pickle.dumps(ANSWER),
    "not bytes": "a string",
}


@pytest.mark.parametrize("value", GARBAGE.values(), ids=GARBAGE.keys())
def test_a_value_that_is_not_an_answer_of_the_model_to_the_request_is_a_miss(value: bytes) -> None:
    assert codec.decode(value, model_info(), 3) is None


def test_a_value_is_checked_against_the_request_and_the_model() -> None:
    value = codec.encode(ANSWER)  # three predictions
    assert codec.decode(value, model_info(), 3) is not None
    assert codec.decode(value, model_info(), 5) is None, "another top_k"
    assert codec.decode(value, dataclasses.replace(model_info(), labels=LABELS[:282]), 3) is None, "fewer classes"
    assert codec.decode(value, dataclasses.replace(model_info(), labels=()), 3) is None, "labels not known"
    three_classes = dataclasses.replace(model_info(), labels=("a", "b", "c"))
    few = Answer(200, predictions=((2, "c", 0.5), (0, "a", 0.3), (1, "b", 0.2)), model="m", engine="e")
    assert codec.decode(codec.encode(few), three_classes, 5) is not None, "top_k beyond the classes: all of them"


def test_random_bytes_never_make_the_codec_raise_nor_give_what_the_model_cannot_answer() -> None:
    rng = random.Random(0)
    value, model = codec.encode(ANSWER), model_info()
    for _ in range(3000):
        mutated = bytearray(value)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        decoded = codec.decode(bytes(mutated), model, 3)
        if decoded is not None:
            assert decoded.status_code == 200 and len(decoded.predictions) == 3
            assert all(label == LABELS[index] and 0 <= p <= 1 for index, label, p in decoded.predictions)
        assert codec.decode(rng.randbytes(rng.randint(0, 64)), model, 3) is None


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

    first, second = asyncio.run(cache.lookup([key], model_info(), 3)), asyncio.run(cache.lookup([key], model_info(), 3))
    assert first[0] == second[0] == Answer(200, predictions=PREDICTIONS, model="resnet18", engine="onnxruntime")
    assert first[0] is not second[0]
    first[0].timings_ms["cache"] = 0.1  # what a caller does with its answer
    assert second[0].timings_ms == {}
    assert asyncio.run(cache.lookup([key], model_info(), 3))[0].timings_ms == {}


@pytest.mark.parametrize(
    "answer",
    [
        Answer(503, detail="busy", retry_after_s=1),
        Answer(400, detail="not an image"),
        Answer(504, detail="deadline"),
        Answer(200, predictions=None),
        # No answer the server makes is an error with predictions; were one made, it is not kept either.
        Answer(503, predictions=PREDICTIONS, model="resnet18", engine="onnxruntime", detail="busy"),
    ],
)
def test_only_a_200_with_predictions_is_stored(answer: Answer) -> None:
    cache = ResponseCache(1 << 20)
    cache.store("k", answer)
    assert cache.memory.entries == 0
    assert asyncio.run(cache.lookup(["k"], model_info(), 3)) == [None]


def test_lookups_count_hits_by_tier_and_misses_per_image() -> None:
    cache = ResponseCache(1 << 20)
    cache.store("a", ANSWER)
    hits, misses = (
        sample("vision_serve_response_cache_hits_total", {"tier": "memory"}),
        sample("vision_serve_response_cache_misses_total"),
    )
    answers = asyncio.run(cache.lookup(["a", "b", "a", "c"], model_info(), 3))
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
        "rejected": 0,
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


def test_a_failed_trial_keeps_the_breaker_open_a_whole_wait_from_its_failure() -> None:
    """A trial's call can fail long after it began (a stalled Redis answers nothing until the timeout):
    the next trial must wait ``retry_after_s`` from that failure, not from the trial's start, or a call
    slower than the wait would be followed by another at once."""
    now = [100.0]
    breaker = Breaker(5.0, clock=lambda: now[0])
    breaker.failed()
    now[0] += 5.0
    assert breaker.allows(), "the trial, at 105"
    now[0] += 3.0
    assert breaker.failed() is False, "it fails at 108"
    now[0] += 4.0
    assert not breaker.allows(), "at 112: 7 s after the trial began, only 4 s after it failed"
    now[0] += 1.0
    assert breaker.allows(), "at 113: the wait from the failure is over"
