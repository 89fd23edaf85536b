"""The request pipeline (service/http/pipeline/) with real channels and real workers' sockets, one
process: the order of its steps, what it owes every request whatever happens to its client, and how
it spreads images."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq
from PIL import Image

from service.errors import ClientClosed, NotFound, ServiceError, Unavailable
from service.http.base.admission import AdmissionGate
from service.http.base.limits import RequestLimits
from service.http.base.request_scope import Departure
from service.http.base.worker_watch import WorkerWatch
from service.http.cache import ResponseCache
from service.http.pipeline.ask import Ask, Outcome
from service.http.pipeline.pipeline import RequestPipeline
from service.http.pipeline.submit import CLIENT_LEFT
from service.metrics import metrics
from service.model_info import ModelInfo
from service.repository.table import RoutingTable, TableFile, VersionRoute
from service.transport.channels import ApiChannel, ChannelConfig, WorkerChannel
from service.transport.control_channel import READY
from service.wire import AbandonedRequests, Answer, ImageRequest, RequestBatch
from service.worker.collector import BatchCollector
from service.worker.contract import BatchPolicy

TIMEOUT_S = 5.0


def route_of(version: int, workers: tuple[int, ...]) -> VersionRoute:
    info = ModelInfo("lite", "w", "torch-eager-fp32", "pil", "", {}, "", "cpu", 8, 0.0, labels=("a", "b"))
    return VersionRoute("lite", version, workers, info)


def table_of(
    *routes: VersionRoute, generation: int = 1, draining: tuple[int, ...] = (), ready: tuple[int, ...] = ()
) -> RoutingTable:
    """``ready``: the workers whose state the table says is READY."""
    models: dict = {}
    for route in routes:
        models.setdefault(route.name, {})[route.version] = route
    states = dict.fromkeys(ready, READY)
    return RoutingTable(generation, models, draining, default_model="lite", worker_states=states)


def image(tag: int) -> bytes:
    """A small PNG of its own, which passes the header check."""
    out = io.BytesIO()
    Image.new("RGB", (2, 2), (tag, 0, 0)).save(out, "PNG")
    return out.getvalue()


A, B, C, D, E, F, G = (image(tag) for tag in range(7))


@dataclass(frozen=True)
class Images:
    """A parsed request as the pipeline takes it."""

    images: list[bytes | Answer]
    worker_top_k: int = 5
    wants_logits: bool = False


def classify(
    pipeline: RequestPipeline, images: Sequence[bytes | Answer], departure: Departure | None = None, **ask: object
) -> asyncio.Task[Outcome[Images]]:
    async def parse() -> Images:
        return Images(list(images))

    return asyncio.create_task(pipeline.run(Ask(ask.pop("model", "lite"), None, departure, **ask), parse))


def pipeline_with(
    tmp_path: Path, workers: int, limit: int = 16, cache: ResponseCache | None = None, table: RoutingTable | None = None
) -> tuple[RequestPipeline, ApiChannel, list[WorkerChannel]]:
    """``table``: the routing table published (default: one version served by every worker)."""
    config = ChannelConfig(str(tmp_path), api_servers=1)
    channel = ApiChannel(config, 0)
    serving = tuple(range(workers))
    TableFile(tmp_path).write(table or table_of(route_of(1, serving), ready=serving))
    watch = WorkerWatch(channel, TableFile(tmp_path))
    watch.refresh()
    pipeline = RequestPipeline(RequestLimits(), AdmissionGate(limit), timeout_s=30.0)
    pipeline.attach(channel, watch, cache)  # the channel releases the slots to the pipeline's gate
    return pipeline, channel, [WorkerChannel(config, worker_id) for worker_id in range(workers)]


def test_a_client_that_leaves_mid_request_frees_its_slots_once_its_late_answers_are_in(tmp_path) -> None:
    """The handler of a client that disconnects is cancelled while it waits for the workers: its
    images stay held, with their admission slots, while the worker has them (they take its memory and
    its time as much as any other); the answers that arrive later find no one waiting, and free them."""

    async def scenario() -> None:
        pipeline, channel, (worker,) = pipeline_with(tmp_path, workers=1, limit=3)
        receiving = asyncio.create_task(channel.receive_answers())
        try:
            waiting = classify(pipeline, [A, B, C])
            taken = [await asyncio.to_thread(worker.receive, TIMEOUT_S) for _ in range(3)]
            assert pipeline.gate.admitted == 3
            waiting.cancel()  # what the server does to the handler of a client that left
            await asyncio.gather(waiting, return_exceptions=True)
            assert pipeline.gate.admitted == 3, "the worker still has the images: their slots are not free"
            assert channel.held.per_worker[0] == 3
            worker.answer_many([(queued, Answer(batch_size=3)) for queued in taken])  # late answers
            await asyncio.sleep(0.2)
            assert len(channel.held) == 0 and channel.held.per_worker[0] == 0
            assert pipeline.gate.admitted == 0, "answered: the slots come back"
            # The server goes on: a new request is admitted and answered.
            again = classify(pipeline, [D])
            queued = await asyncio.to_thread(worker.receive, TIMEOUT_S)
            worker.answer(queued, Answer(predictions=((0, "d", 1.0),), batch_size=1))
            (answer,) = (await asyncio.wait_for(again, TIMEOUT_S)).answers
            assert answer.predictions == ((0, "d", 1.0),)
        finally:
            receiving.cancel()
            channel.close()
            worker.close()

    asyncio.run(scenario())


def test_the_images_of_one_request_are_spread_over_the_workers_and_answered_in_order(tmp_path) -> None:
    async def scenario() -> None:
        pipeline, channel, workers = pipeline_with(tmp_path, workers=2)
        receiving = asyncio.create_task(channel.receive_answers())
        try:
            images = [image(tag) for tag in range(10, 16)]
            waiting = classify(pipeline, images)
            per_worker = []
            for worker in workers:
                taken = [await asyncio.to_thread(worker.receive, TIMEOUT_S) for _ in range(3)]
                assert worker.receive(0.2) is None, "three each: the least busy worker takes the next image"
                per_worker.append(taken)
            for worker, taken in zip(reversed(workers), reversed(per_worker), strict=True):  # answered out of order
                worker.answer_many(
                    [(q, Answer(predictions=((0, str(images.index(q.request.image)), 1.0),))) for q in taken]
                )
            answers = (await asyncio.wait_for(waiting, TIMEOUT_S)).answers
            assert [a.predictions[0][1] for a in answers] == [str(index) for index in range(6)]
            assert {q.request.image for q in per_worker[0]} == {images[0], images[2], images[4]}
        finally:
            receiving.cancel()
            channel.close()
            for worker in workers:
                worker.close()

    asyncio.run(scenario())


def test_a_request_goes_to_the_worker_process_that_holds_fewer_requests(tmp_path) -> None:
    """Shared worker processes: model lite's workers 0 and 1 and model b's 2 and 3 run in processes 100
    and 200. While lite's image is held in process 100 (worker 0), b's goes to process 200 (worker 3),
    though b's worker 2 holds none either: by worker alone, every model's first worker, all in one
    process, would take the traffic spread over many models."""

    async def scenario() -> None:
        routes = route_of(1, (0, 1)), dataclasses.replace(route_of(1, (2, 3)), name="b")
        table = dataclasses.replace(
            table_of(*routes, ready=(0, 1, 2, 3)), worker_processes={0: 100, 2: 100, 1: 200, 3: 200}
        )
        pipeline, channel, workers = pipeline_with(tmp_path, workers=4, table=table)
        receiving = asyncio.create_task(channel.receive_answers())
        try:
            waiting = [classify(pipeline, [A])]
            held = [await asyncio.to_thread(workers[0].receive, TIMEOUT_S)]
            assert held[0] is not None and held[0].request.image == A
            waiting.append(classify(pipeline, [B], model="b"))
            held.append(await asyncio.to_thread(workers[3].receive, TIMEOUT_S))
            assert held[1] is not None and held[1].request.image == B, "b's image went to the busy process"
            assert workers[2].receive(0.2) is None
            for worker, queued in zip((workers[0], workers[3]), held, strict=True):
                worker.answer(queued, Answer(predictions=((0, "x", 1.0),), batch_size=1))
            for task in waiting:
                (answer,) = (await asyncio.wait_for(task, TIMEOUT_S)).answers
                assert answer.predictions == ((0, "x", 1.0),)
            assert dict(channel.held.per_process) == {100: 0, 200: 0}
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
    named on its cancel channel and left out of the next batch, answered ``DROPPED`` (read by nobody),
    which frees their slots."""

    async def scenario() -> None:
        pipeline, channel, (worker,) = pipeline_with(tmp_path, workers=1, limit=8)
        receiving = asyncio.create_task(channel.receive_answers())
        collector = BatchCollector(worker, BatchPolicy(max_batch_size=8))
        dropped_before = counter("requests_abandoned", where="worker")
        try:
            departure = Departure()
            leaving = classify(pipeline, [A, B], departure)
            staying = classify(pipeline, [C])
            await asyncio.sleep(0.1)  # both sent; the worker has not read them yet
            departure.leave()
            with pytest.raises(ClientClosed) as left:
                await asyncio.wait_for(leaving, TIMEOUT_S)
            assert left.value.status == 499 and left.value.message == CLIENT_LEFT.detail
            assert pipeline.gate.admitted == 3, "its images are still queued for the worker"
            await asyncio.sleep(0.1)  # the cancel leaves with the next turn's flush
            batch = await asyncio.to_thread(collector.get_batch)
            assert [queued.request.image for queued in batch] == [C], "only the staying client's image runs"
            await asyncio.sleep(0.1)  # the DROPPED answers come in
            assert pipeline.gate.admitted == 1, "dropped by the worker: the slots of the client that left come back"
            assert counter("requests_abandoned", where="worker") - dropped_before == 2
            assert worker._received._cancelled == set(), "cancels that matched are forgotten"
            worker.answer(batch[0], Answer(predictions=((0, "c", 1.0),), batch_size=1))
            (answer,) = (await asyncio.wait_for(staying, TIMEOUT_S)).answers
            assert answer.predictions == ((0, "c", 1.0),)
        finally:
            receiving.cancel()
            channel.close()
            worker.close()

    asyncio.run(scenario())


