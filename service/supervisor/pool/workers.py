"""The inference workers of the main process, by model version: ``WorkerSet`` starts a planned
version's workers, waits until they are ready, lets retired ones drain, and stops them.

Every inference worker is started here, each with a worker id never used before: a model slot in a
worker process (service/supervisor/pool/hosts.py places it, service/worker/host.py runs it), which
the set handles as a process of its own. Which versions serve and which workers drain
is the set's state; each worker's readiness is in ``WorkerStates`` (service/supervisor/pool/states.py);
the routing table is made from both (service/supervisor/pool/table_publisher.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

from compile.unpacking import remove_unpacked_of
from service.repository.table import VersionRoute
from service.settings import ServeSettings
from service.supervisor.planning.plans import VersionPlan
from service.supervisor.pool.states import WorkerStates
from service.transport.control_channel import ERROR, READY, STARTING

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1
# Beyond the request deadline, how long a draining worker may take to exit before it is stopped.
DRAIN_GRACE_S = 5.0
# How long a draining worker that crashed stays marked failed: a few polls of the HTTP processes.
CRASH_NOTICE_S = 0.5
# How long stopped workers get to end before they are killed (their process with them).
STOP_TIMEOUT_S = 5.0
SHARED_STOP_TIMEOUT_S = 30.0


@dataclass
class Worker:
    worker_id: int
    name: str
    version: int
    device: object  # its device, as LitServe lays them out: "cpu", "cuda:0", or a list of them
    process: BaseProcess  # or what stands for one: its slot in a worker process (hosts.py's SlotProcess)
    entry: object  # the SlotSpec it runs (service/worker/host.py)
    ordinal: int = 0  # the how-manieth of its version's workers on its device: which shared process holds it


@dataclass
class ServedVersion:
    plan: VersionPlan
    workers: list[Worker] = field(default_factory=list)

    def route(self) -> VersionRoute:
        return VersionRoute(
            self.plan.name, self.plan.version, tuple(w.worker_id for w in self.workers), self.plan.serve_plan.model
        )


@dataclass(frozen=True)
class WorkerHooks:
    """What the pool needs of the server (service/supervisor/server.py binds them)."""

    spawn: Callable[[object, int, object, int], BaseProcess]  # (entry, worker id, device, ordinal) -> started
    make_entry: Callable[[VersionPlan], object]  # the SlotSpec of a planned version
    device_slots: Callable[[int], list[object]]  # workers per device -> one device per worker


class WorkerSet:
    """The worker processes by served version, and those draining; one job: their lifecycle."""

    def __init__(
        self, settings: ServeSettings, states: WorkerStates, hooks: WorkerHooks, stopping: threading.Event
    ) -> None:
        """``states``: every worker's state; ``stopping``: set when the server stops, a wait for new
        workers then ends at once."""
        self.settings = settings
        self.states = states
        self.hooks = hooks
        self.stopping = stopping
        self.served: dict[str, dict[int, ServedVersion]] = {}
        self.draining: dict[int, Worker] = {}
        self._next_worker_id = 0
        self._lock = threading.RLock()  # the set's state; held briefly, never across a wait

    # -- which versions serve ----------------------------------------------------------------------
    def serving(self) -> list[Worker]:
        """Every worker of every served version."""
        with self._lock:
            return [w for versions in self.served.values() for v in versions.values() for w in v.workers]

    def processes(self) -> list[BaseProcess]:
        with self._lock:
            return [w.process for w in self.serving()] + [w.process for w in self.draining.values()]

    def versions(self) -> dict[str, set[int]]:
        """Model name -> the version numbers it serves."""
        with self._lock:
            return {name: set(versions) for name, versions in self.served.items()}

    def routes(self) -> tuple[dict[str, dict[int, VersionRoute]], tuple[int, ...]]:
        """The routing table's content: the served versions' routes, and the draining worker ids."""
        with self._lock:
            models = {
                name: {number: version.route() for number, version in versions.items()}
                for name, versions in self.served.items()
                if versions
            }
            return models, tuple(sorted(self.draining))

    def add(self, version: ServedVersion) -> None:
        """Serve ``version`` beside the model's others (the first versions, at launch)."""
        with self._lock:
            self.served.setdefault(version.plan.name, {})[version.plan.version] = version

    def replace(self, name: str, new: list[ServedVersion]) -> list[Worker]:
        """Serve ``new`` instead of ``name``'s versions (none: unload it); returns the old ones'
        workers, now draining: they get no new requests once the table is published."""
        with self._lock:
            old = self.served.pop(name, {})
            if new:
                self.served[name] = {version.plan.version: version for version in new}
            retired = [w for version in old.values() for w in version.workers]
            self.draining.update({w.worker_id: w for w in retired})
            return retired

    # -- worker processes --------------------------------------------------------------------------
    def launch(self, plan: VersionPlan) -> ServedVersion:
        """Start ``plan``'s workers (not yet served: ``add`` or ``replace`` does that)."""
        version = ServedVersion(plan)
        entry = self.hooks.make_entry(plan)
        with self._lock:
            seen: dict[str, int] = {}
            for device in self.hooks.device_slots(plan.serve_plan.settings.workers_per_device):
                worker_id = self._next_worker_id
                self._next_worker_id += 1
                ordinal = seen[str(device)] = seen.get(str(device), -1) + 1
                self.states.set(worker_id, STARTING)
                process = self.hooks.spawn(entry, worker_id, device, ordinal)
                version.workers.append(Worker(worker_id, plan.name, plan.version, device, process, entry, ordinal))
        logger.info(
            "Started %d worker(s) for model %s version %d: ids %s.",
            len(version.workers),
            plan.name,
            plan.version,
            ", ".join(str(w.worker_id) for w in version.workers),
        )
        return version

    def wait_ready(self, workers: list[Worker], timeout_s: float) -> str:
        """ "" once every worker is ready; else why not (its setup error, its death, the timeout)."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            states = self.states.snapshot()
            for worker in workers:
                state = states.get(worker.worker_id)
                if state == ERROR or (state != READY and not worker.process.is_alive()):
                    return f"version {worker.version} could not be loaded: {self._setup_error(worker)}"
            if all(states.get(w.worker_id) == READY for w in workers):
                return ""
            if self.stopping.is_set():
                return "the server is stopping."
            if time.monotonic() >= deadline:
                return f"its workers were not ready within --load-timeout-s {self.settings.load_timeout_s:g} s."
            time.sleep(POLL_INTERVAL_S)

    def _setup_error(self, worker: Worker) -> str:
        detail = self.states.detail(worker.worker_id).strip()
        if detail:
            return detail + "."
        return f"its worker exited with code {worker.process.exitcode} while loading (see the server log)."

    def drain(self, workers: list[Worker]) -> None:
        """Wait for each worker to exit once it answered everything; stop those that outlive the
        request deadline; then forget them (``stop``)."""
        deadline = time.monotonic() + self.settings.request_timeout_s + DRAIN_GRACE_S
        for worker in workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
        crashed = [w for w in workers if not w.process.is_alive() and w.process.exitcode != 0]
        if crashed:
            # It died instead of draining: marked failed for a few polls, so that each HTTP process
            # answers what it still held with a retry-safe 503 instead of waiting for the deadline.
            for worker in crashed:
                self.states.set(worker.worker_id, ERROR)
            time.sleep(CRASH_NOTICE_S)
        late = [w for w in workers if w.process.is_alive()]
        if late:
            logger.warning(
                "Worker(s) %s still held requests %.0f s after their version was retired; stopping them.",
                ", ".join(str(w.worker_id) for w in late),
                self.settings.request_timeout_s + DRAIN_GRACE_S,
            )
        self.stop(workers)

    def stop(self, workers: list[Worker]) -> None:
        """Terminate (then kill) ``workers`` and forget them; the caller publishes the table after,
        so that the HTTP processes close their sockets to them."""
        for worker in workers:
            if worker.process.is_alive():
                worker.process.terminate()
        started = time.monotonic()
        for worker in workers:
            # A slot of a shared process ends after the batch it runs, which may be long on a CPU;
            # killing it would kill the process's other models too.
            limit = SHARED_STOP_TIMEOUT_S if getattr(worker.process, "shared", False) else STOP_TIMEOUT_S
            worker.process.join(max(0.0, started + limit - time.monotonic()))
        for worker in workers:
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
        with self._lock:
            for worker in workers:
                self.draining.pop(worker.worker_id, None)
                self.states.set(worker.worker_id, None)
                if not getattr(worker.process, "shared", False):  # a shared process's files are its other models' too
                    remove_unpacked_of(worker.process.pid)
