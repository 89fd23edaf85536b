"""A tune from start to end, ``Tuner(settings).run()``: engines -> the defaults -> the search -> the
answer -> tuned vs defaults. What vision-tune (cli.py) runs.

Every finished piece of work goes into the journal first, so a tune stopped anywhere (Ctrl-C, a
kill, a crash) resumes where it stopped when started again with the same settings.

The phases, each a module of its own: session.py (the machine, grid, images, journal: ``TuneSession``),
builds.py (the engines: ``TuneEngines``), bench.py (measuring one configuration, journaled: ``Bench``),
search_phase.py (the defaults, then the search: ``SearchPhase``), confirm.py (tuned vs defaults:
``ConfirmRounds``) and answer.py (the answer, the report, or why there is none: ``AnswerFiles``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from service.tune.answer import AnswerFiles
from service.tune.bench import Bench
from service.tune.builds import TuneEngines
from service.tune.confirm import ConfirmRounds
from service.tune.errors import TuneFailed, TuneSetupError
from service.tune.progress import clock
from service.tune.report import TuneRecord
from service.tune.search import quick_limit
from service.tune.search_phase import SearchPhase
from service.tune.session import TuneSession
from service.tune.settings import TuneSettings

# The entry point's names (the errors are raised by the phases).
__all__ = ["TuneFailed", "TuneOutcome", "TuneSetupError", "Tuner"]


@dataclass
class TuneOutcome:
    record: TuneRecord
    toml: Path | None
    report: Path
    plot: Path
    csv: Path
    resumed: int  # finished pieces of work read back from an earlier run


class Tuner:
    """``Tuner(settings).run()``: the whole tune; see the module docstring. ``TuneSetupError``: settings
    that do not fit; ``TuneFailed``: no answer (the report is written all the same where it got that far)."""

    def __init__(self, settings: TuneSettings, live_progress: bool | None = None) -> None:
        self.settings = settings
        self.live_progress = live_progress  # None: a live progress line on a terminal, log lines elsewhere

    def run(self) -> TuneOutcome:
        session = TuneSession.open(self.settings, self.live_progress)
        try:
            return self._run(session)
        finally:
            session.progress.close()

    def _run(self, session: TuneSession) -> TuneOutcome:
        s, journal = self.settings, session.journal
        if journal.resumed:
            session.progress.message(
                f"Resuming the tune in {session.work}: {journal.resumed} finished pieces of work read back "
                f"({clock(journal.spent_s)} of work)."
            )
        engines = TuneEngines.build(session)
        session.space = engines.grid(session.space)
        limit = session.space.size if s.search == "full" else quick_limit(session.space)
        session.progress.set_total(limit + int(session.default not in session.space) + 2 * s.confirm_rounds)
        bench = Bench(session, engines)
        search = SearchPhase(session, engines, bench)
        record = search.run()
        answer = AnswerFiles(session, engines)
        toml = None
        if record.tuned is not None:
            # Written before the confirm rounds too: they serve the answer as written.
            toml = answer.write(record)
            confirm = ConfirmRounds(session, bench, search.poisson(), search.latency_rate)
            record.confirm = confirm.run(record.tuned, answer.path)
            record.confirm_load = confirm.load_note()
            toml = answer.write(record)
        else:
            answer.remove_stale()
        record.spent_s = session.progress.elapsed_s
        answer.write_report(record)
        if record.tuned is None:
            raise TuneFailed(answer.no_answer(record))
        return TuneOutcome(record, toml, answer.report, answer.plot, answer.csv, journal.resumed)
