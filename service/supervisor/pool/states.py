"""Every inference worker's state, in the main process: the one place it is kept.

``WorkerStates`` is written by the pool (a worker is STARTING when spawned, or restarted; gone when
stopped), by the control channel's thread (a worker's own READY or ERROR report, service/transport/
control_channel.py) and by a drain (a retired worker that crashed is marked ERROR). Each change
runs ``on_change``: the server publishes the routing table with the states in it, which is how the
HTTP processes learn them (service/repository/table.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from service.transport.control_channel import ERROR, READY, WorkerReport

REPORTED_STATES = (READY, ERROR)


class WorkerStates:
    """Worker id -> STARTING, READY or ERROR, with the reason of an ERROR its worker reported."""

    def __init__(self) -> None:
        self._states: dict[int, str] = {}
        self._details: dict[int, str] = {}
        # worker id -> (host, device) bytes its READY report said loading took
        self._memory: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self.on_change: Callable[[], None] = lambda: None  # set once the table publisher exists

    def snapshot(self) -> dict[int, str]:
        with self._lock:
            return dict(self._states)

    def get(self, worker_id: int) -> str | None:
        with self._lock:
            return self._states.get(worker_id)

    def detail(self, worker_id: int) -> str:
        """Why the worker's setup failed, as it reported it; "" if it did not."""
        with self._lock:
            return self._details.get(worker_id, "")

    def memory(self, worker_id: int, device: bool = False) -> int:
        """Bytes of host memory (``device``: of GPU memory) the worker's model took when it loaded, as it
        reported; 0 if unknown."""
        with self._lock:
            return self._memory.get(worker_id, (0, 0))[device]

    def set(self, worker_id: int, state: str | None) -> None:
        """Set a worker's state (STARTING when spawned); ``None``: it is gone for good."""
        with self._lock:
            self._details.pop(worker_id, None)
            self._memory.pop(worker_id, None)
            if state is None:
                self._states.pop(worker_id, None)
            else:
                self._states[worker_id] = state
        self.on_change()

    def take_report(self, report: WorkerReport) -> None:
        """A worker's own report; one from a worker the pool no longer has (stopped meanwhile) is
        ignored, and so is a state a worker cannot report."""
        if report.state not in REPORTED_STATES:
            return
        with self._lock:
            if report.worker_id not in self._states:
                return
            self._states[report.worker_id] = report.state
            if report.detail:
                self._details[report.worker_id] = report.detail
            if report.memory_bytes > 0 or report.device_memory_bytes > 0:
                self._memory[report.worker_id] = (max(0, report.memory_bytes), max(0, report.device_memory_bytes))
        self.on_change()
