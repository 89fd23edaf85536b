"""The memory budget of a repository served on demand: how much the resident models may take, what a
model not resident would take, and which idle models to evict, least recently used first, to make
room for it (service/supervisor/pool/on_demand.py acts on the answers).

What a model takes is what its workers' loads took, as each reported it when it was ready (its
engine, workspace and warm-up: service/worker/host.py): host memory on a CPU server, GPU memory on a
GPU server. A worker process's own base (the interpreter, torch, a CUDA context) is paid once per
process, whatever it holds, so the default budget sets it aside. A model never loaded yet is
estimated from the models loaded so far (per worker), else from its files.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from service import _defaults
from service.supervisor.planning.memory import (
    MIB,
    WORKER_BASE_BYTES,
    available_cpu_bytes,
    available_gpu_bytes,
    directory_bytes,
)
from service.supervisor.planning.plans import VersionPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resident:
    """A model whose versions serve now, as the budget sees it."""

    name: str
    bytes: int  # what its workers' loads took, as they reported (0 for a worker that did not say)
    workers: int
    loaded_at: float  # time.monotonic() when it was published
    last_used: float  # when one of its workers last ran a batch (``loaded_at`` if none has since)
    pinned: bool = False  # loading, unloading or wanted by a waiting request: never evicted


@dataclass(frozen=True)
class Room:
    """What making room for a model needs: the residents to evict first (least recently used first),
    or ``fits`` False when even evicting every idle one would not make enough."""

    fits: bool
    evict: tuple[str, ...] = ()


def default_budget_bytes(accelerator: str, worker_processes: int) -> int:
    """``MEMORY_BUDGET_SHARE`` of what the machine has free at start (the least free GPU's memory on
    a GPU server), less the worker processes' own base; 0 when it cannot be read (no budget)."""
    available = available_gpu_bytes() if accelerator == "cuda" else available_cpu_bytes()
    if not available:
        return 0
    base = WORKER_BASE_BYTES.get(accelerator, 0) * max(1, worker_processes)
    return max(MIB, int(available * _defaults.MEMORY_BUDGET_SHARE) - base)


class MemoryBudget:
    """``limit_bytes`` for the resident models' loads (0: no limit) and the eviction rule."""

    def __init__(
        self,
        limit_bytes: int,
        accelerator: str = "cpu",
        idle_grace_s: float = _defaults.EVICT_IDLE_GRACE_S,
        min_resident_s: float = _defaults.EVICT_MIN_RESIDENT_S,
        free_now: Callable[[], int | None] | None = None,
    ) -> None:
        """``free_now``: what the machine has free now (None: unknown): a load also needs that much
        beside ``MEMORY_RESERVE_SHARE`` of it, whatever the budget says (another process may have
        taken memory since the start). Default: MemAvailable on a CPU, nvidia-smi's on a GPU."""
        self.limit_bytes = limit_bytes
        self.accelerator = accelerator
        self.idle_grace_s = idle_grace_s
        self.min_resident_s = min_resident_s
        self.free_now = free_now or (available_gpu_bytes if accelerator == "cuda" else available_cpu_bytes)
        self._reserve = int((self.free_now() or 0) * _defaults.MEMORY_RESERVE_SHARE)

    def describe(self) -> str:
        if not self.limit_bytes:
            return "no memory budget (the free memory could not be read): every model stays resident"
        where = "GPU" if self.accelerator == "cuda" else "host"
        return f"memory budget {self.limit_bytes / MIB:,.0f} MiB of {where} memory for the resident models"

    def estimate(self, plans: Sequence[VersionPlan], residents: Sequence[Resident], known: int = 0) -> int:
        """Bytes ``plans`` (a model's versions) would take: ``known`` (what it took when it was last
        resident), else per worker what the resident models took, else its files twice per worker."""
        workers = sum(plan.serve_plan.workers for plan in plans)
        if known:
            return known
        measured = [r for r in residents if r.bytes and r.workers]
        if measured:
            return workers * sum(r.bytes for r in measured) // sum(r.workers for r in measured)
        files = sum(directory_bytes(p.serve_plan.settings.artifact or p.serve_plan.settings.model) for p in plans)
        return workers * 2 * files

    def room_for(self, needed: int, residents: Sequence[Resident], now: float) -> Room:
        """Which residents to evict so that ``needed`` more bytes fit. Only idle ones go (no batch for
        ``idle_grace_s``, resident for ``min_resident_s``, not pinned), least recently used first; a
        model loads over the budget only when nothing is resident (a budget below one model serves
        one at a time)."""
        if not self.limit_bytes or not residents:
            return Room(True)
        short = max(sum(r.bytes for r in residents) + needed - self.limit_bytes, self._short_of_free(needed))
        if short <= 0:
            return Room(True)
        idle = sorted(
            (
                r
                for r in residents
                if not r.pinned and now - r.last_used >= self.idle_grace_s and now - r.loaded_at >= self.min_resident_s
            ),
            key=lambda r: r.last_used,
        )
        evict: list[str] = []
        freed = 0
        for resident in idle:
            evict.append(resident.name)
            # A resident that did not report its memory still frees some: count it as the estimate does.
            freed += resident.bytes or needed
            if freed >= short:
                return Room(True, tuple(evict))
        if len(evict) == len(residents):  # every resident goes: the model then loads alone
            return Room(True, tuple(evict))
        return Room(False)

    def _short_of_free(self, needed: int) -> int:
        free = self.free_now()
        if free is None:
            return 0
        return needed + self._reserve - free
