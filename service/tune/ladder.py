"""Which closed-loop concurrencies to measure a configuration at, and which one it is judged by.

Doubling from 1 (1, 2, 4, ...) until the p99 passes the target, an answer is not a 200, the
throughput stops rising, or the ceiling is reached; then one step halfway between the last
concurrency that met the target and the first that did not, so that a configuration is not judged
at a power of two that happens to sit far below its limit. A step whose p99 misses the target is
run once more and judged on both runs' requests together (``confirm_miss``): the p99 of a few dozen
requests is their largest, and one slow answer on a busy machine must not end a ladder. Pure: no
server, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from service.tune import _defaults
from service.tune.loadgen import LoadResult

CLOSED, POISSON = "closed", "poisson"


@dataclass(frozen=True)
class Step:
    """One load run against one server: a closed loop at ``concurrency`` or Poisson arrivals at ``rate``."""

    load: str  # CLOSED or POISSON
    concurrency: int  # closed loop; 0 for Poisson
    rate: float  # Poisson arrivals per second; 0.0 for a closed loop
    requests: int
    ok: int
    errors: int
    throughput_rps: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    batch_size_mean: float | None
    elapsed_s: float
    statuses: dict[str, int] = field(default_factory=dict)  # answers by HTTP status ("lost": none came)

    @classmethod
    def from_summary(cls, summary: dict, concurrency: int = 0, rate: float = 0.0) -> Step:
        """From a ``service.tune.loadgen.LoadResult.summary()``."""
        latency = summary["latency_ms"]
        return cls(
            load=POISSON if rate else CLOSED,
            concurrency=concurrency,
            rate=rate,
            requests=summary["requests"],
            ok=summary["ok"],
            errors=summary["errors"],
            throughput_rps=summary["throughput_rps"],
            p50_ms=latency["p50"],
            p95_ms=latency["p95"],
            p99_ms=latency["p99"],
            batch_size_mean=summary["batch_size_mean"],
            elapsed_s=summary["elapsed_s"],
            statuses=summary["statuses"],
        )

    def meets(self, p99_ms: float) -> bool:
        """Every request answered 200 and the p99 within the target."""
        return self.errors == 0 and self.ok > 0 and math.isfinite(self.p99_ms) and self.p99_ms <= p99_ms

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.load == CLOSED else f"Poisson {self.rate:.3g}/s"

    def failures(self) -> str:
        """``"3 of 50 requests failed (400: 3)"``; "" when every answer was a 200."""
        if not self.errors:
            return ""
        failed = ", ".join(f"{status}: {n}" for status, n in sorted(self.statuses.items()) if status != "200")
        return f"{self.errors} of {self.requests} requests failed" + (f" ({failed})" if failed else "")

    def as_dict(self) -> dict:
        return asdict(self)


def max_concurrency(max_batch_size: int, workers: int, devices: int, given: int = 0) -> int:
    """The ladder's ceiling: ``given``, else twice what the workers batch at once (capped)."""
    if given:
        return given
    slots = max_batch_size * workers * max(devices, 1)
    return max(4, min(_defaults.MAX_CONCURRENCY_CAP, _defaults.MAX_CONCURRENCY_PER_SLOT * slots))


class Ladder:
    """``while (c := ladder.next_concurrency()) is not None: ladder.record(run(c))``."""

    def __init__(self, p99_ms: float, ceiling: int) -> None:
        self.p99_ms = p99_ms
        self.ceiling = max(1, ceiling)
        self.steps: list[Step] = []
        self._refined = False

    def next_concurrency(self) -> int | None:
        if not self.steps:
            return 1
        last = self.steps[-1]
        doubling = not self._refined and last.meets(self.p99_ms) and last.concurrency < self.ceiling
        if doubling and self.flat_steps() < _defaults.FLAT_STEPS:
            return min(last.concurrency * 2, self.ceiling)
        return self._refinement()

    def _refinement(self) -> int | None:
        """Once: halfway between the highest concurrency that met the target and the first above it that did not."""
        if self._refined:
            return None
        self._refined = True
        met = [s.concurrency for s in self.steps if s.meets(self.p99_ms)]
        if not met:
            return None
        low = max(met)
        above = [s.concurrency for s in self.steps if s.concurrency > low and not s.meets(self.p99_ms)]
        if not above:
            return None
        middle = (low + min(above)) // 2
        tried = {s.concurrency for s in self.steps}
        return middle if middle > low and middle not in tried else None

    def record(self, step: Step) -> None:
        self.steps.append(step)

    def flat_steps(self) -> int:
        """How many of the last steps gained less than FLAT_GAIN over the best throughput before them."""
        count = 0
        for index in range(len(self.steps) - 1, 0, -1):
            best_before = max(s.throughput_rps for s in self.steps[:index])
            if self.steps[index].throughput_rps >= best_before * (1 + _defaults.FLAT_GAIN):
                break
            count += 1
        return count

    def chosen(self) -> Step | None:
        """The step with the most throughput among those that met the target (the lower concurrency on a tie)."""
        return choose(self.steps, self.p99_ms)


