"""Restarts in the main process: ``WorkerRestarter`` watches every serving inference worker and
restarts one that died, with the same worker id (so the routing table does not change). One that
dies before it was ever ready stops the server instead: its model no longer loads.

A draining worker is not watched (its exit is expected: service/supervisor/pool/workers.py), nor a
version's worker still loading (its load call answers for it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess

from service.supervisor.pool.workers import POLL_INTERVAL_S, WorkerHooks, WorkerSet
from service.transport.control_channel import READY, STARTING

logger = logging.getLogger(__name__)


class WorkerRestarter:
    """Restarts a serving worker that died; stops the server when one never got ready."""

    def __init__(self, workers: WorkerSet, hooks: WorkerHooks, on_unrecoverable: Callable[[str], None]) -> None:
        """``on_unrecoverable(message)``: stop the server, saying why."""
        self.workers = workers
        self.hooks = hooks
        self.on_unrecoverable = on_unrecoverable

    def watch(
        self,
        stopping: Callable[[], bool],
        metrics_restart: Callable[[BaseProcess], None],
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Main-process loop: restart every serving worker that died; until ``stopping()``."""
        while not stopping():
            states = self.workers.states.snapshot()
            for worker in self.workers.serving():
                if worker.process.is_alive() or stopping():
                    continue
                state = states.get(worker.worker_id)
                if state != READY:
                    # Its model no longer loads (or the OOM killer stopped it while loading): restarting
                    # it forever would hide that from the orchestrator. (A version being loaded is not
                    # serving yet: its load call answers for its workers.)
                    self.on_unrecoverable(
                        f"Inference worker {worker.worker_id} (pid {worker.process.pid}) died during its setup (state "
                        f"{state}, exit code {worker.process.exitcode}); stopping the server."
                    )
                    return
                logger.error(
                    "Inference worker %d (pid %s) died (exit code %s); restarting it.",
                    worker.worker_id,
                    worker.process.pid,
                    worker.process.exitcode,
                )
                metrics_restart(worker.process)
                try:
                    self.workers.states.set(worker.worker_id, STARTING)
                    worker.process = self.hooks.spawn(worker.entry, worker.worker_id, worker.device)
                except Exception as exc:
                    self.on_unrecoverable(
                        f"Inference worker {worker.worker_id} could not be restarted ({exc!r}); stopping the server."
                    )
                    return
            sleep(POLL_INTERVAL_S)
