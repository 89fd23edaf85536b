"""Many models in one vision-serve: memory per added model, throughput spread over many, fairness, a
model loaded on demand (issue 62's targets), against a real ``vision-serve --model-repository``.

    python -m benchmarks.model_density                                  # memory,spread,fairness,cold
    python -m benchmarks.model_density --parts memory --sizes 1,6       # one part, smaller
    python -m benchmarks.model_density --parts memory,hundred --max-models 100
    python -m benchmarks.model_density --worker-isolation process      # per-process workers ("before")
    python -m benchmarks.model_density --parts memory --resnet50        # also ResNet-50 inductor models

Every model is the same compile-trt artifact, EfficientNet-Lite0 ``--backend onnx --batch 1,8,8``
(ImageNet weights from the pip package: no download), compiled once into ``--cache``; a repository
of N models is N folders ``mNNN/1`` linking to it (``--copy-versions``: copies), each with
``config.toml`` ``max_batch_size = 8``. The server: ``python -m service.cli --model-repository DIR
--worker-isolation ISOLATION`` plus ``--server-args``; every other setting its default.

Parts (``--parts``, comma-separated):

* ``memory``: for each N of ``--sizes`` (and ``--max-models``, when larger), a server of N models,
  each answering one photo (model 1's labels expected of all), then PSS summed over the server's
  whole process tree (main, manager, resource tracker, HTTP processes, workers: each counted in the
  table) at rest. MiB per added model = the least-squares slope of PSS over N. Sizes alternate
  ascending and descending over ``--memory-runs`` (default 1: memory at rest barely varies; each
  reading's three samples are kept); medians per N. A size whose estimate (the fit so far)
  exceeds 85% of the machine's available memory is skipped, not started. Beside it, the engine's
  own footprint in a fresh process (weights = its engine file, workspace = what a batch of 8 adds at
  its peak). ``--resnet50``: the same for ResNet-50 ``--backend inductor --weights random``
  (``--resnet50-sizes``), with the target per added model <= 1.5 x (weights + workspace).
* ``hundred``: ``--max-models`` models in one server, each answering; the count that answered with
  model 1's labels, and the PSS (the ``memory`` run of that size when there is one).
* ``spread``: ``--spread-models`` models resident; a closed loop of ``--concurrency`` connections
  sending the benchmark photos for ``--seconds``, every request to model 1 ("one") or round-robin
  over all of them ("spread"), alternating ``--runs`` times; images/s and the ratio spread/one
  (target >= 0.9). The server's per-model image counts show the spread happened.
* ``fairness``: two models; the light one B gets a Poisson stream at ``--fairness-rate`` (default: a
  tenth of what a closed loop of 10 connections gets from A alone, measured first, over 11), served
  alone, and beside a heavy client (10 connections, closed loop, to A, in a separate process:
  ``service.tune.loadgen``'s CLI); runs alternate; B's p99 beside A over B's p99 alone (target <= 2),
  medians of the runs' p99s, and the p99 and p95 of every run's answers pooled (a run of ~100 light
  requests has about its largest answer for its p99).
* ``cold``: ``--cold-models`` models under ``--model-control none --memory-budget-mib
  --cold-budget-mib``; each model's first request, then ``--cold-next`` more, then a second pass of
  first requests. On-demand loading is detected, not assumed: a first answer slower than
  max(0.5 s, 5 x that model's next answers), a Server-Timing entry beyond the usual stages, or a
  metric about loading/eviction that moved. Without any: "not supported by this build".

Swaps under load are ``benchmarks.model_swap``'s (printed at the end, with the command to rerun it).
The machine is described in the results with its load average before and after each part: on a
shared machine the numbers are noisy. Results: ``model-density.json`` and ``model-density.md`` in
``--out`` (default: benchmarks/results/<machine>-<date>), the servers' logs in ``--out``/logs.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from benchmarks.harness.common import machine_record, results_dir, write_results
from benchmarks.harness.engine_footprint import engine_footprint
from benchmarks.harness.repository_server import (
    REPO,
    REQUEST_TIMEOUT_S,
    ServerDidNotStart,
    compile_cached,
    images_by_model,
    make_repository,
    metrics,
    model_names,
    predict,
    serving,
    warm_each,
)
from benchmarks.harness.spread_load import run_spread
from benchmarks.harness.suite import DEFAULT_WORK_DIR
from benchmarks.harness.tree_memory import available_mib, linear_fit, settled_tree_memory
from compile import sample_photo_file
from service.tune.images import IMAGENET_SIZE, photo_jpegs, write_benchmark_images
from service.tune.loadgen import CLOSED, OPEN, POISSON, TIMING_PARTS, LoadResult, LoadSpec, percentile, run_load

logger = logging.getLogger(__name__)

PARTS = ("memory", "hundred", "spread", "fairness", "cold")
DEFAULT_PARTS = ("memory", "spread", "fairness", "cold")
STEM = "model-density"
MAX_BATCH = 8
LITE_ARGS = ("--model", "efficientnet-lite0", "--backend", "onnx", "--batch", f"1,{MAX_BATCH},{MAX_BATCH}")
RESNET_ARGS = (
    *("--model", "resnet50", "--backend", "inductor", "--weights", "random"),
    *("--batch", f"1,{MAX_BATCH},{MAX_BATCH}"),
)
MEMORY_GUARD = 0.85  # a server may take at most this share of the machine's available memory
HEAVY_CONNECTIONS = 10  # the heavy client's closed loop, 10x the light model's traffic
COLD_MIN_MS = 500.0  # a first answer slower than this and than 5x the next ones was a load
COLD_FACTOR = 5.0
# Metrics whose names say they count loads on demand or evictions (the names are the new build's to
# choose; any of these that moves during the cold part is reported).
COLD_METRIC_WORDS = ("load", "evict", "resident", "demand", "cold")
TARGETS = {
    "lite_mib_per_model": 150.0,
    "resnet_over_engine": 1.5,
    "spread_ratio": 0.9,
    "fairness_ratio": 2.0,
    "hundred": 100,
}
SWAP_COMMAND = (
    "VISION_SERVE_WORKER_ISOLATION={isolation} python -m benchmarks.model_swap --quick "
    "--output-dir {out}/model-swap   # or without --quick: 5 swap cycles and a corrupt version (~6 min)"
)


class Context:
    """What every part needs: the arguments, the artifacts, the photos, where logs go."""

    def __init__(self, args: argparse.Namespace, out: Path, work: Path) -> None:
        self.args, self.out, self.work = args, out, work
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.photo = sample_photo_file("chelsea")
        self.images = photo_jpegs(*IMAGENET_SIZE)
        self.lite = compile_cached(args.cache / "efficientnet-lite0-onnx-b1-8-8", *LITE_ARGS)
        self.server_args = [
            "--worker-isolation",
            args.worker_isolation,
            *shlex.split(args.server_args),
        ]
        self.fits: dict[str, list[tuple[int, float]]] = {}  # artifact -> (models, PSS MiB) measured so far

    def repository(self, label: str, count: int, artifact: Path | None = None) -> Path:
        return make_repository(
            self.work / "repositories" / f"{label}-{count}",
            artifact or self.lite,
            count,
            MAX_BATCH,
            self.args.copy_versions,
        )

    def serve(self, repository: Path, label: str, extra: Sequence[str] = ()):
        return serving(
            repository,
            [*self.server_args, *extra],
            self.logs / f"{label}.log",
            port=self.args.port,
            start_timeout_s=self.args.start_timeout_s,
        )

    def too_big(self, key: str, count: int) -> str | None:
        """Why a server of ``count`` models should not be started now, or None: the fit of what was
        measured so far (one point: its per-model share) against the available memory."""
        points = self.fits.get(key, [])
        if not points:
            return None
        fit = linear_fit(points)
        if fit is None:
            n, pss = points[0]
            estimate = pss * count / n
        else:
            slope, intercept = fit
            estimate = intercept + slope * count
        available = available_mib()
        if estimate > MEMORY_GUARD * available:
            return (
                f"skipped: {count} models would take about {estimate:,.0f} MiB (fit of the sizes measured), more than "
                f"{MEMORY_GUARD:.0%} of the {available:,.0f} MiB available"
            )
        return None


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def git_commit() -> str:
    completed = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True)
    return completed.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def load_summary(result: LoadResult) -> dict:
    summary = result.summary()
    latency = summary["latency_ms"]
    return {
        "throughput_rps": summary["throughput_rps"],
        "requests": summary["requests"],
        "ok": summary["ok"],
        "errors": summary["errors"],
        "statuses": summary["statuses"],
        "p50_ms": latency["p50"],
        "p99_ms": latency["p99"],
        "max_ms": latency["max"],
        "batch_size_mean": summary["batch_size_mean"],
        "elapsed_s": summary["elapsed_s"],
    }


def median_of(records: Sequence[dict], key: str) -> float:
    values = [r[key] for r in records if r.get(key) is not None and not math.isnan(r[key])]
    return statistics.median(values) if values else math.nan


# ---- memory and hundred ------------------------------------------------------------------------------


def warm_repository(ctx: Context, label: str, count: int, artifact: Path | None = None) -> dict:
    """A server of ``count`` models, each answering one photo, and its memory at rest."""
    key = str(artifact or ctx.lite)
    skipped = ctx.too_big(key, count)
    if skipped:
        logger.warning("%s, %d models: %s", label, count, skipped)
        return {"models": count, "skipped": skipped}
    repository = ctx.repository(label, count, artifact)
    names = model_names(count)
    try:
        with ctx.serve(repository, f"{label}-{count}") as (server, start_s):
            warmed = time.monotonic()
            answers = warm_each(server.url, names, ctx.photo)
            warm_s = time.monotonic() - warmed
            memory = settled_tree_memory(server.process.pid)
    except ServerDidNotStart as exc:
        logger.warning("%s, %d models: the server did not start: %s", label, count, exc.reason)
        return {"models": count, "did_not_start": exc.reason}
    reference = answers[0].get("labels")
    answered = sum(1 for a in answers if a["status"] == 200 and a.get("labels") == reference)
    record = {
        "models": count,
        "start_s": start_s,
        "warm_s": warm_s,
        "answered_like_model_1": answered,
        "statuses": sorted({str(a["status"]) for a in answers}),
        "first_labels": reference,
        "warm_latency_ms": {
            "median": statistics.median(a["latency_ms"] for a in answers),
            "max": max(a["latency_ms"] for a in answers),
        },
        "failures": [a for a in answers if a["status"] != 200 or a.get("labels") != reference][:5],
        "retries_503": sum(a["retries_503"] for a in answers),
        **{k: memory[k] for k in ("pss_mib", "rss_mib", "uss_mib", "processes", "by_role", "pss_mib_readings", "each")},
    }
    ctx.fits.setdefault(key, []).append((count, memory["pss_mib"]))
    logger.info(
        "%s, %d models: PSS %.0f MiB over %d processes (%s), %d/%d answered like model 1, start %.0f s",
        label, count, memory["pss_mib"], memory["processes"],
        ", ".join(f"{r['count']} {role}" for role, r in memory["by_role"].items()), answered, count, start_s,
    )  # fmt: skip
    return record


def memory_series(ctx: Context, label: str, sizes: Sequence[int], artifact: Path | None = None) -> dict:
    runs = []
    for run in range(ctx.args.memory_runs):
        order = sizes if run % 2 == 0 else list(reversed(sizes))
        runs.extend({"run": run + 1, **warm_repository(ctx, label, n, artifact)} for n in order)
    by_size = {}
    for n in sizes:
        measured = [r for r in runs if r["models"] == n and "pss_mib" in r]
        if measured:
            by_size[n] = {
                "pss_mib": statistics.median(r["pss_mib"] for r in measured),
                "rss_mib": statistics.median(r["rss_mib"] for r in measured),
                "processes": statistics.median(r["processes"] for r in measured),
                "answered_like_model_1": min(r["answered_like_model_1"] for r in measured),
                "start_s": statistics.median(r["start_s"] for r in measured),
                "runs": len(measured),
            }
        else:
            reasons = {r.get("skipped") or r.get("did_not_start") for r in runs if r["models"] == n}
            by_size[n] = {"not_measured": "; ".join(sorted(filter(None, reasons)))}
    points = [(n, v["pss_mib"]) for n, v in by_size.items() if "pss_mib" in v]
    fit = linear_fit(points)
    steps = [
        {"from": a, "to": b, "mib_per_model": (pb - pa) / (b - a)} for (a, pa), (b, pb) in itertools.pairwise(points)
    ]
    return {
        "sizes": list(sizes),
        "by_size": {str(n): v for n, v in by_size.items()},
        "mib_per_added_model": fit[0] if fit else None,
        "intercept_mib": fit[1] if fit else None,
        "steps": steps,
        "runs": runs,
    }


def part_memory(ctx: Context) -> dict:
    sizes = memory_sizes(ctx.args.sizes, ctx.args.max_models)
    record = {"lite0": memory_series(ctx, "lite0", sizes)}
    record["lite0"]["engine"] = engine_footprint(ctx.lite)
    if ctx.args.resnet50:
        logger.info("Compiling ResNet-50 (inductor, random weights): minutes on 2 cores the first time.")
        resnet = compile_cached(ctx.args.cache / "resnet50-inductor-random-b1-8-8", *RESNET_ARGS)
        series = memory_series(ctx, "resnet50", ctx.args.resnet50_sizes, resnet)
        series["engine"] = engine = engine_footprint(resnet)
        slope = series["mib_per_added_model"]
        series["over_weights_and_workspace"] = (
            slope / (engine["weights_mib"] + engine["workspace_mib"]) if slope is not None else None
        )
        record["resnet50"] = series
    return record


def memory_sizes(sizes: Sequence[int], max_models: int) -> list[int]:
    """``sizes`` up to ``max_models``, and ``max_models`` itself, ascending."""
    return sorted({n for n in sizes if n <= max_models} | {max_models})


def part_hundred(ctx: Context, memory: dict | None) -> dict:
    count = ctx.args.max_models
    runs = (memory or {}).get("lite0", {}).get("runs", [])
    done = [r for r in runs if r["models"] == count and "pss_mib" in r]
    record = done[0] if done else warm_repository(ctx, "lite0", count)
    return {"models": count, "from_memory_part": bool(done), **record}


# ---- spread -------------------------------------------------------------------------------------------


def part_spread(ctx: Context) -> dict:
    count = ctx.args.spread_models
    skipped = ctx.too_big(str(ctx.lite), count)
    if skipped:
        return {"models": count, "skipped": skipped}
    names = model_names(count)
    arms = {"one": names[:1], "spread": names}
    runs = []
    try:
        with ctx.serve(ctx.repository("lite0", count), f"spread-{count}") as (server, start_s):
            warm = warm_each(server.url, names, ctx.photo)
            spec = LoadSpec(
                requests=10**7,
                mode=CLOSED,
                concurrency=ctx.args.concurrency,
                max_seconds=ctx.args.seconds,
                warmup_requests=max(2 * count, 2 * ctx.args.concurrency),
            )
            for run in range(ctx.args.runs):
                order = ("one", "spread") if run % 2 == 0 else ("spread", "one")
                for arm in order:
                    before = images_by_model(server.url)
                    result = run_spread([f"{server.url}/predict?model={n}" for n in arms[arm]], ctx.images, spec)
                    after = images_by_model(server.url)
                    served = {n: after.get(n, 0) - before.get(n, 0) for n in names}
                    record = {"run": run + 1, "arm": arm, **load_summary(result)}
                    record["models_answering"] = sum(1 for v in served.values() if v > 0)
                    record["images_per_model_min_max"] = [min(served.values()), max(served.values())]
                    runs.append(record)
                    logger.info(
                        "spread run %d, %s: %.1f img/s, p99 %.0f ms, %d errors, %d models answered",
                        run + 1, arm, record["throughput_rps"], record["p99_ms"], record["errors"],
                        record["models_answering"],
                    )  # fmt: skip
    except ServerDidNotStart as exc:
        return {"models": count, "did_not_start": exc.reason}
    medians = {
        arm: {
            key: median_of([r for r in runs if r["arm"] == arm], key) for key in ("throughput_rps", "p50_ms", "p99_ms")
        }
        for arm in arms
    }
    return {
        "models": count,
        "start_s": start_s,
        "warm_statuses": sorted({str(a["status"]) for a in warm}),
        "concurrency": ctx.args.concurrency,
        "seconds": ctx.args.seconds,
        "medians": medians,
        "ratio": medians["spread"]["throughput_rps"] / medians["one"]["throughput_rps"],
        "runs": runs,
    }


# ---- fairness -----------------------------------------------------------------------------------------


def heavy_client(url: str, images_dir: Path, seconds: float, output: Path) -> subprocess.Popen:
    """The heavy traffic: loadgen's CLI, a closed loop of ``HEAVY_CONNECTIONS``, in its own process so
    that its client work does not delay the light client's sends and reads."""
    command = [
        *(sys.executable, "-m", "service.tune.loadgen", "--url", url, "--images", str(images_dir)),
        *("--requests", str(10**7), "--concurrency", str(HEAVY_CONNECTIONS), "--max-seconds", str(seconds)),
        *("--warmup-requests", str(HEAVY_CONNECTIONS), "--output", str(output)),
    ]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_for_traffic(url: str, model: str, timeout_s: float = 120.0) -> None:
    """Until the server has answered images of ``model`` on two readings 0.5 s apart (the heavy
    client's processes are up and its loop is running)."""
    deadline = time.monotonic() + timeout_s
    first = images_by_model(url).get(model, 0.0)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = images_by_model(url).get(model, 0.0)
        if now > first + HEAVY_CONNECTIONS:
            return
    raise TimeoutError(f"the heavy client sent nothing to {model} within {timeout_s:.0f} s")


