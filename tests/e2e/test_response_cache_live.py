"""The response cache end to end: two real servers (two replicas, EfficientNet-Lite0) sharing a real
``redis-server`` on loopback. A repeated image is answered from the cache (X-Cache, Server-Timing,
/info, /metrics), another replica finds it in Redis, other options miss, bad images are never kept,
and a Redis that dies or stalls only turns hits into misses."""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from compile.sample_photos import sample_photo_file
from service.client.launcher import ServerProcess
from tests.redis_server import running_redis

MODEL = "efficientnet-lite0"
TIMEOUT_MS = 50


@pytest.fixture(scope="module")
def redis_url_and_servers(tmp_path_factory):
    base = tmp_path_factory.mktemp("cache")
    with running_redis(base) as redis_server, contextlib.ExitStack() as stack:
        args = ["--model", MODEL, "--response-cache-mb", "4", "--response-cache-redis", redis_server.url]
        args += ["--response-cache-redis-timeout-ms", str(TIMEOUT_MS)]
        servers = [stack.enter_context(ServerProcess(args, log_path=base / f"server-{i}.log")) for i in range(2)]
        yield redis_server, servers


def cache_counts(url: str) -> dict[str, float]:
    counts = {"memory": 0.0, "redis": 0.0, "miss": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "vision_serve_response_cache_hits_total":
                counts[sample.labels["tier"]] += sample.value
            elif sample.name == "vision_serve_response_cache_misses_total":
                counts["miss"] += sample.value
    return counts


def predict(url: str, image: bytes, **params) -> httpx.Response:
    return httpx.post(f"{url}/predict", content=image, params=params, timeout=60)


def test_a_repeated_image_is_answered_from_memory_then_from_redis_on_the_other_replica(
    redis_url_and_servers, chelsea_jpeg
) -> None:
    _, (first, second) = redis_url_and_servers
    missed = predict(first.url, chelsea_jpeg)
    assert missed.status_code == 200 and missed.headers["x-cache"] == "miss"
    assert "x-batch-size" in missed.headers
    before = cache_counts(first.url)
    hit = predict(first.url, chelsea_jpeg)
    assert hit.status_code == 200 and hit.headers["x-cache"] == "hit"
    assert hit.json()["predictions"] == missed.json()["predictions"]
    assert "cache;dur=" in hit.headers["server-timing"] and "x-batch-size" not in hit.headers
    assert cache_counts(first.url)["memory"] - before["memory"] == 1
    # The other replica never saw it: Redis has it (written in the background: allow it a moment).
    time.sleep(0.2)
    before = cache_counts(second.url)
    shared = predict(second.url, chelsea_jpeg)
    assert shared.headers["x-cache"] == "hit" and shared.json()["predictions"] == missed.json()["predictions"]
    assert cache_counts(second.url)["redis"] - before["redis"] == 1
    info = httpx.get(f"{second.url}/info", timeout=10).json()["server"]["response_cache"]
    assert info["entries"] >= 1 and info["max_mb"] == 4 and info["redis"]["healthy"] is True
    assert "***" in info["redis"]["url"] or "@" not in info["redis"]["url"]


def test_another_top_k_is_another_answer_and_errors_are_never_kept(redis_url_and_servers, coffee_jpeg) -> None:
    _, (server, _) = redis_url_and_servers
    assert predict(server.url, coffee_jpeg).headers["x-cache"] == "miss"
    three = predict(server.url, coffee_jpeg, top_k=3)
    assert three.headers["x-cache"] == "miss" and len(three.json()["predictions"]) == 3
    assert predict(server.url, coffee_jpeg, top_k=3).headers["x-cache"] == "hit"
    corrupt = coffee_jpeg[:2000] + bytes(len(coffee_jpeg) - 2000)  # a valid header, no pixel data
    for _ in range(2):
        failed = predict(server.url, corrupt)
        assert 400 <= failed.status_code < 500, failed.text
        assert failed.headers.get("x-cache", "miss") == "miss"


def predict_many(url: str, images: list[bytes]) -> httpx.Response:
    files = [("image", (f"{index}.jpg", image, "image/jpeg")) for index, image in enumerate(images)]
    return httpx.post(f"{url}/predict", files=files, timeout=60)


def top1(answer: dict) -> tuple[str, float]:
    best = answer["predictions"][0]
    return best["label"], best["probability"]


def test_a_request_of_cached_and_new_images_gets_each_answer_in_its_place(
    redis_url_and_servers, chelsea_jpeg, coffee_jpeg
) -> None:
    """A request whose images are partly in the cache is answered in two parts, the hits from the cache
    and the others by the model, merged back in input order: each image must get its own answer, and
    each answer the model gave be kept under its own image's key (a request of the same images is then
    all hits, still in place). Four pictures of four different classes, cached and new ones alternating."""
    _, (server, _) = redis_url_and_servers
    pictures = [chelsea_jpeg, coffee_jpeg, sample_photo_file("astronaut"), sample_photo_file("rocket")]
    # Bytes after a JPEG's end are ignored by its decoder: the same picture under a key of its own.
    expected = []
    for picture in pictures:
        alone = predict(server.url, picture + b"alone")
        assert alone.status_code == 200 and alone.headers["x-cache"] == "miss"
        expected.append(top1(alone.json()))
    assert len({label for label, _ in expected}) == len(pictures), expected
    images = [picture + b"mixed" for picture in pictures]
    for index in (0, 2):
        assert predict(server.url, images[index]).headers["x-cache"] == "miss"  # now cached

    before = cache_counts(server.url)
    mixed = predict_many(server.url, images)
    assert mixed.status_code == 200 and mixed.headers["x-cache"] == "miss", "two of its images ran"
    counts = cache_counts(server.url)
    assert (counts["memory"] - before["memory"], counts["miss"] - before["miss"]) == (2, 2)
    again = predict_many(server.url, images)
    assert again.status_code == 200 and again.headers["x-cache"] == "hit"
    assert cache_counts(server.url)["memory"] - counts["memory"] == 4
    for response in (mixed, again):
        results = response.json()["results"]
        assert [result["status_code"] for result in results] == [200] * len(pictures)
        answered = [top1(result) for result in results]
        assert [label for label, _ in answered] == [label for label, _ in expected]
        assert [probability for _, probability in answered] == pytest.approx([p for _, p in expected], abs=1e-3)


def test_an_image_that_failed_is_run_again_beside_a_hit_never_answered_from_the_cache(
    redis_url_and_servers, coffee_jpeg
) -> None:
    """Only 200s are kept: in a request that repeats a good image and a corrupt one, the good one is a
    hit and the corrupt one runs again (a miss, its own 4xx again), never answered from the cache."""
    _, (server, _) = redis_url_and_servers
    good = coffee_jpeg + b"beside-a-failure"  # a key of its own (see above)
    corrupt = coffee_jpeg[:2000] + bytes(len(coffee_jpeg) - 2000)  # a valid header, no pixel data
    first = predict_many(server.url, [good, corrupt])
    assert first.status_code == 200 and first.headers["x-cache"] == "miss"
    before = cache_counts(server.url)
    second = predict_many(server.url, [good, corrupt])
    assert second.status_code == 200 and second.headers["x-cache"] == "miss", "the corrupt image ran again"
    counts = cache_counts(server.url)
    assert (counts["memory"] - before["memory"], counts["redis"] - before["redis"]) == (1, 0)
    assert counts["miss"] - before["miss"] == 1
    for response in (first, second):
        good_result, failed = response.json()["results"]
        assert good_result["status_code"] == 200 and top1(good_result)[0] == "espresso"
        assert 400 <= failed["status_code"] < 500 and "predictions" not in failed, failed
    assert second.json()["results"][1] == first.json()["results"][1]


def test_a_dead_or_stalled_redis_is_a_miss_never_an_error_or_a_stall(tmp_path, chelsea_jpeg) -> None:
    with running_redis(tmp_path) as redis_server, ServerProcess(
        ["--model", MODEL, "--response-cache-mb", "4", "--response-cache-redis", redis_server.url,
         "--response-cache-redis-timeout-ms", str(TIMEOUT_MS)],
        log_path=tmp_path / "server.log",
    ) as server:  # fmt: skip
        check_stalled_then_dead_redis(redis_server, server, chelsea_jpeg)


def check_stalled_then_dead_redis(redis_server, server, chelsea_jpeg: bytes) -> None:
    variants = [chelsea_jpeg + bytes([i]) for i in range(3)]  # trailing bytes: new keys, same picture
    # Stalled: every Redis call waits 2 s; lookups give up at the timeout.
    redis_server.client().execute_command("CLIENT", "PAUSE", "2000", "ALL")
    started = time.monotonic()
    stalled = predict(server.url, variants[0])
    assert stalled.status_code == 200 and stalled.headers["x-cache"] == "miss"
    assert time.monotonic() - started < 1.5, "a stalled Redis must not hold the request"
    time.sleep(2.2)
    # Dead: no error either, and the memory tier still answers what this process keeps.
    redis_server.kill()
    for image in variants[1:]:
        assert predict(server.url, image).status_code == 200
        again = predict(server.url, image)
        assert again.status_code == 200 and again.headers["x-cache"] == "hit"
    info = httpx.get(f"{server.url}/info", timeout=10).json()["server"]["response_cache"]
    assert info["redis"]["errors"] >= 1
