"""Quick vs full search of vision-tune, from the journals of two real tunes of the same model and grid.

    python -m benchmarks.tune_compare --full lite0-full.journal.jsonl --quick lite0-quick.journal.jsonl \\
        --output benchmarks/results/vm-2cpu-2026-11-25/tune/efficientnet-lite0-compare

Prints and writes (``.md`` and ``.json``):

- measured: the share of the grid each search measured, the best objective each found, and quick's
  best as a share of full's (for the latency objective, full's best p99 over quick's); also full's own
  measurement of the configuration quick chose (the same configuration measured twice differs by the
  machine's noise, so both are shown);
- replayed: every strategy run again over full's table of scores (no server: the scores are looked
  up), so that strategies compare on the same numbers: quick search as shipped (coordinate descent
  from the defaults), coordinate descent from the middle of the grid, and random search with quick's
  budget (median and 10th percentile of 1,000 draws), each counting the defaults as measured;
- tuned vs defaults: the confirm rounds of each tune (alternating runs), medians of the ratios;
- head to head (``--rounds N``): full's answer and quick's, each served from its tuned.toml as
  written, alternating N rounds on this machine, each judged with a finer Poisson rate search than a
  tune's (more runs, 4 % apart). Two tunes' own numbers come from different minutes of a shared
  machine, and full's best is the largest of many noisy measurements (it is biased high): measured
  side by side is how much of the best objective quick's answer really reaches.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from compile import MANIFEST_FILE
from service.settings import read_config_file
from service.testing import (
    FEASIBLE,
    Candidate,
    ConfirmRound,
    LoadPlan,
    Measurement,
    Objective,
    PoissonPlan,
    Score,
    SearchResult,
    SearchSpace,
    confirm_ratios,
    images_digest,
    load_images,
    measure,
    quick_limit,
    quick_search,
    ratio,
)

logger = logging.getLogger(__name__)

RANDOM_DRAWS = 1000
HEAD_TO_HEAD_RUNS = 6
HEAD_TO_HEAD_RESOLUTION = 0.04
# What two tunes must share to be compared: only the search (and where the files went) may differ.
SAME_IN_BOTH = ("model", "weights", "objective", "p99_ms", "rate", "grid", "images", "machine", "max_memory_mib")


def read_journal(path: Path) -> tuple[dict, list[Measurement]]:
    """The tune's identity (settings, grid) and its measurements, from a vision-tune journal."""
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    measurements = []
    for line in lines[1:]:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("kind") == "measurement":
            measurements.append(Measurement.from_dict(entry["measurement"]))
    return header["identity"], measurements


def answer_path(journal: Path) -> Path:
    """The tuned.toml a journal's tune wrote: ``X.journal.jsonl`` -> ``X.toml`` beside it."""
    return journal.with_name(journal.name.removesuffix(".journal.jsonl") + ".toml")


def objective_of(identity: dict) -> Objective:
    accelerator = "cuda" if any(d.startswith("cuda") for d in identity["grid"]["device"]) else "cpu"
    return Objective(identity["objective"], identity["p99_ms"], identity.get("max_memory_mib", 0.0), accelerator)


def search_table(measurements: Sequence[Measurement]) -> dict[Candidate, Measurement]:
    return {m.candidate: m for m in measurements if m.phase == "search"}


def best(table: dict[Candidate, Measurement], objective: Objective, within: set[Candidate] | None = None):
    feasible = [m for c, m in table.items() if objective.feasible(m) and (within is None or c in within)]
    return max(feasible, key=objective.score, default=None)


def replay(
    search: Callable[..., SearchResult], space: SearchSpace, start: Candidate, scores: dict[Candidate, Score]
) -> SearchResult:
    """``search`` as a tune runs it: the defaults (``start``) measured first, and counted."""
    known = {start: scores[start]} if start in scores else None
    return search(space, start, lambda candidate: scores[candidate], known=known)