def part_fairness(ctx: Context) -> dict:
    heavy, light = model_names(2)
    images_dir = ctx.work / "images"
    if not images_dir.is_dir():
        write_benchmark_images(images_dir)
    seconds = ctx.args.seconds
    runs = []
    try:
        with ctx.serve(ctx.repository("lite0", 2), "fairness") as (server, start_s):
            warm_each(server.url, [heavy, light], ctx.photo)
            heavy_url = f"{server.url}/predict?model={heavy}"
            calibration = None
            rate = ctx.args.fairness_rate
            if not rate:
                alone = run_load(
                    heavy_url,
                    ctx.images,
                    LoadSpec(10**7, concurrency=HEAVY_CONNECTIONS, max_seconds=5.0, warmup_requests=20),
                )
                calibration = load_summary(alone)
                rate = calibration["throughput_rps"] / (HEAVY_CONNECTIONS + 1)
            for run in range(ctx.args.runs):
                spec = LoadSpec(
                    requests=int(rate * seconds) + 1,
                    mode=OPEN,
                    rate=rate,
                    arrivals=POISSON,
                    max_seconds=seconds,
                    seed=run,  # the same arrivals alone and beside the heavy client: a paired comparison
                )
                order = ("alone", "beside heavy") if run % 2 == 0 else ("beside heavy", "alone")
                for arm in order:
                    runs.append({"run": run + 1, "arm": arm, **light_run(ctx, server.url, arm, spec, images_dir)})
    except ServerDidNotStart as exc:
        return {"did_not_start": exc.reason}
    medians = {
        arm: {
            key: median_of([r for r in runs if r["arm"] == arm], key) for key in ("p50_ms", "p99_ms", "throughput_rps")
        }
        for arm in ("alone", "beside heavy")
    }
    heavy_rate = median_of([r for r in runs if r["arm"] == "beside heavy"], "heavy_rps")
    # A run of ~100 light requests has the largest for its p99: every run's answers pooled, per arm, too.
    pooled = {
        arm: sorted(latency for r in runs if r["arm"] == arm for latency in r["latencies_ms"])
        for arm in ("alone", "beside heavy")
    }
    pooled_p = {
        arm: {"answers": len(values), "p95_ms": percentile(values, 0.95), "p99_ms": percentile(values, 0.99)}
        for arm, values in pooled.items()
    }
    return {
        "start_s": start_s,
        "light_rate_rps": rate,
        "calibration": calibration,
        "seconds": seconds,
        "medians": medians,
        "heavy_rps": heavy_rate,
        "traffic_ratio": heavy_rate / medians["beside heavy"]["throughput_rps"],
        "ratio": medians["beside heavy"]["p99_ms"] / medians["alone"]["p99_ms"],
        "pooled": pooled_p,
        "pooled_p99_ratio": pooled_p["beside heavy"]["p99_ms"] / pooled_p["alone"]["p99_ms"],
        "pooled_p95_ratio": pooled_p["beside heavy"]["p95_ms"] / pooled_p["alone"]["p95_ms"],
        "runs": runs,
    }


