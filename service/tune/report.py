"""The tune's report: a Markdown page, a plot (throughput vs p99, one point per configuration) and a
CSV of every load run, all from the ``TuneRecord``."""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from service.tune.engines import EngineBuild
from service.tune.ladder import Step
from service.tune.measure import Measurement
from service.tune.search import FEASIBLE, Objective
from service.tune.space import DIMENSIONS, Candidate, SearchSpace

CSV_COLUMNS = (
    "phase", "round", "configuration", *DIMENSIONS, "load", "concurrency", "rate_rps", "requests", "ok", "errors",
    "throughput_rps", "p50_ms", "p95_ms", "p99_ms", "batch_size_mean", "elapsed_s", "meets_target", "chosen",
    "rss_mib", "pss_mib", "gpu_mib", "startup_s", "error",
)  # fmt: skip


@dataclass
class ConfirmRound:
    defaults: Measurement
    tuned: Measurement


@dataclass
class TuneRecord:
    """Everything a tune found, as the report shows it."""

    model: str
    objective: Objective
    search: str
    machine: str
    space: SearchSpace
    notes: list[str]
    builds: list[EngineBuild]
    measurements: list[Measurement]  # the search's, in the order measured (the defaults' among them)
    default: Candidate
    tuned: Candidate | None
    stopped: str
    grid_measured: int  # configurations of the grid the search measured
    spent_s: float
    confirm: list[ConfirmRound] = field(default_factory=list)
    confirm_load: str = ""  # what Poisson load the confirm rounds offered both configurations
    output: Path | None = None

    def measurement(self, candidate: Candidate) -> Measurement | None:
        return next((m for m in self.measurements if m.candidate == candidate), None)

    def ratios(self) -> dict | None:
        return confirm_ratios(self.confirm, self.objective)


def confirm_ratios(rounds: Sequence[ConfirmRound], objective: Objective) -> dict | None:
    """Medians over the confirm rounds, tuned / defaults: the objective (the Poisson rate sustained within
    the target), and the p99 at the same Poisson rate (the defaults' sustained rate, or the latency
    objective's). None without a round that gave either."""
    throughput, p99 = [], []
    for pair in rounds:
        d, t = pair.defaults, pair.tuned
        if d.sustained_rps > 0 and t.sustained_rps > 0:
            throughput.append(t.sustained_rps / d.sustained_rps)
        same_load = t.reference if objective.kind == "throughput" else t.sustained
        if d.sustained is not None and same_load is not None and d.sustained.p99_ms > 0:
            p99.append(same_load.p99_ms / d.sustained.p99_ms)
    if not throughput and not p99:
        return None
    return {
        "throughput": statistics.median(throughput) if throughput else math.nan,
        "p99": statistics.median(p99) if p99 else math.nan,
        "throughput_rounds": throughput,
        "p99_rounds": p99,
    }


def ratio(value: float) -> str:
    """``1.234`` -> ``1.23x``; NaN (no round gave that ratio) -> ``n/a``."""
    return "n/a" if math.isnan(value) else f"{value:.2f}x"


def ratios_text(ratios: dict) -> str:
    return f"throughput {ratio(ratios['throughput'])}, p99 {ratio(ratios['p99'])} at the same load"


def _ms(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.0f}"


def _rate(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.3g}"


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def settings_rows(candidate: Candidate, default: Candidate, layouts: tuple[str, str] = ("", "")) -> list[list[str]]:
    """``layouts``: each one's workers x engine threads as served, which says what workers 0 (the
    server's choice) came to."""

    def cell(c: Candidate, name: str, layout: str) -> str:
        value = getattr(c, name)
        if name == "workers_per_device" and value == 0 and layout:
            return f"`0` (the server's choice: {layout} workers x threads)"
        return f"`{value}`"

    return [[name, cell(candidate, name, layouts[0]), cell(default, name, layouts[1])] for name in DIMENSIONS]


def _layout(record: TuneRecord, candidate: Candidate) -> str:
    measured = record.measurement(candidate)
    return measured.layout if measured is not None else ""


