"""Inference-worker health, seen from both sides of LitServe's queues.

- ``WorkerWatch`` runs in every HTTP process. It keeps a fresh copy of the workers' setup states
  (for ``/ready`` and for refusing work while no worker can take it) and, on every poll, answers
  with 503 the unanswered requests of any worker that is not ready (it died and is being
  restarted). A worker takes requests only once ready, so a request attributed to a worker that is
  not ready was taken by its dead predecessor; sweeping on every poll, not only on the change,
  also catches a START message that arrives late. (A restart faster than a poll, which takes
  seconds of model loading, would be missed; the deadline still answers those requests.)
  LitServe's own restart logic tries to fail them from the main process, whose response buffer is
  empty (the buffers live in the HTTP processes), so those requests would wait forever.
- ``restart_dead_workers`` runs in the main process: it notices a dead worker within a poll
  interval and starts a new one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, MutableMapping
from multiprocessing.process import BaseProcess

from fastapi import HTTPException
from litserve.utils import LitAPIStatus, ResponseBufferItem, WorkerSetupStatus

from service._defaults import RETRY_AFTER_S

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1


def worker_crashed_error() -> HTTPException:
    return HTTPException(
        503,
        "The inference worker handling this request stopped unexpectedly and is being restarted. The request "
        "was not completed; retrying it is safe.",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def worker_index(status_key: str) -> int:
    """LitServe names setup states ``<endpoint>_<worker id>``."""
    return int(status_key.rsplit("_", 1)[1])


class WorkerWatch:
    def __init__(
        self,
        setup_status: Mapping[str, str],
        response_buffer: MutableMapping[str, ResponseBufferItem],
        poll_interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        self._setup_status = setup_status  # a multiprocessing-manager dict, written by the workers
        self._response_buffer = response_buffer
        self.poll_interval_s = poll_interval_s
        self.states: dict[str, str] = {}

    @property
    def ready(self) -> bool:
        """Every inference worker has loaded its model and finished warm-up."""
        return bool(self.states) and all(state == WorkerSetupStatus.READY for state in self.states.values())

    @property
    def any_ready(self) -> bool:
        return any(state == WorkerSetupStatus.READY for state in self.states.values())

    def refresh(self) -> None:
        # One round trip to the manager; and no await between reading and sweeping, so a START
        # processed before this read came from a worker that was already ready (READY precedes it).
        self.states = self._setup_status.copy()
        for key, state in self.states.items():
            if state != WorkerSetupStatus.READY:
                self.fail_requests_of(worker_index(key))

    def fail_requests_of(self, worker_id: int) -> None:
        failed = 0
        for item in list(self._response_buffer.values()):
            if item.worker_id == worker_id and not item.event.is_set():
                item.response = (worker_crashed_error(), LitAPIStatus.ERROR)
                item.event.set()
                failed += 1
        if failed:
            logger.warning("Answered %d request(s) held by inference worker %d with 503: it died.", failed, worker_id)

    async def run(self) -> None:
        while True:
            try:
                self.refresh()
            except (ConnectionError, EOFError):
                return  # the manager is gone: the server is shutting down
            except Exception:
                # Keep watching: a dead watch would freeze /ready and stop failing crashed requests.
                logger.exception("Reading the inference workers' states failed; trying again.")
                self.states = {}
            await asyncio.sleep(self.poll_interval_s)


def restart_dead_workers(
    workers: list[BaseProcess],
    setup_status: Mapping[str, str],
    status_key: Callable[[int], str],
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
            state = setup_status.get(status_key(index))
            if state != WorkerSetupStatus.READY:
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