def light_run(ctx: Context, url: str, arm: str, spec: LoadSpec, images_dir: Path) -> dict:
    heavy, light = model_names(2)
    light_url = f"{url}/predict?model={light}"
    if arm == "alone":
        result = run_load(light_url, ctx.images, spec)
        record = {**load_summary(result), "latencies_ms": [round(s.latency_ms, 1) for s in result.ok]}
        logger.info("fairness, B alone at %.1f/s: p99 %.0f ms", spec.rate, record["p99_ms"])
        return record
    process = heavy_client(f"{url}/predict?model={heavy}", images_dir, spec.max_seconds + 120, ctx.work / "heavy.json")
    try:
        wait_for_traffic(url, heavy)
        before = images_by_model(url).get(heavy, 0.0)
        result = run_load(light_url, ctx.images, spec)
        heavy_images = images_by_model(url).get(heavy, 0.0) - before
    finally:
        process.terminate()  # its own loop would run on: it was given time to spare
        process.wait(30)
    record = {**load_summary(result), "latencies_ms": [round(s.latency_ms, 1) for s in result.ok]}
    record["heavy_rps"] = heavy_images / result.elapsed_s
    logger.info("fairness, B beside A (%.1f img/s): p99 %.0f ms", record["heavy_rps"], record["p99_ms"])
    return record


