"""Measuring within a tune: ``Bench``, one configuration served and loaded at most once per phase and
round, so that a resumed tune never measures anything twice.

The journal's measurement where it holds one, else a new one (measure.py: a real vision-serve from a
config file written here, its server log under ``work/logs``), written to the journal as it finishes;
each counted on the progress line and described in one line.
"""

from __future__ import annotations

from pathlib import Path

from service.tune.builds import TuneEngines
from service.tune.measure import FAILED, SEARCH, Measurement, PoissonPlan, measure
from service.tune.output import write_serve_config
from service.tune.session import TuneSession
from service.tune.space import Candidate


def file_slug(candidate: Candidate) -> str:
    return candidate.key.replace(" ", "_").replace(":", "-").replace("/", "-")


class Bench:
    """``Bench(session, engines).measure(...)``; see the module docstring."""

    def __init__(self, session: TuneSession, engines: TuneEngines) -> None:
        self.session = session
        self.engines = engines

    def measure(
        self, candidate: Candidate, config: Path, poisson: PoissonPlan, phase: str, round_number: int
    ) -> Measurement:
        """``candidate`` served from ``config`` in ``phase`` (round ``round_number``), loaded as ``poisson``
        says: the journal's measurement, or a new one."""
        s = self.session
        known = s.journal.measurement(phase, candidate.key, round_number)
        if known is not None:
            s.progress.item_done(known.seconds, quiet=True)
            return known
        log = s.work / "logs" / f"server-{phase}-{round_number}-{file_slug(candidate)}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        m = measure(candidate, config, s.images, s.plan, poisson, log, s.progress.status, phase, round_number)
        s.journal.add_measurement(m)
        s.progress.item_done(m.seconds)
        s.progress.message(self._describe(m, log))
        return m

    def config_file(self, candidate: Candidate) -> Path:
        """The serve config ``candidate`` is measured with, under ``work/configs``."""
        path = self.session.work / "configs" / f"{file_slug(candidate)}.toml"
        values = candidate.serve_values(self.engines.artifact(candidate))
        return write_serve_config(path, values, [f"vision-tune candidate {candidate.key}"])

    def _describe(self, m: Measurement, log: Path) -> str:
        objective = self.session.objective
        label = f"{m.phase} {m.round + 1}: " if m.phase != SEARCH else ""
        if objective.feasible(m):
            run = m.sustained
            return (
                f"{label}{m.candidate.key}: Poisson {run.rate:.3g}/s at p99 {run.p99_ms:.0f} ms (closed loop "
                f"{m.capacity_rps:.1f} img/s at c={m.chosen.concurrency}) ({m.seconds:.0f} s)"
            )
        where = f" (log: {log})" if m.status == FAILED else ""
        return f"{label}{m.candidate.key}: misses the target: {objective.why_not(m)}{where} ({m.seconds:.0f} s)"