def from_the_middle(space: SearchSpace, start: Candidate, evaluate, known) -> SearchResult:
    """Coordinate descent as quick search does it, but from the middle of every numeric range."""
    return quick_search(space, start, evaluate, from_center=True, known=known)


def random_search(
    space: SearchSpace, start: Candidate, budget: int, scores: dict[Candidate, Score], draws: int
) -> list[float]:
    """The best objective of the defaults (``start``) and ``budget - 1`` other configurations drawn at
    random, ``draws`` times: the same count as quick search's, the defaults included."""
    given = [start] if start in scores else []
    others = [c for c in space if c != start]
    found = []
    for seed in range(draws):
        chosen = [*given, *random.Random(seed).sample(others, min(budget - len(given), len(others)))]
        feasible = [scores[c][1] for c in chosen if scores[c][0] == FEASIBLE]
        found.append(max(feasible, default=0.0))
    return found


def compare(full_path: Path, quick_path: Path) -> dict:
    full_identity, full_measurements = read_journal(full_path)
    quick_identity, quick_measurements = read_journal(quick_path)
    space = SearchSpace({k: tuple(v) for k, v in full_identity["grid"].items()})
    differing = [key for key in SAME_IN_BOTH if full_identity.get(key) != quick_identity.get(key)]
    if differing:
        raise ValueError(f"the two tunes differ in {', '.join(differing)}: compare tunes of one model, grid and target")
    objective = objective_of(full_identity)
    full_table, quick_table = search_table(full_measurements), search_table(quick_measurements)
    default = next(m.candidate for m in full_measurements if m.phase == "search")  # measured first: the baseline
    full_best = best(full_table, objective, set(space))
    quick_best = best(quick_table, objective, set(space))
    if full_best is None:
        raise ValueError("no configuration of the full search met the target")
    top = objective.score(full_best)[1]  # higher is better, for either objective
    scores = {c: objective.score(m) for c, m in full_table.items() if c in space}
    missing = [c.key for c in space if c not in scores]
    if missing:
        raise ValueError(f"the full search did not measure {len(missing)} configurations (e.g. {missing[0]})")

    def share(result: SearchResult) -> float:
        return scores[result.best][1] / top if result.best else 0.0

    quick_replay = replay(quick_search, space, default, scores)
    middle_replay = replay(from_the_middle, space, default, scores)
    budget = quick_limit(space)
    random_found = sorted(value / top for value in random_search(space, default, budget, scores, RANDOM_DRAWS))
    quick_measured = sum(1 for c in quick_table if c in space)
    record = {
        "model": full_identity["model"],
        "objective": f"{objective.kind} at p99 <= {objective.p99_ms:g} ms",
        "grid_size": space.size,
        "full": {"measured": len(scores), "best": full_best.candidate.key, "best_value": objective.value(full_best)},
        "quick": {
            "measured": quick_measured,
            "share_measured": quick_measured / space.size,
            "best": quick_best.candidate.key if quick_best else None,
            "best_value": objective.value(quick_best) if quick_best else math.nan,
            "share_of_full_best": objective.score(quick_best)[1] / top if quick_best else 0.0,
            "full_value_of_quick_choice": objective.value(full_table[quick_best.candidate]) if quick_best else math.nan,
            "full_share_of_quick_choice": scores[quick_best.candidate][1] / top if quick_best else 0.0,
        },
        "replayed_on_full_table": {
            "quick (shipped: coordinate descent from the defaults)": {
                "measured": len(quick_replay.scores),
                "share_of_best": share(quick_replay),
                "best": quick_replay.best.key if quick_replay.best else None,
            },
            "coordinate descent from the middle of the grid": {
                "measured": len(middle_replay.scores),
                "share_of_best": share(middle_replay),
                "best": middle_replay.best.key if middle_replay.best else None,
            },
            f"random, the defaults and {budget - 1} others": {
                "measured": budget,
                "share_of_best_median": statistics.median(random_found),
                "share_of_best_p10": random_found[len(random_found) // 10],
            },
        },
        "tuned_vs_defaults": {
            "full": tuned_vs_defaults(full_measurements, objective),
            "quick": tuned_vs_defaults(quick_measurements, objective),
        },
    }
    return record


def tuned_vs_defaults(measurements: Sequence[Measurement], objective: Objective) -> dict:
    by_round: dict[int, dict[str, Measurement]] = {}
    for m in measurements:
        if m.phase.startswith("confirm-"):
            by_round.setdefault(m.round, {})[m.phase] = m
    rounds = [
        ConfirmRound(pair["confirm-defaults"], pair["confirm-tuned"])
        for _, pair in sorted(by_round.items())
        if len(pair) == 2
    ]
    ratios = confirm_ratios(rounds, objective) or {}
    values = [
        {
            "defaults_rps": r.defaults.sustained_rps,
            "tuned_rps": r.tuned.sustained_rps,
            "defaults_p99_ms": r.defaults.sustained.p99_ms if r.defaults.sustained else None,
            "tuned_p99_ms_same_load": r.tuned.reference.p99_ms if r.tuned.reference else None,
        }
        for r in rounds
    ]
    return {"rounds": values, **ratios}


def candidate_of(values: dict) -> Candidate:
    """The configuration a tuned.toml serves; its engine read from the artifact's manifest."""
    manifest = json.loads((Path(values["artifact"]) / MANIFEST_FILE).read_text())
    return Candidate(
        engine=f"{manifest['backend']}-{manifest['precision']}",
        **{name: values[name] for name in Candidate.__dataclass_fields__ if name != "engine"},
    )


def tuned_images(directory: Path | None, work: Path, digest: str) -> list[bytes]:
    """The images the tunes sent, found as a tune finds them (``load_images``). The journal keeps only
    their digest, which they must match."""
    images = load_images(directory, work)
    if digest and images_digest(images) != digest:
        raise ValueError(
            f"the images in {directory or work / 'images'} are not the ones the tunes sent (digest "
            f"{images_digest(images)}, the journal's {digest}): give --images, the folder the tunes were given"
        )
    return images


def head_to_head(
    full_toml: Path, quick_toml: Path, identity: dict, rounds: int, work: Path, images_dir: Path | None = None
) -> dict:
    """Full's answer and quick's, served as written, alternating ``rounds`` times (full's first)."""
    full, quick = candidate_of(read_config_file(full_toml)), candidate_of(read_config_file(quick_toml))
    if full == quick:
        return {"same_configuration": True, "share_of_full": 1.0, "rounds": []}
    work.mkdir(parents=True, exist_ok=True)
    images = tuned_images(images_dir, work, identity.get("images", ""))
    plan = LoadPlan(
        identity["p99_ms"], identity["step_seconds"], identity["min_requests"], identity["poisson_seconds"],
        identity["load_factor"], identity["max_concurrency"], identity.get("client_processes") or 1, 1,
    )  # fmt: skip
    poisson = PoissonPlan(max_runs=HEAD_TO_HEAD_RUNS, resolution=HEAD_TO_HEAD_RESOLUTION)
    rows = []
    for number in range(rounds):
        pair = {}
        for label, candidate, toml in (("full", full, full_toml), ("quick", quick, quick_toml)):
            log = work / f"server-{label}-{number}.log"
            m = measure(candidate, toml, images, plan, poisson, log, phase=label, round_number=number)
            pair[label] = m.sustained_rps
            logger.info("round %d, %s's answer %s: %.1f/s sustained", number + 1, label, candidate.key, m.sustained_rps)
        rows.append({**pair, "share": pair["quick"] / pair["full"] if pair["full"] else math.nan})
    return {
        "same_configuration": False,
        "full": full.key,
        "quick": quick.key,
        "rounds": rows,
        "share_of_full": statistics.median(row["share"] for row in rows),
    }


def markdown(record: dict) -> str:
    q, f = record["quick"], record["full"]
    lines = [
        f"# Quick vs full search: {record['model']}, {record['objective']}",
        "",
        f"Grid: {record['grid_size']} configurations.",
        "",
        "| search | configurations measured | best found | objective |",
        "|---|---|---|---|",
        f"| full | {f['measured']} (100 %) | `{f['best']}` | {f['best_value']:.1f} |",
        f"| quick | {q['measured']} ({q['share_measured']:.0%}) | `{q['best']}` | {q['best_value']:.1f} "
        f"(**{q['share_of_full_best']:.1%}** of full's best) |",
        "",
        f"Full's own measurement of the configuration quick chose: {q['full_value_of_quick_choice']:.1f} "
        f"({q['full_share_of_quick_choice']:.1%} of full's best).",
        "",
        "## Strategies replayed on full's table (same scores for all)",
        "",
        "| strategy | configurations | share of full's best |",
        "|---|---|---|",
    ]
    for name, values in record["replayed_on_full_table"].items():
        if "share_of_best" in values:
            lines.append(f"| {name} | {values['measured']} | {values['share_of_best']:.1%} (`{values['best']}`) |")
        else:
            lines.append(
                f"| {name} | {values['measured']} | median {values['share_of_best_median']:.1%}, "
                f"10th percentile {values['share_of_best_p10']:.1%} |"
            )
    duel = record.get("head_to_head")
    if duel:
        lines += ["", "## Head to head: full's answer and quick's, alternating", ""]
        if duel["same_configuration"]:
            lines.append("Both searches answered with the same configuration: quick reached 100 % of full's best.")
        else:
            lines += [
                f"Full: `{duel['full']}`; quick: `{duel['quick']}`. Poisson rate sustained within the target, "
                f"each served from its tuned.toml, {HEAD_TO_HEAD_RUNS} rate runs at most, "
                f"{HEAD_TO_HEAD_RESOLUTION:.0%} apart:",
                "",
                "| round | full's answer | quick's answer | quick / full |",
                "|---|---|---|---|",
                *(
                    f"| {n} | {row['full']:.1f} | {row['quick']:.1f} | {row['share']:.1%} |"
                    for n, row in enumerate(duel["rounds"], 1)
                ),
                "",
                f"Median: quick's answer sustains **{duel['share_of_full']:.1%}** of full's.",
            ]
    lines += ["", "## Tuned vs defaults (alternating confirm rounds of each tune)", ""]
    for search, values in record["tuned_vs_defaults"].items():
        if values.get("rounds"):
            lines.append(
                f"- {search}: throughput at the target {ratio(values.get('throughput', float('nan')))}, p99 at the "
                f"same load {ratio(values.get('p99', float('nan')))} (medians of {len(values['rounds'])} rounds)"
            )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", type=Path, required=True, help="the journal of a --search full tune")
    parser.add_argument("--quick", type=Path, required=True, help="the journal of a --search quick tune")
    parser.add_argument("--output", type=Path, help="write OUTPUT.md and OUTPUT.json")
    parser.add_argument(
        "--rounds", type=int, default=0, help="serve full's answer and quick's alternating this many rounds (0: none)"
    )
    parser.add_argument("--full-toml", type=Path, help="full's answer (default: the journal's tune's --output)")
    parser.add_argument("--quick-toml", type=Path, help="quick's answer (default: the journal's tune's --output)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/vision-tune-compare"), help="server logs, images")
    parser.add_argument("--images", type=Path, help="the tunes' --images, if they were given one")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        record = compare(args.full, args.quick)
        if args.rounds:
            full_identity, _ = read_journal(args.full)
            full_toml = args.full_toml or answer_path(args.full)
            quick_toml = args.quick_toml or answer_path(args.quick)
            record["head_to_head"] = head_to_head(
                full_toml, quick_toml, full_identity, args.rounds, args.work, args.images
            )
    except (OSError, ValueError, KeyError) as exc:
        parser.error(str(exc))
    text = markdown(record)
    print(text)
    if args.output:
        args.output.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
        args.output.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