# ---- cold ---------------------------------------------------------------------------------------------


def cold_metrics(url: str) -> dict[str, float]:
    """The server's metrics whose names speak of loading or eviction, summed over their labels."""
    values: dict[str, float] = {}
    for name, _, value in metrics(url):
        if any(word in name for word in COLD_METRIC_WORDS):
            values[name] = values.get(name, 0.0) + value
    return values


def part_cold(ctx: Context) -> dict:
    args = ctx.args
    names = model_names(args.cold_models)
    extra = ["--model-control", "none", "--memory-budget-mib", str(args.cold_budget_mib)]
    passes: list[list[dict]] = []
    try:
        with ctx.serve(ctx.repository("lite0", args.cold_models), "cold", extra) as (server, start_s):
            before = cold_metrics(server.url)
            memory_at_start = settled_tree_memory(server.process.pid, samples=1)
            with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
                first_pass = []
                for name in names:
                    first = predict(server.url, name, ctx.photo, client)
                    following = [predict(server.url, name, ctx.photo, client) for _ in range(args.cold_next)]
                    first_pass.append({"model": name, "first": first, "next": following})
                passes.append(first_pass)
                passes.append([{"model": n, "first": predict(server.url, n, ctx.photo, client)} for n in names])
            after = cold_metrics(server.url)
            memory_after = settled_tree_memory(server.process.pid, samples=1)
    except ServerDidNotStart as exc:
        return {"budget_mib": args.cold_budget_mib, "did_not_start": exc.reason, "verdict": "the server did not start"}
    return {
        "models": args.cold_models,
        "budget_mib": args.cold_budget_mib,
        "start_s": start_s,
        "processes_at_start": memory_at_start["by_role"],
        "pss_mib_at_start": memory_at_start["pss_mib"],
        "pss_mib_after": memory_after["pss_mib"],
        **cold_verdict(passes, before, after),
        "passes": passes,
    }


