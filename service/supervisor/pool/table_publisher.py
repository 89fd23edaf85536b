"""Publishing the routing table, in the main process: ``TablePublisher`` writes the table the worker
set and the workers' states make (service/supervisor/pool/workers.py, states.py) to the file every
HTTP process follows (service/repository/table.py), each time with a new generation; a load or an
unload then waits until every HTTP process acknowledges that generation (shared memory, ``acks``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from service.repository.table import RoutingTable, TableFile, VersionRoute

logger = logging.getLogger(__name__)

ACK_TIMEOUT_S = 10.0
# How often the publisher's thread, with no change to publish, looks whether the server stops.
STOP_CHECK_S = 1.0
ACK_POLL_S = 0.01

# The table's content: model name -> version -> route, and the draining worker ids.
Routes = tuple[dict[str, dict[int, VersionRoute]], tuple[int, ...]]


class TablePublisher:
    """Writes the routing table with a new generation, and waits for every HTTP process's ack."""

    def __init__(
        self,
        channels_directory: str,
        acks: Sequence[int],
        routes: Callable[[], Routes],
        states: Callable[[], dict[int, str]],
        default_model: str,
        stopping: threading.Event,
        ack_timeout_s: float = ACK_TIMEOUT_S,
        parked: Callable[[], dict[str, dict[int, VersionRoute]]] = dict,
        filling: Callable[[], bool] = lambda: False,
        processes: Callable[[], dict[int, int]] = dict,
    ) -> None:
        """``acks``: per HTTP process, the table generation it follows (-1: not started yet);
        ``routes``: the table's content now; ``states``: every worker's state now; ``default_model``:
        --default-model, or ""; ``parked``: the routes of the models not resident (a repository
        served on demand: service/supervisor/pool/on_demand.py); ``filling``: whether the first models
        still load; ``processes``: each worker's process (its pid)."""
        self.table_file = TableFile(channels_directory)
        self.acks = acks
        self.routes = routes
        self.states = states
        self.default_model = default_model
        self.stopping = stopping
        self.ack_timeout_s = ack_timeout_s
        self.parked = parked
        self.filling = filling
        self.processes = processes
        self._generation = 0
        # Generations are written in the order their content was read: a later table never loses
        # to an earlier one that a slower thread wrote after it.
        self._lock = threading.Lock()
        self._changed = threading.Event()

    def start(self) -> None:
        """Start the thread that publishes what ``publish_soon`` asks for."""
        threading.Thread(target=self._publish_changes, name="vision-serve-table", daemon=True).start()

    def publish_soon(self) -> None:
        """A worker's state changed: publish a new table from the publisher's thread, at once. From
        any thread, under any lock (publishing takes the worker set's lock: doing it here could
        deadlock with a thread that holds that lock and waits for ours)."""
        self._changed.set()

    def _publish_changes(self) -> None:
        while not self.stopping.is_set():
            if self._changed.wait(STOP_CHECK_S):
                self._changed.clear()
                self.publish()

    def _table(self) -> RoutingTable:
        """The table with the content now and the current generation (under ``_lock``)."""
        models, draining = self.routes()
        # A model both served and parked (a moment of its load or eviction) is served.
        models = {**self.parked(), **models}
        # /predict without ?model=: --default-model, else the one model when there is exactly one.
        default = self.default_model or (next(iter(models)) if len(models) == 1 else "")
        return RoutingTable(
            self._generation, models, draining, default, self.states(), self.filling(), self.processes()
        )

    def publish(self) -> int:
        """Write the table with a new generation; returns it (not waiting for the HTTP processes)."""
        with self._lock:
            self._generation += 1
            self.table_file.write(self._table())
            return self._generation

    def wait_acks(self, generation: int) -> None:
        """Until every HTTP process follows ``generation`` (before the HTTP processes exist, at once)."""
        deadline = time.monotonic() + self.ack_timeout_s
        while time.monotonic() < deadline and not self.stopping.is_set():
            if all(ack >= generation or ack < 0 for ack in self.acks):
                return
            time.sleep(ACK_POLL_S)
        logger.warning("Not every HTTP process took routing table %d within %.0f s.", generation, self.ack_timeout_s)

    def publish_and_wait(self) -> None:
        """Publish, and return once every HTTP process follows the new table."""
        self.wait_acks(self.publish())
