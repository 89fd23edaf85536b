"""Measure one configuration: serve it for real, load it with the project's load generator, stop it.

The server is ``vision-serve --config FILE``, the very file format vision-tune writes as its answer,
with the port from the environment and two limits raised (queue and deadline, so that a slow
configuration shows as latency, not as 503s). It is tied to this process (``with_parent``): it stops
when the tune stops, however the tune stops.

The load: a warm-up, the closed-loop ladder (ladder.Ladder), then Poisson runs (ladder.RateSearch);
optionally one more Poisson run at a reference rate, to compare two configurations at the same load.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from service.client.launcher import ServerProcess, ServerStartError
from service.settings import without_setting_variables
from service.tune import _defaults
from service.tune.footprint import FootprintSampler
from service.tune.ladder import (
    Ladder,
    RateSearch,
    Step,
    choose,
    confirm_miss,
    max_concurrency,
    step_requests,
    sustained,
)
from service.tune.loadgen import CLOSED as LOADGEN_CLOSED
from service.tune.loadgen import OPEN, POISSON, LoadResult, LoadSpec, run_load
from service.tune.space import Candidate

logger = logging.getLogger(__name__)

OK, FAILED = "ok", "failed"  # FAILED: the server did not start (its log says why)
SEARCH, CONFIRM_DEFAULTS, CONFIRM_TUNED = "search", "confirm-defaults", "confirm-tuned"  # Measurement.phase
SERVER_FLAGS = (
    "--log-level", "warning",
    "--request-timeout-s", str(_defaults.BENCH_REQUEST_TIMEOUT_S),
    "--max-queue", str(_defaults.BENCH_MAX_QUEUE),
)  # fmt: skip


@dataclass(frozen=True)
class LoadPlan:
    """How to load each configuration (from TuneSettings), the same for every one of a tune."""

    p99_ms: float
    step_seconds: float
    min_requests: int
    poisson_seconds: float
    load_factor: float
    max_concurrency: int  # 0: from the configuration
    client_processes: int
    devices: int  # GPUs a configuration with device "cuda" spreads over (1 on a CPU)
    gpu: bool = False  # sample the GPU's memory too


@dataclass(frozen=True)
class PoissonPlan:
    """The Poisson runs of one measurement: a rate search (``fixed_rate`` None) or one fixed rate, and
    an optional extra run at ``reference_rate``."""

    fixed_rate: float | None = None
    max_runs: int = _defaults.MAX_POISSON_RUNS
    reference_rate: float | None = None
    resolution: float = _defaults.RATE_RESOLUTION  # of the rate search


@dataclass(frozen=True)
class Measurement:
    """One configuration served and loaded: its closed-loop ladder, its Poisson runs and its memory."""

    candidate: Candidate
    phase: str  # SEARCH, CONFIRM_DEFAULTS or CONFIRM_TUNED
    round: int
    status: str  # OK or FAILED
    p99_target_ms: float
    steps: list[Step] = field(default_factory=list)  # the closed loop, in the order run
    poisson_runs: list[Step] = field(default_factory=list)
    reference: Step | None = None  # the Poisson run at PoissonPlan.reference_rate
    rss_mib: float = 0.0
    pss_mib: float = 0.0
    gpu_mib: float = 0.0
    startup_s: float = 0.0
    seconds: float = 0.0
    error: str = ""
    # Workers per device x engine threads as the server chose or took them (/info): what "0" (the
    # server's choice) meant on this machine.
    layout: str = ""

    @property
    def chosen(self) -> Step | None:
        """The closed-loop step with the most throughput within the target."""
        return choose(self.steps, self.p99_target_ms)

    @property
    def capacity_rps(self) -> float:
        """Closed-loop throughput at the target (0.0: not even one request at a time met it)."""
        return self.chosen.throughput_rps if self.chosen else 0.0

    @property
    def sustained(self) -> Step | None:
        """The Poisson run of the highest rate whose p99 met the target."""
        return sustained(self.poisson_runs, self.p99_target_ms)

    @property
    def sustained_rps(self) -> float:
        return self.sustained.rate if self.sustained else 0.0

    @property
    def lowest_p99_ms(self) -> float:
        """The smallest p99 of any closed-loop step: how far an infeasible configuration is from the target."""
        return min((s.p99_ms for s in self.steps if s.ok), default=math.inf)

    def as_dict(self) -> dict:
        values = asdict(self)
        values["candidate"] = self.candidate.as_dict()
        return values

    @classmethod
    def from_dict(cls, values: dict) -> Measurement:
        values = dict(values)
        values["candidate"] = Candidate.from_dict(values["candidate"])
        values["steps"] = [Step(**s) for s in values.get("steps", [])]
        values["poisson_runs"] = [Step(**s) for s in values.get("poisson_runs", [])]
        values["reference"] = Step(**values["reference"]) if values.get("reference") else None
        return cls(**values)


StatusLine = Callable[[str], None]


def devices_of(candidate: Candidate, gpus: int) -> int:
    return gpus if candidate.device == "cuda" else 1


def measure(
    candidate: Candidate,
    config_file: Path,
    images: Sequence[bytes],
    plan: LoadPlan,
    poisson: PoissonPlan,
    log_path: Path,
    status: StatusLine = lambda text: None,
    phase: str = "search",
    round_number: int = 0,
) -> Measurement:
    """Serve ``config_file`` (``candidate``'s settings), load it, stop it."""
    started = time.perf_counter()
    # The config file is the whole configuration: a VISION_SERVE_* variable of the tune's own
    # environment would win over it, and every candidate would be measured with that value.
    server = ServerProcess(
        ["--config", str(config_file), *SERVER_FLAGS],
        log_path=log_path,
        with_parent=True,
        base_env=without_setting_variables(),
    )
    try:  # stopped on every way out: a failed start, the end, Ctrl-C at any point (even while it starts)
        try:
            server.start()
        except ServerStartError as exc:
            logger.warning("%s did not start: %s", candidate.key, str(exc).splitlines()[0])
            seconds = time.perf_counter() - started
            return Measurement(
                candidate, phase, round_number, FAILED, plan.p99_ms, seconds=seconds, error=str(exc)[-2000:]
            )
        startup_s = time.perf_counter() - started
        workers, layout = served_layout(server.url)
        with FootprintSampler(server.process.pid, server.url, gpu=plan.gpu) as sampler:
            load = _Load(candidate, f"{server.url}/predict", images, plan, status, workers)
            steps = load.ladder()
            capacity = choose(steps, plan.p99_ms)
            runs = load.poisson(RateSearch(
                plan.p99_ms, capacity.throughput_rps if capacity else 0.0, plan.load_factor, poisson.max_runs,
                poisson.fixed_rate, poisson.resolution,
            ))  # fmt: skip
            reference = load.poisson_run(poisson.reference_rate) if poisson.reference_rate else None
        footprint = sampler.peak()
    finally:
        server.stop()
        server.kill_group()  # what a server that had to be killed left of its workers
    return Measurement(
        candidate,
        phase,
        round_number,
        OK,
        plan.p99_ms,
        steps,
        runs,
        reference,
        footprint.rss_mib,
        footprint.pss_mib,
        footprint.gpu_mib,
        round(startup_s, 2),
        round(time.perf_counter() - started, 2),
        layout=layout,
    )


def served_layout(url: str) -> tuple[int, str]:
    """The workers per device the server runs (the candidate's 0 is the server's choice) and its
    ``workers x threads``, from /info."""
    server = httpx.get(f"{url}/info", timeout=10).json()["server"]
    workers = int(server["workers_per_device"])
    return workers, f"{workers} x {server.get('engine_threads', '?')}"


class _Load:
    """The load runs against one running server."""

    def __init__(
        self,
        candidate: Candidate,
        url: str,
        images: Sequence[bytes],
        plan: LoadPlan,
        status: StatusLine,
        workers_per_device: int,
    ) -> None:
        self.candidate, self.url, self.images, self.plan, self.status = candidate, url, images, plan, status
        devices = devices_of(candidate, plan.devices)
        slots = candidate.max_batch_size * workers_per_device * devices
        self.ceiling = max_concurrency(candidate.max_batch_size, workers_per_device, devices, plan.max_concurrency)
        self.warmup = min(self.ceiling, slots, _defaults.WARMUP_MAX_CONCURRENCY)

    def ladder(self) -> list[Step]:
        self.status(f"{self.candidate.key}: warming up")
        requests = max(_defaults.WARMUP_MIN_REQUESTS, _defaults.WARMUP_ROUNDS * self.warmup)
        self._run(LoadSpec(requests, concurrency=self.warmup, max_seconds=self.max_seconds))
        ladder = Ladder(self.plan.p99_ms, self.ceiling)
        while (concurrency := ladder.next_concurrency()) is not None:
            last = ladder.steps[-1].throughput_rps if ladder.steps else None
            requests = step_requests(self.plan.step_seconds, self.plan.min_requests, last)
            self.status(f"{self.candidate.key}: closed loop c={concurrency}")
            spec = LoadSpec(
                requests,
                mode=LOADGEN_CLOSED,
                concurrency=concurrency,
                warmup_requests=concurrency,
                max_seconds=self.max_seconds,
            )
            result = confirm_miss(self._run(spec), lambda spec=spec: self._run(spec), self.plan.p99_ms)
            ladder.record(Step.from_summary(result.summary(), concurrency=concurrency))
        return ladder.steps

    def poisson(self, search: RateSearch) -> list[Step]:
        while (rate := search.next_rate()) is not None:
            search.record(self.poisson_run(rate))
        return search.runs

    def poisson_run(self, rate: float) -> Step:
        self.status(f"{self.candidate.key}: Poisson {rate:.3g}/s")
        requests = max(self.plan.min_requests, math.ceil(rate * self.plan.poisson_seconds))
        spec = LoadSpec(requests, mode=OPEN, rate=rate, arrivals=POISSON, max_seconds=self.max_seconds, seed=1)
        return Step.from_summary(self._run(spec).summary(), rate=rate)

    @property
    def max_seconds(self) -> float:
        """A bound on one load run: a configuration far slower than the step length still ends."""
        planned = max(self.plan.step_seconds, self.plan.poisson_seconds)
        return _defaults.RUN_LIMIT_FACTOR * planned + _defaults.RUN_LIMIT_EXTRA_S

    def _run(self, spec: LoadSpec) -> LoadResult:
        processes = self.plan.client_processes
        if spec.mode == LOADGEN_CLOSED:
            processes = min(processes, spec.concurrency)
        return run_load(self.url, self.images, spec, processes=max(1, processes))
