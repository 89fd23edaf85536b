"""The response cache's Redis tier against a real ``redis-server`` (tests/redis_server.py): replicas
share answers through it, and a stalled, unreachable or dead Redis costs a request at most the timeout,
then nothing while the breaker is open, and never an exception."""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
from collections.abc import Iterator

import pytest

from service.client.launcher import free_port
from service.http.cache import ResponseCache, redis_store
from service.http.cache.breaker import Breaker
from service.http.cache.redis_store import MAX_WRITES_IN_FLIGHT, RedisStore
from service.metrics import metrics
from tests.redis_server import RedisServer, redis_server_fixture  # noqa: F401 - the redis_server fixture
from tests.unit.test_response_cache import ANSWER, LABELS, PREDICTIONS, route

MIB = 1 << 20
TIMEOUT_S = 0.05  # the lookups' bound in the stall tests
MARGIN_S = 0.3  # scheduling noise on a busy test machine: a stall would hold a lookup a second


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    return metrics().registry.get_sample_value(name, labels) or 0.0


def redis_errors(reason: str) -> float:
    return sample("vision_serve_response_cache_redis_errors_total", {"reason": reason})


def redis_hits() -> float:
    return sample("vision_serve_response_cache_hits_total", {"tier": "redis"})


def mget_calls(server: RedisServer) -> int:
    with server.client() as client:
        return client.info("commandstats").get("cmdstat_mget", {}).get("calls", 0)


async def written(store: RedisStore) -> None:
    """Until the background writes are done."""
    deadline = time.monotonic() + 5
    while store.writes_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    assert store.writes_in_flight == 0


TOP_K = len(PREDICTIONS)  # the keys' top_k: ANSWER is an answer to it


async def looked_up(cache: ResponseCache, keys: list[str], top_k: int = TOP_K) -> list:
    """``cache.lookup`` of ``keys``, answers of route()'s model with ``top_k`` labels."""
    return await cache.lookup(keys, route().model, top_k)


async def timed_lookup(cache: ResponseCache, keys: list[str]) -> tuple[list, float]:
    started = time.perf_counter()
    answers = await looked_up(cache, keys)
    return answers, time.perf_counter() - started


