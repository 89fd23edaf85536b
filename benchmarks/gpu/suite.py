"""The GPU benchmark, in steps that each run as a short process of their own, into one folder.

    python -m benchmarks.gpu.suite --output-dir /tmp/gpu-results --steps compile
    python -m benchmarks.gpu.suite --output-dir /tmp/gpu-results --steps serve,answers,images --resume
    python -m benchmarks.gpu.suite --dry-run --output-dir /tmp/dry --steps compile,serve  # tiny, on a CPU

benchmarks/gpu/session.py runs these steps in the headline's order (``bash benchmarks/gpu_headline.sh``);
each step's wall time and status are recorded, a failed step is recorded with the reason, and
``--resume`` adds to the record already in the output folder:

- ``compile``: ``compile-trt --backend inductor`` (AOTInductor; TensorRT cannot be built where our
  GPU runs happen), ResNet-152 at fp16 for batches 1, 32 and 64, random weights (gated on their
  logits); a cache hit when an earlier run on the machine built it. Only this step compiles: the
  steps that serve the engine take the artifact it recorded, or fail at once and say so;
- ``serve``: vision-serve with the compiled engine and ``--preprocess`` (torch: nvJPEG), closed-loop
  sweep at 1, 64 and 256 connections, then Poisson arrivals at 70 % of the best throughput;
- ``answers``: on the same server, each photo's answer under load (64 connections, a bad JPEG every
  16 requests) against its answer alone: the probability of the photo's class within a tolerance,
  and a 4xx for every bad JPEG;
- ``images``: on the same server, 32 images per request (Open Inference Protocol, binary tensors);
- ``baseline``: eager fp32 with Pillow preprocessing, the same sweep and Poisson;
- ``client``: the load generator's own ceiling against a no-op server, at the sweep's concurrencies;
- ``ceiling``: the model alone, the compiled engine against eager fp32, at batch 1 and 64;
- ``depth``: ``--pipeline-depth`` 2 vs 1 at the sweep's best concurrency, alternating rounds;
- ``preprocess``: ``benchmarks.preprocess_throughput`` on the device.

The load generator's client processes start once per run of this module (service.tune.loadgen's
``LoadClients``) and serve every sweep point. Servers die with the process that started them, however
it dies. Writes ``gpu_suite.json``, ``gpu_suite.md`` and plots after every step, and every server's
log under ``logs/``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from benchmarks.ceiling import load_served, measure_ceiling
from benchmarks.harness import plots
from benchmarks.harness.common import machine_record, replace_text, results_dir, write_results
from benchmarks.harness.suite import (
    DEFAULT_WORK_DIR,
    ServerConfig,
    artifact_key,
    compile_artifact,
    markdown_table,
    prepare_inputs,
    run_record,
    vision_serve,
)
from benchmarks.peers.noop_server import noop_server
from benchmarks.pipeline_check import check_photos, check_under_load
from compile import read_manifest, restart_with_preload
from service.tune.loadgen import LoadClients, LoadSpec, oip_images, run_load
from tests.bad_inputs import bad_inputs

logger = logging.getLogger(__name__)

STEPS = ("compile", "serve", "answers", "images", "baseline", "client", "ceiling", "depth", "preprocess")
LOAD_STEPS = frozenset({"serve", "images", "baseline", "client", "depth"})  # they drive the load generator
SERVER_PARTS = ("queue", "preprocess", "pipeline_wait", "inference")
NOOP_SERVER_WORKERS = 4
POISSON_FRACTION = 0.7
DEPTH_ROUNDS = 2  # pipeline depth 2 vs 1: rounds of one run each
PARTIAL_RECORD = "gpu_suite.partial.json"
COMPILED, BASELINE = "compiled", "baseline"
# The answers check's bad images: JPEGs that pass the HTTP process's header check, so they reach the
# worker and share a batch with good photos, and fail there (decode, or the decode-cost check).
ANSWERS_BAD_INPUTS = ("jpeg_truncated", "jpeg_broken_huffman_table", "jpeg_header_then_garbage",
                      "jpeg_frame_claims_9000x9000")  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """What the steps run; ``GPU_PLAN`` on a GPU, ``DRY_RUN_PLAN`` on a CPU (``--dry-run``)."""

    model: str
    weights: str
    precision: str
    backend: str
    batches: tuple[int, int, int]  # compile-trt --batch: min, opt, max
    concurrencies: tuple[int, ...]
    seconds_per_run: float  # each sweep point and Poisson run: as many requests as fit, bounded by time
    images_per_request: int
    images_concurrencies: tuple[int, ...]
    ceiling_batches: tuple[int, ...]
    ceiling_repeats: int
    answers_requests: int
    answers_concurrency: int
    answers_tolerance: float  # on the probability of the photo's class: batch size changes the kernels a little
    preprocess_args: tuple[str, ...]

    @property
    def max_batch(self) -> int:
        return self.batches[-1]


# fp16: the probability of a photo's class moved by up to 8e-4 against fp32 on a CPU (a GPU's kernels
# change with the batch size too); random ResNet-152's top-1 probabilities of the 48 check photos
# fall into ~10 groups at 3e-3 (a photo's resized variants answer alike), 0.03 to 0.14.
GPU_PLAN = Plan("resnet152", "random", "fp16", "inductor", (1, 32, 64), (1, 64, 256), 8.0, 32, (2, 8), (1, 64), 10,
                2000, 64, 3e-3, ("--repeats", "3"))  # fmt: skip
# The same code path in seconds on a CPU: a small real model, AOTInductor at fp32.
DRY_RUN_PLAN = Plan("efficientnet-lite0", "imagenet", "fp32", "inductor", (1, 4, 8), (1, 8), 2.0, 4, (1,), (1, 8), 2,
                    96, 8, 1e-3,
                    ("--repeats", "1", "--sizes", "imagenet", "--batches", "8", "--backends", "pil,torch"))  # fmt: skip


class StepFailed(RuntimeError):
    """A step that could not measure, with the reason in words (no traceback in the record)."""


def _step(record: dict, name: str, fn: Callable[[], object], out: Path) -> object:
    """Run one step (it writes what it measured into ``record``), record its time and status, and save
    the record and the report so far (a GPU session is rare: a later crash or a time limit must not
    lose what was measured)."""
    started = time.perf_counter()
    try:
        result = fn()
        record["steps"][name] = {"seconds": time.perf_counter() - started, "status": "ok"}
        return result
    except Exception as exc:  # one failed step must not cost the rest of a rare GPU session
        if not isinstance(exc, StepFailed):
            logger.exception("step %s failed", name)
        record["steps"][name] = {"seconds": time.perf_counter() - started, "status": f"failed: {exc}"}
        return None
    finally:
        save_record(record, out)


def save_record(record: dict, out: Path) -> None:
    """The partial record, replaced whole: benchmarks/gpu/session.py packs the folder while steps run."""
    replace_text(out / PARTIAL_RECORD, json.dumps(record, indent=1, default=str) + "\n")


def closed_spec(concurrency: int, seconds: float) -> LoadSpec:
    return LoadSpec(requests=max(50, 400 * concurrency), concurrency=concurrency, max_seconds=seconds,
                    warmup_requests=concurrency)  # fmt: skip


def sweep(
    url: str,
    images: list[bytes],
    plan: Plan,
    clients: LoadClients,
    concurrencies: tuple[int, ...],
    into: dict | None = None,
    saved: Callable[[], None] = lambda: None,
) -> dict:
    """One closed-loop run per concurrency, each added to ``into`` and ``saved`` as soon as it ends:
    a run killed at its time limit keeps the points it finished."""
    runs = {} if into is None else into
    for c in concurrencies:
        spec = closed_spec(c, plan.seconds_per_run)
        runs[c] = run_record(run_load(url, images, spec, processes=min(clients.processes, c), clients=clients))
        logger.info("c=%d: %.1f req/s, p50 %.1f ms", c, runs[c]["throughput_rps"], runs[c]["latency_ms"]["p50"])
        saved()
    return runs


def poisson(url: str, images: list[bytes], plan: Plan, clients: LoadClients, peak: float) -> tuple[str, dict]:
    rate = round(POISSON_FRACTION * peak, 1)
    spec = LoadSpec(requests=max(1, int(rate * plan.seconds_per_run)), mode="open", rate=rate,
                    max_seconds=plan.seconds_per_run, warmup_requests=32)  # fmt: skip
    result = run_load(url, images, spec, processes=clients.processes, clients=clients)
    return f"{POISSON_FRACTION:.0%} of peak ({rate:g} req/s)", run_record(result)


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
    for variant in record.get("variants", {}).values():
        variant["runs"] = _int_keys(variant["runs"])
    if record.get("depth"):
        record["depth"]["median_rps"] = _int_keys(record["depth"]["median_rps"])
        record["depth"]["rounds"] = [_int_keys(found) for found in record["depth"]["rounds"]]
    return record


def compiled_artifact(record: dict) -> Path:
    """The artifact the compile step recorded; ``StepFailed`` with the reason when there is none,
    so that no later step spends its time compiling again."""
    compiled = record.get("compile") or {}
    artifact = Path(compiled["artifact"]) if compiled.get("artifact") else None
    if artifact is not None and (artifact / "manifest.json").exists():
        return artifact
    status = record["steps"].get("compile", {}).get("status", "not run")
    raise StepFailed(f"no compiled engine: the compile step's status is {status!r} (it alone compiles)")


def _row(label: str, c: object, r: dict, images_per_request: int = 1) -> list[object]:
    parts = " / ".join(f"{r['server_ms_median'].get(k, float('nan')):.1f}" for k in SERVER_PARTS)
    latency = r["latency_ms"]
    batch = f"{r['batch_size_mean']:.1f}" if r.get("batch_size_mean") else ""
    img_s = r["throughput_rps"] * images_per_request
    return [label, c, f"{img_s:.1f}", f"{latency['p50']:.1f}", f"{latency['p99']:.1f}", batch, parts]


def _answers_report(answers: dict) -> str:
    verdict = "passed" if answers["passed"] else "FAILED"
    return (
        f"\n\nAnswers under load ({verdict}): {answers['requests']} requests from {answers['concurrency']} "
        f"connections, {answers['bad_sent']} of them bad JPEGs; {answers['differing']} photo answers differed "
        f"from the photo's answer alone (the probability of its top-1 class within "
        f"{answers['probability_tolerance']:g}; largest difference {answers['max_probability_delta']:.2g}; "
        f"{answers['top1_swaps']} near ties swapped; the {answers['distinct_photos']} photos answer in "
        f"{answers['answer_groups']} groups at that tolerance); bad JPEGs answered {answers['bad_statuses']}"
        + (f", wrongly: {answers['bad_wrongly_answered']}" if answers["bad_wrongly_answered"] else "")
        + f"; mean batch {answers['mean_batch'] or 0:.1f}."
    )


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
    if record.get("compile", {}).get("engine"):
        md += "Compiled: " + ", ".join(f"{k} {v}" for k, v in record["compile"].items()) + "\n\n"
    if record.get("weights") == "random":
        md += ("Random weights (seeded; residual branches at 0.25, no all-zero convolution: "
               "compile/weights.py): the speed of a trained model, meaningless labels.\n\n")  # fmt: skip
    md += markdown_table(header, rows)
    if record.get("answers"):
        md += _answers_report(record["answers"])
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
    args.steps = [] if args.report_only else [step for step in args.steps.split(",") if step]
    args.resume = args.resume or args.report_only
    if not set(args.steps) <= set(STEPS):
        parser.error(f"--steps: unknown {sorted(set(args.steps) - set(STEPS))}; choose from {', '.join(STEPS)}.")
    if args.dry_run:
        args.device, args.client_processes = "cpu", min(args.client_processes, 2)
        args.work = args.work.with_name(args.work.name + "-dry-run")
    return args


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds: servers stop, the report of what was measured is written


def main(argv: list[str] | None = None) -> int:
    """Exit code 1 when a step asked for did not end ok in this run (benchmarks/gpu/session.py reads it)."""
    signal.signal(signal.SIGTERM, _stop)
    args = parse_args(argv)
    plan = DRY_RUN_PLAN if args.dry_run else GPU_PLAN
    restart_with_preload(args.device)  # the ceiling step loads the AOTInductor package here
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this suite is for GPU machines (--dry-run runs its plumbing on a CPU).")
    out = results_dir(args.output_dir, device)
    fresh = {"machine": machine_record(device), "steps": {}, "model": plan.model, "precision": plan.precision,
             "weights": plan.weights, "dry_run": args.dry_run, "sweeps": {}, "poisson": {}, "variants": {},
             "client_ceiling": {}}  # fmt: skip
    record = load_record(out, args.resume, fresh)
    try:
        if args.steps:
            suite = Suite(args, plan, record, out, device)
            # The client processes start once for every sweep point of the run, and only where load is sent.
            needed = LOAD_STEPS.intersection(args.steps)
            with LoadClients(args.client_processes) if needed else contextlib.nullcontext() as clients:
                suite.run(args.steps, clients)
    finally:
        finish(record, out)
    statuses = {step: record["steps"].get(step, {}).get("status", "not run") for step in args.steps}
    missed = {step: status for step, status in statuses.items() if status != "ok"}
    if missed:
        logger.error("not ok: %s", "; ".join(f"{step}: {status}" for step, status in missed.items()))
    return 1 if missed else 0


class Suite:
    """The steps, over one record; each saves it (``_step``) and the report follows."""

    def __init__(self, args: argparse.Namespace, plan: Plan, record: dict, out: Path, device: torch.device) -> None:
        self.args, self.plan, self.record, self.out, self.device = args, plan, record, out, device
        self.inputs = prepare_inputs(plan.model, args.work, plan.weights)
        self.inputs.log_dir = out / "logs"
        self.images = self.inputs.images
        compiled = ServerConfig(COMPILED, args.device, plan.precision, compiled=True, backend=plan.backend,
                                max_batch_size=plan.max_batch, preprocess=args.preprocess)  # fmt: skip
        baseline = ServerConfig(BASELINE, args.device, preprocess="pil", max_batch_size=plan.max_batch)
        self.configs = {COMPILED: compiled, BASELINE: baseline}
        self.labels = {COMPILED: f"vision-serve: {plan.backend} {plan.precision} + --preprocess {args.preprocess}",
                       BASELINE: "baseline: eager fp32 + Pillow"}  # fmt: skip

    def step(self, name: str, fn: Callable[[], object]) -> object:
        result = _step(self.record, name, fn, self.out)
        finish(self.record, self.out, quiet=True)  # the report so far: a kill later keeps it
        return result

    def save(self) -> None:
        """The record as it stands, mid-step (the report waits for the step's end)."""
        save_record(self.record, self.out)

    def run(self, steps: list[str], clients: LoadClients | None) -> None:
        if "compile" in steps:
            self.step("compile", self.compile)
        served = [name for name in ("serve", "answers", "images") if name in steps]
        if served:
            self.engine_steps(served, clients)
        if "baseline" in steps:
            self.step("baseline", functools.partial(self.baseline, clients))
        if "client" in steps:
            self.step("client", functools.partial(self.client, clients))
        if "ceiling" in steps:
            self.step("ceiling", self.ceiling)
        if "depth" in steps:
            self.step("depth", functools.partial(self.depth, clients))
        if "preprocess" in steps:
            self.step("preprocess", self.preprocess)

    def compile(self) -> None:
        try:
            artifact = compile_artifact(self.inputs, self.plan.precision, self.args.device, self.plan.backend,
                                        self.plan.batches)  # fmt: skip
        except subprocess.CalledProcessError as exc:
            self.record["compile"] = {"failed": f"compile-trt exited {exc.returncode}"}
            raise StepFailed(f"compile-trt exited {exc.returncode} (its output is in this step's log)") from None
        manifest = read_manifest(artifact)
        self.record["compile"] = {"backend": manifest.backend, "engine": manifest.engine_name,
                                  "artifact": str(artifact), "compile_seconds": round(manifest.compile_seconds, 1),
                                  "batches": list(self.plan.batches)}  # fmt: skip

    def use_engine(self) -> None:
        self.inputs.artifacts[artifact_key(self.plan.backend, self.plan.precision)] = compiled_artifact(self.record)

    def engine_steps(self, steps: list[str], clients: LoadClients) -> None:
        """serve, answers and images on one server of the compiled engine: one start, not three."""
        try:
            self.use_engine()
        except StepFailed as exc:
            for name in steps:
                self.step(name, functools.partial(_raise, exc))
            return
        with vision_serve(self.configs[COMPILED], self.inputs) as url:
            if "serve" in steps:
                self.step("serve", functools.partial(self.serve, COMPILED, url, clients))
            if "answers" in steps:
                self.step("answers", functools.partial(self.answers, url))
            if "images" in steps:
                self.step("images", functools.partial(self.images_per_request, url, clients))

    def serve(self, label: str, url: str, clients: LoadClients) -> None:
        """The sweep, then Poisson arrivals at a share of its peak, of the server at ``url``."""
        runs = self.record["sweeps"].setdefault(self.labels[label], {})
        sweep(url, self.images, self.plan, clients, self.plan.concurrencies, runs, self.save)
        peak = max(r["throughput_rps"] for r in runs.values())
        name, run = poisson(url, self.images, self.plan, clients, peak)
        self.record["poisson"][self.labels[label]] = {name: run}

    def baseline(self, clients: LoadClients) -> None:
        with vision_serve(self.configs[BASELINE], self.inputs) as url:
            self.serve(BASELINE, url, clients)

    def answers(self, url: str) -> None:
        bad = [item for item in bad_inputs() if item.name in ANSWERS_BAD_INPUTS]
        found = check_under_load(url, check_photos(48), bad, self.plan.answers_requests,
                                 self.plan.answers_concurrency, self.plan.answers_tolerance)  # fmt: skip
        self.record["answers"] = {**found, "concurrency": self.plan.answers_concurrency}
        if not found["passed"]:
            raise StepFailed(f"{found['differing']} answers differed, bad JPEGs answered {found['bad_statuses']}")

    def images_per_request(self, url: str, clients: LoadClients) -> None:
        count = self.plan.images_per_request
        encode = functools.partial(oip_images, count=count)
        infer = url.removesuffix("/predict") + f"/v2/models/{self.plan.model}/infer"
        found = {}
        for c in self.plan.images_concurrencies:
            spec = LoadSpec(requests=100_000, concurrency=c, max_seconds=self.plan.seconds_per_run, warmup_requests=c)
            result = run_load(infer, self.images, spec, processes=min(clients.processes, c), encode=encode,
                              clients=clients)  # fmt: skip
            found[c] = run_record(result)
        label = f"same, OIP binary, {count} images per request"
        self.record["variants"][label] = {"images_per_request": count, "runs": found}

    def client(self, clients: LoadClients) -> None:
        with noop_server(NOOP_SERVER_WORKERS) as url:
            runs = self.record["client_ceiling"] = {}
            sweep(url, self.images, self.plan, clients, self.plan.concurrencies, runs, self.save)

    def ceiling(self) -> None:
        artifact = compiled_artifact(self.record)
        found = {}
        for label, source in (("eager fp32", None), ("compiled", artifact)):
            served = load_served(self.plan.model, str(self.inputs.weights_file), source and str(source), self.device)
            found[label] = measure_ceiling(served, self.images, self.plan.ceiling_batches, self.device,
                                           self.plan.ceiling_repeats)  # fmt: skip
            del served
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.record["ceiling"] = found

    def depth(self, clients: LoadClients) -> None:
        self.use_engine()
        runs = self.record["sweeps"].get(self.labels[COMPILED])
        if not runs:
            raise StepFailed("needs the serve step's sweep (its best concurrency)")
        best = best_concurrency(runs)
        rounds: list[dict[int, dict]] = []
        for _ in range(DEPTH_ROUNDS):  # alternating, a fresh server each time: drift hits both alike
            found = {}
            for depth in (2, 1):
                config = replace(self.configs[COMPILED], label=f"compiled-depth{depth}",
                                 extra_args=("--pipeline-depth", str(depth)))  # fmt: skip
                with vision_serve(config, self.inputs) as url:
                    found[depth] = sweep(url, self.images, self.plan, clients, (best,))[best]
            rounds.append(found)
        medians = {d: statistics.median(r[d]["throughput_rps"] for r in rounds) for d in (2, 1)}
        self.record["depth"] = {"concurrency": best, "rounds": rounds, "median_rps": medians,
                                "ratio_2_to_1": medians[2] / medians[1] if medians[1] else None}  # fmt: skip

    def preprocess(self) -> None:
        command = [sys.executable, "-m", "benchmarks.preprocess_throughput", "--device", self.args.device,
                   "--output", str(self.out / "preprocess"), *self.plan.preprocess_args]  # fmt: skip
        subprocess.run(command, check=True, timeout=300)


def _raise(exc: Exception) -> None:
    raise exc


def finish(record: dict, out: Path, quiet: bool = False) -> None:
    md = report(record, out)
    write_results(out, "gpu_suite", record, md, text_suffix=".md")
    (out / "machine.json").write_text(json.dumps(record["machine"], indent=1) + "\n")
    if not quiet:
        print(md)


if __name__ == "__main__":
    sys.exit(main())