def choose(steps: list[Step], p99_ms: float) -> Step | None:
    meeting = [s for s in steps if s.load == CLOSED and s.meets(p99_ms)]
    return max(meeting, key=lambda s: (s.throughput_rps, -s.concurrency), default=None)


def confirm_miss(first: LoadResult, run_again: Callable[[], LoadResult], p99_ms: float) -> LoadResult:
    """``first``, or where its p99 missed the target with every answer a 200, ``first`` and a second run
    of the same load taken together. Failed requests are not noise: those are judged as they are."""
    step = Step.from_summary(first.summary())
    if step.meets(p99_ms) or step.errors or not step.ok:
        return first
    again = run_again()
    return LoadResult(first.spec, [*first.samples, *again.samples], first.elapsed_s + again.elapsed_s)


def step_requests(step_seconds: float, min_requests: int, last_throughput: float | None) -> int:
    """Requests for the next step: ``step_seconds`` at the last throughput seen, at least ``min_requests``."""
    if not last_throughput or not math.isfinite(last_throughput):
        return min_requests
    return int(min(_defaults.MAX_REQUESTS_PER_STEP, max(min_requests, math.ceil(last_throughput * step_seconds))))


class RateSearch:
    """Poisson rates to offer after the ladder, ``max_runs`` at most. The first is LOAD_FACTOR of the
    closed-loop capacity; then bisection between the highest rate that met the target (0 until one
    does) and the lowest that did not (the capacity until one fails), until the two are within
    ``resolution`` (RATE_RESOLUTION) of each other. With ``fixed_rate`` (the latency objective): one
    run at that rate, if the capacity reaches it. The highest rate that met the target is what was
    sustained.

    Bursts queue where a closed loop never lets them, so a Poisson p99 is often well above the closed
    loop's at the same throughput; halving is what finds the rate within a run or two then."""

    def __init__(
        self,
        p99_ms: float,
        capacity: float,
        load_factor: float,
        max_runs: int,
        fixed_rate: float | None = None,
        resolution: float = _defaults.RATE_RESOLUTION,
    ) -> None:
        self.p99_ms, self.capacity, self.load_factor = p99_ms, capacity, load_factor
        self.max_runs, self.fixed_rate, self.resolution = max_runs, fixed_rate, resolution
        self.runs: list[Step] = []

    def next_rate(self) -> float | None:
        if self.capacity <= 0 or len(self.runs) >= self.max_runs:
            return None
        if self.fixed_rate is not None:
            return self.fixed_rate if not self.runs and self.capacity >= self.fixed_rate else None
        if not self.runs:
            return self.load_factor * self.capacity
        low = max((run.rate for run in self.runs if run.meets(self.p99_ms)), default=0.0)
        high = min((run.rate for run in self.runs if not run.meets(self.p99_ms)), default=self.capacity)
        if low and high <= low * (1 + self.resolution):
            return None
        return (low + high) / 2

    def record(self, step: Step) -> None:
        self.runs.append(step)

    def sustained(self) -> Step | None:
        return sustained(self.runs, self.p99_ms)


def sustained(runs: list[Step], p99_ms: float) -> Step | None:
    """The Poisson run of the highest rate that met the target."""
    return max((run for run in runs if run.meets(p99_ms)), key=lambda run: run.rate, default=None)