def test_a_cancelled_call_counts_as_leaving_its_images_are_dropped_by_the_worker(tmp_path) -> None:
    """gRPC cancels the handler of a call its client cancelled: the images it sent are dropped too."""

    async def scenario() -> None:
        pipeline, channel, (worker,) = pipeline_with(tmp_path, workers=1)
        collector = BatchCollector(worker, BatchPolicy(max_batch_size=8))
        receiving = asyncio.create_task(channel.receive_answers())
        try:
            waiting = classify(pipeline, [A, B, C])
            await asyncio.sleep(0.1)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            await asyncio.sleep(0.1)
            assert await asyncio.to_thread(collector.get_batch) == []
            await asyncio.sleep(0.1)
            assert pipeline.gate.admitted == 0 and len(channel.held) == 0
        finally:
            receiving.cancel()
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
        _pipeline, channel, (worker,) = pipeline_with(tmp_path, workers=1)
        dropped_before = counter("requests_abandoned", where="http")
        try:
            future = channel.submit(0, 41, ImageRequest(b"a"))
            channel.abandon([41])  # same turn: the message has not left
            await asyncio.sleep(0.1)
            assert not future.done()
            assert await asyncio.to_thread(worker.receive, 0.3) is None, "nothing reaches the worker"
            assert counter("requests_abandoned", where="http") - dropped_before == 1
            assert channel.held.per_worker[0] == 0
        finally:
            channel.close()
            worker.close()

    asyncio.run(scenario())