def cold_verdict(passes: list[list[dict]], before: dict[str, float], after: dict[str, float]) -> dict:
    """Was any model loaded on its first request? Per model: first and next latencies; the evidence."""
    models, slow, timing_names = [], [], set()
    for entry in passes[0]:
        first = entry["first"]
        following = [a["latency_ms"] for a in entry["next"] if a["status"] == 200]
        next_ms = statistics.median(following) if following else math.nan
        is_load = first["status"] == 200 and first["latency_ms"] > max(COLD_MIN_MS, COLD_FACTOR * next_ms)
        timing_names |= set(first.get("server_timing_ms", {})) - set(TIMING_PARTS) - {"cache"}
        models.append(
            {"model": entry["model"], "first_status": first["status"], "first_ms": first["latency_ms"],
             "next_ms": next_ms, "first_timing_ms": first.get("server_timing_ms", {}), "loaded_on_demand": is_load}
        )  # fmt: skip
        if is_load:
            slow.append(entry["model"])
    revisit = [{"model": e["model"], "status": e["first"]["status"], "ms": e["first"]["latency_ms"]} for e in passes[1]]
    moved = {
        name: after.get(name, 0.0) - before.get(name, 0.0) for name in after if after.get(name) != before.get(name)
    }
    supported = bool(slow or timing_names or moved)
    if supported:
        verdict = (
            f"on-demand loading seen: {len(slow)} of {len(models)} models' first answers were loads"
            + (f"; Server-Timing entries {sorted(timing_names)}" if timing_names else "")
            + (f"; metrics moved: {sorted(moved)}" if moved else "")
        )
    else:
        verdict = (
            "not supported by this build: every model answered its first request about as fast as the next ones "
            "(all were resident at start), no load timing, no load/eviction metric moved"
        )
    loads = [m["first_ms"] for m in models if m["loaded_on_demand"]]
    resident = [m["next_ms"] for m in models if not math.isnan(m["next_ms"])]
    return {
        "supported": supported,
        "verdict": verdict,
        "models_loaded_on_first_request": slow,
        "first_load_ms_median": statistics.median(loads) if loads else None,
        "next_ms_median": statistics.median(resident) if resident else None,
        "extra_timing_names": sorted(timing_names),
        "metrics_moved": moved,
        "per_model": models,
        "revisit": revisit,
    }


