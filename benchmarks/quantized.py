"""Quantized engines served on this CPU: int8 (ONNX Runtime QDQ, PT2E + AOTInductor) vs bf16 vs fp32.

    python -m benchmarks.quantized              # both models, 4 engines, max batch 8/16/32, 3 rounds
    python -m benchmarks.quantized --quick      # smoke: Lite0, onnx-fp32 vs onnx-int8, max batch 8, 1 round, 3 s
    python -m benchmarks.quantized --models resnet152 --engines onnx-fp32,onnx-int8 --seconds 20

Each ``--models`` x ``--engines`` pair is compiled once with compile-trt into ``--work`` (a cache hit
the second time), for batches 1,8,<largest max batch>; the int8 engines are calibrated on
``--calibration`` (default: compile-trt's sample calibration set, 120 JPEGs written into the work
folder). EfficientNet-Lite0 has its ImageNet weights; ResNet-152 runs ``--weights random`` (speed
does not depend on the values, and its gate then compares logits: cosine, max relative error). An
engine that fails its gate, or that this machine cannot build, is reported with compile-trt's
message and not served.

Then each artifact is served (``vision-serve --artifact A --max-batch-size B``, with the suite's
long request deadline and deep queue, defaults otherwise: benchmarks/harness/suite.py) and loaded
with a closed loop of ``--concurrency`` connections (default: twice B) posting the benchmark photos,
after a warm-up of one request per connection. Runs alternate: in each round, for each max batch,
every engine in turn, each on a fresh server (the engine order rotates from round to round), so a
shared machine's drift hits all alike. Per engine: the max batch with the highest median throughput
(answered per second), its median p99, and the ratio to onnx-fp32's best (of the medians),
from the same run; beside them compile-trt's gate figures and compile time.

Results: ``quantized.json`` (every run, the medians, the builds' manifests' figures, the CPU's
int8/bf16 units) and ``quantized.md``, rewritten after every round.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness.common import machine_record, results_dir, write_results
from benchmarks.harness.suite import DEFAULT_WORK_DIR, Inputs, ServerConfig, closed, load_runs, markdown_table
from benchmarks.harness.suite import vision_serve as serving
from compile import cpu_flags, cpu_name, write_sample_calibration_set
from service.client.launcher import ServerStartError, parent_death_hook
from service.testing import FAILED, OK, STATUS_BY_EXIT, gate_or_reason
from service.tune.images import read_images, write_benchmark_images
from service.tune.loadgen import LoadSpec

logger = logging.getLogger(__name__)

BASELINE = "onnx-fp32"
ENGINES = ("onnx-fp32", "inductor-bf16", "onnx-int8", "inductor-int8")
# What each model is compiled from, and its seconds of load per run: served on 2 cores at fp32, ResNet-152
# answers ~5-10 img/s, Lite0 40-100+ (more on an idle machine). A server start (~15 s for Lite0, more for
# ResNet-152, which warms up every batch shape) costs more than the load: 72 of them with the defaults.
MODEL_WEIGHTS = {"efficientnet-lite0": "imagenet", "resnet152": "random"}
MODEL_SECONDS = {"efficientnet-lite0": 6.0, "resnet152": 12.0}
MAX_BATCHES = (8, 16, 32)
ROUNDS = 3
QUANTIZED = ("int8", "fp8")
# --quick: a smoke run of the whole path in a couple of minutes.
QUICK = {
    "models": "efficientnet-lite0",
    "engines": "onnx-fp32,onnx-int8",
    "max_batch_sizes": "8",
    "rounds": 1,
    "seconds": 3.0,
}
DEFAULT_SECONDS = 10.0  # a model not in MODEL_SECONDS
CPU_UNITS = ("avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16", "avx_vnni")
GATE_COLUMNS = ("top1_agreement", "top5_agreement", "mean_prob_drop", "cosine")


# ---- pure parts: the CPU's units, medians, the best batch, the tables ----------------------------


def cpu_units(cpuinfo: str) -> dict[str, bool]:
    """Which int8/bf16 units ``/proc/cpuinfo`` lists (the first processor's ``flags`` line)."""
    flags = cpu_flags(cpuinfo) or set()
    return {unit: unit in flags for unit in CPU_UNITS}


def medians(runs: Sequence[dict]) -> dict[str, dict[int, dict]]:
    """Engine -> max batch -> the medians over rounds of throughput, p50 and p99 (runs that failed,
    with ``throughput_rps`` None, are left out; ``rounds`` counts those that ran)."""
    grouped: dict[str, dict[int, list[dict]]] = {}
    for run in runs:
        if run.get("throughput_rps") is None:
            continue
        grouped.setdefault(run["engine"], {}).setdefault(int(run["max_batch_size"]), []).append(run)
    return {
        engine: {
            batch: {
                "throughput_rps": statistics.median(r["throughput_rps"] for r in done),
                "p50_ms": statistics.median(r["p50_ms"] for r in done),
                "p99_ms": statistics.median(r["p99_ms"] for r in done),
                "rounds": len(done),
            }
            for batch, done in sorted(per_batch.items())
        }
        for engine, per_batch in grouped.items()
    }


def best_batch(per_batch: dict[int, dict]) -> int | None:
    """The max batch size with the highest median throughput; on a tie the smaller (lower latency)."""
    if not per_batch:
        return None
    return max(sorted(per_batch), key=lambda batch: per_batch[batch]["throughput_rps"])


def summarize(runs: Sequence[dict], baseline: str = BASELINE) -> dict[str, dict]:
    """Per engine: its best max batch, the medians there, and the ratio of its throughput to the
    baseline's at the baseline's own best batch (None without a baseline)."""
    table = medians(runs)
    best = {engine: best_batch(per_batch) for engine, per_batch in table.items()}
    base = table[baseline][best[baseline]]["throughput_rps"] if baseline in table else None
    summary = {}
    for engine, per_batch in table.items():
        at_best = per_batch[best[engine]]
        summary[engine] = {
            "best_max_batch_size": best[engine],
            **at_best,
            "ratio_to_baseline": at_best["throughput_rps"] / base if base else None,
            "per_max_batch_size": {str(batch): values for batch, values in per_batch.items()},
        }
    return summary


def _number(value: float | None, digits: int) -> str:
    if value is None:
        return ""
    text = f"{value:.{digits}f}"
    return text.lstrip("-") if float(text) == 0 else text  # -0.000: a drop of -1e-7 is none


def one_line(message: str, limit: int = 300) -> str:
    """compile-trt's message for a table cell: of a gate's report only the figures that failed, on
    one line, without ``|``, at most ``limit`` characters."""
    lines = [" ".join(line.split()) for line in message.splitlines() if line.strip()]
    failed = [line for line in lines if line.endswith(" FAIL")]  # compile/gate.py's verdict per figure
    text = ("; ".join(failed) if failed else " ".join(lines)).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def gate_cell(metrics: dict) -> str:
    """``0.990 / 1.000 / 0.004 / 0.9995``: top-1 and top-5 agreement, mean probability drop, cosine."""
    return " / ".join(_number(metrics.get(name), 4 if name == "cosine" else 3) or "-" for name in GATE_COLUMNS)


def model_table(engines: Sequence[str], builds: dict[str, dict], summary: dict[str, dict], baseline: str) -> str:
    """One row per engine asked for: compile time, gate, best max batch, img/s, p99, ratio; an engine
    that was not built says why instead."""
    header = [
        "engine", "compile s", "gate top1 / top5 / prob drop / cosine", "best max batch", "img/s (median)",
        "p99 ms", f"ratio to {baseline}",
    ]  # fmt: skip
    rows = []
    for engine in engines:
        build = builds.get(engine, {})
        if build.get("status") != OK:
            reason = one_line(build.get("message", ""))
            rows.append([engine, "", f"{build.get('status', 'not built')}: {reason}", "", "", "", ""])
            continue
        row = summary.get(engine)
        ratio = row and row["ratio_to_baseline"]
        rows.append([
            engine,
            _number(build.get("compile_seconds"), 0),
            gate_cell(build.get("metrics", {})),
            row["best_max_batch_size"] if row else "",
            _number(row and row["throughput_rps"], 1),
            _number(row and row["p99_ms"], 0),
            f"{ratio:.2f}x" if ratio else "",
        ])  # fmt: skip
    return markdown_table(header, rows)


def batch_table(summary: dict[str, dict]) -> str:
    """Median img/s and p99 of every engine at every max batch."""
    batches = sorted({int(b) for row in summary.values() for b in row["per_max_batch_size"]})
    header = ["engine", *(f"max batch {b}: img/s, p99 ms" for b in batches)]
    rows = []
    for engine, row in summary.items():
        cells = []
        for batch in batches:
            values = row["per_max_batch_size"].get(str(batch))
            cells.append(f"{values['throughput_rps']:.1f}, {values['p99_ms']:.0f}" if values else "")
        rows.append([engine, *cells])
    return markdown_table(header, rows)


def render(record: dict) -> str:
    units = record["machine"]["cpu_units"]
    present = ", ".join(unit for unit, has in units.items() if has) or "none"
    absent = ", ".join(unit for unit, has in units.items() if not has) or "none"
    settings = record["settings"]
    lines = [
        "# Quantized engines served on this CPU",
        "",
        f"{record['machine']['cpu_name']}, {record['machine']['cpus']} cores; int8/bf16 units present: {present}; "
        f"absent: {absent}. torch {record['machine']['torch']}.",
        "",
        f"Closed loop, concurrency {settings['concurrency'] or '2 x max batch'}, the benchmark photos, "
        f"{settings['rounds']} round(s) alternating engines; per run {settings['load']}. img/s and p99: medians over "
        f"rounds at the engine's best max batch (the one with the highest median img/s); ratio: to "
        f"{record['baseline']}'s best, same run. Gate: compile-trt's accuracy gate against fp32 (cosine: of the "
        "logits; what a random-weights model is gated on).",
    ]
    for model, result in record["models"].items():
        lines += [
            "",
            f"## {model} ({result['weights']} weights)",
            "",
            model_table(result["engines"], result["builds"], result["summary"], record["baseline"]),
        ]
        if result["summary"]:
            lines += ["", "Every max batch (median img/s, p99 ms):", "", batch_table(result["summary"])]
        failed = [r for r in result["runs"] if r.get("throughput_rps") is None]
        if failed:
            lines += ["", f"{len(failed)} run(s) failed to serve: " + "; ".join(
                f"{r['engine']} max batch {r['max_batch_size']} round {r['round']}: {r['error'].splitlines()[0]}"
                for r in failed
            )]  # fmt: skip
        errors = sum(r.get("errors", 0) for r in result["runs"] if r.get("throughput_rps") is not None)
        if errors:
            lines += ["", f"{errors} request(s) answered other than 200 (counted out of img/s)."]
    return "\n".join(lines)


# ---- what runs: compile, serve, load --------------------------------------------------------------


def split_engine(engine: str) -> tuple[str, str]:
    backend, _, precision = engine.rpartition("-")
    return backend, precision


def compile_engine(
    model: str, weights: str, engine: str, batch: tuple[int, int, int], calibration: Path, work: Path
) -> dict:
    """compile-trt for ``engine``; what it made (artifact, the manifest's compile time and gate
    figures) or why it made nothing (its status and message), never an exception."""
    backend, precision = split_engine(engine)
    output = work / "artifacts" / f"{model}-{engine}-b{'-'.join(map(str, batch))}"
    command = [
        sys.executable, "-m", "compile.cli", "--model", model, "--weights", weights, "--backend", backend,
        "--precision", precision, "--device", "cpu", "--batch", ",".join(map(str, batch)),
        "--output", str(output), "--log-level", "warning",
    ]  # fmt: skip
    if precision in QUANTIZED:
        command += ["--calibration", str(calibration)]
    log_path = work / "logs" / f"compile-{model}-{engine}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    logger.info("compile-trt %s %s (into %s)", model, engine, output)
    started = time.perf_counter()
    with log_path.open("w") as log:
        completed = subprocess.run(
            command, stdout=log, stderr=subprocess.PIPE, text=True, preexec_fn=parent_death_hook(True)
        )
        log.write(completed.stderr)
    record = {
        "engine": engine,
        "command": ["compile-trt", *command[3:]],
        "wall_seconds": round(time.perf_counter() - started, 1),
        "status": STATUS_BY_EXIT.get(completed.returncode, FAILED),
        "log": str(log_path),
    }
    if record["status"] != OK:
        message = gate_or_reason(completed.stderr)
        if record["status"] == FAILED:
            message = f"compile-trt exited with {completed.returncode}:\n{message}"
        logger.warning("%s %s not built (%s):\n%s", model, engine, record["status"], message)
        return {**record, "message": message}
    manifest = json.loads((output / "manifest.json").read_text())
    validation = manifest.get("validation", {})
    return {
        **record,
        "artifact": str(output),
        "cached": "cache hit" in log_path.read_text(errors="replace"),  # compile-trt's own words
        "compile_seconds": manifest.get("compile_seconds"),
        "metrics": validation.get("metrics", {}),
        "validation_seconds": validation.get("seconds"),
        "quantization": manifest.get("quantization", {}),
        "device_isa": manifest.get("device_isa"),
    }


def serve_and_load(
    inputs: Inputs, images: list[bytes], engine: str, max_batch: int, spec: LoadSpec, label: str
) -> dict:
    """One run: a fresh server of ``engine`` at ``max_batch``, the load, the server stopped."""
    backend, precision = split_engine(engine)
    config = ServerConfig(label, precision=precision, compiled=True, backend=backend, max_batch_size=max_batch)
    started = time.perf_counter()
    try:
        with serving(config, inputs) as url:
            ready_s = time.perf_counter() - started
            (result,) = load_runs(url, images, [spec], label)
    except ServerStartError as exc:
        logger.error("%s: the server did not start:\n%s", label, exc)
        return {"throughput_rps": None, "error": str(exc)}
    summary = result.summary()
    latency = summary["latency_ms"]
    return {
        "throughput_rps": summary["throughput_rps"] if summary["ok"] else None,
        "p50_ms": latency["p50"],
        "p99_ms": latency["p99"],
        "errors": summary["errors"],
        "start_seconds": round(ready_s, 1),
        **({} if summary["ok"] else {"error": f"no request answered 200: {summary['statuses']}"}),
        "summary": summary,
        "latencies_ms": [round(s.latency_ms, 2) for s in result.ok],
    }


def measure_model(
    model: str, engines: Sequence[str], batches: Sequence[int], args: argparse.Namespace, record: dict, out: Path
) -> None:
    weights = MODEL_WEIGHTS.get(model, "imagenet")
    batch = (1, min(8, max(batches)), max(batches))
    builds = {e: compile_engine(model, weights, e, batch, args.calibration, args.work) for e in engines}
    result = record["models"][model] = {
        "weights": weights,
        "engines": list(engines),
        "compile_batch": list(batch),
        "builds": builds,
        "runs": [],
        "summary": {},
    }
    built = [e for e in engines if builds[e]["status"] == OK]
    inputs = Inputs(model, args.work, args.work / "images", Path(), weights=weights, log_dir=args.work / "logs")
    inputs.artifacts = {e: Path(builds[e]["artifact"]) for e in built}
    images = read_images(inputs.images_dir)
    seconds = args.seconds or MODEL_SECONDS.get(model, DEFAULT_SECONDS)
    logger.info(
        "%s: %d runs (%d engines x %d max batches x %d rounds), %s of load each, plus a server start each",
        model, len(built) * len(batches) * args.rounds, len(built), len(batches), args.rounds,
        f"{args.requests} requests" if args.requests else f"{seconds:g} s",
    )  # fmt: skip
    for round_index in range(args.rounds):
        order = built[round_index % len(built) :] + built[: round_index % len(built)] if built else []
        for max_batch in batches:
            concurrency = args.concurrency or 2 * max_batch
            # The server warms every batch shape up itself; the client's warm-up opens the connections
            # and fills the queue once.
            spec = closed(args.requests or 1_000_000, concurrency, warmup=concurrency)
            if not args.requests or args.seconds:
                spec = dataclasses.replace(spec, max_seconds=seconds)
            for engine in order:
                label = f"{model} {engine} max-batch {max_batch} round {round_index + 1}"
                run = serve_and_load(inputs, images, engine, max_batch, spec, label)
                run = {"engine": engine, "max_batch_size": max_batch, "round": round_index + 1,
                       "concurrency": concurrency, **run}  # fmt: skip
                result["runs"].append(run)
        result["summary"] = summarize(result["runs"])
        write_results(out, "quantized", record, render(record), ".md")


def parse_list(text: str, cast=str) -> list:
    return [cast(item.strip()) for item in text.split(",") if item.strip()]


def load_text(requests: int, seconds: float | None, models: Sequence[str]) -> str:
    """What one run's load is, in words: ``500 requests``, ``8 s``, ``efficientnet-lite0 6 s, resnet152 12 s``."""
    if requests:
        return f"{requests} requests" + (f" or {seconds:g} s" if seconds else "")
    if seconds:
        return f"{seconds:g} s"
    return ", ".join(f"{model} {MODEL_SECONDS.get(model, DEFAULT_SECONDS):g} s" for model in models)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quantized", description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--models", help=f"comma-separated (default: {','.join(MODEL_WEIGHTS)})")
    add("--engines", help=f"backend-precision, comma-separated (default: {','.join(ENGINES)})")
    add("--max-batch-sizes", help=f"the server's --max-batch-size, each (default: {','.join(map(str, MAX_BATCHES))})")
    add("--concurrency", type=int, default=0, help="closed-loop connections (default: 2 x max batch)")
    add("--seconds", type=float, help=f"seconds of load per run (default: {load_text(0, None, MODEL_SECONDS)})")
    add("--requests", type=int, default=0, help="requests per run (then --seconds only if given)")
    add("--rounds", type=int, help=f"rounds of every engine and max batch, alternating (default: {ROUNDS})")
    add("--calibration", type=Path, help="int8 calibration images (default: the sample set, written into --work)")
    add("--work", type=Path, default=DEFAULT_WORK_DIR / "quantized", help="artifacts, photos, logs (kept)")
    add("--out", type=Path, help="results folder (default: benchmarks/results/<machine>-<date>)")
    add("--quick", action="store_true", help="smoke run, unless flags say otherwise: " + json.dumps(QUICK))
    args = parser.parse_args(argv)
    defaults = {
        "models": ",".join(MODEL_WEIGHTS),
        "engines": ",".join(ENGINES),
        "max_batch_sizes": ",".join(map(str, MAX_BATCHES)),
        "rounds": ROUNDS,
    }
    for name, value in {**defaults, **(QUICK if args.quick else {})}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    models, engines = parse_list(args.models), parse_list(args.engines)
    batches = parse_list(args.max_batch_sizes, int)
    if not models or not engines or not batches or min(batches) < 1 or args.rounds < 1:
        parser.error("--models, --engines and --max-batch-sizes need one value each at least (batches >= 1), "
                     "--rounds >= 1")  # fmt: skip
    if any(not backend or not precision for backend, precision in map(split_engine, engines)):
        parser.error(f"--engines takes backend-precision names, such as {','.join(ENGINES)}")
    if args.requests < 0 or (args.seconds is not None and args.seconds <= 0) or args.concurrency < 0:
        parser.error("--requests, --seconds and --concurrency must be > 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise

    args.work = args.work.resolve()
    if not (args.work / "images").is_dir():
        write_benchmark_images(args.work / "images")
    if args.calibration is None:
        args.calibration = args.work / "calibration"
        if not any(args.calibration.glob("*.jpg")):
            write_sample_calibration_set(args.calibration)
    cpuinfo = Path("/proc/cpuinfo")
    record = {
        "machine": {
            **machine_record(),
            "cpu_name": cpu_name(),
            "cpu_units": cpu_units(cpuinfo.read_text() if cpuinfo.exists() else ""),
        },
        "baseline": BASELINE,
        "settings": {
            "models": models,
            "engines": engines,
            "max_batch_sizes": batches,
            "rounds": args.rounds,
            "concurrency": args.concurrency,
            "seconds": args.seconds,
            "requests": args.requests,
            "load": load_text(args.requests, args.seconds, models),
            "calibration": str(args.calibration),
            "work": str(args.work),
        },
        "models": {},
    }
    out = results_dir(args.out)
    for model in models:
        measure_model(model, engines, batches, args, record, out)
    print(render(record))  # written after every round
    return 0


if __name__ == "__main__":
    sys.exit(main())
