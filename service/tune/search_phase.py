"""The search phase of a tune: ``SearchPhase``, the defaults measured first, then the grid searched
(search.py: full or quick) within ``--budget-min``, ending in the ``TuneRecord`` with its best
configuration.

The defaults' run is the baseline the search starts from, one of the configurations it may answer
with, and for the latency objective without ``--rate`` the source of the load every configuration is
offered: the Poisson rate the defaults sustain within the target.
"""

from __future__ import annotations

from service.tune.bench import Bench
from service.tune.builds import TuneEngines
from service.tune.errors import TuneFailed
from service.tune.measure import SEARCH, Measurement, PoissonPlan
from service.tune.report import TuneRecord
from service.tune.search import Score, SearchResult, full_search, quick_search
from service.tune.session import TuneSession
from service.tune.space import Candidate

STOPPED = {"done": "done", "budget": "--budget-min reached", "limit": "quick search's limit"}  # SearchResult.stopped


def out_of_time(elapsed_s: float, durations: list[float], confirm_rounds: int, budget_s: float) -> bool:
    """Whether one more configuration would not fit the budget (0: none), keeping time for the confirm
    rounds: each of those, and the next configuration, is taken to last as long as the mean one so far."""
    if not budget_s:
        return False
    mean = sum(durations) / len(durations) if durations else 0.0
    return elapsed_s + (2 * confirm_rounds + 1) * mean > budget_s


class SearchPhase:
    """``SearchPhase(session, engines, bench).run()`` -> the record; then ``poisson()`` and
    ``latency_rate`` say how the confirm rounds load the configurations."""

    def __init__(self, session: TuneSession, engines: TuneEngines, bench: Bench) -> None:
        self.session = session
        self.engines = engines
        self.bench = bench
        self.measurements: dict[Candidate, Measurement] = {}  # the search's, the defaults' first
        self.latency_rate = session.settings.rate  # the latency objective's Poisson rate (0.0: not yet known)

    def poisson(self) -> PoissonPlan:
        """The Poisson runs of the search: a rate search, or for the latency objective one run at its
        rate once that is known (--rate, else what the defaults sustain: their run is a rate search)."""
        if self.session.objective.kind == "latency" and self.latency_rate:
            return PoissonPlan(fixed_rate=self.latency_rate)
        return PoissonPlan()

    def run(self) -> TuneRecord:
        """The defaults (where their engine built), then the search; ``TuneFailed`` where the latency
        objective has no rate to offer."""
        s = self.session
        known = {}  # counts against quick's share of the grid, where the defaults are a point of it
        if self.engines.default_build.ok:
            baseline = self.bench.measure(s.default, self.bench.config_file(s.default), self.poisson(), SEARCH, 0)
            self.measurements[s.default] = baseline
            self.latency_rate = self._latency_rate(baseline)
            known[s.default] = s.objective.score(baseline)
        elif s.objective.kind == "latency" and not self.latency_rate:
            raise TuneFailed(
                f"--objective latency without --rate offers the load the defaults sustain, and their engine "
                f"({s.default.engine}) did not build: {self.engines.default_build.message}. Give --rate R."
            )
        search = full_search if s.settings.search == "full" else quick_search
        return self._record(search(s.space, s.default, self._evaluate, known=known))

    def _latency_rate(self, baseline: Measurement) -> float:
        """The latency objective's load: --rate, else the Poisson rate the defaults sustain within the target."""
        s = self.session
        if s.objective.kind != "latency":
            return 0.0
        if s.settings.rate:
            return s.settings.rate
        if baseline.sustained is None:
            raise TuneFailed(
                f"--objective latency without --rate offers the load the defaults sustain at p99 <= "
                f"{s.settings.p99_ms:g} ms, and the defaults sustain none here "
                f"({s.objective.why_not(baseline)}). Give --rate R (requests/s)."
            )
        return baseline.sustained.rate

    def _evaluate(self, candidate: Candidate) -> Score | None:
        """The search's score of ``candidate``; None (stop searching) where measuring it would not fit
        the budget. What the journal holds costs no time, so it is never refused."""
        s = self.session
        known = s.journal.measurement(SEARCH, candidate.key)
        budget_s = 60 * s.settings.budget_min
        if known is None and out_of_time(
            s.progress.elapsed_s, s.progress.durations, s.settings.confirm_rounds, budget_s
        ):
            return None
        m = self.bench.measure(candidate, self.bench.config_file(candidate), self.poisson(), SEARCH, 0)
        self.measurements.setdefault(candidate, m)
        return s.objective.score(m)

    def _record(self, result: SearchResult) -> TuneRecord:
        s = self.session
        measurements = list(self.measurements.values())
        feasible = [m for m in measurements if s.objective.feasible(m)]
        best = max(feasible, key=s.objective.score, default=None)  # the defaults' run is one of them
        machine = s.machine
        gpus = f", {machine.gpu_count} GPUs" if machine.accelerator == "cuda" else ""
        return TuneRecord(
            model=s.settings.name or s.settings.model,
            objective=s.objective,
            search=s.settings.search,
            machine=f"{machine.name} ({machine.cpu_count} CPUs{gpus})",
            space=s.space,
            notes=s.notes,
            builds=self.engines.all(),
            measurements=measurements,
            default=s.default,
            tuned=best.candidate if best else None,
            stopped=STOPPED[result.stopped],
            grid_measured=len(result.scores),
            spent_s=s.progress.elapsed_s,
            output=s.output,
        )