def test_an_answer_that_ran_for_a_client_gone_is_counted_unclaimed(tmp_path) -> None:
    async def scenario() -> None:
        pipeline, channel, (worker,) = pipeline_with(tmp_path, workers=1)
        receiving = asyncio.create_task(channel.receive_answers())
        before = counter("images_unclaimed")
        try:
            waiting = classify(pipeline, [A])
            queued = await asyncio.to_thread(worker.receive, TIMEOUT_S)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            worker.answer(queued, Answer(predictions=((0, "a", 1.0),), batch_size=1))  # it ran anyway
            await asyncio.sleep(0.2)
            assert counter("images_unclaimed") - before == 1
            assert pipeline.gate.admitted == 0
            waiting = classify(pipeline, [B])
            queued = await asyncio.to_thread(worker.receive, TIMEOUT_S)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
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
        pipeline, channel, (worker,) = pipeline_with(tmp_path, workers=1)
        departure = Departure()
        departure.leave()
        try:
            with pytest.raises(ClientClosed):
                await classify(pipeline, [A], departure)
            assert await asyncio.to_thread(worker.receive, 0.2) is None
            assert pipeline.gate.admitted == 0
        finally:
            channel.close()
            worker.close()

    asyncio.run(scenario())


def test_a_batch_fills_with_live_requests_in_the_places_of_abandoned_ones(tmp_path) -> None:
    """Dropping the abandoned must not shrink the batch: the worker takes others in their place."""

    async def scenario() -> None:
        pipeline, channel, (worker,) = pipeline_with(tmp_path, workers=1, limit=16)
        collector = BatchCollector(worker, BatchPolicy(max_batch_size=4))
        try:
            departure = Departure()
            leaving = classify(pipeline, [A, B, C], departure)
            await asyncio.sleep(0.05)
            staying = classify(pipeline, [D, E, F, G])
            await asyncio.sleep(0.05)
            departure.leave()
            await asyncio.gather(leaving, return_exceptions=True)
            await asyncio.sleep(0.1)
            batch = await asyncio.to_thread(collector.get_batch)
            assert [queued.request.image for queued in batch] == [D, E, F, G]
            staying.cancel()
            await asyncio.gather(staying, return_exceptions=True)
        finally:
            channel.close()
            worker.close()

    asyncio.run(scenario())


