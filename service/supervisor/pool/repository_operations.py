"""The repository calls, carried out in the main process: ``RepositoryOperations`` loads, unloads and
lists the model versions its ``WorkerSet`` serves (service/supervisor/pool/workers.py), without losing
a request, and publishes each change with its ``TablePublisher`` (service/supervisor/pool/
table_publisher.py). The HTTP processes send it the calls (service/transport/control_channel.py).

The first versions' workers start at launch (``start``). A load:

1. plans the model's versions in a planner process (service/supervisor/planning/: a corrupt artifact,
   a device mismatch or memory that would not fit fail here, before any worker starts);
2. starts the new versions' workers beside the old ones and waits until every one is loaded and
   warm (or failed: then they are stopped, the old version keeps serving, and the call answers why);
3. publishes a routing table in which the model's new versions replace the old ones, and returns
   once every HTTP process follows it (service/repository/table.py);
4. lets the old workers drain: each HTTP process tells each of them it sends nothing more; a worker
   that has answered everything exits, and one still alive after the request deadline is stopped.

An unload is steps 3 and 4 without new versions, and returns once the old workers are gone (their
memory freed). A repository served on demand (``--model-control none``) has its loads and evictions
made by ``OnDemand`` (service/supervisor/pool/on_demand.py) with these same steps; with
``--model-control explicit`` a load that would not fit the memory budget is refused. A worker that
dies while serving is restarted with the same id; one that dies while the server starts stops the
server (service/supervisor/pool/restarts.py).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Protocol

from service.repository.layout import RepositoryError, model_names
from service.settings import ServeSettings
from service.supervisor.planning.launch import Planning, start_planning
from service.supervisor.planning.layout import ServerLayout
from service.supervisor.planning.plans import LoadRequest, VersionPlan
from service.supervisor.pool.table_publisher import TablePublisher
from service.supervisor.pool.workers import Worker, WorkerSet
from service.transport.control_channel import ENSURE, INDEX, LOAD, UNLOAD, ControlReply, ControlRequest

logger = logging.getLogger(__name__)


class ServedOnDemand(Protocol):
    """What the operations ask of a repository served on demand (service/supervisor/pool/on_demand.py)."""

    def start(self, plans: Sequence[VersionPlan]) -> list[VersionPlan]:
        """The plans to launch at once; the others are parked."""

    def fill_after(self, first: list[Worker]) -> None:
        """Load the parked models that fit, once ``first`` are ready."""

    def ensure(self, name: str) -> None:
        """Return once ``name`` serves; ``LoadFailed`` with why not."""


class LoadFailed(Exception):
    """A load or unload that cannot go on; its message is the call's answer."""


