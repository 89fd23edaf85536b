"""A tune from start to end: engines -> the defaults -> the search -> the answer -> tuned vs defaults.

Every finished piece of work goes into the journal first, so a tune stopped anywhere (Ctrl-C, a
kill, a crash) resumes where it stopped when started again with the same settings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from benchmarks.images import read_images, write_benchmark_images
from benchmarks.tune import _defaults
from benchmarks.tune.engines import EngineBuild, build_engine
from benchmarks.tune.journal import NOT_FINGERPRINTED, Journal
from benchmarks.tune.machine import Machine, build_grid, default_candidate, engine_batch, probe_machine
from benchmarks.tune.measure import LoadPlan, Measurement, PoissonPlan, measure
from benchmarks.tune.output import write_serve_config
from benchmarks.tune.progress import TuneProgress, clock
from benchmarks.tune.report import ConfirmRound, TuneRecord, markdown, ratios_text, write_csv, write_plot
from benchmarks.tune.search import Objective, Score, SearchResult, full_search, quick_limit, quick_search
from benchmarks.tune.settings import TuneSettings
from benchmarks.tune.space import Candidate, SearchSpace
from compile import _defaults as compile_defaults

logger = logging.getLogger(__name__)


SEARCH, CONFIRM_DEFAULTS, CONFIRM_TUNED = "search", "confirm-defaults", "confirm-tuned"  # Measurement.phase


class TuneFailed(RuntimeError):
    """The tune ended without an answer; the message says why and what to change."""


@dataclass
class TuneOutcome:
    record: TuneRecord
    toml: Path | None
    report: Path
    plot: Path
    csv: Path
    resumed: int  # finished pieces of work read back from an earlier run


def images_digest(images: list[bytes]) -> str:
    digest = hashlib.sha256()
    for image in images:
        digest.update(hashlib.sha256(image).digest())
    return digest.hexdigest()[:16]


def out_of_time(elapsed_s: float, durations: list[float], confirm_rounds: int, budget_s: float) -> bool:
    """Whether one more configuration would not fit the budget (0: none), keeping time for the confirm
    rounds: each of those, and the next configuration, is taken to last as long as the mean one so far."""
    if not budget_s:
        return False
    mean = sum(durations) / len(durations) if durations else 0.0
    return elapsed_s + (2 * confirm_rounds + 1) * mean > budget_s


def file_slug(candidate: Candidate) -> str:
    return candidate.key.replace(" ", "_").replace(":", "-").replace("/", "-")


class Tuner:
    def __init__(self, settings: TuneSettings, live_progress: bool | None = None) -> None:
        self.settings = settings
        self.live_progress = live_progress
        self.work = settings.work_dir
        self.output = settings.output_path

    # ---- setup --------------------------------------------------------------------------------

    def _images(self) -> list[bytes]:
        if self.settings.images:
            return read_images(Path(self.settings.images).expanduser())
        directory = self.work / "images"
        if not directory.is_dir():
            write_benchmark_images(directory)
        return read_images(directory)

    def _identity(self, machine: Machine, space: SearchSpace, default: Candidate, images: list[bytes]) -> dict:
        measured = {k: v for k, v in self.settings.as_dict().items() if k not in NOT_FINGERPRINTED}
        return {
            **measured,
            "grid": space.as_dict(),
            "default": default.key,
            "machine": machine.name,
            "images": images_digest(images),
        }

    # ---- engines ------------------------------------------------------------------------------

    def _engines(self, engines: list[str], batch: tuple[int, int, int], machine: Machine) -> dict[str, EngineBuild]:
        builds = {}
        for engine in engines:
            build = self.journal.engines.get(engine)
            if build is None or (build.ok and not (Path(build.artifact) / compile_defaults.MANIFEST_FILE).exists()):
                self.progress.status(f"compiling {engine} (compile-trt, then its accuracy gate)")
                build = build_engine(self.settings, engine, batch, self.work / "logs", machine.accelerator)
                self.journal.add_engine(build)
            if build.ok:
                self.progress.message(f"{engine}: accuracy gate passed, {build.seconds:.0f} s ({build.message})")
            else:
                first = build.message.splitlines()[0] if build.message else ""
                self.progress.message(f"{engine}: DROPPED, {build.status}: {first}")
            builds[engine] = build
        return builds

    # ---- measuring ----------------------------------------------------------------------------

    def _measure(
        self, candidate: Candidate, config: Path, poisson: PoissonPlan, phase: str, round_number: int, counted: bool
    ) -> Measurement:
        known = self.journal.measurement(phase, candidate.key, round_number)
        if known is not None:
            return known
        log = self.work / "logs" / f"server-{phase}-{round_number}-{file_slug(candidate)}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        m = measure(candidate, config, self.images, self.plan, poisson, log, self.progress.status, phase, round_number)
        self.journal.add_measurement(m)
        self.progress.item_done(m.seconds, counted)
        self.progress.message(self._describe(m))
        return m

    def _describe(self, m: Measurement) -> str:
        label = f"{m.phase} {m.round + 1}: " if m.phase != SEARCH else ""
        if self.objective.feasible(m):
            run = m.sustained
            return (
                f"{label}{m.candidate.key}: Poisson {run.rate:.3g}/s at p99 {run.p99_ms:.0f} ms (closed loop "
                f"{m.capacity_rps:.1f} img/s at c={m.chosen.concurrency}) ({m.seconds:.0f} s)"
            )
        return f"{label}{m.candidate.key}: misses the target: {self.objective.why_not(m)} ({m.seconds:.0f} s)"

    def _config_file(self, candidate: Candidate) -> Path:
        path = self.work / "configs" / f"{file_slug(candidate)}.toml"
        artifact = Path(self.builds[candidate.engine].artifact)
        return write_serve_config(path, candidate.serve_values(artifact), [f"vision-tune candidate {candidate.key}"])

    def _search_poisson(self) -> PoissonPlan:
        """The Poisson runs of the search: a rate search (throughput), or one run at the latency objective's
        rate; before that rate is known (the defaults' run, without --rate), one run at LOAD_FACTOR of the
        defaults' throughput at the target, which then becomes the rate."""
        if self.objective.kind == "throughput":
            return PoissonPlan()
        if self.latency_rate:
            return PoissonPlan(fixed_rate=self.latency_rate)
        return PoissonPlan(max_runs=1)

    def _out_of_time(self) -> bool:
        return out_of_time(
            self.progress.elapsed_s,
            self.progress.durations,
            self.settings.confirm_rounds,
            60 * self.settings.budget_min,
        )

    def _evaluate(self, candidate: Candidate) -> Score | None:
        if self.journal.measurement(SEARCH, candidate.key) is None and self._out_of_time():
            return None
        m = self._measure(candidate, self._config_file(candidate), self._search_poisson(), SEARCH, 0, True)
        self.search_measurements.setdefault(candidate, m)
        return self.objective.score(m)

    # ---- the tune -----------------------------------------------------------------------------

    def run(self) -> TuneOutcome:
        s = self.settings
        machine = probe_machine(s.device)
        space, notes = build_grid(s, machine)
        default = default_candidate(machine)
        self.images = self._images()
        self.work.mkdir(parents=True, exist_ok=True)
        self.journal = Journal.open(
            self.work / _defaults.JOURNAL_FILE, self._identity(machine, space, default, self.images), s.restart
        )
        self.objective = Objective(s.objective, s.p99_ms, s.max_memory_mib, machine.accelerator)
        self.plan = LoadPlan(
            s.p99_ms, s.step_seconds, s.min_requests, s.poisson_seconds, s.load_factor, s.max_concurrency,
            s.client_processes or (4 if machine.accelerator == "cuda" else 1), max(machine.gpu_count, 1),
        )  # fmt: skip
        self.search_measurements: dict[Candidate, Measurement] = {}
        self.latency_rate = s.rate
        self.progress = TuneProgress(0, 60 * s.budget_min, self.journal.spent_s, live=self.live_progress)
        try:
            return self._run(machine, space, notes, default)
        finally:
            self.progress.close()

    def _run(self, machine: Machine, space: SearchSpace, notes: list[str], default: Candidate) -> TuneOutcome:
        s = self.settings
        if self.journal.resumed:
            self.progress.message(
                f"Resuming the tune in {self.work}: {self.journal.resumed} finished pieces of work read back "
                f"({clock(self.journal.spent_s)} of work)."
            )
        engines = list(dict.fromkeys([*space.values["engine"], default.engine]))
        self.builds = self._engines(engines, engine_batch(space), machine)
        dropped = {e for e, b in self.builds.items() if not b.ok}
        try:
            space = space.without_engines(dropped)
        except ValueError:
            reasons = "; ".join(
                f"{e}: {b.status}: {b.message.splitlines()[0] if b.message else ''}" for e, b in self.builds.items()
            )
            raise TuneFailed(f"No engine of the grid compiled and passed its accuracy gate ({reasons}).") from None
        limit = space.size if s.search == "full" else quick_limit(space)
        outside = default not in space
        self.progress.set_total(limit + int(outside) + 2 * s.confirm_rounds)
        baseline = None
        if self.builds[default.engine].ok:
            baseline = self._measure(default, self._config_file(default), self._search_poisson(), SEARCH, 0, True)
            self.search_measurements[default] = baseline
        self.latency_rate = self._latency_rate(baseline)
        started = self.progress.elapsed_s
        search = full_search if s.search == "full" else quick_search
        result = search(space, default, self._evaluate)
        logger.debug("search took %.0f s", self.progress.elapsed_s - started)
        record = self._record(machine, space, notes, default, result)
        toml = None
        if record.tuned is not None:
            toml = self._write_answer(record, comments=self._comments(record))
            record.confirm = self._confirm(default, record)
            record.confirm_load = self._confirm_load_note()
            toml = self._write_answer(record, comments=self._comments(record))
        record.spent_s = self.progress.elapsed_s
        outcome = self._write_report(record, toml)
        if record.tuned is None:
            raise TuneFailed(self._no_answer(record, outcome.report))
        return outcome

    def _latency_rate(self, baseline: Measurement | None) -> float:
        """The latency objective's load: --rate, else LOAD_FACTOR of what the defaults sustain."""
        if self.objective.kind != "latency":
            return 0.0
        if self.settings.rate:
            return self.settings.rate
        if baseline is None or not baseline.poisson_runs:
            raise TuneFailed(
                f"--objective latency without --rate offers the load the defaults sustain at p99 <= "
                f"{self.settings.p99_ms:g} ms, and the defaults sustain none here. Give --rate R (requests/s)."
            )
        return baseline.poisson_runs[0].rate

    def _record(
        self, machine: Machine, space: SearchSpace, notes: list[str], default: Candidate, result: SearchResult
    ) -> TuneRecord:
        measurements = list(self.search_measurements.values())
        feasible = [m for m in measurements if self.objective.feasible(m)]
        best = max(feasible, key=self.objective.score, default=None)  # the defaults' run is one of them
        return TuneRecord(
            model=self.settings.name or self.settings.model,
            objective=self.objective,
            search=self.settings.search,
            machine=f"{machine.name} ({machine.cpu_count} CPUs"
            + (f", {machine.gpu_count} GPUs)" if machine.accelerator == "cuda" else ")"),
            space=space,
            notes=notes,
            builds=list(self.builds.values()),
            measurements=measurements,
            default=default,
            tuned=best.candidate if best else None,
            stopped={"done": "done", "budget": "--budget-min reached", "limit": "quick search's limit"}[result.stopped],
            grid_measured=len(result.scores),
            spent_s=self.progress.elapsed_s,
            output=self.output,
        )

    # ---- the answer ---------------------------------------------------------------------------

    def _write_answer(self, record: TuneRecord, comments: list[str]) -> Path:
        tuned = record.tuned
        return write_serve_config(self.output, tuned.serve_values(Path(self.builds[tuned.engine].artifact)), comments)

    def _comments(self, record: TuneRecord) -> list[str]:
        s, o = self.settings, self.objective
        tuned = record.measurement(record.tuned)
        comments = [
            f"vision-tune: {record.model}, {o.kind} at p99 <= {o.p99_ms:g} ms on {record.machine}",
            f"{s.search} search: {record.grid_measured} of {record.space.size} configurations measured; report: "
            f"{self.output.with_suffix(_defaults.REPORT_SUFFIX).name}",
            f"Configuration {record.tuned.key}: Poisson {tuned.sustained.rate:.3g}/s at p99 "
            f"{tuned.sustained.p99_ms:.0f} ms; closed loop {tuned.capacity_rps:.1f} img/s at "
            f"c={tuned.chosen.concurrency}",
        ]
        ratios = record.ratios()
        if ratios:
            comments.append(
                f"vs the defaults ({record.default.key}), medians of {len(record.confirm)} alternating rounds: "
                f"{ratios_text(ratios)}"
            )
        build = self.builds[record.tuned.engine]
        comments += [
            "The artifact, again elsewhere: " + " ".join(build.command),
            f"Serve: vision-serve --config {self.output.name}",
        ]
        return comments

    def _confirm(self, default: Candidate, record: TuneRecord) -> list[ConfirmRound]:
        """The defaults, then the answer as written (``--config tuned.toml``), alternating. Each is measured
        as in the search; the tuned one also at the Poisson rate the defaults sustained in that round, so
        that their p99s compare at the same load."""
        if not self.builds[default.engine].ok:
            return []
        rounds = []
        for number in range(self.settings.confirm_rounds):
            defaults = self._measure(
                default, self._config_file(default), self._search_poisson(), CONFIRM_DEFAULTS, number, True
            )
            reference = defaults.sustained_rps if self.objective.kind == "throughput" else None
            plan = dataclasses.replace(self._search_poisson(), reference_rate=reference or None)
            tuned = self._measure(record.tuned, self.output, plan, CONFIRM_TUNED, number, True)
            rounds.append(ConfirmRound(defaults, tuned))
        return rounds

    def _confirm_load_note(self) -> str:
        if self.objective.kind == "latency":
            return f"Poisson arrivals at {self.latency_rate:.3g}/s, the latency objective's rate"
        return "Poisson arrivals at the rate the defaults sustained within the target in that round"

    def _write_report(self, record: TuneRecord, toml: Path | None) -> TuneOutcome:
        report = self.output.with_suffix(_defaults.REPORT_SUFFIX)
        plot = self.output.with_suffix(_defaults.PLOT_SUFFIX)
        table = self.output.with_suffix(_defaults.CSV_SUFFIX)
        write_plot(record, plot)
        write_csv(record, table)
        report.write_text(markdown(record, plot.name, table.name))
        return TuneOutcome(record, toml, report, plot, table, self.journal.resumed)

    def _no_answer(self, record: TuneRecord, report: Path) -> str:
        closest = sorted(record.measurements, key=self.objective.score, reverse=True)[:3]
        why = "; ".join(f"{m.candidate.key}: {self.objective.why_not(m)}" for m in closest) or "nothing was measured"
        lowest = min((m.lowest_p99_ms for m in record.measurements), default=math.inf)
        hint = f" The lowest p99 seen was {lowest:.0f} ms." if math.isfinite(lowest) else ""
        return (
            f"No configuration met p99 <= {self.settings.p99_ms:g} ms ({record.grid_measured} measured; closest: "
            f"{why}).{hint} Raise --p99-ms, or widen the grid. Report: {report}"
        )
