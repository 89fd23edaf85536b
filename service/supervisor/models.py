"""The main process's model pool: which inference workers serve which model version, and the
repository calls that change it (load, unload, index) without losing a request.

Every inference worker is started here, through LitServe's own worker function (service/
litserve_bridge.py: ``ls.LitAPI`` stays the model contract), the first ones at launch and the others
at load calls, each with a worker id never used before. A load:

1. plans the model's versions in a planner process (service/supervisor/plan.py: a corrupt artifact,
   a device mismatch or memory that would not fit fail here, before any worker starts);
2. starts the new versions' workers beside the old ones and waits until every one is loaded and
   warm (or failed: then they are stopped, the old version keeps serving, and the call answers why);
3. publishes a routing table in which the model's new versions replace the old ones, and returns
   once every HTTP process follows it (service/repository/table.py);
4. lets the old workers drain: each HTTP process tells each of them it sends nothing more; a worker
   that has answered everything exits, and one still alive after the request deadline is stopped.

An unload is steps 3 and 4 without new versions, and returns once the old workers are gone (their
memory freed). A worker that dies while serving is restarted with the same id; one that dies while
the server starts stops the server, as before.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path

from service.litserve_bridge import ERROR, READY, STARTING
from service.repository.control import INDEX, LOAD, UNLOAD, ControlReply, ControlRequest
from service.repository.layout import RepositoryError, model_names
from service.repository.table import RoutingTable, TableFile, VersionRoute
from service.settings import ServeSettings
from service.supervisor.plan import LoadRequest, VersionPlan, start_planning
from service.worker.entry import setup_error_path

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1
ACK_TIMEOUT_S = 10.0
# Beyond the request deadline, how long a draining worker may take to exit before it is stopped.
DRAIN_GRACE_S = 5.0
# How long a draining worker that crashed stays marked failed: a few polls of the HTTP processes.
CRASH_NOTICE_S = 0.5


class LoadFailed(Exception):
    """A load or unload that cannot go on; its message is the call's answer."""


@dataclass
class Worker:
    worker_id: int
    name: str
    version: int
    device: object  # LitServe's device for it: "cpu", "cuda:0", or a list of them
    process: BaseProcess
    entry: object  # the LitAPI it runs


@dataclass
class ServedVersion:
    plan: VersionPlan
    workers: list[Worker] = field(default_factory=list)

    def route(self) -> VersionRoute:
        return VersionRoute(
            self.plan.name, self.plan.version, tuple(w.worker_id for w in self.workers), self.plan.plan.model
        )


@dataclass(frozen=True)
class WorkerHooks:
    """What the pool needs of LitServe (service/supervisor/server.py binds them)."""

    spawn: Callable[[object, int, object], BaseProcess]  # (LitAPI, worker id, device) -> started process
    states: Callable[[], dict[int, str]]  # worker id -> setup state
    set_state: Callable[[int, str | None], None]  # None removes it
    make_entry: Callable[[VersionPlan], object]  # the LitAPI of a planned version
    device_slots: Callable[[int], list[object]]  # workers per device -> one device per worker