# --- The route checked again after the cache lookup (issue 52, item 3) -------------------------------


def test_a_route_still_served_is_kept_and_a_retired_one_is_resolved_again() -> None:
    """What the pipeline asks of the table after a cache lookup that awaited Redis."""
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


# --- The steps in order, each called by the pipeline (issue 54) ---------------------------------------

GOOD = Answer(predictions=((0, "a", 0.75), (1, "b", 0.25)), model="lite", batch_size=1)  # what the cache keeps


def test_a_version_not_served_is_refused_before_the_parse(tmp_path) -> None:
    """The route comes first: a model not served is a 404 before the body is read; 503 before the
    process follows a routing table."""

    async def scenario() -> None:
        parsed = []

        async def parse() -> Images:
            parsed.append(True)
            return Images([A])

        starting = RequestPipeline(RequestLimits(), AdmissionGate(4), timeout_s=30.0)  # not attached yet
        with pytest.raises(Unavailable):
            await starting.run(Ask("lite", None), parse)
        pipeline, channel, (worker,) = pipeline_with(tmp_path, workers=1)
        try:
            with pytest.raises(NotFound):
                await pipeline.run(Ask("nope", None), parse)
            assert not parsed
        finally:
            channel.close()
            worker.close()

    asyncio.run(scenario())


def test_a_refused_image_is_answered_its_own_error_and_never_reaches_the_cache_or_a_worker(tmp_path) -> None:
    async def scenario() -> None:
        cache = ResponseCache(1 << 20)
        pipeline, channel, (worker,) = pipeline_with(tmp_path, workers=1, cache=cache)
        receiving = asyncio.create_task(channel.receive_answers())
        parse_error = Answer(status_code=400, detail="not base64")
        try:
            waiting = classify(pipeline, [A, b"not an image", parse_error])
            queued = await asyncio.to_thread(worker.receive, TIMEOUT_S)
            assert queued.request.image == A and worker.receive(0.2) is None, "only the image that passed runs"
            worker.answer(queued, GOOD)
            outcome = await asyncio.wait_for(waiting, TIMEOUT_S)
            assert [answer.status_code for answer in outcome.answers] == [200, 415, 400]
            assert outcome.answers[2] is parse_error and outcome.ran == [0]
            assert cache.misses == 1, "the cache is asked for the image that passed its checks only"
        finally:
            receiving.cancel()
            channel.close()
            worker.close()

    asyncio.run(scenario())


def test_the_protocols_rule_for_a_refused_image_fails_the_request_before_any_lookup(tmp_path) -> None:
    def any_fails_all(parsed: Images, refused: list[Answer | None]) -> None:
        if any(refused):
            raise ServiceError(400, "one image failed")

    async def scenario() -> None:
        cache = ResponseCache(1 << 20)
        pipeline, channel, (worker,) = pipeline_with(tmp_path, workers=1, cache=cache)
        try:
            with pytest.raises(ServiceError, match="one image failed"):
                await classify(pipeline, [A, b"not an image"], on_refused=any_fails_all)
            assert cache.misses == 0 and pipeline.gate.admitted == 0
            assert await asyncio.to_thread(worker.receive, 0.2) is None
        finally:
            channel.close()
            worker.close()

    asyncio.run(scenario())


