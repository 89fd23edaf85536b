"""How a tune judges configurations (``Objective``) and walks the grid (``full_search``, ``quick_search``).

The searches see only scores, so the same code runs a live tune and a replay over a finished tune's
measurements (benchmarks/tune_compare.py compares strategies that way).

Quick search is coordinate descent: from the defaults (their nearest point of the grid), along each
dimension in turn, measure every value with the others held, move to the best if it beats the
current configuration by more than noise, and pass over the dimensions again until a pass moves
nothing. It measures at most QUICK_MAX_SHARE of the grid (or one pass, on a grid of a few points),
the defaults included: a configuration measured is one measured, whichever step asked for it
(``known``: the tune measures the defaults first, as its baseline). So the defaults are the start
that costs nothing; a start at the middle of every range (``from_center``) costs one measurement
more, which on the smallest grids is the last dimension of the pass (benchmarks/tune_compare.py
replays both).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from service.tune import _defaults
from service.tune.measure import OK, Measurement
from service.tune.space import Candidate, SearchSpace

# (tier, value): tier 1 meets every constraint, 0 was served but misses one, -1 was not served;
# value: higher is better within a tier (throughput, or 1000 / p99 for the latency objective).
Score = tuple[int, float]
FEASIBLE, INFEASIBLE, NOT_SERVED = 1, 0, -1


@dataclass(frozen=True)
class Objective:
    """What a tune maximizes, under which constraints."""

    kind: str  # "throughput" or "latency"
    p99_ms: float
    max_memory_mib: float = 0.0  # 0: no limit
    accelerator: str = "cpu"  # the memory limit is on the GPU's memory there, else the host's (PSS)

    def memory_mib(self, m: Measurement) -> float:
        return m.gpu_mib if self.accelerator == "cuda" else m.pss_mib

    def why_not(self, m: Measurement) -> str:
        """Why ``m`` does not meet the constraints; "" when it does."""
        if m.status != OK:
            first_line = next((line for line in m.error.splitlines() if line.strip()), "")
            return f"the server did not start: {first_line}" if first_line else "the server did not start"
        if m.chosen is None:
            first = m.steps[0] if m.steps else None
            if first is None:
                return "no load step ran"
            if first.errors:
                return f"{first.failures()} at c=1"
            return f"p99 {first.p99_ms:.0f} ms at c=1 > {self.p99_ms:g} ms"
        if not m.poisson_runs:
            return f"its throughput at the target, {m.capacity_rps:.3g}/s, is below the objective's rate"
        if m.sustained is None:
            lowest = min(m.poisson_runs, key=lambda run: run.rate)
            if lowest.errors:
                return f"{lowest.failures()} at Poisson {lowest.rate:.3g}/s"
            return f"Poisson p99 {lowest.p99_ms:.0f} ms at {lowest.rate:.3g}/s > {self.p99_ms:g} ms"
        if self.max_memory_mib and self.memory_mib(m) > self.max_memory_mib:
            return f"memory {self.memory_mib(m):.0f} MiB > {self.max_memory_mib:g} MiB"
        return ""

    def feasible(self, m: Measurement) -> bool:
        return not self.why_not(m)

    def value(self, m: Measurement) -> float:
        """The objective's own number: the Poisson rate sustained within the target (images/s), or the
        p99 in ms at the latency objective's rate."""
        if self.kind == "throughput":
            return m.sustained_rps
        return m.sustained.p99_ms if m.sustained is not None else math.inf

    def score(self, m: Measurement) -> Score:
        if m.status != OK:
            return (NOT_SERVED, 0.0)
        if not self.feasible(m):
            lowest = m.lowest_p99_ms
            return (INFEASIBLE, 1000.0 / lowest if math.isfinite(lowest) and lowest > 0 else 0.0)
        if self.kind == "throughput":
            return (FEASIBLE, m.sustained_rps)
        return (FEASIBLE, 1000.0 / max(self.value(m), 1e-9))

    def unit(self) -> str:
        return "img/s" if self.kind == "throughput" else "ms p99"


