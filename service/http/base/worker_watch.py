"""Inference-worker health as an HTTP process sees it (the main process restarts dead workers:
service/supervisor/pool/).

``WorkerWatch`` keeps a fresh copy of the routing table the main process publishes (which workers
serve which model version, and each worker's state: service/repository/table.py), for ``/ready`` and
to send work only to ready workers of the version asked for. At each new table it answers with 503
the unanswered requests this process sent to any worker that is not ready (it died, or stopped
answering: service/supervisor/pool/hangs.py, and is being restarted), sends the final message to
workers whose version was retired, and records the table generation it follows, which a load call
waits for. The HTTP process picks the worker of every
request (service/transport/channels.py), so it knows exactly which requests a dead worker held.
Looking for a new table costs one ``stat`` per poll: no round trip to another process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import MutableSequence

from service.errors import Unavailable
from service.repository.table import RoutingTable, TableFile, VersionRoute
from service.transport.channels import ApiChannel
from service.transport.control_channel import READY, UNRESPONSIVE
from service.wire import Answer, answer_for

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1


def worker_crashed_answer() -> Answer:
    return answer_for(
        Unavailable(
            "The inference worker handling this request stopped unexpectedly and is being restarted. The request "
            "was not completed; retrying it is safe."
        )
    )


def worker_hung_answer() -> Answer:
    return answer_for(
        Unavailable(
            "The inference worker handling this request stopped answering (no heartbeat, or one batch far past its "
            "time) and is being restarted. The request was not completed; retrying it is safe."
        )
    )


def worker_name(worker_id: int) -> str:
    return f"worker_{worker_id}"


class WorkerWatch:
    def __init__(
        self,
        channel: ApiChannel,
        table_file: TableFile,
        poll_interval_s: float = POLL_INTERVAL_S,
        acks: MutableSequence[int] | None = None,
    ) -> None:
        """``table_file``: the routing table the main process publishes; ``acks``: per HTTP process,
        the generation it follows (this one writes its own)."""
        self._channel = channel
        self._table_file = table_file
        self._acks = acks
        self.poll_interval_s = poll_interval_s
        self.states: dict[int, str] = {}
        self.ready_workers: list[int] = []
        self.table = RoutingTable()
        self._known: set[int] = set()  # workers this process may hold a socket to

    @property
    def ready(self) -> bool:
        """Some model version is served, and every worker of every served version has loaded its
        model and finished warm-up (versions being loaded beside them do not count: the old ones
        serve meanwhile)."""
        serving = self.table.serving_workers()
        # Nothing served (every model unloaded): no inference can succeed, so not ready. Nor while the
        # main process still loads a repository's first models.
        return bool(serving) and not self.table.filling and all(self.states.get(worker) == READY for worker in serving)

    def ready_in(self, route: VersionRoute) -> list[int]:
        """The ready workers of one model version."""
        return [worker for worker in route.workers if self.states.get(worker) == READY]

    def named_states(self) -> dict[str, str]:
        """``{"worker_0": "ready", ...}``: for /ready and the workers gauge."""
        return {worker_name(worker_id): state for worker_id, state in sorted(self.states.items())}

    def refresh(self) -> None:
        """Follow the published table if it changed since the last look (one ``stat``)."""
        table = self._table_file.read_if_changed()
        if table is not None:
            self.follow_table(table)
        else:
            # Again at every poll: a request may have picked a worker just before this process saw
            # that it is no longer ready, and sent it there after.
            self.fail_unready()

    def follow_table(self, table: RoutingTable) -> None:
        """Take a newly published routing table: the workers' states, then retire, forget, acknowledge."""
        self.table = table
        self._channel.place_workers(table.worker_processes)
        self.apply(table.worker_states)
        for worker_id in table.draining:
            self._channel.retire(worker_id)
        current = table.serving_workers() | set(table.draining)
        for worker_id in self._known - current:
            self._channel.drop_worker(worker_id)
        self._known = current
        if self._acks is not None:
            self._acks[self._channel.api_server] = table.generation

    def apply(self, states: dict[int, str]) -> None:
        """New states: requests go only to ready workers from now on, and those that a worker no
        longer ready holds (it died and is restarted, or it crashed while draining) get a 503."""
        self.states = dict(states)
        self.ready_workers = [worker_id for worker_id, state in self.states.items() if state == READY]
        self.fail_unready()

    def fail_unready(self) -> None:
        """Answer with 503 what this process sent to a worker that is not ready."""
        for worker_id, state in self.states.items():
            if state != READY:
                hung = state == UNRESPONSIVE
                failed = self._channel.fail_worker(worker_id, worker_hung_answer() if hung else worker_crashed_answer())
                if failed:
                    logger.warning(
                        "Answered %d request(s) held by inference worker %d with 503: it %s.",
                        failed,
                        worker_id,
                        "stopped answering" if hung else "died",
                    )

    async def run(self) -> None:
        while True:
            try:
                self.refresh()
            except Exception:
                # Keep watching: a dead watch would freeze /ready and stop failing crashed requests.
                logger.exception("Reading the routing table failed; trying again.")
            await asyncio.sleep(self.poll_interval_s)
