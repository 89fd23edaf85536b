"""Hung workers on their own: the heartbeat (service/transport/heartbeats.py), the batch the runner
shows on it, and the main process's rules (service/supervisor/pool/hangs.py) on a fake clock.

The end-to-end behaviour (a real SIGSTOP, a real slow batch, a real restart) is in
tests/e2e/test_hung_workers.py; these pin the rules at their edges.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from compile.settings_errors import SettingsError
from service import _defaults
from service.settings import ServeSettings, batch_hang_timeout_s
from service.supervisor.pool.hangs import HangRules, HangWatch
from service.supervisor.pool.restarts import WorkerRestarter
from service.supervisor.pool.states import WorkerStates
from service.supervisor.pool.workers import ServedVersion, Worker, WorkerHooks, WorkerSet
from service.transport.control_channel import READY, STARTING, UNRESPONSIVE
from service.transport.heartbeats import FIELDS, Heartbeat, HeartbeatBoard
from service.worker.runner import BatchRunner

RULES = HangRules(heartbeat_timeout_s=5.0, batch_timeout_s=60.0)


class FakeProcess:
    def __init__(self, pid: int) -> None:
        self.pid, self.alive, self.exitcode, self.kills = pid, True, None, 0

    def is_alive(self) -> bool:
        return self.alive

    def kill(self) -> None:
        self.kills += 1


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Scene:
    """One READY serving worker (id 0), its board slot, a watch on a fake clock."""

    def __init__(self, rules: HangRules = RULES) -> None:
        self.clock = Clock()
        self.board = HeartbeatBoard([0.0] * (4 * FIELDS))
        self.states = WorkerStates()
        self.states.set(0, READY)
        self.process = FakeProcess(pid=10)
        self.hooks = WorkerHooks(spawn=self.spawn, make_entry=lambda plan: None, device_slots=lambda n: ["cpu"] * n)
        self.workers = WorkerSet(ServeSettings(), self.states, self.hooks, threading.Event())
        self.worker = Worker(0, "m", 1, "cpu", self.process, None)
        self.workers.served = {"m": {1: ServedVersion(plan=None, workers=[self.worker])}}
        self.hung: list[str] = []
        self.spawned: list[int] = []
        self.watch = HangWatch(self.workers, self.board, rules, self.hung.append, self.clock)

    def spawn(self, entry, worker_id: int, device, ordinal: int = 0) -> FakeProcess:
        self.spawned.append(worker_id)
        self.board.clear(worker_id)
        return FakeProcess(pid=11)

    def after(self, seconds: float, beat: bool = False) -> str | None:
        """``seconds`` later (the worker beating throughout if ``beat``), one check; the state then."""
        self.clock.now += seconds
        if beat:
            self.board.beat(0, self.clock.now)
        self.watch.check()
        return self.states.get(0)


def test_a_silent_worker_is_unresponsive_at_the_timeout_and_killed_at_twice_it() -> None:
    scene = Scene()
    assert scene.after(0, beat=True) == READY
    assert scene.after(4.9) == READY  # under the bound
    assert scene.after(0.2) == UNRESPONSIVE and scene.hung == ["silent"]
    assert scene.process.kills == 0  # it may come back yet
    assert scene.after(4.0) == UNRESPONSIVE and scene.process.kills == 0
    assert scene.after(1.0) == UNRESPONSIVE and scene.process.kills == 1
    assert scene.after(1.0) == UNRESPONSIVE and scene.process.kills == 1  # killed once, counted once
    assert scene.hung == ["silent"]


def test_a_worker_that_beats_again_before_its_kill_serves_again() -> None:
    scene = Scene()
    scene.after(0, beat=True)
    assert scene.after(6.0) == UNRESPONSIVE
    assert scene.after(1.0, beat=True) == READY  # resumed (SIGCONT): ready again, not killed
    assert scene.process.kills == 0 and scene.hung == ["silent"]


def test_a_busy_worker_that_beats_is_left_alone_however_long_its_batch_below_the_batch_bound() -> None:
    scene = Scene()
    scene.after(0, beat=True)
    scene.board.hold_batch(0, scene.clock.now)
    for _ in range(59):  # a batch of 59 s, twelve heartbeat timeouts long: busy, not hung
        assert scene.after(1.0, beat=True) == READY
    assert scene.process.kills == 0 and scene.hung == []


def test_one_batch_past_the_batch_bound_while_it_beats_gets_the_worker_killed_at_once() -> None:
    scene = Scene()
    scene.after(0, beat=True)
    scene.board.hold_batch(0, scene.clock.now)
    assert scene.after(59.0, beat=True) == READY
    assert scene.after(1.0, beat=True) == UNRESPONSIVE
    assert scene.hung == ["stuck_batch"] and scene.process.kills == 1


def test_a_worker_is_watched_from_when_it_is_seen_ready() -> None:
    scene = Scene()
    scene.states.set(0, STARTING)  # loading: its load has its own bounds
    assert scene.after(100.0) == STARTING and scene.hung == []
    scene.states.set(0, READY)  # ready, and no beat yet (its loop starts a moment after its report)
    assert scene.after(0.1) == READY
    assert scene.after(4.8) == READY
    assert scene.after(0.2) == UNRESPONSIVE  # no beat within the timeout of being seen ready


def test_a_killed_unresponsive_worker_is_restarted_not_taken_for_a_failed_setup() -> None:
    scene = Scene()
    scene.after(0, beat=True)
    scene.after(10.0)
    assert scene.process.kills == 1
    scene.process.alive, scene.process.exitcode = False, -9
    stopped: list[str] = []
    restarter = WorkerRestarter(scene.workers, scene.hooks, stopped.append, scene.watch)
    rounds: list[float] = []
    restarter.watch(stopping=lambda: len(rounds) > 2, metrics_restart=lambda process: None, sleep=rounds.append)
    assert stopped == [] and scene.spawned == [0]
    assert scene.worker.process.pid == 11 and scene.states.get(0) == STARTING
    scene.states.set(0, READY)  # the new one, seen ready: watched afresh, its slot cleared
    assert scene.after(1.0) == READY and scene.hung == ["silent"]


def test_the_heartbeats_of_one_process_share_one_thread_and_a_stopped_one_beats_no_more() -> None:
    """A worker process holding many models beats for each of them from one thread."""
    board = HeartbeatBoard([0.0] * FIELDS * 3)
    beats = [Heartbeat(board, worker_id, interval_s=0.03) for worker_id in range(3)]
    before = {t.ident for t in threading.enumerate()}
    for heartbeat in beats:
        heartbeat.start()
    try:
        new = [t for t in threading.enumerate() if t.ident not in before and t.name == "vision-serve-heartbeat"]
        assert len(new) <= 1, "one beating thread for the process, not one per model"
        beats[1].stop()
        stopped_at = board.read(1)[0]
        time.sleep(0.3)
        assert board.read(0)[0] > stopped_at and board.read(2)[0] > stopped_at, "the others beat on"
        assert board.read(1)[0] == stopped_at, "a stopped model's slot is not beaten for"
    finally:
        for heartbeat in beats:
            heartbeat.stop()


def test_the_heartbeat_beats_in_its_own_thread_and_shows_the_batch() -> None:
    board = HeartbeatBoard([0.0] * FIELDS)
    heartbeat = Heartbeat(board, 0, interval_s=0.02)
    heartbeat.start()
    try:
        first, _ = board.read(0)
        assert first > 0
        time.sleep(0.2)  # the calling thread does nothing: the beats come from the heartbeat's thread
        assert board.read(0)[0] > first
        heartbeat.batch_started()
        assert board.read(0)[1] > 0
        heartbeat.batch_finished()
        assert board.read(0)[1] == 0.0
    finally:
        heartbeat.stop()


class FramedModel:
    """Records what the board shows while the batch is prepared and run."""

    def __init__(self, board: HeartbeatBoard) -> None:
        self.board, self.seen = board, []

    def prepare(self, requests: list) -> list:
        self.seen.append(("prepare", self.board.read(0)[1]))
        return requests

    def run(self, prepared: list) -> list:
        self.seen.append(("run", self.board.read(0)[1]))
        return [object()] * len(prepared)

    def unusable_device(self) -> None:
        return None


class Channel:
    def answer_many(self, answered: list) -> None:
        self.answered = answered


@pytest.mark.parametrize("pipelined", [False, True])
def test_the_runner_shows_the_batch_it_holds_from_its_prepare_or_its_run(pipelined: bool) -> None:
    board = HeartbeatBoard([0.0] * FIELDS)
    model = FramedModel(board)
    runner = BatchRunner(model, Channel(), 0, running=[0], heartbeat=Heartbeat(board, 0))
    batch = [SimpleNamespace(request=b"a"), SimpleNamespace(request=b"b")]
    if pipelined:  # the prepare thread prepares; the batch is held from its run
        runner.finish(batch, runner.prepare(batch))
        assert model.seen[0] == ("prepare", 0.0) and model.seen[1][1] > 0
    else:
        runner.run_batch(batch)
        started = model.seen[0][1]
        assert started > 0 and model.seen == [("prepare", started), ("run", started)]
    assert board.read(0)[1] == 0.0  # released after the answers


def test_the_hang_settings_and_their_defaults() -> None:
    settings = ServeSettings()
    assert settings.worker_heartbeat_timeout_s == _defaults.WORKER_HEARTBEAT_TIMEOUT_S
    assert batch_hang_timeout_s(settings) == _defaults.BATCH_HANG_REQUEST_TIMEOUTS * settings.request_timeout_s
    assert batch_hang_timeout_s(ServeSettings(batch_hang_timeout_s=7.0)) == 7.0
    assert HangRules.from_settings(ServeSettings(request_timeout_s=60.0)).batch_timeout_s == 240.0
    # A short request deadline does not make slow batches look hung (ResNet-152: 32 images, one core).
    assert HangRules.from_settings(ServeSettings(request_timeout_s=1.0)).batch_timeout_s == _defaults.MIN_BATCH_HANG_S
    ServeSettings(worker_heartbeat_timeout_s=0)  # off
    with pytest.raises(SettingsError, match=r"--worker-heartbeat-timeout-s must be 0 \(off\) or >= 1 s"):
        ServeSettings(worker_heartbeat_timeout_s=0.5)
    with pytest.raises(SettingsError, match="--batch-hang-timeout-s"):
        ServeSettings(batch_hang_timeout_s=-1)


def test_the_board_says_when_a_worker_last_ran_a_batch_for_the_memory_budget() -> None:
    # The budget evicts the least recently used idle model: "used" is a batch, running or ended.
    board = HeartbeatBoard([0.0] * (FIELDS * 4))
    clock = iter([10.0, 20.0, 20.0])  # the batch start; its end, and the beat with it
    heartbeat = Heartbeat(board, 5, clock=lambda: next(clock))
    assert board.last_used(5, now=1.0) == 0.0  # never ran one
    heartbeat.batch_started()  # at 10
    assert board.last_used(5, now=15.0) == 15.0  # running one now
    heartbeat.batch_finished()  # at 20
    assert board.last_used(5, now=30.0) == 20.0
    assert board.last_used(2, now=30.0) == 0.0  # another slot's is its own
    board.clear(5)
    assert board.last_used(5, now=30.0) == 0.0  # a restarted worker starts afresh