def test_two_replicas_share_an_answer_through_redis(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        first = ResponseCache(MIB, RedisStore(redis_server.url, timeout_s=2.0, ttl_s=60))
        second = ResponseCache(MIB, RedisStore(redis_server.url, timeout_s=2.0, ttl_s=60))
        keys = second.keys([b"photo"], route(), TOP_K)
        assert await looked_up(second, keys) == [None]
        assert second.misses == 1

        first.store(keys[0], ANSWER)  # the replica that ran the model
        await written(first.redis)
        hits = redis_hits()
        (answer,) = await looked_up(second, second.keys([b"photo"], route(), TOP_K))
        assert answer is not None and answer.predictions == PREDICTIONS and answer.model == "resnet18"
        assert second.hits == {"memory": 0, "redis": 1}
        assert redis_hits() == hits + 1

        (again,) = await looked_up(second, keys)  # now in the second replica's memory
        assert again == answer and again is not answer
        assert second.hits == {"memory": 1, "redis": 1}
        assert second.stats()["entries"] == 1
        assert second.stats()["redis"] == {"url": redis_server.url, "healthy": True, "errors": 0}
        await first.close()
        await second.close()

    asyncio.run(scenario())


def test_another_top_k_or_version_is_not_shared(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        first = ResponseCache(MIB, RedisStore(redis_server.url, timeout_s=2.0, ttl_s=60))
        second = ResponseCache(MIB, RedisStore(redis_server.url, timeout_s=2.0, ttl_s=60))
        (key,) = first.keys([b"photo"], route(version=1), TOP_K)
        first.store(key, ANSWER)
        await written(first.redis)
        other_top_k = second.keys([b"photo"], route(version=1), 5)
        other_version = second.keys([b"photo"], route(version=2), TOP_K)
        assert await looked_up(second, other_top_k + other_version) == [None, None]
        assert (await looked_up(second, [key]))[0] is not None
        await first.close()
        await second.close()

    asyncio.run(scenario())


def test_a_stalled_redis_is_a_miss_within_the_timeout_then_left_alone(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        store = RedisStore(redis_server.url, timeout_s=TIMEOUT_S, ttl_s=60, retry_after_s=30)
        cache = ResponseCache(MIB, store)
        keys = cache.keys([b"a", b"b"], route(), TOP_K)
        assert await looked_up(cache, keys) == [None, None]  # connected, and Redis answers
        assert store.healthy and store.errors == 0

        with redis_server.client() as admin:
            admin.execute_command("CLIENT", "PAUSE", "1000", "ALL")  # every command waits a second
        timeouts = redis_errors("timeout")
        answers, elapsed = await timed_lookup(cache, keys)
        assert answers == [None, None]
        assert elapsed < TIMEOUT_S + MARGIN_S, f"a stalled Redis held the lookup {elapsed:.3f} s"
        assert store.errors == 1 and redis_errors("timeout") == timeouts + 1
        assert not store.healthy and store.describe()["healthy"] is False

        calls = await asyncio.to_thread(mget_calls, redis_server)  # answered once the pause is over
        started = time.perf_counter()
        for _ in range(20):
            assert await looked_up(cache, keys) == [None, None]
        assert time.perf_counter() - started < MARGIN_S
        assert await asyncio.to_thread(mget_calls, redis_server) == calls, "the breaker is open: no call to Redis"
        assert store.errors == 1
        await cache.close()

    asyncio.run(scenario())


def test_after_the_wait_one_trial_finds_redis_again(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        store = RedisStore(redis_server.url, timeout_s=TIMEOUT_S, ttl_s=60, retry_after_s=0.3)
        cache = ResponseCache(MIB, store)
        keys = cache.keys([b"a"], route(), TOP_K)
        with redis_server.client() as admin:
            admin.set(keys[0], b'{"v":2,"p":[[1,0.5],[2,0.25],[3,0.125]]}')
            admin.execute_command("CLIENT", "PAUSE", "200", "ALL")
        assert await looked_up(cache, keys) == [None]
        assert not store.healthy
        await asyncio.sleep(0.35)  # the pause and the wait are over
        (answer,) = await looked_up(cache, keys)
        assert answer is not None and answer.predictions == (
            (1, LABELS[1], 0.5),
            (2, LABELS[2], 0.25),
            (3, LABELS[3], 0.125),
        )
        assert store.healthy and store.errors == 1
        await cache.close()

    asyncio.run(scenario())


@pytest.fixture
def listening_socket_that_never_answers() -> Iterator[str]:
    """A port that accepts TCP connections (the kernel's backlog) and never says a word: a hung Redis."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"redis://127.0.0.1:{sock.getsockname()[1]}/0"


def test_a_redis_that_never_answers_costs_the_first_lookup_only_the_timeout(
    listening_socket_that_never_answers: str,
) -> None:
    async def scenario() -> None:
        store = RedisStore(listening_socket_that_never_answers, timeout_s=TIMEOUT_S, ttl_s=60)
        cache = ResponseCache(MIB, store)
        timeouts = redis_errors("timeout")
        answers, elapsed = await timed_lookup(cache, cache.keys([b"a"], route(), TOP_K))
        assert answers == [None] and elapsed < TIMEOUT_S + MARGIN_S
        assert store.errors == 1 and redis_errors("timeout") == timeouts + 1
        await cache.close()

    asyncio.run(scenario())


def test_a_trial_that_stalls_until_its_timeout_restarts_the_wait_from_its_failure(
    listening_socket_that_never_answers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a failed trial the breaker keeps Redis alone a whole ``retry_after_s`` from that failure.
    Counted from the trial's start, a trial slower than the wait (a hung Redis holds each call until the
    timeout) would be followed at once by another, and every request would pay the timeout again. The
    breaker's clock is the test's, moved while the trial's call hangs."""
    now = [1000.0]
    monkeypatch.setattr(redis_store, "Breaker", functools.partial(Breaker, clock=lambda: now[0]))

    async def scenario() -> None:
        store = RedisStore(listening_socket_that_never_answers, timeout_s=TIMEOUT_S, ttl_s=60, retry_after_s=10)
        keys = ["a"]
        assert await store.get_many(keys) == [None] and store.errors == 1, "the first call times out"
        now[0] += 10  # the wait is over: the next lookup is the trial
        trial = asyncio.create_task(store.get_many(keys))
        await asyncio.sleep(0)  # the trial has begun its call (at 1010) and hangs on the socket
        now[0] += 6
        assert await trial == [None] and store.errors == 2, "the trial times out (at 1016)"
        now[0] += 6  # 1022: 12 s after the trial began, 6 s after it failed
        assert await store.get_many(keys) == [None]
        assert store.errors == 2, "a lookup 6 s after a failed trial called Redis: the wait was not restarted"
        now[0] += 4  # 1026: 10 s after the failure, the next trial
        assert await store.get_many(keys) == [None] and store.errors == 3
        await store.close()

    asyncio.run(scenario())


def test_an_unreachable_redis_is_a_miss_from_the_first_lookup_and_warns_once(caplog) -> None:
    async def scenario() -> None:
        store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1.0, ttl_s=60, retry_after_s=0.05)
        cache = ResponseCache(MIB, store)
        errors = redis_errors("error")
        for attempt in range(3):
            keys = cache.keys([b"a%d" % attempt, b"b%d" % attempt], route(), TOP_K)
            answers, elapsed = await timed_lookup(cache, keys)
            assert answers == [None, None] and elapsed < MARGIN_S
            cache.store(keys[0], ANSWER)  # memory keeps it; Redis is left alone while the breaker is open
            assert store.writes_in_flight == 0
            await asyncio.sleep(0.06)  # past the wait: the next lookup is a trial, and fails too
        assert store.errors == 3 and redis_errors("error") == errors + 3
        assert cache.stats()["redis"]["healthy"] is False
        await cache.close()

    with caplog.at_level(logging.WARNING, logger="service.http.cache.redis_store"):
        asyncio.run(scenario())
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1, [record.getMessage() for record in warnings]


def test_a_redis_that_dies_is_a_miss_not_an_error(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        store = RedisStore(redis_server.url, timeout_s=1.0, ttl_s=60)
        cache = ResponseCache(MIB, store)
        (key,) = cache.keys([b"a"], route(), TOP_K)
        assert await looked_up(cache, [key]) == [None]
        assert store.healthy
        redis_server.kill()
        answers, elapsed = await timed_lookup(cache, [key])
        assert answers == [None] and elapsed < MARGIN_S
        assert store.errors == 1 and not store.healthy
        await cache.close()

    asyncio.run(scenario())


def test_stored_keys_expire_after_the_ttl(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        long, short = (RedisStore(redis_server.url, timeout_s=2.0, ttl_s=ttl) for ttl in (3600, 1.5))
        long.put("k-long", b"v")
        short.put("k-short", b"v")
        await written(long)
        await written(short)
        await long.close()
        await short.close()

    asyncio.run(scenario())
    with redis_server.client() as client:
        assert 3590 <= client.ttl("k-long") <= 3600
        assert 0 < client.pttl("k-short") <= 1500


def test_background_writes_are_bounded_and_never_awaited_by_the_caller(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        store = RedisStore(redis_server.url, timeout_s=2.0, ttl_s=60)
        with redis_server.client() as admin:
            admin.execute_command("CLIENT", "PAUSE", "300", "WRITE")  # reads go on, writes wait
        started = time.perf_counter()
        for index in range(MAX_WRITES_IN_FLIGHT):
            store.put(f"k{index}", b"v")
        await asyncio.sleep(0.05)  # the writes are sent and wait on the pause
        for index in range(MAX_WRITES_IN_FLIGHT, 3 * MAX_WRITES_IN_FLIGHT):
            store.put(f"k{index}", b"v")
        assert time.perf_counter() - started < 0.25, "put must not wait for Redis"
        assert store.writes_in_flight == MAX_WRITES_IN_FLIGHT
        await written(store)
        assert store.errors == 0
        await store.close()

    asyncio.run(scenario())
    with redis_server.client() as client:
        assert client.dbsize() == MAX_WRITES_IN_FLIGHT, "writes past the bound are dropped"
