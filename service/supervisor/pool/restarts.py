"""Restarts in the main process: ``WorkerRestarter`` watches every serving inference worker and
restarts one that died, with the same worker id (so the routing table does not change). One that
dies before it was ever ready stops the server instead: its model no longer loads.

A worker that stopped answering is killed by ``HangWatch`` (service/supervisor/pool/hangs.py, whose
``check`` runs at every poll of this loop, so a kill and its restart never race) and restarted here
as any worker that died.

A draining worker is not watched (its exit is expected: service/supervisor/pool/workers.py), nor a
version's worker still loading (its load call answers for it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess

from service.supervisor.pool.hangs import HangWatch
from service.supervisor.pool.workers import POLL_INTERVAL_S, WorkerHooks, WorkerSet
from service.transport.control_channel import READY, STARTING, UNRESPONSIVE

# A serving worker in one of these states that died had been serving: it is restarted.
SERVED_STATES = (READY, UNRESPONSIVE)

logger = logging.getLogger(__name__)


class WorkerRestarter:
    """Restarts a serving worker that died; stops the server when one never got ready."""

    def __init__(
        self,
        workers: WorkerSet,
        hooks: WorkerHooks,
        on_unrecoverable: Callable[[str], None],
        hangs: HangWatch | None = None,
    ) -> None:
        """``on_unrecoverable(message)``: stop the server, saying why; ``hangs``: kills hung workers
        (``None``: hang detection off)."""
        self.workers = workers
        self.hooks = hooks
        self.on_unrecoverable = on_unrecoverable
        self.hangs = hangs

    def watch(
        self,
        stopping: Callable[[], bool],
        metrics_restart: Callable[[BaseProcess], None],
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Main-process loop: restart every serving worker that died; until ``stopping()``."""
        while not stopping():
            if self.hangs is not None:
                try:
                    self.hangs.check()
                except Exception:  # never: the restarts below must go on
                    logger.exception("Looking for hung workers failed; trying again.")
            states = self.workers.states.snapshot()
            for worker in self.workers.serving():
                if worker.process.is_alive() or stopping():
                    continue
                state = states.get(worker.worker_id)
                if state not in SERVED_STATES:
                    # Its model no longer loads (or the OOM killer stopped it while loading): restarting
                    # it forever would hide that from the orchestrator. (A version being loaded is not
                    # serving yet: its load call answers for its workers.)
                    self.on_unrecoverable(
                        f"Inference worker {worker.worker_id} (pid {worker.process.pid}) died during its setup (state "
                        f"{state}, exit code {worker.process.exitcode}); stopping the server."
                    )
                    return
                logger.error(
                    "Inference worker %d (pid %s) %s (exit code %s); restarting it.",
                    worker.worker_id,
                    worker.process.pid,
                    "was killed as hung" if state == UNRESPONSIVE else "died",
                    worker.process.exitcode,
                )
                metrics_restart(worker.process)
                try:
                    self.workers.states.set(worker.worker_id, STARTING)
                    worker.process = self.hooks.spawn(worker.entry, worker.worker_id, worker.device, worker.ordinal)
                except Exception as exc:
                    self.on_unrecoverable(
                        f"Inference worker {worker.worker_id} could not be restarted ({exc!r}); stopping the server."
                    )
                    return
            sleep(POLL_INTERVAL_S)