class ModelPool:
    def __init__(
        self,
        settings: ServeSettings,
        channels_directory: str,
        acks: Sequence[int],
        hooks: WorkerHooks,
        on_unrecoverable: Callable[[str], None],
    ) -> None:
        """``acks``: per HTTP process, the table generation it follows (shared memory)."""
        self.settings = settings
        self.acks = acks
        self.hooks = hooks
        self.on_unrecoverable = on_unrecoverable
        self.table_file = TableFile(channels_directory)
        self.channels_directory = channels_directory
        self.served: dict[str, dict[int, ServedVersion]] = {}
        self.draining: dict[int, Worker] = {}
        self._next_worker_id = 0
        self._generation = 0
        self._lock = threading.RLock()  # the pool's state; held briefly, never across a wait
        self._model_locks: dict[str, threading.Lock] = {}  # one load or unload per model at a time
        # (accelerator, devices, worker environment) every version must share: set by the server.
        self.layout: tuple[str, object, dict[str, str]] | None = None
        self.stopping = threading.Event()

    # -- startup ---------------------------------------------------------------------------------
    def start(self, plans: Sequence[VersionPlan]) -> list[BaseProcess]:
        """Launch the first versions' workers and publish them (routes send only to ready workers)."""
        with self._lock:
            for plan in plans:
                version = self._launch(plan)
                self.served.setdefault(plan.name, {})[plan.version] = version
            self._publish()
        return self.processes()

    def processes(self) -> list[BaseProcess]:
        with self._lock:
            serving = [w.process for w in self._serving()]
            return serving + [w.process for w in self.draining.values()]

    def _serving(self) -> list[Worker]:
        """Every worker of every served version (under ``_lock``)."""
        return [w for versions in self.served.values() for v in versions.values() for w in v.workers]

    def _retire(self, versions: dict[int, ServedVersion]) -> list[Worker]:
        """Move ``versions``' workers to ``draining`` (under ``_lock``); returns them."""
        retired = [w for version in versions.values() for w in version.workers]
        self.draining.update({w.worker_id: w for w in retired})
        return retired

    def _launch(self, plan: VersionPlan) -> ServedVersion:
        version = ServedVersion(plan)
        entry = self.hooks.make_entry(plan)
        for device in self.hooks.device_slots(plan.plan.settings.workers_per_device):
            worker_id = self._next_worker_id
            self._next_worker_id += 1
            process = self.hooks.spawn(entry, worker_id, device)
            version.workers.append(Worker(worker_id, plan.name, plan.version, device, process, entry))
        logger.info(
            "Started %d worker(s) for model %s version %d: ids %s.",
            len(version.workers),
            plan.name,
            plan.version,
            ", ".join(str(w.worker_id) for w in version.workers),
        )
        return version

    # -- the routing table -----------------------------------------------------------------------
    def table(self) -> RoutingTable:
        with self._lock:
            models = {
                name: {number: version.route() for number, version in versions.items()}
                for name, versions in self.served.items()
                if versions
            }
            default = self.settings.default_model or (next(iter(models)) if len(models) == 1 else "")
            return RoutingTable(self._generation, models, tuple(sorted(self.draining)), default)

    def _publish(self) -> int:
        self._generation += 1
        self.table_file.write(self.table())
        return self._generation

    def _wait_acks(self, generation: int) -> None:
        """Until every HTTP process follows ``generation`` (before the HTTP processes exist, at once)."""
        deadline = time.monotonic() + ACK_TIMEOUT_S
        while time.monotonic() < deadline and not self.stopping.is_set():
            if all(ack >= generation or ack < 0 for ack in self.acks):
                return
            time.sleep(0.01)
        logger.warning("Not every HTTP process took routing table %d within %.0f s.", generation, ACK_TIMEOUT_S)

    # -- repository calls ------------------------------------------------------------------------
    def handle(self, request: ControlRequest) -> ControlReply:
        try:
            if request.op == INDEX:
                return ControlReply(index=self.index(request.ready_only))
            if request.op == LOAD:
                self.load(request.model, request.config)
                return ControlReply()
            if request.op == UNLOAD:
                self.unload(request.model)
                return ControlReply()
        except LoadFailed as exc:
            return ControlReply(400, str(exc))
        return ControlReply(400, f"Unknown repository call {request.op!r}.")

    def index(self, ready_only: bool = False) -> list[dict]:
        """Triton's repository index: every model version there, READY when it serves."""
        repository = Path(self.settings.model_repository) if self.settings.model_repository else None
        with self._lock:
            served = {name: set(versions) for name, versions in self.served.items()}
        entries = []
        names = set(served)
        if repository is not None:
            with contextlib.suppress(RepositoryError):
                names.update(model_names(repository))
        for name in sorted(names):
            loaded = served.get(name, set())
            for version in sorted(loaded):
                entries.append({"name": name, "version": str(version), "state": "READY", "reason": ""})
            if not loaded and not ready_only:
                entries.append({"name": name, "version": "", "state": "UNAVAILABLE", "reason": "unloaded"})
        return entries

    def _model_lock(self, name: str) -> threading.Lock:
        with self._lock:
            return self._model_locks.setdefault(name, threading.Lock())

    def load(self, name: str, config: str = "") -> None:
        """Load (or reload) ``name``'s versions; ``LoadFailed`` with the reason, the old ones serving on."""
        if not self.settings.model_repository:
            raise LoadFailed("This server has no --model-repository to load models from.")
        with self._model_lock(name):
            started = time.monotonic()
            try:
                plans = start_planning(self.settings, LoadRequest(name, config)).result(self.settings.load_timeout_s)
            except (ValueError, RepositoryError) as exc:
                raise LoadFailed(f"failed to load '{name}': {exc}") from None
            if not plans:
                raise LoadFailed(f"failed to load '{name}': its version policy selects no version.")
            for plan in plans:
                layout = (plan.plan.accelerator, plan.plan.devices, plan.plan.worker_env)
                if self.layout is not None and layout != self.layout:
                    raise LoadFailed(
                        f"failed to load '{name}': version {plan.version} is for {plan.plan.accelerator} "
                        f"(devices {plan.plan.devices}), and this server runs on {self.layout[0]} (devices "
                        f"{self.layout[1]}). Compile it for this server's device."
                    )
            with self._lock:
                new = [self._launch(plan) for plan in plans]
            remaining = self.settings.load_timeout_s - (time.monotonic() - started)
            failure = self._wait_ready([w for version in new for w in version.workers], remaining)
            if failure:
                self._stop_workers([w for version in new for w in version.workers])
                raise LoadFailed(f"failed to load '{name}': {failure} The versions it served still serve.")
            with self._lock:
                old = self.served.get(name, {})
                self.served[name] = {version.plan.version: version for version in new}
                retired = self._retire(old)
                generation = self._publish()
            self._wait_acks(generation)
            logger.info(
                "Model %s now serves version(s) %s (%.1f s after the load call).",
                name,
                ", ".join(str(v.plan.version) for v in new),
                time.monotonic() - started,
            )
            if retired:
                threading.Thread(target=self._drain, args=(retired,), name="vision-serve-drain", daemon=True).start()

    def unload(self, name: str) -> None:
        """Stop new requests for ``name`` (404), let its workers answer what they hold, then stop them."""
        with self._model_lock(name):
            with self._lock:
                old = self.served.pop(name, {})
                retired = self._retire(old)
                generation = self._publish()
            self._wait_acks(generation)
            self._drain(retired)
            logger.info("Model %s unloaded.", name)

    # -- workers ---------------------------------------------------------------------------------
    def _wait_ready(self, workers: list[Worker], timeout_s: float) -> str:
        """ "" once every worker is ready; else why not (its setup error, its death, the timeout)."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            states = self.hooks.states()
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
        path = setup_error_path(self.channels_directory, worker.worker_id)
        try:
            return path.read_text().strip() + "."
        except OSError:
            return f"its worker exited with code {worker.process.exitcode} while loading (see the server log)."

    def _drain(self, workers: list[Worker]) -> None:
        """Wait for each worker to exit once it answered everything; stop those that outlive the
        request deadline; then forget them."""
        deadline = time.monotonic() + self.settings.request_timeout_s + DRAIN_GRACE_S
        for worker in workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
        crashed = [w for w in workers if not w.process.is_alive() and w.process.exitcode != 0]
        if crashed:
            # It died instead of draining: marked failed for a few polls, so that each HTTP process
            # answers what it still held with a retry-safe 503 instead of waiting for the deadline.
            for worker in crashed:
                self.hooks.set_state(worker.worker_id, ERROR)
            time.sleep(CRASH_NOTICE_S)
        late = [w for w in workers if w.process.is_alive()]
        if late:
            logger.warning(
                "Worker(s) %s still held requests %.0f s after their version was retired; stopping them.",
                ", ".join(str(w.worker_id) for w in late),
                self.settings.request_timeout_s + DRAIN_GRACE_S,
            )
        self._stop_workers(workers)

    def _stop_workers(self, workers: list[Worker]) -> None:
        for worker in workers:
            if worker.process.is_alive():
                worker.process.terminate()
        for worker in workers:
            worker.process.join(5.0)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
        with self._lock:
            for worker in workers:
                self.draining.pop(worker.worker_id, None)
                self.hooks.set_state(worker.worker_id, None)
                with contextlib.suppress(OSError):
                    setup_error_path(self.channels_directory, worker.worker_id).unlink(missing_ok=True)
            self._publish()  # the HTTP processes close their sockets to these workers

    def watch(
        self,
        stopping: Callable[[], bool],
        metrics_restart: Callable[[BaseProcess], None],
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Main-process loop: restart every serving worker that died; until ``stopping()``."""
        while not stopping():
            states = self.hooks.states()
            with self._lock:
                serving = self._serving()
            for worker in serving:
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
                    self.hooks.set_state(worker.worker_id, STARTING)
                    worker.process = self.hooks.spawn(worker.entry, worker.worker_id, worker.device)
                except Exception as exc:
                    self.on_unrecoverable(
                        f"Inference worker {worker.worker_id} could not be restarted ({exc!r}); stopping the server."
                    )
                    return
            sleep(POLL_INTERVAL_S)
