"""The worker's queue of received requests and of cancels (service/transport/worker_queue.py), and the
collector's newest-first order while clients leave (service/worker/collector.py)."""

from __future__ import annotations

import asyncio
import pickle
import time
from pathlib import Path

import zmq

from service.transport.channels import ApiChannel, ChannelConfig, WorkerChannel
from service.transport.worker_queue import WorkerQueue
from service.wire import AbandonedRequests, ImageRequest, RequestBatch
from service.worker.collector import LEAVING_FOR_S, BatchCollector
from service.worker.contract import BatchPolicy

TIMEOUT_S = 5.0


def batch_of(api_server: int, uids: list[int], deadline: float | None = None) -> RequestBatch:
    return RequestBatch(
        api_server,
        uids,
        [ImageRequest(f"{api_server}-{uid}".encode(), queued_at=time.monotonic(), deadline=deadline) for uid in uids],
    )


def test_a_cancel_drops_a_queued_request_at_once_and_waits_for_one_not_received_yet() -> None:
    queue = WorkerQueue()
    queue.add(batch_of(0, [1, 2, 3]))
    assert [q.uid for q in queue.cancel(0, [2, 5])] == [2] and len(queue) == 2
    queue.forget_matched()
    assert queue._cancelled == {(0, 5)}, "2 was dropped; 5 is still to come"
    queue.add(batch_of(0, [4, 5]))
    taken = [queue.take() for _ in range(len(queue))]
    assert [q.uid for q in taken] == [1, 3, 4, 5]
    assert [q.uid for q in taken if queue.abandoned(q)] == [5]
    queue.forget_matched()
    assert queue._cancelled == set()


def test_a_cancel_for_a_request_taken_already_is_forgotten_but_not_another_process_s() -> None:
    queue = WorkerQueue()
    queue.add(batch_of(0, [1]))
    queue.take()
    queue.cancel(0, [1])
    queue.cancel(1, [1])  # HTTP process 1 has sent nothing yet: its uid 1 is still to come
    queue.forget_matched()
    assert queue._cancelled == {(1, 1)}


def test_a_cancel_names_a_request_of_its_own_http_process_only() -> None:
    """Each HTTP process numbers its requests on its own, so two of them send the same uids: a cancel
    from one must drop that process's request only, whether it is queued or still to come."""
    queue = WorkerQueue()
    queue.add(batch_of(0, [1, 2]))
    queue.add(batch_of(1, [1, 2]))
    assert len(queue.cancel(1, [2])) == 1, "only process 1's uid 2 was queued for this cancel"
    assert queue.cancel(0, [3]) == [], "received from neither process yet"
    queue.forget_matched()
    queue.add(batch_of(1, [3]))
    queue.add(batch_of(0, [3]))
    taken = [queue.take() for _ in range(len(queue))]
    assert [(q.api_server, q.uid) for q in taken] == [(0, 1), (0, 2), (1, 1), (1, 3), (0, 3)]
    assert [(q.api_server, q.uid) for q in taken if queue.abandoned(q)] == [(0, 3)]


def test_a_cancel_through_the_channels_drops_its_own_http_process_s_request_only(tmp_path: Path) -> None:
    """The same through the real channels: two HTTP processes send a worker requests with the same uids,
    one of them abandons one; its cancel overtakes the requests, and the worker drops that process's
    request alone."""
    config = ChannelConfig(str(tmp_path), api_servers=2)

    async def scenario() -> None:
        apis = [ApiChannel(config, api_server) for api_server in range(2)]
        worker = WorkerChannel(config, 0)
        try:
            for api in apis:
                for uid in (1, 2):
                    api.submit(0, uid, ImageRequest(f"{api.api_server}-{uid}".encode()))
            await asyncio.sleep(0)  # the end of the turn: both flush their requests
            apis[1].abandon([2])  # sent already: named on the worker's cancel channel at the next flush
            await asyncio.sleep(0)
            assert await asyncio.to_thread(worker._cancels.poll, TIMEOUT_S * 1000)
            assert worker.read_cancels() == 1, "read before the worker took any request in"
            received = [await asyncio.to_thread(worker.receive, TIMEOUT_S) for _ in range(4)]
            assert None not in received
            kept = worker.drop_abandoned(received)
            assert sorted((q.api_server, q.uid, q.request.image) for q in kept) == [
                (0, 1, b"0-1"),
                (0, 2, b"0-2"),
                (1, 1, b"1-1"),
            ]
        finally:
            for api in apis:
                api.close()
            worker.close()

    asyncio.run(scenario())


def test_take_newest_and_take_expired() -> None:
    queue = WorkerQueue()
    queue.add(batch_of(0, [1, 2], deadline=time.monotonic() - 0.001))
    queue.add(batch_of(0, [3, 4], deadline=time.monotonic() + 60))
    assert queue.take(newest=True).uid == 4
    assert [q.uid for q in queue.take_expired()] == [1, 2]
    assert [queue.take().uid] == [3]


def test_take_expired_finds_short_deadlines_behind_long_ones() -> None:
    """Clients set their own deadlines: a request that expired may wait behind one that has not."""
    queue = WorkerQueue()
    queue.add(batch_of(0, [1], deadline=time.monotonic() + 60))
    queue.add(batch_of(0, [2], deadline=time.monotonic() - 0.001))
    queue.add(batch_of(0, [3]))  # no deadline (the worker's own warm-up): never expires
    queue.add(batch_of(1, [1], deadline=time.monotonic() - 0.001))
    assert [(q.api_server, q.uid) for q in queue.take_expired()] == [(0, 2), (1, 1)]
    assert [queue.take().uid for _ in range(len(queue))] == [1, 3]


def test_batches_take_the_newest_first_while_clients_leave_and_the_oldest_first_otherwise(tmp_path: Path) -> None:
    config = ChannelConfig(str(tmp_path), api_servers=1)
    worker = WorkerChannel(config, 0)
    context = zmq.Context()
    requests, cancels = context.socket(zmq.PUSH), context.socket(zmq.PUSH)
    requests.connect(config.request_address(0))
    cancels.connect(config.cancel_address(0))
    collector = BatchCollector(worker, BatchPolicy(max_batch_size=2))
    try:
        requests.send(pickle.dumps(batch_of(0, [1, 2, 3, 4, 5, 6])))
        time.sleep(0.1)
        assert [q.uid for q in collector.get_batch()] == [1, 2], "first come, first served"
        cancels.send(pickle.dumps(AbandonedRequests(0, [3])))
        time.sleep(0.1)
        assert [q.uid for q in collector.get_batch()] == [4, 5], "3 left; the batch fills in its place"
        # One client left: a burst says nothing of the queue's age, the order stays.
        requests.send(pickle.dumps(batch_of(0, [7, 8, 9, 10, 11])))
        time.sleep(0.1)
        assert [q.uid for q in collector.get_batch()] == [6, 7]
        # Clients have kept leaving for longer than LEAVING_FOR_S: from the next batch on, the newest first.
        collector.leaving_since -= LEAVING_FOR_S
        cancels.send(pickle.dumps(AbandonedRequests(0, [8])))
        time.sleep(0.1)
        assert [q.uid for q in collector.get_batch()] == [9, 10], "8 left, this batch was begun in order"
        requests.send(pickle.dumps(batch_of(0, [12, 13, 14])))
        time.sleep(0.1)
        assert [q.uid for q in collector.get_batch()] == [14, 13]
        collector.newest_first_until = 0.0  # no client left for a while
        assert [q.uid for q in collector.get_batch()] == [11, 12]
    finally:
        context.destroy(linger=0)
        worker.close()
