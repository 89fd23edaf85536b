"""Deadlines bound every wait on a request's way, and ``--max-queue`` bounds every image on the way to
the workers whatever the deadlines (issues 60 and 64): the request pipeline with real channels and a
worker's sockets in this process (tests/unit/test_pipeline.py has the helpers)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

import pytest

from service.errors import DeadlineExceeded, ServiceError
from service.http.base.deadlines import ClientDeadline
from service.http.cache import ResponseCache
from service.http.pipeline.ask import Ask
from service.worker.collector import BatchCollector
from service.worker.contract import BatchPolicy
from tests.unit.test_pipeline import TIMEOUT_S, A, B, Images, counter, image, pipeline_with

TINY_S = 0.02  # a client deadline that passes while the worker does not read


def deadline_in(seconds: float) -> ClientDeadline:
    deadline = ClientDeadline()
    deadline.tighten(seconds, "the x-request-timeout-ms header")
    return deadline


class NoChannel:
    """A channel that fails the test on any use: what a submission past its deadline must not touch."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"the submission reached the channel ({name})")


def test_a_submission_whose_deadline_passed_is_answered_504_and_never_reaches_the_channel(tmp_path) -> None:
    """Issue 64: the images of a request whose deadline passed before the submit (a slow upload or
    lookup) are answered 504 at once and never shipped to a worker."""

    async def scenario() -> None:
        pipeline, channel, (worker,) = pipeline_with(tmp_path, workers=1)
        pipeline.channel = NoChannel()  # type: ignore[assignment]
        passed = ClientDeadline(received_at=time.monotonic() - 1.0)
        passed.tighten(0.5, "the x-request-timeout-ms header")
        expired_before = counter("requests_expired")
        try:
            outcome = await pipeline.run(Ask("lite", None, deadline=passed), _parsed([A, B]))
            assert [answer.status_code for answer in outcome.answers] == [504, 504]
            assert "500 ms deadline" in outcome.answers[0].detail
            assert pipeline.gate.admitted == 0, "no slot stays taken"
            assert counter("requests_expired") - expired_before == 2
        finally:
            channel.close()
            worker.close()

    asyncio.run(scenario())


def test_images_answered_504_keep_their_slots_until_the_worker_drops_them(tmp_path) -> None:
    """A worker that does not read (a long batch, a hung engine): requests with tiny deadlines get their
    504s, but their images are still in its pipe, so they keep their slots and later requests get 503.
    However many come, the worker is sent at most --max-queue images; once it reads them, it drops them
    past their deadline, and the slots come back."""
    limit = 4

    async def scenario() -> None:
        pipeline, channel, (worker,) = pipeline_with(tmp_path, workers=1, limit=limit)
        receiving = asyncio.create_task(channel.receive_answers())
        try:
            statuses: list[int] = []
            for round_ in range(5):
                tasks = [
                    asyncio.create_task(
                        pipeline.run(
                            Ask("lite", None, deadline=deadline_in(TINY_S)), _parsed([image(100 + round_ * 10 + i)])
                        )
                    )
                    for i in range(limit)
                ]
                for outcome in await asyncio.gather(*tasks, return_exceptions=True):
                    statuses.append(
                        outcome.status if isinstance(outcome, ServiceError) else outcome.answers[0].status_code
                    )
            assert set(statuses) <= {503, 504}, statuses
            await asyncio.sleep(0.1)
            worker.read_pending()
            sent = len(worker._received)
            assert sent <= limit, f"{sent} images were sent to the worker, more than --max-queue {limit}"
            assert statuses.count(504) == limit and pipeline.gate.admitted == limit, "the 504s' images hold slots"
            collector = BatchCollector(worker, BatchPolicy(max_batch_size=limit))
            assert await asyncio.to_thread(collector.get_batch) == [], "past their deadline: dropped unrun"
            await asyncio.sleep(0.1)  # the worker's 504s come in
            assert pipeline.gate.admitted == 0, "dropped by the worker: the slots come back"
        finally:
            receiving.cancel()
            channel.close()
            worker.close()

    asyncio.run(scenario())


def _parsed(images: Sequence[bytes]) -> Callable[[], Awaitable[Images]]:
    async def parse() -> Images:
        return Images(list(images))

    return parse


class StalledRedis:
    """A Redis tier whose replies never come (held by a slow or stalled server)."""

    def __init__(self) -> None:
        self.lookups = 0

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        self.lookups += 1
        await asyncio.sleep(3600)
        return [None] * len(keys)

    def put(self, key: str, value: bytes) -> None:
        pass


def test_a_lookup_waiting_on_redis_ends_at_the_clients_deadline_with_504(tmp_path) -> None:
    async def scenario() -> None:
        redis = StalledRedis()
        cache = ResponseCache(1 << 20, redis)  # type: ignore[arg-type]
        pipeline, channel, (worker,) = pipeline_with(tmp_path, workers=1, cache=cache)
        try:
            started = time.monotonic()
            outcome = await asyncio.wait_for(
                pipeline.run(Ask("lite", None, deadline=deadline_in(0.1)), _parsed([A, B])), TIMEOUT_S
            )
            waited = time.monotonic() - started
            assert redis.lookups == 1 and waited < 0.5, waited
            assert [answer.status_code for answer in outcome.answers] == [504, 504]
            assert "100 ms deadline" in outcome.answers[0].detail
            assert pipeline.gate.admitted == 0 and worker.receive(0.1) is None, "nothing admitted, nothing sent"
        finally:
            channel.close()
            worker.close()

    asyncio.run(scenario())


def test_a_slow_upload_ends_at_the_clients_deadline_with_504(tmp_path) -> None:
    async def scenario() -> None:
        pipeline, channel, (worker,) = pipeline_with(tmp_path, workers=1)

        async def slow_parse() -> Images:
            await asyncio.sleep(3600)  # the body's bytes trickle in
            return Images([A])

        try:
            started = time.monotonic()
            with pytest.raises(DeadlineExceeded, match="100 ms deadline"):
                await asyncio.wait_for(
                    pipeline.run(Ask("lite", None, deadline=deadline_in(0.1)), slow_parse), TIMEOUT_S
                )
            assert time.monotonic() - started < 0.5
        finally:
            channel.close()
            worker.close()

    asyncio.run(scenario())
