"""Inference-worker health, seen from both sides.

- ``WorkerWatch`` runs in every HTTP process. It keeps a fresh copy of the workers' setup states
  (for ``/ready``, and to send work only to ready workers) and, on every poll, answers with 503
  the unanswered requests this process sent to any worker that is not ready: it died and is being
  restarted. The HTTP process picks the worker of every request (service/transport/channels.py), so it knows
  exactly which requests a dead worker held. (A restart faster than a poll, which takes seconds of
  model loading, would be missed; the deadline still answers those requests.)
- ``restart_dead_workers`` runs in the main process: it notices a dead worker within a poll
  interval and starts a new one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess

from service.litserve_bridge import READY
from service.transport.channels import ApiChannel
from service.wire import RETRY_HEADERS, Answer, error_answer

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1


def worker_crashed_answer() -> Answer:
    return error_answer(
        503,
        "The inference worker handling this request stopped unexpectedly and is being restarted. The request "
        "was not completed; retrying it is safe.",
        headers=RETRY_HEADERS,
    )


def worker_name(worker_id: int) -> str:
    return f"worker_{worker_id}"


class WorkerWatch:
    def __init__(
        self,
        read_states: Callable[[], dict[int, str]],
        channel: ApiChannel,
        poll_interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        self._read_states = read_states  # worker id -> setup state, written by the workers
        self._channel = channel
        self.poll_interval_s = poll_interval_s
        self.states: dict[int, str] = {}
        self.ready_workers: list[int] = []

    @property
    def ready(self) -> bool:
        """Every inference worker has loaded its model and finished warm-up."""
        return bool(self.states) and len(self.ready_workers) == len(self.states)

    def named_states(self) -> dict[str, str]:
        """``{"worker_0": "ready", ...}``: for /ready and the workers gauge."""
        return {worker_name(worker_id): state for worker_id, state in sorted(self.states.items())}

    def refresh(self) -> None:
        self.apply(self._read_states())

    def apply(self, states: dict[int, str]) -> None:
        self.states = states
        self.ready_workers = [worker_id for worker_id, state in self.states.items() if state == READY]
        for worker_id, state in self.states.items():
            if state != READY:
                failed = self._channel.fail_worker(worker_id, worker_crashed_answer())
                if failed:
                    logger.warning(
                        "Answered %d request(s) held by inference worker %d with 503: it died.", failed, worker_id
                    )

    async def run(self) -> None:
        while True:
            try:
                # A round trip to the multiprocessing manager, which a busy machine can hold up for
                # a long time: in a thread, so deadlines and answers on this loop are not held up.
                self.apply(await asyncio.to_thread(self._read_states))
            except (ConnectionError, EOFError):
                return  # the manager is gone: the server is shutting down
            except Exception:
                # Keep watching: a dead watch would freeze /ready and stop failing crashed requests.
                logger.exception("Reading the inference workers' states failed; trying again.")
                self.states, self.ready_workers = {}, []
            await asyncio.sleep(self.poll_interval_s)


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