def markdown(record: TuneRecord, plot_name: str | None, csv_name: str) -> str:
    o = record.objective
    lines = [f"# vision-tune: {record.model}, {o.kind} at p99 <= {o.p99_ms:g} ms", ""]
    lines.append(
        f"Machine: {record.machine}. Search: {record.search}, {record.grid_measured} of {record.space.size} "
        f"configurations of the grid measured ({record.grid_measured / record.space.size:.0%}); "
        f"stopped: {record.stopped}; {record.spent_s / 60:.1f} min in all."
    )
    lines.append("")
    tuned = record.measurement(record.tuned) if record.tuned else None
    if record.tuned is None or tuned is None:
        lines += ["**No configuration met the target.** The closest ones are at the top of the table below.", ""]
    else:
        where = f" ([{record.output.name}]({record.output.name}))" if record.output else ""
        run, chosen = tuned.sustained, tuned.chosen
        lines.append(
            f"**Tuned{where}:** Poisson arrivals at {_rate(run.rate)}/s answered with p50 {_ms(run.p50_ms)} ms and "
            f"p99 {_ms(run.p99_ms)} ms; closed loop {chosen.throughput_rps:.1f} img/s at c={chosen.concurrency} "
            f"(p99 {_ms(chosen.p99_ms)} ms)."
        )
        lines += [
            "",
            *_table(
                ["setting", "tuned", "defaults"],
                settings_rows(record.tuned, record.default, (tuned.layout, _layout(record, record.default))),
            ),
            "",
        ]
    lines += confirm_section(record)
    if plot_name:
        lines += [f"![throughput vs p99]({plot_name})", ""]
    lines += ["## Engines", ""]
    lines += _table(
        ["engine", "status", "compile s", "accuracy gate, or why it was dropped"],
        [[b.engine, b.status, f"{b.seconds:.0f}", b.message.replace("\n", "<br>")] for b in record.builds],
    )
    if record.notes:
        lines += ["", *[f"- {note}" for note in record.notes]]
    lines += ["", "## Every configuration measured", ""]
    lines += configurations_table(record)
    lines += ["", f"Every load run: [{csv_name}]({csv_name}).", ""]
    return "\n".join(lines)


def confirm_section(record: TuneRecord) -> list[str]:
    if not record.confirm:
        return []
    ratios = record.ratios()
    lines = ["## Tuned vs defaults, alternating rounds", ""]
    rows = []
    for number, pair in enumerate(record.confirm, 1):
        for label, m in (("defaults", pair.defaults), ("tuned", pair.tuned)):
            run, chosen = m.sustained, m.chosen
            same = m.reference if label == "tuned" and m.reference else run
            rows.append(
                [
                    number, label, _rate(run.rate if run else None), _ms(run.p99_ms if run else None),
                    f"{m.capacity_rps:.1f}", chosen.concurrency if chosen else "-",
                    _rate(same.rate if same else None), _ms(same.p99_ms if same else None),
                ]
            )  # fmt: skip
    header = ["round", "config", "Poisson rate sustained", "its p99 ms", "closed-loop img/s at target", "c",
              "same-load rate", "p99 ms at it"]  # fmt: skip
    lines += _table(header, rows)
    if ratios:
        gain = ""
        if record.objective.kind == "throughput":
            gain = (
                f"**Poisson rate sustained at p99 <= {record.objective.p99_ms:g} ms {ratio(ratios['throughput'])}**, "
            )
        lines += [
            "",
            f"Tuned / defaults, medians of {len(record.confirm)} rounds: {gain}**p99 {ratio(ratios['p99'])}** at "
            f"the same load ({record.confirm_load}).",
        ]
    return [*lines, ""]


