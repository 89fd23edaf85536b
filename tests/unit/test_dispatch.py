"""The dispatcher (service/http/base/dispatch.py) with real channels and real workers' sockets, one
process: what it owes every request whatever happens to its client, and how it spreads images."""

from __future__ import annotations

import asyncio
from pathlib import Path

from service.http.base.admission import AdmissionGate
from service.http.base.dispatch import ImageDispatcher
from service.http.base.worker_watch import WorkerWatch
from service.litserve_bridge import READY
from service.transport.channels import ApiChannel, ChannelConfig, WorkerChannel
from service.wire import Answer

TIMEOUT_S = 5.0


def dispatcher_with(
    tmp_path: Path, workers: int, limit: int = 16
) -> tuple[ImageDispatcher, ApiChannel, list[WorkerChannel]]:
    config = ChannelConfig(str(tmp_path), api_servers=1)
    channel = ApiChannel(config, 0)
    watch = WorkerWatch(lambda: dict.fromkeys(range(workers), READY), channel)
    watch.refresh()
    dispatcher = ImageDispatcher(AdmissionGate(limit), timeout_s=30.0)
    dispatcher.attach(channel, watch)
    return dispatcher, channel, [WorkerChannel(config, worker_id) for worker_id in range(workers)]


def test_a_client_that_leaves_mid_request_frees_its_slots_and_its_late_answers_are_dropped(tmp_path) -> None:
    """The handler of a client that disconnects is cancelled while it waits for the workers: its
    admission slots come back, and the answers that arrive later find no one waiting."""

    async def scenario() -> None:
        dispatcher, channel, (worker,) = dispatcher_with(tmp_path, workers=1, limit=3)
        receiving = asyncio.create_task(channel.receive_answers())
        try:
            waiting = asyncio.create_task(dispatcher.classify([b"a", b"b", b"c"], top_k=5))
            taken = [await asyncio.to_thread(worker.receive, TIMEOUT_S) for _ in range(3)]
            assert dispatcher.gate.admitted == 3
            waiting.cancel()  # what the server does to the handler of a client that left
            await asyncio.gather(waiting, return_exceptions=True)
            assert dispatcher.gate.admitted == 0, "the slots of a request nobody waits for must come back"
            assert channel.pick_worker([0]) == 0 and channel._unanswered[0] == 0, "its pending entries are dropped"
            worker.answer_many([(queued, Answer(batch_size=3)) for queued in taken])  # late answers
            await asyncio.sleep(0.2)
            assert channel._pending == {}
            # The server goes on: a new request is admitted and answered.
            again = asyncio.create_task(dispatcher.classify([b"d"], top_k=5))
            queued = await asyncio.to_thread(worker.receive, TIMEOUT_S)
            worker.answer(queued, Answer(predictions=((0, "d", 1.0),), batch_size=1))
            (answer,), _ = await asyncio.wait_for(again, TIMEOUT_S)
            assert answer.predictions == ((0, "d", 1.0),)
        finally:
            receiving.cancel()
            channel.close()
            worker.close()

    asyncio.run(scenario())


def test_the_images_of_one_request_are_spread_over_the_workers_and_answered_in_order(tmp_path) -> None:
    async def scenario() -> None:
        dispatcher, channel, workers = dispatcher_with(tmp_path, workers=2)
        receiving = asyncio.create_task(channel.receive_answers())
        try:
            images = [f"image-{i}".encode() for i in range(6)]
            waiting = asyncio.create_task(dispatcher.classify(images, top_k=5))
            per_worker = []
            for worker in workers:
                taken = [await asyncio.to_thread(worker.receive, TIMEOUT_S) for _ in range(3)]
                assert worker.receive(0.2) is None, "three each: the least busy worker takes the next image"
                per_worker.append(taken)
            for worker, taken in zip(reversed(workers), reversed(per_worker), strict=True):  # answered out of order
                worker.answer_many([(q, Answer(predictions=((0, q.request.image.decode(), 1.0),))) for q in taken])
            answers, _ = await asyncio.wait_for(waiting, TIMEOUT_S)
            assert [a.predictions[0][1] for a in answers] == [image.decode() for image in images]
            assert {q.request.image for q in per_worker[0]} == {b"image-0", b"image-2", b"image-4"}
        finally:
            receiving.cancel()
            channel.close()
            for worker in workers:
                worker.close()

    asyncio.run(scenario())
