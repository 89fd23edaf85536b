"""The whole GPU benchmark in one command, in under 10 minutes, into one folder.

    python -m benchmarks.gpu_suite                    # ResNet-152, random weights, cuda:0
    python -m benchmarks.gpu_suite --output-dir /tmp/gpu-results --quick

Steps, in order (each one's wall time is recorded; a step that cannot run is recorded as skipped
with the reason, and the rest go on):
1. compile: ``compile-trt --backend auto`` (TensorRT where torch_tensorrt imports, else AOTInductor)
   at fp16, batch 1..64; the compile time comes from the manifest;
2. model-only ceiling of the compiled engine and of eager fp32 at batch 1 and 64;
3. preprocessing micro-benchmark: ``benchmarks.preprocess_throughput --device cuda``;
4. concurrency sweep of vision-serve (compiled engine, GPU preprocessing: ``--preprocess auto``);
5. Poisson arrivals at 50 % and 90 % of the sweep's best throughput;
6. the baseline server: eager fp32 with Pillow preprocessing (``--preprocess pil``), same sweep;
7. the client's own ceiling: the same sweep against a no-op endpoint (``benchmarks.noop_server``).
Load comes from several client processes (``--client-processes``); step 7 shows whether they were
the bottleneck. ``--steps`` runs some steps only, and ``--resume`` adds to the partial record already in the output
folder, so the suite can be split over several shorter runs (a GPU machine's per-command limit).
Writes ``gpu_suite.json``, ``gpu_suite.md`` and plots under benchmarks/results/<gpu>-<date>/.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks import plots
from benchmarks.ceiling import load_served, measure_ceiling
from benchmarks.common import machine_record, results_dir, write_results
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

GPU_MAX_BATCH = 64
CONCURRENCIES = (1, 16, 64, 256)
QUICK_CONCURRENCIES = (1, 64)
SECONDS_PER_RUN = 15.0  # each sweep point and Poisson run: as many requests as fit, bounded by time
POISSON_FRACTIONS = (0.5, 0.9)
SERVER_PARTS = ("queue", "preprocess", "pipeline_wait", "inference")
STEPS = ("compile", "ceiling", "preprocess", "serve", "client")
NOOP_SERVER_WORKERS = 4


def _step(record: dict, name: str, fn: Callable[[], object], out: Path | None = None) -> object:
    """Run one step, record its time and status, and save the record so far (a GPU session is rare:
    a later crash or a time limit must not lose what was measured)."""
    try:
        return _run_step(record, name, fn)
    finally:
        if out is not None:
            (out / "gpu_suite.partial.json").write_text(json.dumps(record, indent=1, default=str) + "\n")


def _run_step(record: dict, name: str, fn: Callable[[], object]) -> object:
    started = time.perf_counter()
    try:
        result = fn()
        record["steps"][name] = {"seconds": time.perf_counter() - started, "status": "ok"}
        return result
    except Exception as exc:  # one failed step must not cost the rest of a rare GPU session
        logger.exception("step %s failed", name)
        record["steps"][name] = {"seconds": time.perf_counter() - started, "status": f"failed: {exc!r}"}
        return None


def _sweep(url: str, images: list[bytes], concurrencies: tuple[int, ...], processes: int) -> dict[int, dict]:
    runs = {}
    for c in concurrencies:
        spec = LoadSpec(requests=max(50, 400 * c), concurrency=c, max_seconds=SECONDS_PER_RUN, warmup_requests=c)
        runs[c] = run_record(run_load(url, images, spec, processes=min(processes, c)))
        logger.info("c=%d: %.1f img/s, p50 %.1f ms", c, runs[c]["throughput_rps"], runs[c]["latency_ms"]["p50"])
    return runs


def _int_keys(runs: dict) -> dict[int, dict]:
    return {int(c): r for c, r in runs.items()}


def report(record: dict, out: Path, model: str, top_concurrency: int) -> str:
    """Plots and the markdown summary of a suite record."""
    gpu = record["machine"].get("gpu")
    written = []
    if record["sweeps"]:
        series = {
            label: [(c, r["throughput_rps"]) for c, r in sweep.items()] for label, sweep in record["sweeps"].items()
        }
        written.append(plots.throughput_vs_concurrency(series, f"{model} on {gpu}", out / "gpu_suite-throughput.png"))
        cdf = {
            f"{label}, {name}": r["latencies_ms"]
            for label, runs in record["poisson"].items()
            for name, r in runs.items()
        }
        written.append(plots.latency_cdf(cdf, "Poisson arrivals", out / "gpu_suite-latency-cdf.png"))
        top = {label: sweep[max(sweep)]["batch_sizes"] for label, sweep in record["sweeps"].items()}
        title = f"batch sizes at c={top_concurrency}"
        written.append(plots.batch_histogram(top, title, out / "gpu_suite-batch-sizes.png"))
    rows = []
    for label, sweep in record["sweeps"].items():
        for c, r in sweep.items():
            parts = " / ".join(f"{r['server_ms_median'].get(k, float('nan')):.1f}" for k in SERVER_PARTS)
            latency = r["latency_ms"]
            mean_batch = r["batch_size_mean"] or 0
            rows.append(
                [
                    label,
                    c,
                    f"{r['throughput_rps']:.1f}",
                    f"{latency['p50']:.1f}",
                    f"{latency['p99']:.1f}",
                    f"{mean_batch:.1f}",
                    parts,
                ]
            )
    for c, r in (record.get("client_ceiling") or {}).items():
        latency = r["latency_ms"]
        rows.append(["client ceiling: no-op server", c, f"{r['throughput_rps']:.1f}", f"{latency['p50']:.1f}",
                     f"{latency['p99']:.1f}", "", ""])  # fmt: skip
    header = ["server", "conc.", "img/s", "p50 ms", "p99 ms", "mean batch", " / ".join(SERVER_PARTS) + " ms"]
    steps = [[name, f"{step['seconds']:.0f}", step["status"]] for name, step in record["steps"].items()]
    md = f"# GPU suite: {model} on {gpu}\n\n" + markdown_table(header, rows)
    md += "\n\n" + markdown_table(["step", "seconds", "status"], steps)
    return md + "\n\n" + "\n".join(f"![{p.name}]({p.name})" for p in written) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet152")
    parser.add_argument("--weights", default="random")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--precision", default="fp16")
    # 4 processes are not enough for a compiled engine on a 16-core H100 machine (what they sent to a
    # no-op server: benchmarks/results/nvidia-h100-80gb-hbm3-2026-11-22/README.md), so use more where
    # there are cores for them.
    parser.add_argument("--client-processes", type=int, default=max(4, (os.cpu_count() or 1) // 2))
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK_DIR / "gpu")
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="two concurrencies, one Poisson rate")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated of {', '.join(STEPS)}")
    parser.add_argument("--resume", action="store_true", help="add to the partial record in the output folder")
    args = parser.parse_args()
    restart_with_preload(args.device)  # the ceiling step loads the AOTInductor package here
    steps = set(args.steps.split(","))
    if not steps <= set(STEPS):
        parser.error(f"--steps: unknown {sorted(steps - set(STEPS))}; choose from {', '.join(STEPS)}.")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    if not torch.cuda.is_available():
        parser.error("no CUDA device: this suite is for GPU machines (the CPU one is benchmarks.experiments).")
    device = torch.device(args.device)
    out = results_dir(args.output_dir, device)
    concurrencies = QUICK_CONCURRENCIES if args.quick else CONCURRENCIES
    record: dict = {"machine": machine_record(device), "steps": {}, "model": args.model, "precision": args.precision}
    previous = out / "gpu_suite.partial.json"
    if args.resume and previous.exists():  # an earlier part of the same suite: add to it
        saved = json.loads(previous.read_text())
        if (saved.get("model"), saved.get("precision")) != (args.model, args.precision):
            parser.error(f"--resume: {previous} is for {saved.get('model')} {saved.get('precision')}.")
        record = {**saved, "machine": record["machine"]}
        # JSON made the concurrency keys strings; the report sorts and plots them as numbers.
        record["sweeps"] = {label: _int_keys(sweep) for label, sweep in record.get("sweeps", {}).items()}
        if record.get("client_ceiling"):
            record["client_ceiling"] = _int_keys(record["client_ceiling"])
    inputs = prepare_inputs(args.model, args.work, args.weights)
    images = inputs.images

    def compile_step() -> Path:
        batch = (1, GPU_MAX_BATCH // 2, GPU_MAX_BATCH)
        artifact = compile_artifact(inputs, args.precision, args.device, "auto", batch)
        manifest = read_manifest(artifact)
        record["compile"] = {
            "backend": manifest.backend,
            "engine": manifest.engine_name,
            "compile_seconds": manifest.compile_seconds,
        }
        return artifact

    # Later steps need the artifact: compile_artifact is a cache hit when an earlier run built it.
    artifact = _step(record, "compile", compile_step, out) if steps & {"compile", "ceiling", "serve"} else None
    if artifact is not None:
        inputs.artifacts[artifact_key("auto", args.precision)] = artifact

    def ceiling_step() -> dict:
        found = {}
        for label, source in (("eager-fp32", None), ("compiled", artifact)):
            if label == "compiled" and source is None:
                continue
            served = load_served(args.model, str(inputs.weights_file), source and str(source), device)
            found[label] = measure_ceiling(served, images, [1, GPU_MAX_BATCH], device, repeats=10)
            del served
            torch.cuda.empty_cache()
        return found

    if "ceiling" in steps:
        found = _step(record, "ceiling", ceiling_step, out)
        record["ceiling"] = found or record.get("ceiling")  # a failed rerun keeps what an earlier run measured
    preprocess_dir = out / "preprocess"
    command = [
        sys.executable,
        "-m",
        "benchmarks.preprocess_throughput",
        "--device",
        args.device,
        "--repeats",
        "3",
        "--output",
        str(preprocess_dir),
    ]
    if "preprocess" in steps:
        _step(record, "preprocess", lambda: subprocess.run(command, check=True, timeout=300), out)

    configs = {
        "baseline: eager fp32 + Pillow": ServerConfig(
            "baseline", args.device, preprocess="pil", max_batch_size=GPU_MAX_BATCH
        )
    }
    if artifact is not None:
        label = f"vision-serve: {record['compile']['engine']} + GPU preprocessing"
        configs = {
            label: ServerConfig(
                "compiled", args.device, args.precision, compiled=True, backend="auto", max_batch_size=GPU_MAX_BATCH
            ),
            **configs,
        }
    record.setdefault("sweeps", {})
    record.setdefault("poisson", {})
    for label, config in configs.items() if "serve" in steps else ():

        def serve_step(label: str = label, config: ServerConfig = config) -> None:
            with vision_serve(config, inputs) as url:
                sweep = _sweep(url, images, concurrencies, args.client_processes)
                record["sweeps"][label] = sweep
                peak = max(r["throughput_rps"] for r in sweep.values())
                for fraction in POISSON_FRACTIONS[: 1 if args.quick else None]:
                    rate = round(fraction * peak, 1)
                    spec = LoadSpec(
                        requests=int(rate * SECONDS_PER_RUN),
                        mode="open",
                        rate=rate,
                        max_seconds=SECONDS_PER_RUN,
                        warmup_requests=32,
                    )
                    result = run_load(url, images, spec, processes=args.client_processes)
                    name = f"{fraction:.0%} of peak ({rate:g} req/s)"
                    record["poisson"].setdefault(label, {})[name] = run_record(result)

        _step(record, f"serve {config.label}", serve_step, out)

    def client_step() -> dict[int, dict]:
        with noop_server(NOOP_SERVER_WORKERS) as url:
            return _sweep(url, images, concurrencies, args.client_processes)

    if "client" in steps:
        found = _step(record, "client ceiling", client_step, out)
        record["client_ceiling"] = found or record.get("client_ceiling")

    md = report(record, out, args.model, max(concurrencies))
    write_results(out, "gpu_suite", record, md, text_suffix=".md")
    (out / "machine.json").write_text(json.dumps(record["machine"], indent=1) + "\n")
    print(md)


if __name__ == "__main__":
    main()
