"""The dispatcher (service/http/base/dispatch.py) with real channels and real workers' sockets, one
process: what it owes every request whatever happens to its client, and how it spreads images."""

from __future__ import annotations

import asyncio
import pickle
import time
from pathlib import Path

import pytest
import zmq

from service.errors import ClientClosed, ServiceError
from service.http.base.admission import AdmissionGate
from service.http.base.departure import Departure
from service.http.base.dispatch import CLIENT_LEFT, ImageDispatcher
from service.http.base.worker_watch import WorkerWatch
from service.metrics import metrics
from service.model_info import ModelInfo
from service.repository.table import RoutingTable, TableFile, VersionRoute
from service.transport.channels import ApiChannel, ChannelConfig, WorkerChannel
from service.transport.control_channel import READY
from service.wire import AbandonedRequests, Answer, ImageRequest, RequestBatch
from service.worker.collector import BatchCollector
from service.worker.contract import BatchPolicy

TIMEOUT_S = 5.0


def dispatcher_with(
    tmp_path: Path, workers: int, limit: int = 16
) -> tuple[ImageDispatcher, ApiChannel, list[WorkerChannel]]:
    config = ChannelConfig(str(tmp_path), api_servers=1)
    channel = ApiChannel(config, 0)
    TableFile(tmp_path).write(RoutingTable(1, worker_states=dict.fromkeys(range(workers), READY)))
    watch = WorkerWatch(channel, TableFile(tmp_path))
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
            (answer,), _, _ = await asyncio.wait_for(again, TIMEOUT_S)
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
            answers, _, _ = await asyncio.wait_for(waiting, TIMEOUT_S)
            assert [a.predictions[0][1] for a in answers] == [image.decode() for image in images]
            assert {q.request.image for q in per_worker[0]} == {b"image-0", b"image-2", b"image-4"}
        finally:
            receiving.cancel()
            channel.close()
            for worker in workers:
                worker.close()

    asyncio.run(scenario())


def counter(name: str, **labels: str) -> float:
    metric = getattr(metrics(), name)
    return (metric.labels(**labels) if labels else metric)._value.get()


def test_a_client_that_disconnects_gets_499_at_once_and_its_worker_drops_the_images_unrun(tmp_path) -> None:
    """The connection tells the request's Departure; the images still queued for the worker are
    named on its cancel channel and left out of the next batch, unanswered: nobody waits for them."""

    async def scenario() -> None:
        dispatcher, channel, (worker,) = dispatcher_with(tmp_path, workers=1, limit=8)
        receiving = asyncio.create_task(channel.receive_answers())
        collector = BatchCollector(worker, BatchPolicy(max_batch_size=8))
        dropped_before = counter("requests_abandoned", where="worker")
        try:
            departure = Departure()
            leaving = asyncio.create_task(dispatcher.classify([b"a", b"b"], top_k=5, departure=departure))
            staying = asyncio.create_task(dispatcher.classify([b"c"], top_k=5))
            await asyncio.sleep(0.1)  # both sent; the worker has not read them yet
            departure.leave()
            with pytest.raises(ClientClosed) as left:
                await asyncio.wait_for(leaving, TIMEOUT_S)
            assert left.value.status == 499 and left.value.message == CLIENT_LEFT.detail
            assert dispatcher.gate.admitted == 1, "the slots of the client that left come back at once"
            await asyncio.sleep(0.1)  # the cancel leaves with the next turn's flush
            batch = await asyncio.to_thread(collector.get_batch)
            assert [queued.request.image for queued in batch] == [b"c"], "only the staying client's image runs"
            assert counter("requests_abandoned", where="worker") - dropped_before == 2
            assert worker._received._cancelled == set(), "cancels that matched are forgotten"
            worker.answer(batch[0], Answer(predictions=((0, "c", 1.0),), batch_size=1))
            (answer,), _, _ = await asyncio.wait_for(staying, TIMEOUT_S)
            assert answer.predictions == ((0, "c", 1.0),)
        finally:
            receiving.cancel()
            channel.close()
            worker.close()

    asyncio.run(scenario())


def test_a_cancelled_call_counts_as_leaving_its_images_are_dropped_by_the_worker(tmp_path) -> None:
    """gRPC cancels the handler of a call its client cancelled: the images it sent are dropped too."""

    async def scenario() -> None:
        dispatcher, channel, (worker,) = dispatcher_with(tmp_path, workers=1)
        collector = BatchCollector(worker, BatchPolicy(max_batch_size=8))
        try:
            waiting = asyncio.create_task(dispatcher.classify([b"a", b"b", b"c"], top_k=5))
            await asyncio.sleep(0.1)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            await asyncio.sleep(0.1)
            assert await asyncio.to_thread(collector.get_batch) == []
            assert dispatcher.gate.admitted == 0 and channel._pending == {}
        finally:
            channel.close()
            worker.close()

    asyncio.run(scenario())


def test_cancels_for_requests_already_taken_are_forgotten(tmp_path) -> None:
    """A cancel that arrives after its request was taken can match nothing more; it must not pile up,
    nor drop another process's request with the same uid."""

    config = ChannelConfig(str(tmp_path), api_servers=2)
    worker = WorkerChannel(config, 0)
    context = zmq.Context()
    requests, cancels = context.socket(zmq.PUSH), context.socket(zmq.PUSH)
    requests.connect(config.request_address(0))
    cancels.connect(config.cancel_address(0))
    try:
        requests.send(pickle.dumps(RequestBatch(0, [1, 2], [ImageRequest(b"x"), ImageRequest(b"y")])))
        requests.send(pickle.dumps(RequestBatch(1, [1], [ImageRequest(b"z")])))
        first = [worker.receive(TIMEOUT_S), worker.receive(TIMEOUT_S)]
        assert worker.drop_abandoned(first) == first
        cancels.send(pickle.dumps(AbandonedRequests(0, [1, 7])))  # 1 was taken; 7 is still to come
        time.sleep(0.1)
        second = [worker.receive(TIMEOUT_S)]
        assert worker.drop_abandoned(second) == second, "HTTP process 1's uid 1 is another request"
        assert worker._received._cancelled == {(0, 7)}
    finally:
        context.destroy(linger=0)
        worker.close()


