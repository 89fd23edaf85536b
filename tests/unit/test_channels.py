"""The request and answer channels (service/transport/channels.py) between HTTP processes and workers.

Real ZeroMQ sockets over Unix sockets in a temporary folder, both ends in this process.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
import time
from pathlib import Path

import pytest

from service.transport.channels import ApiChannel, ChannelConfig, WorkerChannel
from service.wire import Answer, ImageRequest, QueuedRequest

TIMEOUT_S = 5.0


def answer_for(request: ImageRequest) -> Answer:
    return Answer(predictions=((0, request.image.decode(), 1.0),), batch_size=1)


def test_a_request_reaches_the_chosen_worker_and_its_answer_comes_back(tmp_path: Path) -> None:
    config = ChannelConfig(str(tmp_path), api_servers=2)

    async def scenario() -> None:
        api = ApiChannel(config, api_server=1)
        workers = [WorkerChannel(config, worker_id) for worker_id in range(2)]
        receiving = asyncio.create_task(api.receive_answers())
        try:
            future = api.submit(1, 11, ImageRequest(b"cat", top_k=3))
            message = await asyncio.to_thread(workers[1].receive, TIMEOUT_S)
            assert workers[0].receive(0) is None, "only the chosen worker gets it"
            request = message.request
            assert (message.api_server, message.uid, request.image, request.top_k) == (1, 11, b"cat", 3)
            workers[1].answer(message, answer_for(request))
            answer = await asyncio.wait_for(future, TIMEOUT_S)
            assert answer.predictions == ((0, "cat", 1.0),)
        finally:
            receiving.cancel()
            api.close()
            for worker in workers:
                worker.close()

    asyncio.run(scenario())


def test_the_least_busy_ready_worker_is_picked(tmp_path: Path) -> None:
    async def scenario() -> None:
        api = ApiChannel(ChannelConfig(str(tmp_path), api_servers=1), 0)
        assert api.pick_worker([]) is None
        assert api.pick_worker([0, 1, 2]) == 0
        api.submit(0, 1, ImageRequest(b"x"))
        assert api.pick_worker([0, 1, 2]) == 1
        api.submit(1, 2, ImageRequest(b"x"))
        assert api.pick_worker([0, 1]) == 0, "a tie goes to the first listed"
        assert api.pick_worker([0, 1, 2]) == 2
        api.abandon([1])  # in the same turn: never sent, so held no more
        assert api.pick_worker([0, 1]) == 0
        api.close()

    asyncio.run(scenario())


def test_a_request_whose_client_stopped_waiting_is_held_until_its_late_answer(tmp_path: Path) -> None:
    """A 504 does not free what the worker still has: the request stays held (and its admission slot
    taken) until the worker answers it, and that answer goes to nobody."""
    config = ChannelConfig(str(tmp_path), api_servers=1)

    async def scenario() -> None:
        api = ApiChannel(config, 0)
        released: list[int] = []
        api.held.release = released.append
        worker = WorkerChannel(config, 0)
        receiving = asyncio.create_task(api.receive_answers())
        try:
            gone = api.submit(0, 1, ImageRequest(b"a"))
            waiting = api.submit(0, 2, ImageRequest(b"b"))
            await asyncio.sleep(0)  # sent
            gone.set_result(Answer(status_code=504))  # its client got a 504 (submit.py's Expiry)
            api.abandon([1], expired=True)
            assert len(api.held) == 2 and released == [], "the worker has it: still held"
            for _ in range(2):
                message = await asyncio.to_thread(worker.receive, TIMEOUT_S)
                worker.answer(message, answer_for(message.request))
            assert (await asyncio.wait_for(waiting, TIMEOUT_S)).predictions[0][1] == "b"
            await asyncio.sleep(0.1)
            assert gone.result().status_code == 504, "the late answer goes to nobody"
            assert len(api.held) == 0 and sum(released) == 2
        finally:
            receiving.cancel()
            api.close()
            worker.close()

    asyncio.run(scenario())


def test_failing_a_worker_answers_its_requests_and_drops_what_it_never_took(tmp_path: Path) -> None:
    config = ChannelConfig(str(tmp_path), api_servers=1)

    async def scenario() -> None:
        api = ApiChannel(config, 0)
        # No worker is bound (it died): the requests leave the outbox at the end of the loop's turn
        # and wait in the socket's pipe, where a restarted worker would find them.
        held = [api.submit(0, i, ImageRequest(b"x")) for i in range(3)]
        await asyncio.sleep(0)
        assert 0 not in api._outbox, "sent: the purge must reach the pipe, not only the outbox"
        queued_in = api._requests[0]
        assert api.fail_worker(0, Answer(status_code=503, detail="worker died")) == 3
        # Gone when fail_worker returns, not later in a reaper thread: a worker that binds after this
        # can never be reached by that socket's queue (it once was, under load).
        assert queued_in.closed and queued_in.context.closed
        assert [f.result().status_code for f in held] == [503, 503, 503]
        assert api.pick_worker([0]) == 0 and api.fail_worker(0, Answer(status_code=503, detail="again")) == 0
        restarted = WorkerChannel(config, 0)
        try:
            assert restarted.receive(0.5) is None, "the restarted worker must not run answered requests"
            api.submit(0, 100, ImageRequest(b"y"))
            assert (await asyncio.to_thread(restarted.receive, TIMEOUT_S)).uid == 100
        finally:
            restarted.close()
            api.close()

    asyncio.run(scenario())


def test_requests_to_a_worker_that_stopped_reading_are_answered_503(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.transport import channels

    monkeypatch.setattr(channels, "SEND_HIGH_WATER_MARK", 2)
    config = ChannelConfig(str(tmp_path), api_servers=1)

    async def scenario() -> None:
        api = ApiChannel(config, 0)
        try:
            futures = []
            for turn in range(50):  # one message per turn of the loop; nobody reads them
                futures += [api.submit(0, turn * 3 + i, ImageRequest(b"x")) for i in range(3)]
                await asyncio.sleep(0)
            refused = [f.result() for f in futures if f.done()]
            assert refused, "a full pipe must answer, not hang"
            assert {a.status_code for a in refused} == {503}
            assert "worker 0 is not reading" in refused[0].detail and refused[0].retry_after_s
        finally:
            api.close()

    asyncio.run(scenario())


def test_requests_submitted_in_one_turn_of_the_loop_travel_as_one_message(tmp_path: Path) -> None:
    config = ChannelConfig(str(tmp_path), api_servers=1)

    async def scenario() -> None:
        api = ApiChannel(config, 0)
        worker = WorkerChannel(config, 0)
        try:
            for i in range(5):
                api.submit(0, i, ImageRequest(bytes([i])))
            await asyncio.sleep(0)  # the end of the turn: the flush
            assert await asyncio.to_thread(worker._requests.poll, TIMEOUT_S * 1000)
            batch = pickle.loads(worker._requests.recv())
            assert batch.api_server == 0 and batch.uids == list(range(5))
            assert [request.image for request in batch.requests] == [bytes([i]) for i in range(5)]
            assert worker._requests.poll(0) == 0, "one message, not five"
        finally:
            api.close()
            worker.close()

    asyncio.run(scenario())


def test_an_answer_to_a_gone_http_process_does_not_block_the_worker(tmp_path: Path, monkeypatch) -> None:
    from service.transport import channels

    monkeypatch.setattr(channels, "SEND_HIGH_WATER_MARK", 2)
    worker = WorkerChannel(ChannelConfig(str(tmp_path), api_servers=1), 0)
    started = time.monotonic()
    for i in range(100):  # nobody binds answers-0
        worker.answer(QueuedRequest(0, i, ImageRequest(b"")), Answer(status_code=504, detail="late"))
    assert time.monotonic() - started < 2.0
    worker.close()


@pytest.mark.parametrize("pipeline_depth", [1, 2])
def test_a_retired_worker_answers_everything_sent_before_the_final_messages_then_its_loop_ends(
    tmp_path: Path, pipeline_depth: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replaced version's worker: each HTTP process sends its last requests, then ``retire``; the
    worker's loop answers all of them and returns (the process then exits)."""
    from service.worker import loop as worker_loop
    from service.worker.contract import BatchPolicy

    config = ChannelConfig(str(tmp_path), api_servers=2)

    class Echo:
        def prepare(self, requests):
            return requests

        def run(self, prepared):
            return [answer_for(request) for request in prepared]

        def unusable_device(self):
            return None

    one_final_and_not_drained = threading.Event()

    class WatchedChannel(WorkerChannel):
        """Tells when the loop learnt that one HTTP process is done and still found itself not drained."""

        @property
        def drained(self) -> bool:
            drained = super().drained
            if self._finished and not drained:
                one_final_and_not_drained.set()
            return drained

    monkeypatch.setattr(worker_loop, "WorkerChannel", WatchedChannel)

    async def scenario() -> None:
        apis = [ApiChannel(config, api_server) for api_server in range(2)]
        receiving = [asyncio.create_task(api.receive_answers()) for api in apis]
        loop = worker_loop.GreedyBatchedLoop(config, BatchPolicy(max_batch_size=2, pipeline_depth=pipeline_depth))
        serving = asyncio.create_task(asyncio.to_thread(loop.serve, Echo(), 0))
        try:
            futures = [apis[i % 2].submit(0, i, ImageRequest(f"img{i}".encode())) for i in range(7)]
            apis[0].retire(0)
            assert await asyncio.to_thread(one_final_and_not_drained.wait, TIMEOUT_S)
            assert not serving.done(), "one HTTP process may still send: the worker must wait for both"
            futures.append(apis[1].submit(0, 99, ImageRequest(b"last")))
            apis[1].retire(0)
            apis[1].retire(0)  # once per worker: a second call sends nothing
            answers = await asyncio.wait_for(asyncio.gather(*futures), TIMEOUT_S)
            assert [a.predictions[0][1] for a in answers] == [f"img{i}" for i in range(7)] + ["last"]
            await asyncio.wait_for(serving, TIMEOUT_S)  # the loop returned: drained
        finally:
            for task in receiving:
                task.cancel()
            for api in apis:
                api.close()

    asyncio.run(scenario())
