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
from benchmarks.tune.engines import EngineBuild, build_engine, build_key
from benchmarks.tune.journal import NOT_FINGERPRINTED, Journal
from benchmarks.tune.machine import Machine, build_grid, default_candidate, engine_batch, probe_machine
from benchmarks.tune.measure import FAILED, LoadPlan, Measurement, PoissonPlan, measure
from benchmarks.tune.output import write_serve_config
from benchmarks.tune.progress import TuneProgress, clock
from benchmarks.tune.report import ConfirmRound, TuneRecord, markdown, ratios_text, write_csv, write_plot
from benchmarks.tune.search import Objective, Score, SearchResult, full_search, quick_limit, quick_search
from benchmarks.tune.settings import TuneSettings
from benchmarks.tune.space import Candidate, SearchSpace
from compile import _defaults as compile_defaults

logger = logging.getLogger(__name__)

SEARCH, CONFIRM_DEFAULTS, CONFIRM_TUNED = "search", "confirm-defaults", "confirm-tuned"  # Measurement.phase
ANSWER_MARK = "# vision-tune:"  # the first line of every answer file: only those are ever replaced or removed


class TuneSetupError(ValueError):
    """The settings do not fit this machine or the work folder: what to change (a usage error)."""


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


def load_images(folder: str | Path | None, work: Path) -> list[bytes]:
    """The images a tune sends: ``folder`` (its --images), or the project's benchmark photos, written
    into ``work/images`` once (seeded: the same bytes every time)."""
    if folder:
        return read_images(Path(folder).expanduser())
    directory = work / "images"
    if not directory.is_dir():
        write_benchmark_images(directory)
    return read_images(directory)


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
    """``Tuner(settings).run()``: the whole tune; see the module docstring."""

    # Set up by run(), before anything is measured.
    machine: Machine
    space: SearchSpace
    notes: list[str]
    default: Candidate
    images: list[bytes]
    journal: Journal
    objective: Objective
    plan: LoadPlan
    progress: TuneProgress
    builds: dict[str, EngineBuild]  # the grid's engines, by name
    default_build: EngineBuild  # the defaults' engine, at compile-trt's default batch
    latency_rate: float  # the latency objective's Poisson rate, once known (0.0 before, and for throughput)

    def __init__(self, settings: TuneSettings, live_progress: bool | None = None) -> None:
        self.settings = settings
        self.live_progress = live_progress
        self.work = settings.work_dir
        self.output = settings.output_path
        self.search_measurements: dict[Candidate, Measurement] = {}

    # ---- setup --------------------------------------------------------------------------------

    def _setup(self) -> None:
        """What the machine offers, the images, the journal; ``TuneSetupError`` says what does not fit."""
        s = self.settings
        try:
            self.machine = probe_machine(s.device)
            self.space, self.notes = build_grid(s, self.machine)
            self.default = default_candidate(self.machine)
            self.images = load_images(s.images, self.work)
            self.work.mkdir(parents=True, exist_ok=True)
            identity = self._identity()
            self.journal = Journal.open(self.work / _defaults.JOURNAL_FILE, identity, s.restart)
        except ValueError as exc:
            raise TuneSetupError(str(exc)) from None
        gpu = self.machine.accelerator == "cuda"
        self.objective = Objective(s.objective, s.p99_ms, s.max_memory_mib, self.machine.accelerator)
        clients = s.client_processes or (_defaults.GPU_CLIENT_PROCESSES if gpu else _defaults.CPU_CLIENT_PROCESSES)
        self.plan = LoadPlan(
            s.p99_ms, s.step_seconds, s.min_requests, s.poisson_seconds, s.load_factor, s.max_concurrency,
            clients, max(self.machine.gpu_count, 1), gpu,
        )  # fmt: skip
        self.latency_rate = s.rate
        self.progress = TuneProgress(0, 60 * s.budget_min, self.journal.spent_s, live=self.live_progress)

    def _identity(self) -> dict:
        measured = {k: v for k, v in self.settings.as_dict().items() if k not in NOT_FINGERPRINTED}
        return {
            **measured,
            "grid": self.space.as_dict(),
            "default": self.default.key,
            "machine": self.machine.name,
            "images": images_digest(self.images),
        }

    # ---- engines ------------------------------------------------------------------------------

    def _build(self, engine: str, batch: tuple[int, int, int]) -> EngineBuild:
        """The journal's build of ``engine`` at ``batch``, or compile-trt's now."""
        build = self.journal.engines.get(build_key(engine, batch))
        stale = build is not None and (
            build.retry_on_resume or (build.ok and not (Path(build.artifact) / compile_defaults.MANIFEST_FILE).exists())
        )
        if build is None or stale:
            self.progress.status(f"compiling {engine} (compile-trt, then its accuracy gate)")
            build = build_engine(self.settings, engine, batch, self.work / "logs", self.machine.accelerator)
            self.journal.add_engine(build)
        if build.ok:
            self.progress.message(f"{engine}: accuracy gate passed, {build.seconds:.0f} s ({build.message})")
        else:
            first = build.message.splitlines()[0] if build.message else ""
            self.progress.message(f"{engine}: DROPPED, {build.status}: {first}")
        return build

    def _engines(self) -> None:
        """Every engine of the grid at the grid's batch range, and the defaults' at compile-trt's own
        (the same build where the two ranges agree, as on a CPU)."""
        batch = engine_batch(self.space)
        self.builds = {engine: self._build(engine, batch) for engine in self.space.values["engine"]}
        default_batch = tuple(compile_defaults.DEFAULT_BATCH)
        same = batch == default_batch and self.default.engine in self.builds
        self.default_build = (
            self.builds[self.default.engine] if same else self._build(self.default.engine, default_batch)
        )
        dropped = {e for e, b in self.builds.items() if not b.ok}
        try:
            self.space = self.space.without_engines(dropped)
        except ValueError:
            reasons = "; ".join(
                f"{e}: {b.status}: {b.message.splitlines()[0] if b.message else ''}" for e, b in self.builds.items()
            )
            raise TuneFailed(f"No engine of the grid compiled and passed its accuracy gate ({reasons}).") from None

    def _artifact(self, candidate: Candidate) -> Path:
        build = self.default_build if candidate == self.default else self.builds[candidate.engine]
        return Path(build.artifact)

    # ---- measuring ----------------------------------------------------------------------------

    def _measure(
        self, candidate: Candidate, config: Path, poisson: PoissonPlan, phase: str, round_number: int
    ) -> Measurement:
        known = self.journal.measurement(phase, candidate.key, round_number)
        if known is not None:
            self.progress.item_done(known.seconds, quiet=True)
            return known
        log = self.work / "logs" / f"server-{phase}-{round_number}-{file_slug(candidate)}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        m = measure(candidate, config, self.images, self.plan, poisson, log, self.progress.status, phase, round_number)
        self.journal.add_measurement(m)
        self.progress.item_done(m.seconds)
        self.progress.message(self._describe(m, log))
        return m

    def _describe(self, m: Measurement, log: Path) -> str:
        label = f"{m.phase} {m.round + 1}: " if m.phase != SEARCH else ""
        if self.objective.feasible(m):
            run = m.sustained
            return (
                f"{label}{m.candidate.key}: Poisson {run.rate:.3g}/s at p99 {run.p99_ms:.0f} ms (closed loop "
                f"{m.capacity_rps:.1f} img/s at c={m.chosen.concurrency}) ({m.seconds:.0f} s)"
            )
        where = f" (log: {log})" if m.status == FAILED else ""
        return f"{label}{m.candidate.key}: misses the target: {self.objective.why_not(m)}{where} ({m.seconds:.0f} s)"

    def _config_file(self, candidate: Candidate) -> Path:
        path = self.work / "configs" / f"{file_slug(candidate)}.toml"
        values = candidate.serve_values(self._artifact(candidate))
        return write_serve_config(path, values, [f"vision-tune candidate {candidate.key}"])

    def _search_poisson(self) -> PoissonPlan:
        """The Poisson runs of the search: a rate search, or for the latency objective one run at its
        rate once that is known (--rate, else what the defaults sustain: their run is a rate search)."""
        if self.objective.kind == "latency" and self.latency_rate:
            return PoissonPlan(fixed_rate=self.latency_rate)
        return PoissonPlan()

    def _evaluate(self, candidate: Candidate) -> Score | None:
        known = self.journal.measurement(SEARCH, candidate.key)
        if known is None and out_of_time(
            self.progress.elapsed_s,
            self.progress.durations,
            self.settings.confirm_rounds,
            60 * self.settings.budget_min,
        ):
            return None
        m = self._measure(candidate, self._config_file(candidate), self._search_poisson(), SEARCH, 0)
        self.search_measurements.setdefault(candidate, m)
        return self.objective.score(m)

    # ---- the tune -----------------------------------------------------------------------------

    def run(self) -> TuneOutcome:
        self._setup()
        try:
            return self._run()
        finally:
            self.progress.close()

    def _run(self) -> TuneOutcome:
        s = self.settings
        if self.journal.resumed:
            self.progress.message(
                f"Resuming the tune in {self.work}: {self.journal.resumed} finished pieces of work read back "
                f"({clock(self.journal.spent_s)} of work)."
            )
        self._engines()
        limit = self.space.size if s.search == "full" else quick_limit(self.space)
        self.progress.set_total(limit + int(self.default not in self.space) + 2 * s.confirm_rounds)
        known = {}  # counts against quick's share of the grid, where the defaults are a point of it
        if self.default_build.ok:
            baseline = self._measure(self.default, self._config_file(self.default), self._search_poisson(), SEARCH, 0)
            self.search_measurements[self.default] = baseline
            self.latency_rate = self._latency_rate(baseline)
            known[self.default] = self.objective.score(baseline)
        elif self.objective.kind == "latency" and not self.latency_rate:
            raise TuneFailed(
                f"--objective latency without --rate offers the load the defaults sustain, and their engine "
                f"({self.default.engine}) did not build: {self.default_build.message}. Give --rate R."
            )
        search = full_search if s.search == "full" else quick_search
        result = search(self.space, self.default, self._evaluate, known=known)
        record = self._record(result)
        toml = None
        if record.tuned is not None:
            toml = self._write_answer(record)
            record.confirm = self._confirm(record)
            record.confirm_load = self._confirm_load_note()
            toml = self._write_answer(record)
        else:
            self._remove_stale_answer()
        record.spent_s = self.progress.elapsed_s
        outcome = self._write_report(record, toml)
        if record.tuned is None:
            raise TuneFailed(self._no_answer(record, outcome.report))
        return outcome

    def _latency_rate(self, baseline: Measurement) -> float:
        """The latency objective's load: --rate, else the Poisson rate the defaults sustain within the target."""
        if self.objective.kind != "latency":
            return 0.0
        if self.settings.rate:
            return self.settings.rate
        if baseline.sustained is None:
            raise TuneFailed(
                f"--objective latency without --rate offers the load the defaults sustain at p99 <= "
                f"{self.settings.p99_ms:g} ms, and the defaults sustain none here "
                f"({self.objective.why_not(baseline)}). Give --rate R (requests/s)."
            )
        return baseline.sustained.rate

    def _record(self, result: SearchResult) -> TuneRecord:
        measurements = list(self.search_measurements.values())
        feasible = [m for m in measurements if self.objective.feasible(m)]
        best = max(feasible, key=self.objective.score, default=None)  # the defaults' run is one of them
        machine = self.machine
        gpus = f", {machine.gpu_count} GPUs" if machine.accelerator == "cuda" else ""
        return TuneRecord(
            model=self.settings.name or self.settings.model,
            objective=self.objective,
            search=self.settings.search,
            machine=f"{machine.name} ({machine.cpu_count} CPUs{gpus})",
            space=self.space,
            notes=self.notes,
            builds=list({b.key: b for b in [*self.builds.values(), self.default_build]}.values()),
            measurements=measurements,
            default=self.default,
            tuned=best.candidate if best else None,
            stopped={"done": "done", "budget": "--budget-min reached", "limit": "quick search's limit"}[result.stopped],
            grid_measured=len(result.scores),
            spent_s=self.progress.elapsed_s,
            output=self.output,
        )

    # ---- the answer ---------------------------------------------------------------------------

    def _write_answer(self, record: TuneRecord) -> Path:
        values = record.tuned.serve_values(self._artifact(record.tuned))
        return write_serve_config(self.output, values, self._comments(record))

    def _remove_stale_answer(self) -> None:
        """An answer an earlier tune wrote at --output must not outlive a tune that found none."""
        try:
            stale = self.output.read_text().startswith(ANSWER_MARK)
        except OSError:
            return
        if stale:
            self.output.unlink()
            self.progress.message(f"Removed {self.output}, an earlier tune's answer: this one found none.")

    def _comments(self, record: TuneRecord) -> list[str]:
        s, o = self.settings, self.objective
        tuned = record.measurement(record.tuned)
        comments = [
            f"{ANSWER_MARK[2:]} {record.model}, {o.kind} at p99 <= {o.p99_ms:g} ms on {record.machine}",
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
        build = self.default_build if record.tuned == self.default else self.builds[record.tuned.engine]
        comments += [
            "The artifact, again elsewhere: " + " ".join(build.command),
            f"Serve: vision-serve --config {self.output.name}",
        ]
        return comments

    def _confirm(self, record: TuneRecord) -> list[ConfirmRound]:
        """The defaults, then the answer as written (``--config tuned.toml``), alternating. Each is measured
        as in the search; the tuned one also at the Poisson rate the defaults sustained in that round, so
        that their p99s compare at the same load."""
        if not self.default_build.ok:
            return []
        rounds = []
        for number in range(self.settings.confirm_rounds):
            defaults = self._measure(
                self.default, self._config_file(self.default), self._search_poisson(), CONFIRM_DEFAULTS, number
            )
            reference = defaults.sustained_rps if self.objective.kind == "throughput" else None
            plan = dataclasses.replace(self._search_poisson(), reference_rate=reference or None)
            tuned = self._measure(record.tuned, self.output, plan, CONFIRM_TUNED, number)
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
        measured = record.measurements
        closest = sorted(measured, key=self.objective.score, reverse=True)[:3]
        why = "; ".join(f"{m.candidate.key}: {self.objective.why_not(m)}" for m in closest) or "nothing was measured"
        if measured and all(m.status == FAILED for m in measured):
            hint = f"No server started: their logs are in {self.work / 'logs'}."
        elif any(step.errors for m in measured for step in m.steps[:1]):
            hint = (
                "Requests failed: check that --images holds images the model's server takes (the statuses say "
                f"which answers came), and the servers' logs in {self.work / 'logs'}."
            )
        else:
            lowest = min((m.lowest_p99_ms for m in measured), default=math.inf)
            seen = f"The lowest p99 seen was {lowest:.0f} ms. " if math.isfinite(lowest) else ""
            hint = f"{seen}Raise --p99-ms, or widen the grid."
        return (
            f"No configuration met p99 <= {self.settings.p99_ms:g} ms ({record.grid_measured} measured; closest: "
            f"{why}). {hint} Report: {report}"
        )
