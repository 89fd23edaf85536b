"""The main process's side of worker health: a worker that dies while serving is replaced.

The HTTP processes answer what a dead worker held (service/frontend/worker_watch.py); this loop, in
a thread of the main process, notices the death within a poll interval and starts a new worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess

from service.litserve_bridge import READY

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1


def restart_dead_workers(
    workers: list[BaseProcess],
    state_of: Callable[[int], str | None],
    relaunch: Callable[[int], BaseProcess],
    stopping: Callable[[], bool],
    on_unrecoverable: Callable[[str], None],
    poll_interval_s: float = POLL_INTERVAL_S,
    sleep: Callable[[float], None] | None = None,
) -> None:
    """Main-process loop: replace every worker that died while serving, until ``stopping()``.

    A worker that dies before it was ready (its setup raised: a model that no longer loads; or it
    was killed while loading: the OOM killer) is not restarted again, nor is one that cannot be
    relaunched: ``on_unrecoverable`` stops the server, so that a supervisor (Kubernetes, systemd)
    sees the failure instead of a server that restarts workers forever or never becomes ready.
    """
    sleep = sleep or time.sleep
    while not stopping():
        for index, process in enumerate(workers):
            if process.is_alive() or stopping():
                continue
            state = state_of(index)
            if state != READY:
                on_unrecoverable(
                    f"Inference worker {index} (pid {process.pid}) died during its setup (state {state}, exit code "
                    f"{process.exitcode}); stopping the server."
                )
                return
            logger.error(
                "Inference worker %d (pid %s) died (exit code %s); restarting it.",
                index,
                process.pid,
                process.exitcode,
            )
            try:
                workers[index] = relaunch(index)
            except Exception as exc:
                on_unrecoverable(f"Inference worker {index} could not be restarted ({exc!r}); stopping the server.")
                return
        sleep(poll_interval_s)
