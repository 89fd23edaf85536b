"""What a tune leaves next to ``--output``: ``AnswerFiles``.

The answer (a vision-serve config file whose comments say where it came from and how it compared with
the defaults), or, where no configuration met the target, no answer and a message saying why; and in
either case the report, its plot and the CSV of every load run (report.py), named after ``--output``.
"""

from __future__ import annotations

import math
from pathlib import Path

from service.tune import _defaults
from service.tune.builds import TuneEngines
from service.tune.measure import FAILED
from service.tune.output import write_serve_config
from service.tune.report import TuneRecord, markdown, ratios_text, write_csv, write_plot
from service.tune.session import TuneSession

ANSWER_MARK = "# vision-tune:"  # the first line of every answer file: only those are ever replaced or removed


class AnswerFiles:
    """``AnswerFiles(session, engines)``: ``write``/``remove_stale`` the answer, ``write_report``, and
    ``no_answer`` (the message of a tune that found none); see the module docstring."""

    def __init__(self, session: TuneSession, engines: TuneEngines) -> None:
        self.session = session
        self.engines = engines
        self.path = session.output
        self.report = self.path.with_suffix(_defaults.REPORT_SUFFIX)
        self.plot = self.path.with_suffix(_defaults.PLOT_SUFFIX)
        self.csv = self.path.with_suffix(_defaults.CSV_SUFFIX)

    def write(self, record: TuneRecord) -> Path:
        """The answer: ``record.tuned`` as a serve config at --output (replaced as the record grows)."""
        values = record.tuned.serve_values(self.engines.artifact(record.tuned))
        return write_serve_config(self.path, values, self._comments(record))

    def remove_stale(self) -> None:
        """An answer an earlier tune wrote at --output must not outlive a tune that found none."""
        try:
            stale = self.path.read_text().startswith(ANSWER_MARK)
        except OSError:
            return
        if stale:
            self.path.unlink()
            self.session.progress.message(f"Removed {self.path}, an earlier tune's answer: this one found none.")

    def write_report(self, record: TuneRecord) -> None:
        """The report, its plot and the CSV, at ``report``, ``plot`` and ``csv``."""
        write_plot(record, self.plot)
        write_csv(record, self.csv)
        self.report.write_text(markdown(record, self.plot.name, self.csv.name))

    def _comments(self, record: TuneRecord) -> list[str]:
        s, o = self.session.settings, self.session.objective
        tuned = record.measurement(record.tuned)
        comments = [
            f"{ANSWER_MARK[2:]} {record.model}, {o.kind} at p99 <= {o.p99_ms:g} ms on {record.machine}",
            f"{s.search} search: {record.grid_measured} of {record.space.size} configurations measured; report: "
            f"{self.report.name}",
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
        comments += [
            "The artifact, again elsewhere: " + " ".join(self.engines.of(record.tuned).command),
            f"Serve: vision-serve --config {self.path.name}",
        ]
        return comments

    def no_answer(self, record: TuneRecord) -> str:
        """Why no configuration met the target (the closest three), what to change, and where the report is."""
        objective, logs = self.session.objective, self.session.work / "logs"
        measured = record.measurements
        closest = sorted(measured, key=objective.score, reverse=True)[:3]
        why = "; ".join(f"{m.candidate.key}: {objective.why_not(m)}" for m in closest) or "nothing was measured"
        if measured and all(m.status == FAILED for m in measured):
            hint = f"No server started: their logs are in {logs}."
        elif any(step.errors for m in measured for step in m.steps[:1]):
            hint = (
                "Requests failed: check that --images holds images the model's server takes (the statuses say "
                f"which answers came), and the servers' logs in {logs}."
            )
        else:
            lowest = min((m.lowest_p99_ms for m in measured), default=math.inf)
            seen = f"The lowest p99 seen was {lowest:.0f} ms. " if math.isfinite(lowest) else ""
            hint = f"{seen}Raise --p99-ms, or widen the grid."
        target = self.session.settings.p99_ms
        return (
            f"No configuration met p99 <= {target:g} ms ({record.grid_measured} measured; closest: {why}). {hint} "
            f"Report: {self.report}"
        )