# A configuration -> its score, measuring it if need be; None: no time is left, stop searching.
Evaluate = Callable[[Candidate], Score | None]


@dataclass
class SearchResult:
    scores: dict[Candidate, Score] = field(default_factory=dict)  # in the order measured
    stopped: str = "done"  # "done", "budget" (time ran out) or "limit" (quick's share of the grid)

    @property
    def best(self) -> Candidate | None:
        feasible = [c for c, s in self.scores.items() if s[0] == FEASIBLE]
        return max(feasible, key=lambda c: self.scores[c][1], default=None)


class _Stop(Exception):
    def __init__(self, reason: str) -> None:
        self.reason = reason


class _Scorer:
    """Scores each configuration once, in the order asked, up to ``limit`` configurations, counting
    those of ``known`` (scored before the search began) among them."""

    def __init__(
        self, evaluate: Evaluate, limit: int, space: SearchSpace, known: Mapping[Candidate, Score] | None
    ) -> None:
        self.evaluate, self.limit = evaluate, limit
        self.result = SearchResult({c: score for c, score in (known or {}).items() if c in space})

    def __call__(self, candidate: Candidate) -> Score:
        scores = self.result.scores
        if candidate in scores:
            return scores[candidate]
        if len(scores) >= self.limit:
            raise _Stop("limit")
        score = self.evaluate(candidate)
        if score is None:
            raise _Stop("budget")
        scores[candidate] = score
        return score


def full_search(
    space: SearchSpace, start: Candidate, evaluate: Evaluate, known: Mapping[Candidate, Score] | None = None
) -> SearchResult:
    """Every configuration of the grid, the defaults' nearest point first."""
    scorer = _Scorer(evaluate, space.size, space, known)
    first = space.project(start)
    try:
        for candidate in [first, *(c for c in space if c != first)]:
            scorer(candidate)
    except _Stop as stop:
        scorer.result.stopped = stop.reason
    return scorer.result


def quick_limit(space: SearchSpace) -> int:
    """How many configurations of the grid quick search may measure, the defaults included:
    QUICK_MAX_SHARE of the grid, or one pass over every dimension where that is more."""
    one_pass = 1 + sum(len(space.values[d]) - 1 for d in space.varied)
    return min(space.size, max(math.floor(_defaults.QUICK_MAX_SHARE * space.size), one_pass))


def beats(challenger: Score, incumbent: Score, min_gain: float) -> bool:
    """A higher tier always wins; within a tier, a gain beyond ``min_gain`` (relative) does."""
    if challenger[0] != incumbent[0]:
        return challenger[0] > incumbent[0]
    return challenger[1] > incumbent[1] * (1 + min_gain)


def quick_search(
    space: SearchSpace,
    start: Candidate,
    evaluate: Evaluate,
    limit: int | None = None,
    min_gain: float = _defaults.QUICK_MIN_GAIN,
    max_passes: int = _defaults.QUICK_MAX_PASSES,
    from_center: bool = False,
    known: Mapping[Candidate, Score] | None = None,
) -> SearchResult:
    """Coordinate descent from ``start`` (projected onto the grid), or with ``from_center`` from the
    middle of every numeric range around it; see the module docstring."""
    scorer = _Scorer(evaluate, quick_limit(space) if limit is None else limit, space, known)
    current = space.center(start) if from_center else space.project(start)
    try:
        scorer(current)
        for _ in range(max_passes):
            moved = False
            for dimension in space.varied:
                line = space.line(current, dimension)
                for candidate in line:
                    scorer(candidate)
                best = max(line, key=lambda c: scorer.result.scores[c])
                if best != current and beats(scorer.result.scores[best], scorer.result.scores[current], min_gain):
                    current, moved = best, True
            if not moved:
                break
    except _Stop as stop:
        scorer.result.stopped = stop.reason
    return scorer.result