# ---- the report ---------------------------------------------------------------------------------------


def fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def verdict(value: float | None, target: float, higher_is_better: bool) -> str:
    if value is None or math.isnan(value):
        return "not measured"
    ok = value >= target if higher_is_better else value <= target
    return "meets" if ok else "misses"


def render_memory(series: dict, name: str) -> list[str]:
    lines = [
        f"### Memory per added model: {name}",
        "",
        "| models | PSS MiB | RSS MiB | processes | answered like model 1 | start s |",
    ]
    lines.append("|---|---|---|---|---|---|")
    for n, v in series["by_size"].items():
        if "pss_mib" in v:
            lines.append(
                f"| {n} | {v['pss_mib']:,.0f} | {v['rss_mib']:,.0f} | {v['processes']:g} | "
                f"{v['answered_like_model_1']}/{n} | {v['start_s']:.0f} |"
            )
        else:
            lines.append(f"| {n} | {v['not_measured']} | | | | |")
    roles = next((r["by_role"] for r in reversed(series["runs"]) if "by_role" in r), {})
    steps = ", ".join(f"{s['from']}->{s['to']}: {s['mib_per_model']:,.0f}" for s in series["steps"])
    engine = series.get("engine", {})
    lines += [
        "",
        f"**{fmt(series['mib_per_added_model'])} MiB PSS per added model** (least-squares slope over the sizes; "
        f"between sizes: {steps or '-'}).",
        "",
        "Processes of the last server measured, by role (PSS MiB): "
        + ", ".join(f"{r['count']} {role} {r['pss_mib']:,.0f}" for role, r in roles.items())
        + ".",
    ]
    if engine:
        lines.append(
            f"The engine alone, in a fresh process ({engine['engine']}, batch {engine['batch']}): weights "
            f"{engine['weights_mib']:.0f} MiB (its file), {engine['loaded_mib']:.0f} MiB added by loading it, "
            f"workspace {engine['workspace_mib']:.0f} MiB (what a batch adds at its peak)."
        )
    return lines


