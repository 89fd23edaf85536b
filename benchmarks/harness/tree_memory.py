"""The memory of a server's whole process tree: PSS (and RSS, USS) summed over the main process and all
its descendants, by role (main, manager, tracker, http, worker: ``benchmarks.soak.process_role``).

PSS is the measure for "what does one more model cost": a page shared by k processes (torch's code,
a file mapped by several workers) counts 1/k in each, so the sum over the tree is what the tree
holds. RSS counts shared pages once per process and overstates a tree of many workers; it is kept
beside PSS for comparison with older results. Reading PSS (/proc/PID/smaps) costs a few ms per
process; a process that exits while it is read is left out.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter

import psutil

from benchmarks.soak import process_role

MIB = 2**20


def tree_memory(server_pid: int) -> dict:
    """``{"pss_mib", "rss_mib", "uss_mib", "processes", "by_role": {role: {"count", "pss_mib", ...}},
    "each": [{"pid", "role", "pss_mib", "rss_mib"}]}`` of the tree rooted at ``server_pid``."""
    root = psutil.Process(server_pid)
    each = []
    for process in (root, *root.children(recursive=True)):
        with contextlib.suppress(psutil.Error):
            role = process_role(process, server_pid)
            info = process.memory_full_info()
            each.append(
                {"pid": process.pid, "role": role, "pss_mib": info.pss / MIB, "rss_mib": info.rss / MIB,
                 "uss_mib": info.uss / MIB}
            )  # fmt: skip
    by_role: dict[str, dict] = {}
    for role, count in sorted(Counter(entry["role"] for entry in each).items()):
        mine = [entry for entry in each if entry["role"] == role]
        by_role[role] = {
            "count": count,
            **{key: sum(e[key] for e in mine) for key in ("pss_mib", "rss_mib", "uss_mib")},
        }
    totals = {key: sum(entry[key] for entry in each) for key in ("pss_mib", "rss_mib", "uss_mib")}
    return {**totals, "processes": len(each), "by_role": by_role, "each": each}


def settled_tree_memory(server_pid: int, samples: int = 3, interval_s: float = 1.0) -> dict:
    """``samples`` readings ``interval_s`` apart; the one with the median PSS, with all the totals
    (an allocator returning memory, a log flush, moves a single reading by a few MiB)."""
    readings = []
    for i in range(samples):
        if i:
            time.sleep(interval_s)
        readings.append(tree_memory(server_pid))
    middle = statistics.median_low([reading["pss_mib"] for reading in readings])
    chosen = next(reading for reading in readings if reading["pss_mib"] == middle)
    return {**chosen, "pss_mib_readings": [round(reading["pss_mib"], 1) for reading in readings]}


def available_mib() -> float:
    """The machine's MemAvailable, in MiB: what a new server may take before others are squeezed."""
    return psutil.virtual_memory().available / MIB


def linear_fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares ``(slope, intercept)`` of y on x; None for fewer than two distinct x."""
    if len({x for x, _ in points}) < 2:
        return None
    fit = statistics.linear_regression([x for x, _ in points], [y for _, y in points])
    return fit.slope, fit.intercept