def test_an_abandoned_image_still_in_this_turns_message_is_never_sent(tmp_path) -> None:
    async def scenario() -> None:
        _dispatcher, channel, (worker,) = dispatcher_with(tmp_path, workers=1)
        dropped_before = counter("requests_abandoned", where="http")
        try:
            future = channel.submit(0, 41, ImageRequest(b"a"))
            channel.abandon([41])  # same turn: the message has not left
            await asyncio.sleep(0.1)
            assert not future.done()
            assert await asyncio.to_thread(worker.receive, 0.3) is None, "nothing reaches the worker"
            assert counter("requests_abandoned", where="http") - dropped_before == 1
            assert channel._unanswered[0] == 0
        finally:
            channel.close()
            worker.close()

    asyncio.run(scenario())


def test_an_answer_that_ran_for_a_client_gone_is_counted_unclaimed(tmp_path) -> None:
    async def scenario() -> None:
        dispatcher, channel, (worker,) = dispatcher_with(tmp_path, workers=1)
        receiving = asyncio.create_task(channel.receive_answers())
        before = counter("images_unclaimed")
        try:
            waiting = asyncio.create_task(dispatcher.classify([b"a"], top_k=5))
            queued = await asyncio.to_thread(worker.receive, TIMEOUT_S)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            worker.answer(queued, Answer(predictions=((0, "a", 1.0),), batch_size=1))  # it ran anyway
            worker.answer(queued, Answer(status_code=504, detail="expired"))  # never ran: not counted
            await asyncio.sleep(0.2)
            assert counter("images_unclaimed") - before == 1
        finally:
            receiving.cancel()
            channel.close()
            worker.close()

    asyncio.run(scenario())


def test_a_client_gone_before_classify_is_answered_499_and_sends_nothing(tmp_path) -> None:

    async def scenario() -> None:
        dispatcher, channel, (worker,) = dispatcher_with(tmp_path, workers=1)
        departure = Departure()
        departure.leave()
        try:
            with pytest.raises(ClientClosed):
                await dispatcher.classify([b"a"], top_k=5, departure=departure)
            assert await asyncio.to_thread(worker.receive, 0.2) is None
            assert dispatcher.gate.admitted == 0
        finally:
            channel.close()
            worker.close()

    asyncio.run(scenario())


def test_a_batch_fills_with_live_requests_in_the_places_of_abandoned_ones(tmp_path) -> None:
    """Dropping the abandoned must not shrink the batch: the worker takes others in their place."""

    async def scenario() -> None:
        dispatcher, channel, (worker,) = dispatcher_with(tmp_path, workers=1, limit=16)
        collector = BatchCollector(worker, BatchPolicy(max_batch_size=4))
        try:
            departure = Departure()
            leaving = asyncio.create_task(dispatcher.classify([b"a", b"b", b"c"], top_k=5, departure=departure))
            await asyncio.sleep(0.05)
            staying = asyncio.create_task(dispatcher.classify([b"d", b"e", b"f", b"g"], top_k=5))
            await asyncio.sleep(0.05)
            departure.leave()
            await asyncio.gather(leaving, return_exceptions=True)
            await asyncio.sleep(0.1)
            batch = await asyncio.to_thread(collector.get_batch)
            assert [queued.request.image for queued in batch] == [b"d", b"e", b"f", b"g"]
            staying.cancel()
            await asyncio.gather(staying, return_exceptions=True)
        finally:
            channel.close()
            worker.close()

    asyncio.run(scenario())


# --- The route checked again after the cache lookup (issue 52, item 3) -------------------------------


def route_of(version: int, workers: tuple[int, ...]) -> VersionRoute:
    info = ModelInfo("lite", "w", "torch-eager-fp32", "pil", "", {}, "", "cpu", 8, 0.0, labels=("a", "b"))
    return VersionRoute("lite", version, workers, info)


def table_of(*routes: VersionRoute, generation: int = 1, draining: tuple[int, ...] = ()) -> RoutingTable:
    models: dict = {}
    for route in routes:
        models.setdefault(route.name, {})[route.version] = route
    return RoutingTable(generation, models, draining, default_model="lite")


def test_a_route_still_served_is_kept_and_a_retired_one_is_resolved_again() -> None:
    """What the dispatcher asks of the table after a cache lookup that awaited Redis."""
    v1, v2 = route_of(1, (0, 1)), route_of(2, (2, 3))
    assert table_of(v1).current(v1) is v1
    # A load published version 2 and retired version 1 (its workers drain) while a lookup waited.
    swapped = table_of(v2, generation=2, draining=(0, 1))
    assert swapped.current(v1) is v2, "an unpinned request runs on the version served now"
    with pytest.raises(ServiceError) as caught:
        swapped.current(v1, pinned=True)
    assert caught.value.status == 404 and "version 1 is not found" in caught.value.message
    # Unloaded altogether: 404 either way, never a send to a retired worker.
    with pytest.raises(ServiceError) as caught:
        RoutingTable(3, {}, (2, 3)).current(v2)
    assert caught.value.status == 404
    # Republished with other workers (a restart): the route as now published.
    assert table_of(route_of(1, (4, 5))).current(v1).workers == (4, 5)
