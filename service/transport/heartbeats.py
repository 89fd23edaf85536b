"""Heartbeats: how the main process tells a worker that stopped answering from one that is only busy.

A shared array of doubles (``HeartbeatBoard``), three per worker slot: when the worker last beat,
when the batch it holds started (0: it holds none), and when its last batch ended, all on
``time.monotonic`` (CLOCK_MONOTONIC, one clock for every process of the machine). Each worker writes
its own slot, the main process reads them (service/supervisor/pool/hangs.py; the memory budget's
least recently used model, service/supervisor/pool/budget.py) and clears a worker's slot before it
starts it.

The worker's end is ``Heartbeat``: a thread of the process (one for all the models it holds) beats
every ``BEAT_INTERVAL_S`` whatever the loop does, so a long batch does not silence it; the loop
(service/worker/runner.py) sets and clears the batch's start. A process that is stopped (SIGSTOP, a
debugger) or frozen in a native call that holds the GIL beats no more; one whose engine hangs with
the GIL released (a kernel that never returns, a deadlocked library) beats on, with one batch held
far longer than batches take.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, MutableSequence

from service import _defaults

logger = logging.getLogger(__name__)

FIELDS = 3  # per worker slot: its last beat, the start of the batch it holds, the end of its last batch
BEAT, BATCH, LAST = 0, 1, 2
BEAT_INTERVAL_S = _defaults.WORKER_BEAT_INTERVAL_S


class HeartbeatBoard:
    """Per worker (slot ``worker_id % slots``): its last beat, its batch's start and its last batch's
    end; 0 when none."""

    def __init__(self, shared: MutableSequence[float]) -> None:
        """``shared``: ``FIELDS`` doubles per slot (a ``multiprocessing.Array("d", ..., lock=False)``:
        each slot has one writer, and an aligned double is written whole)."""
        self.shared = shared
        self.slots = len(shared) // FIELDS

    def _base(self, worker_id: int) -> int:
        return (worker_id % self.slots) * FIELDS

    def read(self, worker_id: int) -> tuple[float, float]:
        """(last beat, start of the batch it holds); 0.0 for what it has not written."""
        base = self._base(worker_id)
        return self.shared[base + BEAT], self.shared[base + BATCH]

    def clear(self, worker_id: int) -> None:
        """Before the worker (re)starts: nothing of its predecessor's is read as its own."""
        base = self._base(worker_id)
        self.shared[base + BEAT] = 0.0
        self.shared[base + BATCH] = 0.0
        self.shared[base + LAST] = 0.0

    def last_used(self, worker_id: int, now: float) -> float:
        """When the worker last ran a batch: ``now`` while it runs one, 0.0 if it never ran one."""
        base = self._base(worker_id)
        return now if self.shared[base + BATCH] else self.shared[base + LAST]

    def beat(self, worker_id: int, now: float) -> None:
        self.shared[self._base(worker_id) + BEAT] = now

    def hold_batch(self, worker_id: int, since: float) -> None:
        """The batch the worker holds started at ``since`` (0.0: it holds none)."""
        self.shared[self._base(worker_id) + BATCH] = since

    def end_batch(self, worker_id: int, now: float) -> None:
        """The batch the worker held ended at ``now``: it holds none."""
        base = self._base(worker_id)
        self.shared[base + LAST] = now
        self.shared[base + BATCH] = 0.0


class Heartbeat:
    """The worker's end: ``start`` beats in a thread until ``stop``; ``batch_started`` and
    ``batch_finished`` frame each batch the loop runs."""

    def __init__(
        self,
        board: HeartbeatBoard,
        worker_id: int,
        interval_s: float = BEAT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.board = board
        self.worker_id = worker_id
        self.interval_s = interval_s
        self.clock = clock

    def start(self) -> None:
        self.beat()
        process_beater(self.interval_s).add(self)

    def stop(self) -> None:
        process_beater(self.interval_s).remove(self)

    def beat(self) -> None:
        self.board.beat(self.worker_id, self.clock())

    def batch_started(self) -> None:
        now = self.clock()
        self.board.hold_batch(self.worker_id, now)
        self.board.beat(self.worker_id, now)

    def batch_finished(self) -> None:
        self.board.end_batch(self.worker_id, self.clock())
        self.beat()


class ProcessBeater:
    """One thread that beats, every ``interval_s``, for each heartbeat started in this process: a
    worker process holding many models needs no thread per model for that."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._beating: set[Heartbeat] = set()
        self._thread: threading.Thread | None = None

    def add(self, heartbeat: Heartbeat) -> None:
        with self._lock:
            self._beating.add(heartbeat)
            if self._thread is None:
                self._thread = threading.Thread(target=self._beat_forever, name="vision-serve-heartbeat", daemon=True)
                self._thread.start()

    def remove(self, heartbeat: Heartbeat) -> None:
        with self._lock:
            self._beating.discard(heartbeat)

    def _beat_forever(self) -> None:
        while True:
            time.sleep(self.interval_s)
            with self._lock:
                beating = list(self._beating)
            for heartbeat in beating:
                try:
                    heartbeat.beat()
                except Exception:  # never: a dead thread would get a live worker killed as hung
                    logger.exception("The heartbeat of worker %d failed; beating on.", heartbeat.worker_id)


_beaters: dict[tuple[int, float], ProcessBeater] = {}
_beaters_lock = threading.Lock()


def process_beater(interval_s: float) -> ProcessBeater:
    """This process's beater for ``interval_s`` (made on first use; a forked child makes its own)."""
    key = (os.getpid(), interval_s)
    with _beaters_lock:
        beater = _beaters.get(key)
        if beater is None:
            beater = _beaters[key] = ProcessBeater(interval_s)
        return beater
