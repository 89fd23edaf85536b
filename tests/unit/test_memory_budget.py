"""The memory budget's rule (service/supervisor/pool/budget.py): which resident models a load on demand
evicts, least recently used first, and which it never does (busy, just loaded, pinned)."""

from __future__ import annotations

from service.supervisor.planning.memory import MIB
from service.supervisor.pool.budget import MemoryBudget, Resident

NOW = 1000.0


def budget(limit_mib: int, free_mib: int | None = None) -> MemoryBudget:
    """A budget of ``limit_mib``; ``free_mib``: what the machine has free (None: unknown)."""
    free = None if free_mib is None else free_mib * MIB
    return MemoryBudget(limit_mib * MIB, idle_grace_s=1.0, min_resident_s=2.0, free_now=lambda: free)


def resident(name: str, mib: int, idle_s: float, loaded_s_ago: float = 60.0, pinned: bool = False) -> Resident:
    return Resident(name, mib * MIB, 1, NOW - loaded_s_ago, NOW - idle_s, pinned)


def test_a_model_that_fits_evicts_nothing() -> None:
    room = budget(1000).room_for(300 * MIB, [resident("a", 300, 50), resident("b", 300, 40)], NOW)
    assert room.fits and room.evict == ()


def test_the_least_recently_used_idle_models_go_first_and_no_more_than_needed() -> None:
    residents = [resident("recent", 300, 5), resident("oldest", 300, 50), resident("older", 300, 30)]
    assert budget(1000).room_for(200 * MIB, residents, NOW).evict == ("oldest",)
    assert budget(1000).room_for(500 * MIB, residents, NOW).evict == ("oldest", "older")


def test_busy_just_loaded_and_pinned_models_are_never_evicted() -> None:
    residents = [
        resident("busy", 300, 0.5),  # ran a batch half a second ago
        resident("fresh", 300, 1.5, loaded_s_ago=1.5),  # idle, but loaded moments ago
        resident("wanted", 300, 50, pinned=True),  # a request waits for it
        resident("idle", 300, 1.5),
    ]
    assert budget(1200).room_for(200 * MIB, residents, NOW).evict == ("idle",)
    # Only those could make the rest of the room: the load waits instead of evicting in vain.
    assert not budget(1200).room_for(600 * MIB, residents, NOW).fits


def test_a_budget_below_one_model_serves_one_at_a_time() -> None:
    assert budget(1).room_for(300 * MIB, [], NOW).fits  # nothing resident: it loads anyway
    room = budget(1).room_for(300 * MIB, [resident("a", 300, 10)], NOW)
    assert room.fits and room.evict == ("a",)
    assert not budget(1).room_for(300 * MIB, [resident("a", 300, 0.1)], NOW).fits


def test_memory_the_machine_lacks_makes_room_whatever_the_budget_says() -> None:
    # The budget has room, the machine (another process took memory since the start) has not.
    residents = [resident("a", 300, 50), resident("b", 300, 40)]
    room = budget(10_000, free_mib=250).room_for(300 * MIB, residents, NOW)
    assert room.fits and room.evict == ("a",)
    assert budget(10_000, free_mib=5_000).room_for(300 * MIB, residents, NOW).evict == ()


def test_no_budget_keeps_every_model() -> None:
    assert budget(0).room_for(10_000 * MIB, [resident("a", 300, 50)], NOW).evict == ()
