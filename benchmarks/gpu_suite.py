"""The GPU benchmark, in steps that can be spread over several short runs, into one folder.

    python -m benchmarks.gpu_suite --output-dir /tmp/gpu-results                   # every step
    python -m benchmarks.gpu_suite --steps client,serve,depth --resume --output-dir /tmp/gpu-results
    python -m benchmarks.gpu_suite --dry-run --output-dir /tmp/dry                # the same, tiny, on a CPU

Steps (each one's wall time and status are recorded; a step that fails is recorded with the reason
and the rest go on; ``--resume`` adds to the record already in the output folder, which is how
benchmarks/gpu_session.py spreads the suite over runs that each fit one 10-minute command):

- ``compile``: ``compile-trt --backend auto`` (TensorRT where torch_tensorrt imports, else
  AOTInductor), ResNet-152 at fp16, batch 1..64, random weights (gated on their logits); a cache hit
  when an earlier run built it;
- ``ceiling``: the model alone, compiled engine against eager fp32, at batch 1 and 64;
- ``client``: the load generator's own ceiling against a no-op server, at the sweep's
  concurrencies: measured before the sweeps it qualifies;
- ``serve``: vision-serve with the compiled engine and ``--preprocess`` (torch: nvJPEG), closed-loop
  sweep at 1, 64 and 256 connections, then Poisson arrivals at 70 % of the best throughput;
- ``depth``: the same server with ``--pipeline-depth 1`` at the sweep's best concurrency (the GPU
  default is 2);
- ``images``: the same server with many images per request (Open Inference Protocol, binary tensor
  extension, 32 images per request);
- ``baseline``: eager fp32 with Pillow preprocessing, the same sweep and Poisson;
- ``preprocess``: ``benchmarks.preprocess_throughput`` on the device.

Writes ``gpu_suite.json``, ``gpu_suite.md`` and plots, and every server's log under ``logs/``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from benchmarks import plots
from benchmarks.ceiling import load_served, measure_ceiling
from benchmarks.common import machine_record, results_dir, write_results
from benchmarks.images_per_request import oip_request
from benchmarks.loadgen import LoadSpec, run_load
from benchmarks.noop_server import noop_server
from benchmarks.suite import (
    DEFAULT_WORK_DIR,
    ServerConfig,
    artifact_key,
    compile_artifact,
    markdown_table,
    prepare_inputs,
    run_record,
    vision_serve,
)
from compile.libstdcxx import restart_with_preload
from compile.manifest import read_manifest

logger = logging.getLogger(__name__)

STEPS = ("compile", "ceiling", "client", "serve", "depth", "images", "baseline", "preprocess")
SERVER_PARTS = ("queue", "preprocess", "pipeline_wait", "inference")
NOOP_SERVER_WORKERS = 4
POISSON_FRACTION = 0.7
DEPTH_ROUNDS = 2  # pipeline depth 2 vs 1: rounds of one run each
PARTIAL_RECORD = "gpu_suite.partial.json"
COMPILED, BASELINE = "compiled", "baseline"


@dataclass(frozen=True)
class Plan:
    """What the steps run; ``GPU_PLAN`` on a GPU, ``DRY_RUN_PLAN`` on a CPU (``--dry-run``)."""

    model: str
    weights: str
    precision: str
    max_batch: int
    concurrencies: tuple[int, ...]
    seconds_per_run: float  # each sweep point and Poisson run: as many requests as fit, bounded by time
    images_per_request: int
    images_concurrencies: tuple[int, ...]
    ceiling_batches: tuple[int, ...]
    ceiling_repeats: int
    preprocess_args: tuple[str, ...]


GPU_PLAN = Plan("resnet152", "random", "fp16", 64, (1, 64, 256), 10.0, 32, (2, 8), (1, 64), 10,
                ("--repeats", "3"))  # fmt: skip
# The same code path in seconds on a CPU: a small real model, fp32 (compile-trt picks ONNX Runtime).
DRY_RUN_PLAN = Plan("efficientnet-lite0", "imagenet", "fp32", 8, (1, 8), 2.0, 4, (1,), (1, 8), 2,
                    ("--repeats", "1", "--sizes", "imagenet", "--batches", "8", "--backends", "pil,torch"))  # fmt: skip


def _step(record: dict, name: str, fn: Callable[[], object], out: Path) -> object:
    """Run one step (it writes what it measured into ``record``), record its time and status, and save
    the record so far (a GPU session is rare: a later crash or a time limit must not lose what was
    measured)."""
    started = time.perf_counter()
    try:
        result = fn()
        record["steps"][name] = {"seconds": time.perf_counter() - started, "status": "ok"}
        return result
    except Exception as exc:  # one failed step must not cost the rest of a rare GPU session
        logger.exception("step %s failed", name)
        record["steps"][name] = {"seconds": time.perf_counter() - started, "status": f"failed: {exc!r}"}
        return None
    finally:
        (out / PARTIAL_RECORD).write_text(json.dumps(record, indent=1, default=str) + "\n")


def closed_spec(concurrency: int, seconds: float) -> LoadSpec:
    return LoadSpec(requests=max(50, 400 * concurrency), concurrency=concurrency, max_seconds=seconds,
                    warmup_requests=concurrency)  # fmt: skip


def sweep(url: str, images: list[bytes], plan: Plan, processes: int, concurrencies: tuple[int, ...]) -> dict[int, dict]:
    runs = {}
    for c in concurrencies:
        runs[c] = run_record(run_load(url, images, closed_spec(c, plan.seconds_per_run), processes=min(processes, c)))
        logger.info("c=%d: %.1f req/s, p50 %.1f ms", c, runs[c]["throughput_rps"], runs[c]["latency_ms"]["p50"])
    return runs


def poisson(url: str, images: list[bytes], plan: Plan, processes: int, peak: float) -> tuple[str, dict]:
    rate = round(POISSON_FRACTION * peak, 1)
    spec = LoadSpec(requests=max(1, int(rate * plan.seconds_per_run)), mode="open", rate=rate,
                    max_seconds=plan.seconds_per_run, warmup_requests=32)  # fmt: skip
    return f"{POISSON_FRACTION:.0%} of peak ({rate:g} req/s)", run_record(run_load(url, images, spec, processes))


def oip_images_body(image: bytes, count: int, model: str) -> tuple[bytes, dict[str, str]]:
    """One Open Inference Protocol request of ``count`` copies of ``image`` (binary tensor extension)."""
    request = oip_request(image, count, model)
    return request.body, request.headers


def best_concurrency(runs: dict[int, dict]) -> int:
    return max(runs, key=lambda c: runs[c]["throughput_rps"])


def _int_keys(runs: dict) -> dict[int, dict]:
    return {int(c): r for c, r in runs.items()}


def load_record(out: Path, resume: bool, fresh: dict) -> dict:
    """``fresh``, or with ``resume`` the partial record an earlier run left in ``out`` (same model)."""
    previous = out / PARTIAL_RECORD
    if not (resume and previous.exists()):
        return fresh
    saved = json.loads(previous.read_text())
    if (saved.get("model"), saved.get("precision")) != (fresh["model"], fresh["precision"]):
        raise ValueError(f"--resume: {previous} is for {saved.get('model')} {saved.get('precision')}.")
    record = {**fresh, **saved, "machine": fresh["machine"]}
    # JSON made the concurrency keys strings; the report sorts and plots them as numbers.
    record["sweeps"] = {label: _int_keys(runs) for label, runs in record.get("sweeps", {}).items()}
    record["client_ceiling"] = _int_keys(record.get("client_ceiling") or {})
    if record.get("depth"):
        record["depth"]["median_rps"] = _int_keys(record["depth"]["median_rps"])
        record["depth"]["rounds"] = [_int_keys(found) for found in record["depth"]["rounds"]]
    return record


def _row(label: str, c: object, r: dict, images_per_request: int = 1) -> list[object]:
    parts = " / ".join(f"{r['server_ms_median'].get(k, float('nan')):.1f}" for k in SERVER_PARTS)
    latency = r["latency_ms"]
    batch = f"{r['batch_size_mean']:.1f}" if r.get("batch_size_mean") else ""
    img_s = r["throughput_rps"] * images_per_request
    return [label, c, f"{img_s:.1f}", f"{latency['p50']:.1f}", f"{latency['p99']:.1f}", batch, parts]


def report(record: dict, out: Path) -> str:
    """Plots and the markdown summary of a suite record."""
    gpu = record["machine"].get("gpu") or record["machine"].get("processor") or "CPU"
    model = record["model"]
    written = []
    sweeps, poisson_runs = record.get("sweeps", {}), record.get("poisson", {})
    if sweeps:
        series = {label: [(c, r["throughput_rps"]) for c, r in runs.items()] for label, runs in sweeps.items()}
        written.append(plots.throughput_vs_concurrency(series, f"{model} on {gpu}", out / "gpu_suite-throughput.png"))
        cdf = {
            f"{label}, {name}": r["latencies_ms"] for label, runs in poisson_runs.items() for name, r in runs.items()
        }
        if cdf:
            written.append(plots.latency_cdf(cdf, "Poisson arrivals", out / "gpu_suite-latency-cdf.png"))
        top = {label: runs[max(runs)]["batch_sizes"] for label, runs in sweeps.items()}
        title = f"batch sizes at the highest concurrency ({max(max(runs) for runs in sweeps.values())})"
        written.append(plots.batch_histogram(top, title, out / "gpu_suite-batch-sizes.png"))
    rows = [[*_row("client ceiling: no-op server", c, r)[:5], "", ""] for c, r in record["client_ceiling"].items()]
    for label, runs in sweeps.items():
        rows += [_row(label, c, r) for c, r in runs.items()]
        rows += [_row(label, name, r) for name, r in poisson_runs.get(label, {}).items()]
    for label, runs in record.get("variants", {}).items():
        count = runs.get("images_per_request", 1)
        rows += [_row(label, c, r, count) for c, r in runs["runs"].items()]
    depth = record.get("depth")
    for number, found in enumerate((depth or {}).get("rounds", []), 1):
        rows += [_row(f"compiled, --pipeline-depth {d} (round {number})", depth["concurrency"], r)
                 for d, r in found.items()]  # fmt: skip
    header = ["server", "load (connections)", "img/s", "p50 ms", "p99 ms", "mean batch",
              " / ".join(SERVER_PARTS) + " ms"]  # fmt: skip
    md = f"# GPU suite: {model} {record['precision']} on {gpu}\n\n"
    if record.get("compile"):
        md += "Compiled: " + ", ".join(f"{k} {v}" for k, v in record["compile"].items()) + "\n\n"
    md += markdown_table(header, rows)
    for label, found in (record.get("ceiling") or {}).items():
        cells = [[size, f"{b['model_ms']:.2f}", f"{b['model_img_per_s']:.0f}", f"{b['preprocess_ms']:.2f}"]
                 for size, b in found["batches"].items()]  # fmt: skip
        md += f"\n\nModel alone, {label} ({found['engine']}):\n\n"
        md += markdown_table(["batch", "model ms", "model img/s", "preprocess ms"], cells)
    if depth and depth.get("ratio_2_to_1"):
        medians = depth["median_rps"]
        md += (f"\n\nPipeline depth 2 vs 1 at {depth['concurrency']} connections, median of "
               f"{len(depth['rounds'])} alternating rounds: {medians[2]:.1f} vs {medians[1]:.1f} req/s "
               f"({depth['ratio_2_to_1']:.2f}x).")  # fmt: skip
    steps = [[name, f"{step['seconds']:.0f}", step["status"]] for name, step in record["steps"].items()]
    md += "\n\n" + markdown_table(["step", "seconds", "status"], steps)
    return md + "\n\n" + "\n".join(f"![{p.name}]({p.name})" for p in written) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--preprocess", default="torch", help="the compiled server's --preprocess")
    # 4 processes were not enough for a no-op server on a 16-core H100 machine (2026-11-22): use
    # more where there are cores for them.
    parser.add_argument("--client-processes", type=int, default=max(4, (os.cpu_count() or 1) // 2))
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK_DIR / "gpu")
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated of {', '.join(STEPS)}")
    parser.add_argument("--resume", action="store_true", help="add to the partial record in the output folder")
    parser.add_argument("--dry-run", action="store_true", help="every step, tiny, on this CPU: checks the plumbing")
    parser.add_argument("--report-only", action="store_true", help="write the report of the record in --output-dir")
    args = parser.parse_args(argv)
    steps = set() if args.report_only else set(args.steps.split(","))
    args.resume = args.resume or args.report_only
    if not steps <= set(STEPS):
        parser.error(f"--steps: unknown {sorted(steps - set(STEPS))}; choose from {', '.join(STEPS)}.")
    plan = DRY_RUN_PLAN if args.dry_run else GPU_PLAN
    if args.dry_run:
        args.device, args.client_processes = "cpu", min(args.client_processes, 2)
        args.work = args.work.with_name(args.work.name + "-dry-run")
    restart_with_preload(args.device)  # the ceiling step loads the AOTInductor package here
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: this suite is for GPU machines (--dry-run runs its plumbing on a CPU).")
    out = results_dir(args.output_dir, device)
    fresh = {"machine": machine_record(device), "steps": {}, "model": plan.model, "precision": plan.precision,
             "dry_run": args.dry_run, "sweeps": {}, "poisson": {}, "variants": {}, "client_ceiling": {}}  # fmt: skip
    try:
        record = load_record(out, args.resume, fresh)
    except ValueError as exc:
        parser.error(str(exc))
    if args.report_only:
        finish(record, out)
        return
    inputs = prepare_inputs(plan.model, args.work, plan.weights)
    inputs.log_dir = out / "logs"
    images = inputs.images
    processes = args.client_processes

    def compile_step() -> Path:
        batch = (1, plan.max_batch // 2, plan.max_batch)
        artifact = compile_artifact(inputs, plan.precision, args.device, "auto", batch)
        manifest = read_manifest(artifact)
        record["compile"] = {"backend": manifest.backend, "engine": manifest.engine_name, "artifact": str(artifact),
                             "compile_seconds": round(manifest.compile_seconds, 1)}  # fmt: skip
        return artifact

    # The steps that serve the engine take the artifact this session's compile step built (recorded),
    # or compile it (a cache hit when it exists: compile-trt checks its key, which costs seconds).
    artifact = None
    built = Path((record.get("compile") or {}).get("artifact") or "/nonexistent")
    if "compile" not in steps and (built / "manifest.json").exists():
        artifact = built
    elif steps & {"compile", "ceiling", "serve", "depth", "images"}:
        artifact = _step(record, "compile", compile_step, out)
    if artifact is not None:
        inputs.artifacts[artifact_key("auto", plan.precision)] = artifact

    def ceiling_step() -> None:
        found = {}
        for label, source in (("eager fp32", None), ("compiled", artifact)):
            if label == "compiled" and source is None:
                continue
            served = load_served(plan.model, str(inputs.weights_file), source and str(source), device)
            found[label] = measure_ceiling(served, images, plan.ceiling_batches, device, plan.ceiling_repeats)
            del served
            if device.type == "cuda":
                torch.cuda.empty_cache()
        record["ceiling"] = found

    if "ceiling" in steps:
        _step(record, "ceiling", ceiling_step, out)

    def client_step() -> None:
        with noop_server(NOOP_SERVER_WORKERS) as url:
            record["client_ceiling"] = sweep(url, images, plan, processes, plan.concurrencies)

    if "client" in steps:
        _step(record, "client", client_step, out)

    compiled = ServerConfig(COMPILED, args.device, plan.precision, compiled=True, backend="auto",
                            max_batch_size=plan.max_batch, preprocess=args.preprocess)  # fmt: skip
    baseline = ServerConfig(BASELINE, args.device, preprocess="pil", max_batch_size=plan.max_batch)
    labels = {COMPILED: f"vision-serve: compiled + --preprocess {args.preprocess}",
              BASELINE: "baseline: eager fp32 + Pillow"}  # fmt: skip

    def serve_step(config: ServerConfig) -> None:
        label = labels[config.label]
        with vision_serve(config, inputs) as url:
            runs = sweep(url, images, plan, processes, plan.concurrencies)
            record["sweeps"][label] = runs
            name, run = poisson(url, images, plan, processes, max(r["throughput_rps"] for r in runs.values()))
            record["poisson"][label] = {name: run}

    if "serve" in steps and artifact is not None:
        _step(record, "serve", functools.partial(serve_step, compiled), out)

    def depth_step() -> None:
        runs = record["sweeps"].get(labels[COMPILED])
        if not runs:
            raise RuntimeError("needs the serve step's sweep (its best concurrency)")
        best = best_concurrency(runs)
        rounds: list[dict[int, dict]] = []
        for _ in range(DEPTH_ROUNDS):  # alternating, a fresh server each time: drift hits both alike
            found = {}
            for depth in (2, 1):
                config = replace(compiled, label=f"compiled-depth{depth}", extra_args=("--pipeline-depth", str(depth)))
                with vision_serve(config, inputs) as url:
                    found[depth] = sweep(url, images, plan, processes, (best,))[best]
            rounds.append(found)
        medians = {d: statistics.median(r[d]["throughput_rps"] for r in rounds) for d in (2, 1)}
        record["depth"] = {"concurrency": best, "rounds": rounds, "median_rps": medians,
                           "ratio_2_to_1": medians[2] / medians[1] if medians[1] else None}  # fmt: skip

    if "depth" in steps and artifact is not None:
        _step(record, "depth", depth_step, out)

    def images_step() -> None:
        encode = functools.partial(oip_images_body, count=plan.images_per_request, model=plan.model)
        with vision_serve(replace(compiled, label="compiled-oip"), inputs) as url:
            infer = url.removesuffix("/predict") + f"/v2/models/{plan.model}/infer"
            found = {}
            for c in plan.images_concurrencies:
                spec = LoadSpec(requests=100_000, concurrency=c, max_seconds=plan.seconds_per_run, warmup_requests=c)
                found[c] = run_record(run_load(infer, images, spec, processes=min(processes, c), encode=encode))
        label = f"same, OIP binary, {plan.images_per_request} images per request"
        record["variants"][label] = {"images_per_request": plan.images_per_request, "runs": found}

    if "images" in steps and artifact is not None:
        _step(record, "images", images_step, out)
    if "baseline" in steps:
        _step(record, "baseline", functools.partial(serve_step, baseline), out)
    if "preprocess" in steps:
        command = [sys.executable, "-m", "benchmarks.preprocess_throughput", "--device", args.device,
                   "--output", str(out / "preprocess"), *plan.preprocess_args]  # fmt: skip
        _step(record, "preprocess", lambda: subprocess.run(command, check=True, timeout=300), out)

    finish(record, out)


def finish(record: dict, out: Path) -> None:
    md = report(record, out)
    write_results(out, "gpu_suite", record, md, text_suffix=".md")
    (out / "machine.json").write_text(json.dumps(record["machine"], indent=1) + "\n")
    print(md)


if __name__ == "__main__":
    main()