def test_a_hit_is_answered_without_admission_or_a_worker_and_only_a_success_is_kept(tmp_path) -> None:
    """The pipeline looks the images up, admits and submits the misses, then keeps their answers: a
    200 is kept and answers the next request from the cache; an error is never kept."""

    async def scenario() -> None:
        cache = ResponseCache(1 << 20)
        pipeline, channel, (worker,) = pipeline_with(tmp_path, workers=1, limit=1, cache=cache)
        receiving = asyncio.create_task(channel.receive_answers())
        try:
            first = classify(pipeline, [A])
            worker.answer(await asyncio.to_thread(worker.receive, TIMEOUT_S), GOOD)
            outcome = await asyncio.wait_for(first, TIMEOUT_S)
            assert outcome.cache_on and not outcome.from_cache
            # The gate is full (limit 1): a hit must not need a slot.
            assert pipeline.gate.try_admit(1)
            again = await asyncio.wait_for(classify(pipeline, [A]), TIMEOUT_S)
            pipeline.gate.release(1)
            assert again.from_cache and again.answers[0].predictions == GOOD.predictions
            assert await asyncio.to_thread(worker.receive, 0.2) is None, "a hit reaches no worker"
            failed = classify(pipeline, [B])
            worker.answer(await asyncio.to_thread(worker.receive, TIMEOUT_S), Answer(status_code=504, detail="late"))
            assert (await asyncio.wait_for(failed, TIMEOUT_S)).answers[0].status_code == 504
            retried = classify(pipeline, [B])
            assert await asyncio.to_thread(worker.receive, TIMEOUT_S) is not None, "an error is never kept"
            retried.cancel()
            await asyncio.gather(retried, return_exceptions=True)
        finally:
            receiving.cancel()
            channel.close()
            worker.close()

    asyncio.run(scenario())


def test_a_request_for_the_logits_carries_its_flag_to_the_worker_and_bypasses_the_cache(tmp_path) -> None:
    """A request that asks for the model's whole output is never answered a cached top-k, and its
    answer (with the logits) is not kept; a plain request's flag stays off (the default path)."""
    with_logits = Answer(predictions=GOOD.predictions, model="lite", batch_size=1, logits=b"\0\0\x80?\0\0\0\0")

    def ask_for(images: list[bytes], logits: bool) -> asyncio.Task[Outcome[Images]]:
        async def parse() -> Images:
            return Images(images, wants_logits=logits)

        return asyncio.create_task(pipeline.run(Ask("lite", None), parse))

    async def scenario() -> None:
        receiving = asyncio.create_task(channel.receive_answers())
        try:
            plain = ask_for([A], logits=False)
            queued = await asyncio.to_thread(worker.receive, TIMEOUT_S)
            assert queued.request.logits is False, "a plain request must not ask the worker for the logits"
            worker.answer(queued, GOOD)
            await asyncio.wait_for(plain, TIMEOUT_S)
            lookups = cache.misses + sum(cache.hits.values())
            asking = ask_for([A], logits=True)  # A's top-k is cached: it must not answer this one
            queued = await asyncio.to_thread(worker.receive, TIMEOUT_S)
            assert queued is not None and queued.request.logits is True
            worker.answer(queued, with_logits)
            outcome = await asyncio.wait_for(asking, TIMEOUT_S)
            assert not outcome.from_cache and outcome.answers[0].logits == with_logits.logits
            assert cache.misses + sum(cache.hits.values()) == lookups, "a request for the logits never asks the cache"
            asking = ask_for([B], logits=True)
            worker.answer(await asyncio.to_thread(worker.receive, TIMEOUT_S), with_logits)
            await asyncio.wait_for(asking, TIMEOUT_S)
            plain = ask_for([B], logits=False)  # the logits answer was not kept: B still runs
            queued = await asyncio.to_thread(worker.receive, TIMEOUT_S)
            assert queued is not None, "an answer with the logits must not be kept for a top-k request"
            worker.answer(queued, GOOD)
            assert (await asyncio.wait_for(plain, TIMEOUT_S)).answers[0].logits is None
        finally:
            receiving.cancel()
            channel.close()
            worker.close()

    cache = ResponseCache(1 << 20)
    pipeline, channel, (worker,) = pipeline_with(tmp_path, workers=1, cache=cache)
    asyncio.run(scenario())