def render(record: dict) -> str:
    args = record["arguments"]
    results = record["results"]
    lines = [
        f"# Model density ({args['worker_isolation']} worker isolation)",
        "",
        f"`{record['command']}` at {record['commit']}, {record['machine']['cpus']} CPUs. Load average before/after "
        "each part is in the JSON; this machine may be shared with other work, so the numbers are noisy: compare "
        "medians of alternating runs, not single values.",
        "",
        "| target (issue 62) | measured | verdict |",
        "|---|---|---|",
    ]
    memory = results.get("memory", {})
    lite = memory.get("lite0")
    if lite:
        slope = lite["mib_per_added_model"]
        lines.append(
            f"| Lite0 ONNX: <= {TARGETS['lite_mib_per_model']:.0f} MiB PSS per added model | {fmt(slope)} MiB | "
            f"{verdict(slope, TARGETS['lite_mib_per_model'], False)} |"
        )
    resnet = memory.get("resnet50")
    if resnet:
        ratio = resnet.get("over_weights_and_workspace")
        lines.append(
            f"| ResNet-50 inductor: <= {TARGETS['resnet_over_engine']}x weights + workspace per added model | "
            f"{fmt(resnet['mib_per_added_model'])} MiB = {fmt(ratio, '.2f')}x | "
            f"{verdict(ratio, TARGETS['resnet_over_engine'], False)} |"
        )
    hundred = results.get("hundred")
    if hundred:
        answered = hundred.get("answered_like_model_1")
        reason = hundred.get("skipped") or hundred.get("did_not_start")
        measured = (
            f"{answered}/{hundred['models']} answered, PSS {fmt(hundred.get('pss_mib'), ',.0f')} MiB"
            if answered is not None
            else reason
        )
        if answered is None:
            met = "not measured"
        elif hundred["models"] < TARGETS["hundred"]:
            met = f"not measured (only {hundred['models']} models: --max-models {TARGETS['hundred']})"
        else:
            met = "meets" if answered == hundred["models"] else "misses"
        lines.append(f"| {TARGETS['hundred']} Lite0 models in one server, each answering | {measured} | {met} |")
    spread = results.get("spread")
    if spread:
        ratio = spread.get("ratio")
        measured = (
            f"{fmt(spread['medians']['spread']['throughput_rps'], '.1f')} / "
            f"{fmt(spread['medians']['one']['throughput_rps'], '.1f')} img/s = {fmt(ratio, '.2f')}"
            if ratio is not None
            else spread.get("skipped") or spread.get("did_not_start")
        )
        lines.append(
            f"| {spread['models']} models spread / one model, same concurrency >= {TARGETS['spread_ratio']} | "
            f"{measured} | {verdict(ratio, TARGETS['spread_ratio'], True)} |"
        )
    fairness = results.get("fairness")
    if fairness:
        ratio = fairness.get("ratio")
        measured = (
            f"p99 {fmt(fairness['medians']['beside heavy']['p99_ms'])} / "
            f"{fmt(fairness['medians']['alone']['p99_ms'])} ms = {fmt(ratio, '.2f')}"
            if ratio is not None
            else fairness.get("did_not_start")
        )
        lines.append(
            f"| light model's p99 beside a 10x heavier one / alone <= {TARGETS['fairness_ratio']} | {measured} | "
            f"{verdict(ratio, TARGETS['fairness_ratio'], False)} |"
        )
    cold = results.get("cold")
    if cold:
        measured = (
            f"first {fmt(cold.get('first_load_ms_median'))} ms, next {fmt(cold.get('next_ms_median'), '.0f')} ms"
            if cold.get("supported")
            else cold["verdict"]
        )
        seen = "measured" if cold.get("supported") else "not measured"
        lines.append(f"| first answer of a model not resident: measured | {measured} | {seen} |")
    lines.append("| swap under load: 0 failed requests | `benchmarks.model_swap` (below) | rerun it |")
    if lite:
        lines += ["", *render_memory(lite, "EfficientNet-Lite0 ONNX")]
    if resnet:
        lines += ["", *render_memory(resnet, "ResNet-50 inductor (random weights)")]
    if hundred and hundred.get("by_role"):
        lines += [
            "",
            f"### {hundred['models']} models in one server",
            "",
            f"{hundred['answered_like_model_1']}/{hundred['models']} answered the photo with model 1's labels; PSS "
            f"{hundred['pss_mib']:,.0f} MiB over {hundred['processes']} processes; ready after "
            f"{hundred['start_s']:.0f} s.",
        ]
    if spread and "runs" in spread:
        lines += [
            "",
            f"### Throughput: {spread['models']} resident models, {spread['concurrency']} connections, "
            f"{spread['seconds']:g} s per run",
            "",
            "| run | requests to | img/s | p50 ms | p99 ms | errors | mean batch | models answering |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in spread["runs"]:
            lines.append(
                f"| {r['run']} | {'model 1' if r['arm'] == 'one' else 'all, in turn'} | {r['throughput_rps']:.1f} | "
                f"{fmt(r['p50_ms'])} | {fmt(r['p99_ms'])} | {r['errors']} | {fmt(r['batch_size_mean'], '.1f')} | "
                f"{r['models_answering']} |"
            )
    if fairness and "runs" in fairness:
        lines += [
            "",
            f"### Fairness: light model B at {fairness['light_rate_rps']:.1f} req/s (Poisson), heavy A with "
            f"{HEAVY_CONNECTIONS} connections closed loop, {fairness['seconds']:g} s per run",
            "",
            "| run | B served | B p50 ms | B p99 ms | B req/s | A img/s | errors |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in fairness["runs"]:
            lines.append(
                f"| {r['run']} | {r['arm']} | {fmt(r['p50_ms'])} | {fmt(r['p99_ms'])} | {r['throughput_rps']:.1f} | "
                f"{fmt(r.get('heavy_rps'), '.1f')} | {r['errors']} |"
            )
        lines.append("")
        pooled = fairness["pooled"]
        lines.append(
            f"A's traffic / B's beside it: {fmt(fairness['traffic_ratio'], '.1f')}x. Every run's answers pooled "
            f"({pooled['alone']['answers']} alone, {pooled['beside heavy']['answers']} beside A): B's p99 "
            f"{fmt(pooled['beside heavy']['p99_ms'])} / {fmt(pooled['alone']['p99_ms'])} ms = "
            f"{fmt(fairness['pooled_p99_ratio'], '.2f')}, p95 {fmt(pooled['beside heavy']['p95_ms'])} / "
            f"{fmt(pooled['alone']['p95_ms'])} ms = {fmt(fairness['pooled_p95_ratio'], '.2f')} (a run's p99 is about "
            "its largest answer)."
        )
    if cold and "per_model" in cold:
        lines += [
            "",
            f"### First answer of a model not resident ({cold['models']} models, --memory-budget-mib "
            f"{cold['budget_mib']}, --model-control none)",
            "",
            f"{cold['verdict']}. Processes at start: "
            + ", ".join(f"{r['count']} {role}" for role, r in cold["processes_at_start"].items())
            + f"; PSS {cold['pss_mib_at_start']:,.0f} MiB at start, {cold['pss_mib_after']:,.0f} MiB after.",
            "",
            "| model | first ms | next ms (median) | loaded on demand | second pass ms |",
            "|---|---|---|---|---|",
        ]
        for m, again in zip(cold["per_model"], cold["revisit"], strict=True):
            lines.append(
                f"| {m['model']} | {m['first_ms']:.0f} ({m['first_status']}) | {fmt(m['next_ms'])} | "
                f"{'yes' if m['loaded_on_demand'] else 'no'} | {again['ms']:.0f} ({again['status']}) |"
            )
    elif cold:
        lines += [
            "",
            "### First answer of a model not resident",
            "",
            f"The server did not start: {cold['did_not_start']}",
        ]
    lines += [
        "",
        "### Swap under load",
        "",
        "Not repeated here: `benchmarks.model_swap` (benchmarks/harness/swap_load.py) is the swap benchmark. Rerun it "
        "with the same isolation:",
        "",
        "```bash",
        record["swap_command"],
        "```",
    ]
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of model counts, e.g. 1,6,20; got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"model counts must be >= 1, got {text!r}")
    return values


def part_list(text: str) -> list[str]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [part for part in parts if part not in PARTS]
    if unknown or not parts:
        raise argparse.ArgumentTypeError(f"--parts takes some of {','.join(PARTS)}; got {text!r}")
    return [part for part in PARTS if part in parts]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.model_density", description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--parts", type=part_list, default=list(DEFAULT_PARTS), help=f"some of {','.join(PARTS)}")
    add("--worker-isolation", choices=("shared", "process"), default="shared", help="passed to vision-serve")
    add("--server-args", default="", help="more vision-serve flags, one string (e.g. '--workers-per-device 1')")
    add("--runs", type=int, default=2, help="alternating runs per comparison (medians)")
    add("--memory-runs", type=int, default=1, help="memory: runs over the sizes (alternating ascending, descending)")
    add("--sizes", type=int_list, default=[1, 6, 20], help="memory: model counts")
    add("--max-models", type=int, default=20, help="largest repository: memory's sizes up to it, and hundred's")
    add("--resnet50", action="store_true", help="memory: also ResNet-50 inductor models (a compile of minutes)")
    add("--resnet50-sizes", type=int_list, default=[1, 3], help="memory: ResNet-50 model counts")
    add("--copy-versions", action="store_true", help="copy the artifact into each model (default: symbolic links)")
    add("--spread-models", type=int, default=20, help="spread: resident models")
    add("--concurrency", type=int, default=16, help="spread: closed-loop connections")
    add("--seconds", type=float, default=20.0, help="spread and fairness: seconds of load per run")
    add("--fairness-rate", type=float, default=0.0, help="fairness: light model's req/s (0: A's alone rate / 11)")
    add("--cold-models", type=int, default=4, help="cold: models in the repository")
    add("--cold-budget-mib", type=int, default=1024, help="cold: --memory-budget-mib, smaller than they all need")
    add("--cold-next", type=int, default=3, help="cold: requests after each first one")
    add("--port", type=int, help="the server's port (default: a free one)")
    add("--start-timeout-s", type=float, default=900.0, help="longest a server may take to be ready")
    add("--cache", type=Path, default=DEFAULT_WORK_DIR / "density", help="compiled artifacts, kept between runs")
    add("--out", type=Path, help="results folder (default: benchmarks/results/<machine>-<date>)")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("runs", "memory_runs", "max_models", "spread_models", "concurrency", "cold_models", "cold_next"):
        if getattr(args, name) < (0 if name == "cold_next" else 1):
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.seconds <= 0 or args.fairness_rate < 0 or args.cold_budget_mib < 1:
        parser.error("--seconds must be > 0, --fairness-rate >= 0 and --cold-budget-mib >= 1")


