"""The worker's batch collection (greedy, blocking, optional window) and the idle-time heap trimmer.

The loop is exercised against a real ``multiprocessing`` manager queue, the kind LitServe hands it;
only the LitAPI (three attributes) and the transport (records what the loop sends) stand in.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from types import SimpleNamespace

import pytest
from litserve.loops.base import _SENTINEL_VALUE, _StopLoopError
from litserve.utils import LitAPIStatus

from service import batching
from service.batching import GreedyBatchedLoop
from service.heap import IDLE_BEFORE_TRIM_S, MAX_TRIM_GAP_S, HeapTrimmer
from service.metrics import metrics


class RecordingTransport:
    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def send(self, item: tuple, consumer_id: int) -> None:
        self.sent.append((consumer_id, item))


@pytest.fixture(scope="module")
def manager():
    with mp.Manager() as running:
        yield running


def _loop() -> GreedyBatchedLoop:
    loop = GreedyBatchedLoop()
    loop._restart_workers = True  # what LitServer sets with restart_workers=True: START messages are sent
    loop._worker_id = 0
    return loop


def _api(max_batch_size: int = 4, batch_timeout: float = 0.0, request_timeout: float = 30.0) -> SimpleNamespace:
    return SimpleNamespace(max_batch_size=max_batch_size, batch_timeout=batch_timeout, request_timeout=request_timeout)


def _put(queue, n: int, start: int = 0, queued_at: float | None = None) -> None:
    for i in range(start, start + n):
        queue.put((7, f"uid-{i}", time.monotonic() if queued_at is None else queued_at, f"request-{i}"))


def test_takes_what_is_queued_without_waiting(manager) -> None:
    queue, transport = manager.Queue(), RecordingTransport()
    _put(queue, 3)
    started = time.monotonic()
    payloads, timed_out = _loop().get_batch_requests(_api(), queue, transport)
    assert time.monotonic() - started < 0.5  # no window: it did not wait for a 4th
    assert [p[2] for p in payloads] == ["request-0", "request-1", "request-2"] and timed_out == []
    # Each taken request was announced as started, so the HTTP process knows which worker holds it.
    assert [(cid, item[0], item[1][1]) for cid, item in transport.sent] == [
        (7, f"uid-{i}", LitAPIStatus.START) for i in range(3)
    ]


def test_never_exceeds_the_max_batch_size(manager) -> None:
    queue = manager.Queue()
    _put(queue, 6)
    payloads, _ = _loop().get_batch_requests(_api(max_batch_size=4), queue, RecordingTransport())
    assert len(payloads) == 4 and queue.qsize() == 2


def test_a_window_waits_for_late_arrivals_and_then_stops(manager) -> None:
    queue = manager.Queue()
    _put(queue, 1)
    threading.Timer(0.1, _put, (queue, 1, 1)).start()
    started = time.monotonic()
    payloads, _ = _loop().get_batch_requests(_api(batch_timeout=0.5), queue, RecordingTransport())
    elapsed = time.monotonic() - started
    assert [p[2] for p in payloads] == ["request-0", "request-1"]
    assert 0.45 <= elapsed < 2.0  # the window runs from the first request; nothing else came


def test_an_idle_queue_returns_empty_after_the_idle_wait(manager, monkeypatch) -> None:
    monkeypatch.setattr(batching, "IDLE_WAIT_S", 0.05)
    assert _loop().get_batch_requests(_api(), manager.Queue(), RecordingTransport()) == ([], [])


def expired_count() -> float:
    return metrics().registry.get_sample_value("vision_serve_requests_expired_total") or 0.0


def test_expired_requests_are_answered_504_counted_and_not_run(manager, caplog) -> None:
    queue, transport, loop = manager.Queue(), RecordingTransport(), _loop()
    before = expired_count()
    for _ in range(2):  # two rounds: the second drop is counted but not logged again so soon
        _put(queue, 1, queued_at=time.monotonic() - 60)
        _put(queue, 1, start=1)
        payloads, timed_out = loop.get_batch_requests(_api(request_timeout=30), queue, transport)
        assert timed_out == [] and [p[1] for p in payloads] == ["uid-1"]
    answers = [(uid, message[0]) for _, (uid, message) in transport.sent if message[1] == LitAPIStatus.ERROR]
    assert [(uid, error.status_code) for uid, error in answers] == [("uid-0", 504), ("uid-0", 504)]
    assert expired_count() == before + 2
    dropped = [r for r in caplog.records if r.name == "service.batching" and "Dropped" in r.getMessage()]
    assert len(dropped) == 1 and dropped[0].levelname == "WARNING"


def test_the_shutdown_sentinel_stops_the_loop(manager) -> None:
    queue = manager.Queue()
    queue.put(_SENTINEL_VALUE)
    with pytest.raises(_StopLoopError):
        _loop().get_batch_requests(_api(), queue, RecordingTransport())


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
    trimmer = HeapTrimmer(trim).start()
    try:
        assert _wait_for(lambda: trim.calls == 1)  # what setup and warm-up freed
        time.sleep(3 * IDLE_BEFORE_TRIM_S)
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
