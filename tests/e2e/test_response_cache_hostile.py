"""A poisoned shared cache: values planted in a real ``redis-server`` under the keys a real server
reads are untrusted input. Each must be a miss, counted in ``vision_serve_response_cache_rejected_total``
(never a 500, never a malformed answer, never a label that is not the model's), on ``/predict`` and
the Open Inference Protocol alike, and the model's own answer is served instead.

The planted values are the ones a review found served or crashing on the earlier code (a 400-digit
probability gave 500; a 30-digit class index, seven predictions for ``top_k=3`` and a foreign label
were served), and the other ways a value can lie about its shape.
"""

from __future__ import annotations

import hashlib
import json
import time

import httpx
import numpy as np
import pytest
import tritonclient.http as triton_http
from prometheus_client.parser import text_string_to_metric_families

from service.client.launcher import ServerProcess
from tests.conftest import CAT_LABELS
from tests.redis_server import running_redis

MODEL = "efficientnet-lite0"
CLASSES = 1000

# (name, top_k asked, the value planted): each case its own top_k, so its key is one the server's
# memory tier has never held and the lookup reads Redis.
POISONS = [
    ("probability-400-digit-integer", 1, {"v": 2, "p": [[281, int("9" * 400)]]}),
    ("class-index-30-digits", 2, {"v": 2, "p": [[10**30, 0.5], [285, 0.25]]}),
    ("seven-predictions-for-top-k-3", 3, {"v": 2, "p": [[i, 0.1] for i in range(7)]}),
    ("a-label-of-its-own", 4, {"v": 2, "p": [[281, 0.5], [285, 0.2], [282, 0.1], [0, 0.05]], "l": ["pwned"] * 4}),
    ("the-earlier-format-with-labels", 6, {"v": 1, "m": MODEL, "e": "x", "p": [[281, "pwned", 0.5]] * 6}),
    ("probability-above-one", 7, {"v": 2, "p": [[i, 1.5 - i / 10] for i in range(7)]}),
    ("negative-probability", 8, {"v": 2, "p": [[i, -0.1] for i in range(8)]}),
    ("index-out-of-range", 9, {"v": 2, "p": [[CLASSES + i, 0.1] for i in range(9)]}),
    ("repeated-index", 10, {"v": 2, "p": [[281, 0.1]] * 10}),
    ("boolean-index", 11, {"v": 2, "p": [[True, 0.1]] + [[i, 0.05] for i in range(10)]}),
    ("probabilities-rising", 12, {"v": 2, "p": [[i, i / 100] for i in range(12)]}),
]
RAW_POISONS = [
    ("not-json", 13, b"\x80\x81 not json"),
    ("nan", 14, b'{"v":2,"p":[' + b",".join(b"[%d,NaN]" % i for i in range(14)) + b"]}"),
    ("deeply-nested", 15, b"[" * 100_000 + b"]" * 100_000),
]


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    base = tmp_path_factory.mktemp("poisoned-cache")
    with running_redis(base) as redis_server:
        args = ["--model", MODEL, "--response-cache-mb", "4", "--response-cache-redis", redis_server.url]
        # Generous: a loaded 2-core machine must not turn the planted reads into timeouts.
        args += ["--response-cache-redis-timeout-ms", "2000", "--grpc-port", "0"]
        with ServerProcess(args, log_path=base / "server.log") as server:
            yield redis_server, server


def rejected(url: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)
        for sample in family.samples
        if sample.name == "vision_serve_response_cache_rejected_total" and sample.labels.get("tier") == "redis"
    )


def key_for(redis_server, server, image: bytes, top_k: int) -> str:
    """The key the server reads for ``image`` at ``top_k``: its model fingerprint taken from the key it
    wrote for a first, ordinary answer of the same image."""
    digest = hashlib.sha256(image).hexdigest()
    client = redis_server.client()
    written = client.keys(f"vs2:*:5:{digest}")
    if not written:
        assert httpx.post(f"{server.url}/predict", content=image, timeout=60).status_code == 200
        for _ in range(100):  # written in the background
            if written := client.keys(f"vs2:*:5:{digest}"):
                break
            time.sleep(0.05)
    assert written, "the server wrote no Redis entry for an ordinary answer"
    prefix, fingerprint, _, _ = written[0].decode().split(":")
    return f"{prefix}:{fingerprint}:{top_k}:{digest}"


@pytest.mark.parametrize(
    ("top_k", "value"),
    [pytest.param(top_k, json.dumps(v).encode(), id=name) for name, top_k, v in POISONS]
    + [pytest.param(top_k, raw, id=name) for name, top_k, raw in RAW_POISONS],
)
def test_a_planted_value_is_a_counted_miss_and_the_models_own_answer_is_served(
    poisoned, chelsea_jpeg, top_k: int, value: bytes
) -> None:
    redis_server, server = poisoned
    redis_server.client().set(key_for(redis_server, server, chelsea_jpeg, top_k), value)
    before = rejected(server.url)
    response = httpx.post(f"{server.url}/predict", content=chelsea_jpeg, params={"top_k": top_k}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["x-cache"] == "miss"
    predictions = response.json()["predictions"]
    assert len(predictions) == top_k and predictions[0]["label"] in CAT_LABELS
    assert all(0.0 <= p["probability"] <= 1.0 and 0 <= p["index"] < CLASSES for p in predictions)
    assert rejected(server.url) - before == 1
    # The model's own answer replaced the planted value: the next one is a hit, and the same.
    again = httpx.post(f"{server.url}/predict", content=chelsea_jpeg, params={"top_k": top_k}, timeout=60)
    assert again.headers["x-cache"] == "hit" and again.json()["predictions"] == predictions


def test_a_planted_value_on_the_open_inference_protocol_is_a_miss_too(poisoned, coffee_jpeg) -> None:
    redis_server, server = poisoned
    top_k = 16
    redis_server.client().set(
        key_for(redis_server, server, coffee_jpeg, top_k),
        json.dumps({"v": 2, "p": [[10**30, int("9" * 400)]] * top_k}).encode(),
    )
    before = rejected(server.url)
    client = triton_http.InferenceServerClient(f"127.0.0.1:{server.port}")
    tensor = triton_http.InferInput("IMAGE", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([coffee_jpeg], dtype=np.object_))
    result = client.infer(MODEL, [tensor], parameters={"top_k": top_k})
    assert result.as_numpy("LABELS")[0, 0] == b"espresso"
    indices = result.as_numpy("CLASS_INDICES")
    assert indices.shape == (1, top_k) and indices.max() < CLASSES
    assert rejected(server.url) - before == 1


def test_a_hit_says_what_a_miss_says(poisoned, chelsea_jpeg) -> None:
    """Model, engine and labels of a hit come from the model that answers, not from the value: they
    must match what the worker itself answered."""
    _, server = poisoned
    image = chelsea_jpeg + b"\x00"
    missed = httpx.post(f"{server.url}/predict", content=image, timeout=60)
    hit = httpx.post(f"{server.url}/predict", content=image, timeout=60)
    assert (missed.headers["x-cache"], hit.headers["x-cache"]) == ("miss", "hit")
    for field in ("model", "engine", "model_version", "predictions"):
        assert hit.json()[field] == missed.json()[field], field
