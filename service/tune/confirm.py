"""The confirm phase of a tune: ``ConfirmRounds``, the tuned configuration against the defaults.

Rounds alternate the two, so that a machine that drifts (heat, a neighbour) weighs on both alike; the
tuned one is served from the answer as written, so what is confirmed is what will be served.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from service.tune.bench import Bench
from service.tune.measure import CONFIRM_DEFAULTS, CONFIRM_TUNED, PoissonPlan
from service.tune.report import ConfirmRound
from service.tune.session import TuneSession
from service.tune.space import Candidate


class ConfirmRounds:
    """``ConfirmRounds(session, bench, poisson, latency_rate).run(tuned, answer)``, measured as the search
    measured (``poisson``: its Poisson runs; ``latency_rate``: the latency objective's rate)."""

    def __init__(self, session: TuneSession, bench: Bench, poisson: PoissonPlan, latency_rate: float) -> None:
        self.session = session
        self.bench = bench
        self.poisson = poisson
        self.latency_rate = latency_rate

    def run(self, tuned: Candidate, answer: Path) -> list[ConfirmRound]:
        """The defaults, then the answer as written (``--config tuned.toml``), alternating, for
        --confirm-rounds rounds; none where the defaults' engine did not build. The tuned one is also
        measured at the Poisson rate the defaults sustained in that round, so that their p99s compare
        at the same load."""
        s, bench = self.session, self.bench
        if not bench.engines.default_build.ok:
            return []
        rounds = []
        for number in range(s.settings.confirm_rounds):
            defaults = bench.measure(s.default, bench.config_file(s.default), self.poisson, CONFIRM_DEFAULTS, number)
            reference = defaults.sustained_rps if s.objective.kind == "throughput" else None
            plan = dataclasses.replace(self.poisson, reference_rate=reference or None)
            rounds.append(ConfirmRound(defaults, bench.measure(tuned, answer, plan, CONFIRM_TUNED, number)))
        return rounds

    def load_note(self) -> str:
        """How the rounds loaded the two, for the report."""
        if self.session.objective.kind == "latency":
            return f"Poisson arrivals at {self.latency_rate:.3g}/s, the latency objective's rate"
        return "Poisson arrivals at the rate the defaults sustained within the target in that round"