class RepositoryOperations:
    """Load, unload and index: the worker set's changes, each published to every HTTP process."""

    def __init__(
        self,
        settings: ServeSettings,
        layout: ServerLayout | None,
        workers: WorkerSet,
        publisher: TablePublisher,
        plan: Callable[[ServeSettings, LoadRequest], Planning] = start_planning,
    ) -> None:
        """``layout``: what every loaded version must share (``None``: anything); ``plan``: starts
        the planner for a load (tests pass their own)."""
        self.settings = settings
        self.layout = layout
        self.workers = workers
        self.publisher = publisher
        self.plan = plan
        # Set by the server: the models served on demand (--model-control none with a repository), and
        # the check an explicit load must pass (the memory budget); None: neither.
        self.on_demand: ServedOnDemand | None = None
        self.check_budget: Callable[[str, Sequence[VersionPlan]], None] | None = None
        self._lock = threading.Lock()
        self._model_locks: dict[str, threading.Lock] = {}  # one load or unload per model at a time

    def start(self, plans: Sequence[VersionPlan]) -> list[BaseProcess]:
        """Launch the first versions' workers and publish them (routes send only to ready workers);
        on demand, those of the first model, the others loaded after it while they fit."""
        if self.on_demand is not None:
            plans = self.on_demand.start(plans)
        for plan in plans:
            self.workers.add(self.workers.launch(plan))
        self.publisher.publish()
        if self.on_demand is not None:
            self.on_demand.fill_after(self.workers.serving())
        return self.workers.processes()

    def handle(self, request: ControlRequest) -> ControlReply:
        """One call from an HTTP process (service/transport/control_channel.py's server runs it)."""
        try:
            if request.op == INDEX:
                return ControlReply(index=self.index(request.ready_only))
            if request.op == LOAD:
                self.load(request.model, request.config)
                return ControlReply()
            if request.op == UNLOAD:
                self.unload(request.model)
                return ControlReply()
            if request.op == ENSURE and self.on_demand is not None:
                self.on_demand.ensure(request.model)
                return ControlReply()
        except LoadFailed as exc:
            # A request's model that could not be brought in: retry-safe, as when no worker is ready.
            return ControlReply(503 if request.op == ENSURE else 400, str(exc))
        return ControlReply(400, f"Unknown repository call {request.op!r}.")

    def index(self, ready_only: bool = False) -> list[dict]:
        """Triton's repository index: every model version there, READY when it serves."""
        repository = Path(self.settings.model_repository) if self.settings.model_repository else None
        served = self.workers.versions()
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

    def model_lock(self, name: str) -> threading.Lock:
        """Held for each load or unload of ``name``: one at a time."""
        with self._lock:
            return self._model_locks.setdefault(name, threading.Lock())

    def load(self, name: str, config: str = "") -> None:
        """Load (or reload) ``name``'s versions; ``LoadFailed`` with the reason, the old ones serving on."""
        if not self.settings.model_repository:
            raise LoadFailed("This server has no --model-repository to load models from.")
        with self.model_lock(name):
            started = time.monotonic()
            try:
                plans = self.plan(self.settings, LoadRequest(name, config)).result(self.settings.load_timeout_s)
            except (ValueError, RepositoryError) as exc:
                raise LoadFailed(f"failed to load '{name}': {exc}") from None
            if not plans:
                raise LoadFailed(f"failed to load '{name}': its version policy selects no version.")
            self._check_layout(name, plans)
            if self.check_budget is not None:
                self.check_budget(name, plans)
            self.serve(name, plans, started)

    def serve(self, name: str, plans: Sequence[VersionPlan], started: float) -> None:
        """Steps 2 to 4 of a load (the caller holds ``model_lock(name)``): ``plans``' workers started,
        waited for, published in place of the model's old versions, which then drain."""
        new = [self.workers.launch(plan) for plan in plans]
        remaining = self.settings.load_timeout_s - (time.monotonic() - started)
        failure = self.workers.wait_ready([w for version in new for w in version.workers], remaining)
        if failure:
            self._stop([w for version in new for w in version.workers])
            raise LoadFailed(f"failed to load '{name}': {failure} The versions it served still serve.")
        retired = self.workers.replace(name, new)
        self.publisher.publish_and_wait()
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
        with self.model_lock(name):
            self.retire(name)
            logger.info("Model %s unloaded.", name)

    def retire(self, name: str) -> None:
        """An unload's steps (the caller holds ``model_lock(name)``): returns once its workers are gone."""
        retired = self.workers.replace(name, [])
        self.publisher.publish_and_wait()
        self._drain(retired)

    def _check_layout(self, name: str, plans: Sequence[VersionPlan]) -> None:
        for plan in plans:
            serve_plan = plan.serve_plan
            if self.layout is not None and not self.layout.fits(serve_plan):
                raise LoadFailed(
                    f"failed to load '{name}': version {plan.version} is for {serve_plan.accelerator} "
                    f"(devices {serve_plan.devices}), and this server runs on {self.layout.accelerator} (devices "
                    f"{self.layout.devices}). Compile it for this server's device."
                )

    def _drain(self, workers: list[Worker]) -> None:
        self.workers.drain(workers)
        self.publisher.publish()  # the HTTP processes close their sockets to these workers

    def _stop(self, workers: list[Worker]) -> None:
        self.workers.stop(workers)
        self.publisher.publish()  # as after a drain