def configurations_table(record: TuneRecord) -> list[str]:
    o = record.objective
    ordered = sorted(record.measurements, key=lambda m: o.score(m), reverse=True)
    rows = []
    for m in ordered:
        marks = [label for label, c in (("tuned", record.tuned), ("defaults", record.default)) if c == m.candidate]
        memory = m.gpu_mib if o.accelerator == "cuda" else m.pss_mib
        run, chosen = m.sustained, m.chosen
        rows.append(
            [
                f"`{m.candidate.key}`" + (f" **{', '.join(marks)}**" if marks else ""),
                "yes" if o.score(m)[0] == FEASIBLE else f"no: {o.why_not(m)}",
                _rate(run.rate if run else None), _ms(run.p50_ms if run else None), _ms(run.p99_ms if run else None),
                f"{m.capacity_rps:.1f}", chosen.concurrency if chosen else "-", _ms(chosen.p99_ms if chosen else None),
                f"{memory:.0f}", f"{m.seconds:.0f}",
            ]
        )  # fmt: skip
    memory_label = "GPU MiB" if o.accelerator == "cuda" else "PSS MiB"
    header = ["configuration", "meets target", "Poisson rate sustained", "p50 ms", "p99 ms",
              "closed-loop img/s", "c", "p99 ms", memory_label, "s"]  # fmt: skip
    return _table(header, rows)


def plot_point(m: Measurement) -> tuple[float, float] | None:
    """(p99 ms, images/s) of a configuration: the Poisson run it is judged by; for one that met no
    target, its closed-loop step nearest the target."""
    if m.sustained is not None:
        return m.sustained.p99_ms, m.sustained.throughput_rps
    step = m.chosen or next((s for s in m.steps if s.ok), None)
    return (step.p99_ms, step.throughput_rps) if step else None


def write_plot(record: TuneRecord, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    o = record.objective
    fig, ax = plt.subplots(figsize=(8, 5.5))
    met = [plot_point(m) for m in record.measurements if o.score(m)[0] == FEASIBLE]
    missed = [plot_point(m) for m in record.measurements if o.score(m)[0] != FEASIBLE]
    for points, style, label in (
        (met, {"color": "tab:blue", "marker": "o"}, "meets the target"),
        (missed, {"color": "0.6", "marker": "x"}, "misses it (closed loop)"),
    ):
        points = [p for p in points if p is not None]
        if points:
            ax.scatter([p[0] for p in points], [p[1] for p in points], label=label, alpha=0.8, **style)
    for candidate, style, name in (
        (record.default, {"color": "black", "marker": "D", "s": 90}, "defaults"),
        (record.tuned, {"color": "tab:red", "marker": "*", "s": 260}, "tuned"),
    ):
        measured = record.measurement(candidate) if candidate else None
        point = plot_point(measured) if measured else None
        if point:
            ax.scatter([point[0]], [point[1]], label=f"{name}: {candidate.key}", zorder=5, **style)
    ax.axvline(o.p99_ms, color="tab:red", linestyle="--", linewidth=1, label=f"target p99 {o.p99_ms:g} ms")
    ax.set_xlabel("p99 latency, ms (Poisson arrivals at the rate sustained)")
    ax.set_ylabel("throughput, images/s")
    ax.set_title(f"{record.model}: one point per configuration ({record.search} search)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def csv_rows(record: TuneRecord) -> list[dict]:
    measurements = [*record.measurements]
    for pair in record.confirm:
        measurements += [pair.defaults, pair.tuned]
    rows = []
    for m in measurements:
        common = {
            "phase": m.phase,
            "round": m.round,
            "configuration": m.candidate.key,
            **{d: getattr(m.candidate, d) for d in DIMENSIONS},
            "rss_mib": m.rss_mib,
            "pss_mib": m.pss_mib,
            "gpu_mib": m.gpu_mib,
            "startup_s": m.startup_s,
            "error": m.error.splitlines()[0] if m.error else "",
        }
        runs: list[Step] = [*m.steps, *m.poisson_runs, *([m.reference] if m.reference else [])]
        if not runs:
            rows.append({**common, "load": "none"})
        for step in runs:
            values = {k: _round(v) for k, v in step.as_dict().items() if k in CSV_COLUMNS}
            judged = step is m.chosen or step is m.sustained
            rows.append(
                {
                    **common,
                    **values,
                    "rate_rps": _round(step.rate),
                    "meets_target": step.meets(record.objective.p99_ms),
                    "chosen": judged,
                }
            )
    return rows


def _round(value: object) -> object:
    return round(value, 3) if isinstance(value, float) else value


def write_csv(record: TuneRecord, path: Path) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(csv_rows(record))
    return path
