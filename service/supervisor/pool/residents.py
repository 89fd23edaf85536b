"""The resident models as the memory budget sees them (service/supervisor/pool/budget.py), in the main
process: what each one's workers took when they loaded (their READY reports, service/supervisor/pool/
states.py), when each last ran a batch (the heartbeat board, service/transport/heartbeats.py), and
which must not be evicted now (loading, unloading, or wanted by a waiting request).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterator, Sequence

from service.supervisor.planning.memory import MIB
from service.supervisor.planning.plans import VersionPlan
from service.supervisor.pool.budget import MemoryBudget, Resident
from service.supervisor.pool.repository_operations import LoadFailed, RepositoryOperations
from service.supervisor.pool.states import WorkerStates
from service.supervisor.pool.workers import Worker
from service.transport.heartbeats import HeartbeatBoard


class ResidentModels:
    """The budget's view of the served models, and what it remembers of the evicted ones."""

    def __init__(
        self,
        operations: RepositoryOperations,
        budget: MemoryBudget,
        states: WorkerStates,
        board: HeartbeatBoard | None,
    ) -> None:
        """``states``: the memory each worker's load took; ``board``: when each last ran a batch."""
        self.operations = operations
        self.budget = budget
        self.states = states
        self.board = board
        self._known: dict[str, int] = {}  # model -> bytes it took when it was last resident
        self._loaded_at: dict[str, float] = {}
        self._wanted: collections.Counter[str] = collections.Counter()  # models requests wait for
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def wanted(self, name: str) -> Iterator[None]:
        """While a request waits for ``name``: once it is loaded, it is not evicted for another."""
        with self._lock:
            self._wanted[name] += 1
        try:
            yield
        finally:
            with self._lock:
                self._wanted[name] -= 1
                if not self._wanted[name]:
                    del self._wanted[name]

    def loaded(self, name: str) -> None:
        with self._lock:
            self._loaded_at[name] = time.monotonic()

    def evicted(self, name: str, took: int) -> None:
        with self._lock:
            self._loaded_at.pop(name, None)
            if took:
                self._known[name] = took

    def took(self, workers: Sequence[Worker]) -> int:
        """Bytes ``workers``' loads took, as they reported (GPU memory on a GPU server)."""
        device = self.budget.accelerator == "cuda"
        return sum(self.states.memory(worker.worker_id, device) for worker in workers)

    def residents(self) -> list[Resident]:
        """The models serving now, with what they took and when they last ran a batch."""
        now = time.monotonic()
        by_model: dict[str, list[Worker]] = {}
        for worker in self.operations.workers.serving():
            by_model.setdefault(worker.name, []).append(worker)
        with self._lock:
            wanted = set(self._wanted)
            loaded_at = dict(self._loaded_at)
        residents = []
        for name, workers in by_model.items():
            since = loaded_at.get(name, 0.0)
            used = [self.board.last_used(w.worker_id, now) for w in workers] if self.board is not None else []
            pinned = name in wanted or self.operations.model_lock(name).locked()
            residents.append(Resident(name, self.took(workers), len(workers), since, max([since, *used]), pinned))
        return residents

    def estimate(self, name: str, plans: Sequence[VersionPlan], residents: Sequence[Resident]) -> int:
        """Bytes ``name``'s ``plans`` would take (what it took when last resident, if it was)."""
        with self._lock:
            known = self._known.get(name, 0)
        return self.budget.estimate(plans, residents, known)

    def check_load(self, name: str, plans: Sequence[VersionPlan]) -> None:
        """An explicit load (``--model-control explicit``: nothing is evicted, as Triton does):
        ``LoadFailed`` with the numbers when it would not fit beside the resident models."""
        limit = self.budget.limit_bytes
        if not limit:
            return
        residents = self.residents()  # a reload's old versions count: they serve until the new ones do
        needed, used = self.estimate(name, plans, residents), sum(r.bytes for r in residents)
        if used + needed > limit:
            raise LoadFailed(
                f"failed to load '{name}': it needs about {needed / MIB:,.0f} MiB, and the {len(residents)} resident "
                f"model(s) hold {used / MIB:,.0f} MiB of the {limit / MIB:,.0f} MiB memory budget. Unload a model "
                "first, or raise --memory-budget-mib."
            )