def run_part(name: str, ctx: Context, action: Callable[[], dict]) -> dict:
    before, started = load_average(), time.monotonic()
    logger.info("Part %s", name)
    result = action()
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["load_average_before_after"] = [before, load_average()]
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = results_dir(args.out)
    args.cache.mkdir(parents=True, exist_ok=True)
    record = {
        "command": "python -m benchmarks.model_density " + shlex.join(sys.argv[1:] if argv is None else argv),
        "commit": git_commit(),
        "machine": machine_record(),
        "arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "results": {},
        "swap_command": SWAP_COMMAND.format(isolation=args.worker_isolation, out=out),
    }
    with tempfile.TemporaryDirectory(prefix="model-density-") as tmp:
        ctx = Context(args, out, Path(tmp))
        actions = {
            "memory": lambda: part_memory(ctx),
            "hundred": lambda: part_hundred(ctx, record["results"].get("memory")),
            "spread": lambda: part_spread(ctx),
            "fairness": lambda: part_fairness(ctx),
            "cold": lambda: part_cold(ctx),
        }
        for name in args.parts:
            record["results"][name] = run_part(name, ctx, actions[name])
            text = render(record)
            write_results(out, STEM, record, text, ".md")  # after each part: a stopped run keeps what it measured
    print(text)
    print(f"\nSwap under load: {record['swap_command']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
