"""The worker's batch collection (greedy, blocking, optional window), the running and answering of
batches (one at a time and pipelined), and the idle-time heap trimmer.

The loop's pieces read a real ``WorkerChannel`` (service/transport/channels.py); the test sends requests into
it and reads the answers over ZeroMQ sockets, as an HTTP process would. Only the model stands in.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq

from service.heap import IDLE_BEFORE_TRIM_S, MAX_TRIM_GAP_S, HeapTrimmer
from service.metrics import metrics
from service.transport.channels import ChannelConfig, WorkerChannel
from service.wire import Answer, ImageRequest, QueuedRequest, RequestBatch
from service.worker import collector as collecting
from service.worker.collector import LEAVING_FOR_S, BatchCollector
from service.worker.contract import BatchPolicy
from service.worker.loop import GreedyBatchedLoop
from service.worker.pipeline import PipelinedRunner
from service.worker.runner import DEVICE_FAILED, EXIT_DEVICE_UNUSABLE, MODEL_FAILED, BatchRunner
from service.worker.turns import TURN_SLICE_S, ModelTurns
from tests.worker_hold import wait_until

DELIVERY_TIMEOUT_S = 5.0  # far more than a local socket needs to deliver what was sent


@dataclass
class Wire:
    """The worker's channel, and the HTTP process's ends of it (a request sender, an answer reader)."""

    worker: WorkerChannel
    sender: zmq.Socket
    answers: zmq.Socket
    in_transit: int = 0  # requests sent that the worker's channel may not hold yet

    def put(self, n: int, start: int = 0, deadline: float | None = None, wait: bool = True) -> None:
        """Send ``n`` requests, one per message; ``wait``: until the worker holds all sent so far."""
        for i in range(start, start + n):
            request = ImageRequest(f"request-{i}".encode(), queued_at=time.monotonic(), deadline=deadline)
            self.sender.send(pickle.dumps(RequestBatch(0, [f"uid-{i}"], [request])))  # one per message
        self.in_transit += n
        if wait:
            self.wait_delivered()

    def wait_delivered(self) -> None:
        """Until the worker's channel holds every request sent, as requests that queued while its
        model was busy would be: taken off the socket as they arrive and put back in order, so a
        batch then finds them without waiting (a fixed sleep would be a guess at delivery time)."""
        received = self.worker._received._queued  # the WorkerQueue's deque (service/transport/worker_queue.py)
        held = list(received)
        received.clear()
        for _ in range(self.in_transit):
            queued = self.worker.receive(DELIVERY_TIMEOUT_S)
            assert queued is not None, f"a request was not delivered within {DELIVERY_TIMEOUT_S} s"
            held.append(queued)
        received.extend(held)
        self.in_transit = 0

    def answered(self, timeout_s: float = 5.0) -> list[tuple[str, Answer]]:
        """(uid, answer) pairs, as they came back."""
        received = []
        while self.answers.poll(round(timeout_s * 1000) if not received else 100):
            batch = pickle.loads(self.answers.recv())
            received.extend(zip(batch.uids, batch.answers, strict=True))
        return received


@pytest.fixture
def wire(tmp_path: Path) -> Iterator[Wire]:
    config = ChannelConfig(str(tmp_path), api_servers=1)
    context = zmq.Context()
    answers = context.socket(zmq.PULL)
    answers.bind(config.answer_address(0))
    worker = WorkerChannel(config, 0)
    sender = context.socket(zmq.PUSH)
    sender.connect(config.request_address(0))
    yield Wire(worker, sender, answers)
    worker.close()
    context.destroy(linger=0)


def _collector(wire: Wire, max_batch_size: int = 4, batch_timeout_s: float = 0.0) -> BatchCollector:
    return BatchCollector(wire.worker, BatchPolicy(max_batch_size, batch_timeout_s))


def contents(batch: list[QueuedRequest]) -> list[tuple[int, str, bytes]]:
    return [(m.api_server, m.uid, m.request.image) for m in batch]


def test_takes_what_is_queued_without_waiting(wire: Wire) -> None:
    wire.put(3)
    started = time.monotonic()
    batch = _collector(wire).get_batch()
    assert time.monotonic() - started < 0.5  # no window: it did not wait for a 4th
    assert contents(batch) == [(0, f"uid-{i}", f"request-{i}".encode()) for i in range(3)]


def test_never_exceeds_the_max_batch_size(wire: Wire) -> None:
    wire.put(6)
    collector = _collector(wire, max_batch_size=4)
    assert len(collector.get_batch()) == 4
    assert len(collector.get_batch()) == 2, "the rest waits for the next batch"


def test_a_window_waits_for_late_arrivals_and_then_stops(wire: Wire) -> None:
    wire.put(1)
    threading.Timer(0.1, wire.put, (1, 1), {"wait": False}).start()
    started = time.monotonic()
    batch = _collector(wire, batch_timeout_s=0.5).get_batch()
    elapsed = time.monotonic() - started
    assert [m.request.image for m in batch] == [b"request-0", b"request-1"]
    assert 0.45 <= elapsed < 2.0  # the window runs from the first request; nothing else came


def test_an_idle_channel_returns_empty_after_the_idle_wait(wire: Wire, monkeypatch) -> None:
    monkeypatch.setattr(collecting, "IDLE_WAIT_S", 0.05)
    assert _collector(wire).get_batch() == []


def expired_count() -> float:
    return metrics().registry.get_sample_value("vision_serve_requests_expired_total") or 0.0


def test_expired_requests_are_answered_504_counted_and_not_run(wire: Wire, caplog) -> None:
    collector = _collector(wire)
    before = expired_count()
    for _ in range(2):  # two rounds: the second drop is counted but not logged again so soon
        wire.put(1, deadline=time.monotonic() - 0.001, wait=False)
        wire.put(1, start=1, deadline=time.monotonic() + 60)
        assert [m.uid for m in collector.get_batch()] == ["uid-1"]
    assert [(uid, answer.status_code) for uid, answer in wire.answered()] == [("uid-0", 504), ("uid-0", 504)]
    assert expired_count() == before + 2
    dropped = [r for r in caplog.records if r.name == "service.worker.collector" and "Dropped" in r.getMessage()]
    assert len(dropped) == 1 and dropped[0].levelname == "WARNING"


def test_only_an_expiry_after_a_real_wait_turns_the_order_to_newest_first(wire: Wire) -> None:
    """A client's 1 ms deadline passing says nothing of the queue's age; a 1 s one does."""
    collector = _collector(wire)
    collector.leaving_since = time.monotonic() - LEAVING_FOR_S - 1  # clients have been leaving a while
    collector.last_left = time.monotonic()
    wire.put(1, deadline=time.monotonic() - 0.001, wait=False)  # queued_at now: a timeout of about 0
    wire.put(1, start=1, deadline=time.monotonic() + 60)
    assert [m.uid for m in collector.get_batch()] == ["uid-1"]
    assert collector.newest_first_until == 0.0, "a 1 ms deadline flipped the order"
    request = ImageRequest(b"request-2", queued_at=time.monotonic() - 1.0, deadline=time.monotonic() - 0.001)
    wire.sender.send(pickle.dumps(RequestBatch(0, ["uid-2"], [request])))
    wire.in_transit += 1
    wire.put(1, start=3, deadline=time.monotonic() + 60)
    assert [m.uid for m in collector.get_batch()] == ["uid-3"]
    assert collector.newest_first_until > time.monotonic(), "a request that waited 1 s and expired is a client leaving"


class EchoModel:
    """A ``BatchedModel`` that answers each request's text, or fails.

    ``device_broken``: after a failure, ``unusable_device`` reports the device unusable, as
    preprocessing.device_health does after a sticky CUDA error (which a CPU cannot produce).
    """

    def __init__(self, fail: bool = False, drop_one: bool = False, device_broken: bool = False) -> None:
        self.fail, self.drop_one, self.device_broken = fail, drop_one, device_broken
        self.ran = 0

    def unusable_device(self) -> str | None:
        return "cuda:0: CUDA error: an illegal memory access was encountered" if self.device_broken else None

    def prepare(self, requests: list[ImageRequest]) -> list[ImageRequest]:
        return requests

    def run(self, prepared: list[ImageRequest]) -> list[Answer]:
        self.ran += 1
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        kept = prepared[1:] if self.drop_one else prepared
        return [Answer(predictions=((0, r.image.decode(), 1.0),), batch_size=1) for r in kept]


def test_each_request_of_a_batch_gets_its_own_answer(wire: Wire) -> None:
    wire.put(3)
    BatchRunner(EchoModel(), wire.worker, 0).run_batch(_collector(wire, max_batch_size=8).get_batch())
    assert [(uid, answer.predictions[0][1]) for uid, answer in wire.answered()] == [
        (f"uid-{i}", f"request-{i}") for i in range(3)
    ]


class SizeLog(EchoModel):
    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def run(self, prepared: list[ImageRequest]) -> list[Answer]:
        self.sizes.append(len(prepared))
        return super().run(prepared)


@pytest.mark.parametrize("max_batch_size", [8, 3])
def test_a_batch_that_waited_for_its_turn_takes_what_queued_meanwhile(wire: Wire, max_batch_size: int) -> None:
    """Another model of the process holds the turn: this model's batch of one waits, and the three
    requests that queue meanwhile run in it (up to the max batch size), not one batch each after it."""
    turns, model = ModelTurns(), SizeLog()
    collector = _collector(wire, max_batch_size=max_batch_size)
    runner = BatchRunner(model, wire.worker, 0, turns=turns)
    wire.put(1)
    batch = collector.get_batch()
    other_model_holds, release = threading.Event(), threading.Event()

    def other_model() -> None:
        with turns.turn():
            other_model_holds.set()
            release.wait(10)

    threading.Thread(target=other_model).start()
    other_model_holds.wait(5)
    waiting = threading.Thread(target=runner.run_batch, args=(batch, collector.top_up))
    waiting.start()
    wait_until(lambda: turns.waiting == 1, "this model's batch waits for its turn")
    wire.put(3, start=1)
    release.set()
    waiting.join(10)
    assert model.sizes == [min(4, max_batch_size)]
    answered = sorted(uid for uid, _ in wire.answered(timeout_s=2))
    assert answered == [f"uid-{i}" for i in range(min(4, max_batch_size))]
    assert [m.uid for m in collector.get_batch()] == [f"uid-{i}" for i in range(max_batch_size, 4)]


class SlowLog(SizeLog):
    """10 ms an image, as a CPU's engine costs about the same per image whatever the batch; ``during_first``
    runs inside its first call."""

    def __init__(self, name: str, order: list[tuple[str, int]], during_first=None) -> None:
        super().__init__()
        self.name, self.order, self.during_first = name, order, during_first

    def run(self, prepared: list[ImageRequest]) -> list[Answer]:
        self.order.append((self.name, len(prepared)))
        if self.during_first is not None:
            self.during_first, during = None, self.during_first
            during()
        time.sleep(0.01 * len(prepared))
        return super().run(prepared)


def test_beside_another_model_a_long_batch_runs_in_slices_and_lets_it_in(tmp_path: Path) -> None:
    """Two models share the process (the light one just ran). A light request that arrives as the busy
    model's batch of 6 begins waits for one slice of it (about TURN_SLICE_S), not for all 6 images;
    the rest of the batch runs after it."""
    config = ChannelConfig(str(tmp_path), api_servers=1)
    busy_wire, light_wire = WorkerChannel(config, 0), WorkerChannel(config, 1)
    turns, order = ModelTurns(), []
    light = BatchRunner(SlowLog("light", order), light_wire, 1, turns=turns)
    light_thread = threading.Thread(target=light.run_batch, args=([QueuedRequest(0, 101, ImageRequest(b"b"))],))

    def light_arrives() -> None:
        light_thread.start()
        wait_until(lambda: turns.waiting == 1, "the light model waits for its turn")

    busy = BatchRunner(SlowLog("busy", order, light_arrives), busy_wire, 0, turns=turns)
    busy.seconds_per_image = 0.01  # what its earlier batches measured
    try:
        light.run_batch([QueuedRequest(0, 100, ImageRequest(b"b"))])
        busy.run_batch([QueuedRequest(0, uid, ImageRequest(b"a")) for uid in range(6)])
        light_thread.join(5)
    finally:
        busy_wire.close()
        light_wire.close()
    assert order[0] == ("light", 1)
    assert order[1][0] == "busy" and order[1][1] < 6, "the busy model's batch ran whole"
    assert order[2] == ("light", 1), "the light model waited for the whole batch"
    busy_slices = [size for name, size in order if name == "busy"]
    assert sum(busy_slices) == 6 and max(busy_slices) <= TURN_SLICE_S / 0.01


def test_a_model_alone_in_its_process_runs_its_batches_whole(wire: Wire) -> None:
    order: list[tuple[str, int]] = []
    runner = BatchRunner(SlowLog("alone", order), wire.worker, 0, turns=ModelTurns())
    runner.seconds_per_image = 0.01
    for _ in range(2):
        runner.run_batch([QueuedRequest(0, uid, ImageRequest(b"x")) for uid in range(6)])
    assert order == [("alone", 6), ("alone", 6)]


def test_a_batch_that_did_not_wait_is_not_topped_up(wire: Wire) -> None:
    model = SizeLog()
    collector = _collector(wire, max_batch_size=8)
    wire.put(1)
    batch = collector.get_batch()
    wire.put(2, start=1)
    BatchRunner(model, wire.worker, 0, turns=ModelTurns()).run_batch(batch, collector.top_up)
    assert model.sizes == [1], "a batch that got the turn at once runs as it was taken"


@pytest.mark.parametrize(
    "model", [EchoModel(fail=True), EchoModel(drop_one=True)], ids=["model-raises", "output-missing"]
)
def test_a_failed_batch_answers_every_request_500_and_the_loop_goes_on(wire: Wire, model: EchoModel, caplog) -> None:
    wire.put(2)
    runner = BatchRunner(model, wire.worker, 0, running=[5])
    runner.run_batch(_collector(wire, max_batch_size=8).get_batch())
    assert [(uid, a.status_code, a.detail) for uid, a in wire.answered()] == [
        ("uid-0", 500, MODEL_FAILED),
        ("uid-1", 500, MODEL_FAILED),
    ]
    assert runner.running == [0], "the running-batch count is cleared after a failure too"
    assert any("The model failed on a batch of 2" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("depth", [1, 2], ids=["one-batch-at-a-time", "pipelined"])
def test_a_batch_that_broke_the_device_is_answered_503_and_the_worker_exits_for_a_restart(tmp_path, depth, caplog):
    """A sticky CUDA error (injected: no GPU here) must not be swallowed: a worker that went on would
    answer 500 forever. The batch gets a retry-safe 503, nothing else runs on the broken device, and
    the worker exits with its code, which the main process answers with a new worker."""
    config = ChannelConfig(str(tmp_path), api_servers=1)
    context = zmq.Context()
    answers = context.socket(zmq.PULL)
    answers.bind(config.answer_address(0))
    sender = context.socket(zmq.PUSH)
    sender.connect(config.request_address(0))
    exits: list[int] = []
    loop = GreedyBatchedLoop(config, BatchPolicy(max_batch_size=2, pipeline_depth=depth), [0], exits.append)
    model = EchoModel(fail=True, device_broken=True)
    now = time.monotonic()
    sender.send(pickle.dumps(RequestBatch(0, [f"uid-{i}" for i in range(4)], [ImageRequest(b"x", queued_at=now)] * 4)))
    worker = threading.Thread(target=loop.serve, args=(model, 0))
    worker.start()
    try:
        worker.join(20)
        assert not worker.is_alive(), "the worker must end, not go on with a broken device"
        assert answers.poll(5000)
        batch = pickle.loads(answers.recv())
        answered = list(zip(batch.uids, batch.answers, strict=True))
    finally:
        context.destroy(linger=0)
    assert exits == [EXIT_DEVICE_UNUSABLE]
    assert [(uid, a.status_code, a.retry_after_s) for uid, a in answered] == [("uid-0", 503, 1), ("uid-1", 503, 1)]
    assert answered[0][1].detail == DEVICE_FAILED
    # The batch after it may have been prepared (depth 2) but never ran: its requests are answered
    # 503 by the HTTP process when it sees the worker restart (service/http/base/worker_watch.py).
    assert model.ran == 1
    assert any(r.levelname == "CRITICAL" and "no longer runs work" in r.getMessage() for r in caplog.records)


class CountingTrim:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, pad: int) -> int:
        self.calls += 1
        return 1


def test_trims_once_after_a_pause_and_never_during_a_batch() -> None:
    trim = CountingTrim()
    trimmer = HeapTrimmer(trim)
    with trimmer.busy():
        now = time.monotonic()
        assert not trimmer.trim_if_due(now + IDLE_BEFORE_TRIM_S + 1)  # a long batch is not a pause
    ended = time.monotonic()
    assert not trimmer.trim_if_due(ended + IDLE_BEFORE_TRIM_S / 2)  # too soon after the batch
    assert trimmer.trim_if_due(ended + IDLE_BEFORE_TRIM_S)
    assert not trimmer.trim_if_due(ended + 10 * IDLE_BEFORE_TRIM_S)  # nothing ran since: no second trim
    assert trim.calls == 1


def test_unbroken_work_still_gets_a_trim_per_max_gap() -> None:
    trim = CountingTrim()
    trimmer = HeapTrimmer(trim)
    with trimmer.busy():
        start = time.monotonic()
        assert not trimmer.trim_if_due(start + MAX_TRIM_GAP_S / 2)
        assert trimmer.trim_if_due(start + MAX_TRIM_GAP_S + 0.1)
    assert trim.calls == 1


def _wait_for(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_the_thread_trims_after_warm_up_and_after_each_burst_of_work() -> None:
    trim = CountingTrim()
    trimmer = HeapTrimmer(trim)
    checked_at: list[float] = []
    trim_if_due = trimmer.trim_if_due

    def checking(now: float) -> bool:
        checked_at.append(now)
        return trim_if_due(now)

    trimmer.trim_if_due = checking
    trimmer.start()
    try:
        assert _wait_for(lambda: trim.calls == 1)  # what setup and warm-up freed
        trimmed_by = time.monotonic()
        # The thread checked again after a pause long enough for a trim, had anything run since.
        assert _wait_for(lambda: checked_at[-1] >= trimmed_by + IDLE_BEFORE_TRIM_S)
        assert trim.calls == 1  # idle and nothing new: no trim
        with trimmer.busy():
            pass
        assert _wait_for(lambda: trim.calls == 2)  # work happened, then a pause
    finally:
        trimmer.stop()


def test_a_batch_that_starts_while_a_trim_is_claimed_keeps_its_dirt() -> None:
    trimmer = HeapTrimmer(CountingTrim())
    start = time.monotonic()
    assert trimmer.trim_if_due(start + IDLE_BEFORE_TRIM_S + 0.01)
    with trimmer.busy():  # a batch right after the trim: its garbage must get the next trim
        pass
    assert trimmer.trim_if_due(time.monotonic() + IDLE_BEFORE_TRIM_S + 0.01)


class PrepareFailsOn(EchoModel):
    def __init__(self, bad: bytes) -> None:
        super().__init__()
        self.bad = bad

    def prepare(self, requests: list[ImageRequest]) -> list[ImageRequest]:
        if any(r.image == self.bad for r in requests):
            raise ValueError("a preprocessing bug")
        return requests


def test_the_pipelined_loop_answers_every_request_and_survives_a_failed_prepare(wire: Wire) -> None:
    wire.put(6)
    runner = BatchRunner(PrepareFailsOn(b"request-3"), wire.worker, 0, running=[0])
    pipeline, stop = PipelinedRunner(_collector(wire, max_batch_size=2), runner, ahead=1), threading.Event()
    thread = threading.Thread(target=pipeline.serve, args=(stop,))
    thread.start()
    try:
        answers = {}
        while len(answers) < 6:
            got = wire.answered()
            assert got, f"only {sorted(answers)} answered"
            answers.update((uid, (a.status_code, a.predictions)) for uid, a in got)
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive(), "the loop must end when told to"
    # Batches of 2: the one holding request-3 failed in preparation; the others were answered.
    assert {uid: code for uid, (code, _) in answers.items()} == {
        "uid-0": 200, "uid-1": 200, "uid-2": 500, "uid-3": 500, "uid-4": 200, "uid-5": 200,
    }  # fmt: skip
    assert answers["uid-4"][1][0][1] == "request-4"


def test_pipeline_depth_must_be_at_least_one() -> None:
    with pytest.raises(ValueError, match="pipeline_depth must be >= 1"):
        BatchPolicy(pipeline_depth=0)


def test_startup_objects_are_frozen_out_of_the_collectors_passes() -> None:
    import gc

    from service.heap import freeze_startup_objects

    long_lived = [[] for _ in range(1000)]  # lists: the collector tracks them
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() >= len(long_lived), "what is alive at the call is frozen"
        made_later = [[i] for i in range(100)]
        # gc.get_objects() lists the collector's generations, not the permanent one. (The freeze
        # count itself is no measure: it drops whenever any frozen object dies by refcount.)
        in_collector = {id(obj) for obj in gc.get_objects()}
        assert not any(id(obj) in in_collector for obj in long_lived), "startup objects frozen"
        assert all(id(obj) in in_collector for obj in made_later), "later ones collected as usual"
        del made_later, in_collector
    finally:
        gc.unfreeze()


def instant_classifier(pipeline_depth: int):
    """The real Classifier with a model that answers at once: the stage accounting is under test."""
    import torch

    from compile.catalog import get_model_entry
    from preprocessing.pil_backend import PilPreprocessor
    from service.settings import ServeSettings
    from service.worker.classifier import Classifier
    from service.worker.engine import ServedModel

    entry = get_model_entry("efficientnet-lite0")
    served = ServedModel(entry, "instant", run=lambda images: torch.zeros(len(images), len(entry.labels)))
    settings = ServeSettings(model=entry.name, pipeline_depth=pipeline_depth)
    return Classifier(settings, served, PilPreprocessor(entry.preprocess, "cpu"), torch.device("cpu"))


@pytest.mark.parametrize("depth", [1, 2])
def test_a_prepared_batch_waiting_for_the_engine_is_a_stage_of_its_own(depth: int, chelsea_jpeg: bytes) -> None:
    """At depth 2 a prepared batch waits while the engine runs the one before it: that wait must be
    in the breakdown (Server-Timing, the stage histogram), or the stages do not add up."""
    classifier = instant_classifier(depth)
    classifier.run(classifier.prepare([ImageRequest(chelsea_jpeg)]))  # first-call costs are not a stage
    started = time.perf_counter()
    prepared = classifier.prepare([ImageRequest(chelsea_jpeg), ImageRequest(chelsea_jpeg)])
    time.sleep(0.3)  # the engine is busy with the batch before this one
    (answer, _) = classifier.run(prepared)
    elapsed_ms = (time.perf_counter() - started) * 1e3
    stages = answer.timings_ms
    if depth == 1:
        assert "pipeline_wait" not in stages  # nothing waits between preparing and running
        return
    assert list(stages) == ["preprocess", "pipeline_wait", "inference"]
    assert stages["pipeline_wait"] >= 300
    assert elapsed_ms - 5 <= sum(stages.values()) <= elapsed_ms
