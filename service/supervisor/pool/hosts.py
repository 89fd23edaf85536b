"""The worker processes of the main process: ``WorkerHosts`` places each model version's workers
(model slots, service/worker/host.py) in worker processes, starts those processes, and shows each
slot to the pool as a process of its own (``SlotProcess``), so that the pool's lifecycle, its
restarts and its hang watch (workers.py, restarts.py, hangs.py) do not change with the placement.

Placement: with ``worker_isolation = "shared"`` (the default), a version's k-th worker on a device
goes to that device's k-th worker process, which holds the k-th worker of every other shared
version too: a model costs its engine in each, not a process. With ``"process"`` (a model's
config.toml, or --worker-isolation), each worker gets a process of its own, which ends with it.

A slot is alive while its process is and its loop has not ended (its EXITED report, taken from the
control channel). Stopping a slot asks its process to stop that loop; a slot that does not stop
can only be stopped with its process: ``kill`` ends the process, and the restarter loads its other
models in a new one (service/supervisor/pool/restarts.py).
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from service.supervisor.pool.states import WorkerStates
from service.transport.control_channel import EXITED, WorkerReport
from service.worker.host import HostResources, LoadSlot, SlotSpec, StopSlot, run_host

logger = logging.getLogger(__name__)

JOIN_POLL_S = 0.05
# A process of its own per worker: keyed by its worker id, never shared.
OWN = "own"

HostKey = tuple[str, int]


class HostProcess:
    """One worker process and the pipe the main process sends it commands on."""

    def __init__(self, process: BaseProcess, commands: Connection, shared: bool) -> None:
        self.process = process
        self.commands = commands
        self.shared = shared
        self._lock = threading.Lock()

    def send(self, command: object) -> bool:
        """Send ``command``; ``False`` if the process is gone (its pipe broke)."""
        with self._lock:
            try:
                self.commands.send(command)
                return True
            except (OSError, ValueError):  # a closed or broken pipe: the process ended
                return False

    def alive(self) -> bool:
        return self.process.is_alive()


class SlotProcess:
    """A model slot seen as a process: ``is_alive``, ``exitcode``, ``pid``, ``join``, ``terminate``
    and ``kill``, as the pool uses a process."""

    def __init__(self, host: HostProcess, worker_id: int) -> None:
        self.host = host
        self.worker_id = worker_id
        self._exited = threading.Event()
        self._exit_code: int | None = None

    @property
    def shared(self) -> bool:
        """Whether its process may hold other models (what it unpacked is then not its own)."""
        return self.host.shared

    @property
    def pid(self) -> int | None:
        return self.host.process.pid

    @property
    def exitcode(self) -> int | None:
        if self._exited.is_set():
            return self._exit_code
        return self.host.process.exitcode

    def is_alive(self) -> bool:
        return not self._exited.is_set() and self.host.alive()

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_alive():
            left = JOIN_POLL_S if deadline is None else min(JOIN_POLL_S, deadline - time.monotonic())
            if left <= 0:
                return
            self._exited.wait(left)

    def terminate(self) -> None:
        """Ask the process to stop this slot's loop (it ends after the batch it runs)."""
        if self.is_alive():
            self.host.send(StopSlot(self.worker_id))

    def kill(self) -> None:
        """End the slot's process: the only way to stop a slot whose loop does not end (a hung engine).
        The process's other slots die with it and are restarted."""
        if self.is_alive():
            if self.host.shared:
                logger.warning(
                    "Inference worker %d did not stop; killing its worker process (pid %s), whose other models "
                    "are restarted.",
                    self.worker_id,
                    self.pid,
                )
            self.host.process.kill()

    def exited(self, exit_code: int) -> None:
        self._exit_code = exit_code
        self._exited.set()


class WorkerHosts:
    """The worker processes by placement, and the slots in them by worker id."""

    def __init__(
        self, resources: Callable[[], HostResources], before_start: Callable[[int], None] = lambda worker_id: None
    ) -> None:
        """``resources``: what every new process gets (made in the main process before any spawn);
        ``before_start(worker_id)``: runs before each worker starts (the server clears its heartbeat)."""
        self.resources = resources
        self.before_start = before_start
        self._hosts: dict[HostKey, HostProcess] = {}
        self._slots: dict[int, SlotProcess] = {}
        self._lock = threading.Lock()

    def place(self, spec: SlotSpec, worker_id: int, device: object, ordinal: int) -> SlotProcess:
        """Start worker ``worker_id`` of ``spec`` (the ``ordinal``-th of its version on ``device``)."""
        self.before_start(worker_id)
        shared = spec.settings.worker_isolation == "shared"
        key: HostKey = (str(device), ordinal) if shared else (OWN, worker_id)
        slot = LoadSlot(worker_id, spec)
        with self._lock:
            # Processes that ended (an isolated model's, or a crashed one) are forgotten: ids grow forever.
            self._hosts = {known: host for known, host in self._hosts.items() if host.alive()}
            host = self._hosts.get(key)
            if host is None or not host.alive() or not host.send(slot):
                host = self._start(device, slot, shared)
                self._hosts[key] = host
            handle = SlotProcess(host, worker_id)
            self._slots[worker_id] = handle
        return handle

    def _start(self, device: object, first: LoadSlot, shared: bool) -> HostProcess:
        context = multiprocessing.get_context("spawn")
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(
            target=run_host, args=(self.resources(), device, reader, first, shared), name="inference-worker"
        )
        process.start()
        reader.close()  # the child's end: ours would keep the pipe open after the child died
        logger.debug("Worker process %s started on %s (shared: %s).", process.pid, device, shared)
        return HostProcess(process, writer, shared)

    def take_exit(self, report: WorkerReport) -> None:
        """A slot's EXITED report (from the control channel's thread)."""
        with self._lock:
            handle = self._slots.pop(report.worker_id, None)  # its loop is over: a restart makes a new one
        if handle is not None:
            handle.exited(report.exit_code)

    def reports_to(self, states: WorkerStates) -> Callable[[WorkerReport], None]:
        """What takes the workers' reports: a slot's end here, its state in ``states``."""

        def take(report: WorkerReport) -> None:
            if report.state == EXITED:
                self.take_exit(report)
            else:
                states.take_report(report)

        return take

    def worker_processes(self) -> dict[int, int]:
        """Worker id -> the pid of the process it runs in (the slots of a shared process share one)."""
        with self._lock:
            return {worker_id: slot.pid for worker_id, slot in self._slots.items() if slot.pid is not None}

    def processes(self) -> list[BaseProcess]:
        """Every worker process started and not yet reaped (for the server's stop)."""
        with self._lock:
            return [host.process for host in self._hosts.values()]
