"""Hangs, in the main process: ``HangWatch`` finds a serving worker that stopped answering, takes it
out of the routing table, and kills it for the restarter to start again (service/supervisor/pool/
restarts.py, whose loop calls ``check`` at every poll).

What it reads is each worker's heartbeat (service/transport/heartbeats.py): a thread of the worker
beats twice a second whatever its loop does, and the loop shows the batch it holds and since when.
So it tells three workers apart:

- busy: it beats, and its batch has run less than ``batch_timeout_s``: left alone however long
  batches take (a slow model, a large batch on a CPU);
- silent: no beat for ``heartbeat_timeout_s`` (SIGSTOP, a debugger, a native call that holds the
  GIL). It is marked UNRESPONSIVE: /ready answers 503, the HTTP processes send it nothing and answer
  what it holds with 503 at their next poll (service/http/base/worker_watch.py). Silent for twice
  the timeout it is killed; if it beats again before that, it is ready again (what it held was
  answered already; its late answers are counted as unclaimed);
- stuck: it beats, but one batch has run for ``batch_timeout_s`` (an engine that never returns): it
  is marked UNRESPONSIVE and killed at once.

Each hang is counted in ``vision_serve_workers_hung_total`` by reason, and its restart in
``vision_serve_worker_restarts_total`` as any restart. A worker is watched from the moment this
watch first sees it READY (its beats may start a moment after its ready report); its slot on the
board is cleared when it is started, so a predecessor's beat or batch is never read as its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from service.metrics import HUNG_SILENT, HUNG_STUCK_BATCH, metrics
from service.settings import ServeSettings, batch_hang_timeout_s
from service.supervisor.pool.workers import Worker, WorkerSet
from service.transport.control_channel import READY, UNRESPONSIVE
from service.transport.heartbeats import HeartbeatBoard

logger = logging.getLogger(__name__)

# A silent worker is marked unresponsive after the heartbeat timeout, and killed after this many.
KILL_AFTER_TIMEOUTS = 2.0


@dataclass(frozen=True)
class HangRules:
    heartbeat_timeout_s: float  # no beat this long: unresponsive; KILL_AFTER_TIMEOUTS x this: killed
    batch_timeout_s: float  # one batch this long while it beats: killed

    @classmethod
    def from_settings(cls, settings: ServeSettings) -> HangRules:
        return cls(settings.worker_heartbeat_timeout_s, batch_hang_timeout_s(settings))


def count_in_metrics(reason: str) -> None:
    metrics().workers_hung.labels(reason=reason).inc()


def hang_watch(settings: ServeSettings, workers: WorkerSet, board: HeartbeatBoard) -> HangWatch | None:
    """The server's watch, counting in its metrics; ``None`` with --worker-heartbeat-timeout-s 0 (off)."""
    if settings.worker_heartbeat_timeout_s <= 0:
        return None
    return HangWatch(workers, board, HangRules.from_settings(settings), count_in_metrics)


@dataclass
class _Watched:
    pid: int | None
    ready_since: float  # when this watch first saw it ready: its beats count from then
    silent: bool = False  # marked unresponsive for want of beats (it may come back)
    killed: bool = False


class HangWatch:
    """Finds hung serving workers on ``board`` by ``rules``; ``count_hung(reason)`` counts each."""

    def __init__(
        self,
        workers: WorkerSet,
        board: HeartbeatBoard,
        rules: HangRules,
        count_hung: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.workers = workers
        self.board = board
        self.rules = rules
        self.count_hung = count_hung
        self.clock = clock
        self._watched: dict[int, _Watched] = {}

    def check(self) -> None:
        """One look at every serving worker (the restarter's loop calls it at each poll)."""
        now = self.clock()
        states = self.workers.states.snapshot()
        serving = self.workers.serving()
        for worker_id in set(self._watched) - {w.worker_id for w in serving}:
            del self._watched[worker_id]  # retired or stopped
        for worker in serving:
            self._check(worker, states.get(worker.worker_id), now)

    def _check(self, worker: Worker, state: str | None, now: float) -> None:
        watched = self._watched.get(worker.worker_id)
        if watched is None or watched.pid != worker.process.pid:
            if state != READY:
                return  # starting (or restarting): its load has its own bounds
            watched = self._watched[worker.worker_id] = _Watched(worker.process.pid, now)
        if state not in (READY, UNRESPONSIVE) or watched.killed or not worker.process.is_alive():
            return  # the restarter restarts a dead one (a new pid: watched anew once ready)
        beat, batch = self.board.read(worker.worker_id)
        silent_s = now - max(beat, watched.ready_since)
        batch_s = now - batch if batch else 0.0
        rules = self.rules
        if silent_s >= rules.heartbeat_timeout_s:
            if state == READY:
                watched.silent = True
                self._mark(worker, HUNG_SILENT, f"no heartbeat for {silent_s:.1f} s")
            if silent_s >= KILL_AFTER_TIMEOUTS * rules.heartbeat_timeout_s:
                self._kill(worker, watched, f"still no heartbeat after {silent_s:.1f} s")
        elif batch_s >= rules.batch_timeout_s:
            if state == READY:
                self._mark(worker, HUNG_STUCK_BATCH, f"one batch running for {batch_s:.1f} s while it beats")
            self._kill(worker, watched, f"its batch has run for {batch_s:.1f} s (--batch-hang-timeout-s)")
        elif state == UNRESPONSIVE and watched.silent:
            watched.silent = False
            logger.warning(
                "Inference worker %d (pid %s) beats again before it was killed; it serves again.",
                worker.worker_id,
                worker.process.pid,
            )
            self.workers.states.set(worker.worker_id, READY)

    def _mark(self, worker: Worker, reason: str, why: str) -> None:
        logger.error(
            "Inference worker %d (pid %s) stopped answering (%s): marked unresponsive, its requests are answered 503.",
            worker.worker_id,
            worker.process.pid,
            why,
        )
        self.count_hung(reason)
        self.workers.states.set(worker.worker_id, UNRESPONSIVE)

    def _kill(self, worker: Worker, watched: _Watched, why: str) -> None:
        logger.error(
            "Inference worker %d (pid %s) is hung (%s); killing it for a restart.",
            worker.worker_id,
            worker.process.pid,
            why,
        )
        watched.killed = True
        worker.process.kill()  # SIGKILL ends a stopped process too
