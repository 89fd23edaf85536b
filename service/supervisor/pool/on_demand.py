"""A model repository served on demand, in the main process (``--model-control none`` with
``--model-repository``): the repository may hold more models than the memory budget holds
(service/supervisor/pool/budget.py). ``OnDemand`` keeps the versions planned at start of every model
that is not loaded now (*parked*), loads one when a request asks for it, and evicts the least
recently used idle models when the budget is short.

- **At start** the first model (``--default-model``, else the first name) loads as a server's first
  model always does; then the others, one after another, while each fits the budget with nothing
  evicted. The server is ready (``/ready``) once that pass ended; the rest stay parked.
- **A request for a parked model** reaches an HTTP process, which asks for it over the control
  channel (``ENSURE``, service/http/pipeline/on_demand.py) and waits within the request's deadline.
  The load is a repository load's steps (service/supervisor/pool/repository_operations.py) with the
  plans made at start, so it plans nothing again. Loads on demand take turns (``_room``): the budget
  is counted for one at a time.
- **Eviction** is an unload's steps: the model is published parked (a request then loads it again),
  its workers answer what they hold and exit, and only then does the next model load, so the memory
  is free before it is taken again. A model running batches, or loaded moments ago, or wanted by a
  waiting request, is never evicted; when only such models could make room, the request's load waits
  for one to go idle, until the request deadline (then a 503 that says so).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from service.metrics import metrics
from service.repository.table import VersionRoute
from service.supervisor.planning.memory import MIB
from service.supervisor.planning.plans import VersionPlan
from service.supervisor.pool.budget import MemoryBudget, default_budget_bytes
from service.supervisor.pool.repository_operations import LoadFailed, RepositoryOperations
from service.supervisor.pool.residents import ResidentModels
from service.supervisor.pool.states import WorkerStates
from service.supervisor.pool.workers import Worker
from service.transport.heartbeats import HeartbeatBoard

logger = logging.getLogger(__name__)

# How often a load that finds only busy models to evict looks again.
ROOM_RETRY_S = 0.2


class OnDemand:
    """The parked models' plans, their loads when asked for, and the evictions that make room."""

    def __init__(self, operations: RepositoryOperations, residents: ResidentModels, default_model: str = "") -> None:
        self.operations = operations
        self.residents = residents
        self.budget = residents.budget
        self.default_model = default_model
        self.parked: dict[str, list[VersionPlan]] = {}
        self.filling = False  # the pass at start still loads models (the server is not ready)
        self._room = threading.Lock()  # one load on demand (or eviction) at a time
        self._lock = threading.Lock()  # parked

    # -- what the routing table shows ---------------------------------------------------------------

    def parked_names(self) -> set[str]:
        with self._lock:
            return set(self.parked)

    def routes(self) -> dict[str, dict[int, VersionRoute]]:
        """The parked versions' routes: no workers, ``resident`` False (a request asks for them)."""
        with self._lock:
            return {
                name: {
                    plan.version: VersionRoute(plan.name, plan.version, (), plan.serve_plan.model, resident=False)
                    for plan in plans
                }
                for name, plans in self.parked.items()
            }

    # -- start ---------------------------------------------------------------------------------------

    def start(self, plans: Sequence[VersionPlan]) -> list[VersionPlan]:
        """Park every model's plans but the first model's, which are returned to launch now."""
        by_model: dict[str, list[VersionPlan]] = {}
        for plan in plans:
            by_model.setdefault(plan.name, []).append(plan)
        first = self.default_model if self.default_model in by_model else next(iter(by_model))
        with self._lock:
            self.parked = {name: versions for name, versions in by_model.items() if name != first}
            self.filling = bool(self.parked)
        self.residents.loaded(first)
        logger.info("%s; %d model(s) load after the first while they fit.", self.budget.describe(), len(self.parked))
        return by_model[first]

    def fill_after(self, first: list[Worker]) -> None:
        """In a thread: once ``first`` are ready, load the parked models in turn while each fits."""
        if self.filling:
            threading.Thread(target=self._fill, args=(first,), name="vision-serve-fill", daemon=True).start()

    def _fill(self, first: list[Worker]) -> None:
        operations = self.operations
        try:
            if operations.workers.wait_ready(first, operations.settings.load_timeout_s):
                return  # the first model failed: the server stops (service/supervisor/server.py)
            for name in sorted(self.parked_names()):
                if operations.workers.stopping.is_set():
                    return
                with self._room:
                    plans = self.parked.get(name)
                    if plans is None:  # a request brought it in meanwhile
                        continue
                    residents = self.residents.residents()
                    needed = self.residents.estimate(name, plans, residents)
                    room = self.budget.room_for(needed, residents, time.monotonic())
                    if not room.fits or room.evict:
                        logger.info("The memory budget is full: %s and the models after it load on demand.", name)
                        return
                    try:
                        self._bring_in(name, plans)
                    except LoadFailed as exc:
                        logger.error("%s It stays in the repository; a request for it tries again.", exc)
        finally:
            self.filling = False
            operations.publisher.publish()

    # -- a request's model ---------------------------------------------------------------------------

    def ensure(self, name: str) -> None:
        """Return once ``name`` serves (loaded now if it was parked); ``LoadFailed`` with why not:
        it failed to load, or the budget stayed full of busy models until the request deadline."""
        deadline = time.monotonic() + self.operations.settings.request_timeout_s
        with self.residents.wanted(name):
            while True:
                with self._room:
                    plans = self.parked.get(name)
                    if plans is None:
                        if name in self.operations.workers.versions():
                            return
                        raise LoadFailed(f"Model '{name}' is not in the model repository any more.")
                    residents = self.residents.residents()
                    needed = self.residents.estimate(name, plans, residents)
                    room = self.budget.room_for(needed, residents, time.monotonic())
                    if room.fits:
                        for victim in room.evict:
                            self._evict(victim, name)
                        self._bring_in(name, plans)
                        metrics().model_loads_on_demand.labels(model=name).inc()
                        return
                if time.monotonic() >= deadline:
                    raise LoadFailed(
                        f"Model '{name}' is not resident, and the memory budget ({self.budget.limit_bytes / MIB:,.0f} "
                        f"MiB) is held by {len(residents)} model(s) that were all busy for the whole "
                        f"--request-timeout-s: it needs about {needed / MIB:,.0f} MiB. Raise --memory-budget-mib, "
                        "or retry."
                    )
                time.sleep(ROOM_RETRY_S)

    # -- moves (under ``_room``) ---------------------------------------------------------------------

    def _bring_in(self, name: str, plans: list[VersionPlan]) -> None:
        started = time.monotonic()
        with self.operations.model_lock(name):
            self.operations.serve(name, plans, started)  # LoadFailed: it stays parked
            with self._lock:
                self.parked.pop(name, None)  # the table shows it resident from the next publish
            self.residents.loaded(name)
        logger.info("Model %s loaded on demand in %.2f s.", name, time.monotonic() - started)

    def _evict(self, name: str, for_model: str) -> None:
        operations = self.operations
        with operations.model_lock(name):
            served = operations.workers.served.get(name, {})
            plans = [version.plan for version in served.values()]
            if not plans:
                return
            took = self.residents.took([w for version in served.values() for w in version.workers])
            with self._lock:
                # Parked before it is retired: no table shows it neither served nor parked (a 404).
                self.parked[name] = plans
            self.residents.evicted(name, took)
            operations.retire(name)  # returns once its workers answered what they held and exited
        metrics().model_evictions.labels(model=name).inc()
        logger.info("Model %s evicted (%.0f MiB) to make room for %s.", name, took / MIB, for_model)


def attach_memory_budget(
    operations: RepositoryOperations,
    accelerator: str,
    worker_processes: int,
    states: WorkerStates,
    board: HeartbeatBoard | None,
) -> OnDemand | None:
    """The memory budget of a repository server: with ``--model-control none`` its models are served
    on demand; with ``explicit`` each load is checked against it. ``None`` without a repository."""
    settings = operations.settings
    if not settings.model_repository:
        return None
    limit = settings.memory_budget_mib * MIB or default_budget_bytes(accelerator, worker_processes)
    residents = ResidentModels(operations, MemoryBudget(limit, accelerator), states, board)
    on_demand = OnDemand(operations, residents, settings.default_model)
    if settings.model_control == "explicit":
        operations.check_budget = residents.check_load
    else:
        operations.on_demand = on_demand
    return on_demand
