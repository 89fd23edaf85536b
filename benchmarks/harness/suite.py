"""What the experiments share: the inputs they prepare once, the servers they start, how they write.

An experiment's inputs live in a work folder (``--work``, default /tmp/vision-serve-bench) and are
reused across runs: the benchmark photos, the model's weights as a state_dict file (so vision-serve,
TorchServe and the per-process script load identical weights), and compiled CPU artifacts.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compile import EXIT_GATE_FAILED, BackendUnavailable, get_backend, get_model_entry, load_model
from service.client.launcher import ServerProcess
from service.tune.images import read_images, write_benchmark_images
from service.tune.loadgen import LoadResult, LoadSpec, format_summary, run_load

logger = logging.getLogger(__name__)

DEFAULT_WORK_DIR = Path("/tmp/vision-serve-bench")
# The CPU experiments serve batches of up to 8, TorchServe's batch size in the seed setup; on 2 cores
# ResNet-152 is fastest per image at 8 (benchmarks/results/vm-2cpu-2026-11-21/compiled_throughput-resnet152-cpu.txt).
CPU_MAX_BATCH = 8
# Closed-loop runs never hit the deadline on purpose: a slow configuration must show up as low
# throughput and high latency, not as 504s.
BENCH_REQUEST_TIMEOUT_S = 600
BENCH_MAX_QUEUE = 4096


@dataclass
class Inputs:
    """Prepared once per work folder; see the module docstring."""

    model: str
    work: Path
    images_dir: Path
    weights_file: Path
    artifacts: dict[str, Path] = field(default_factory=dict)  # artifact_key(backend, precision) -> artifact
    weights: str = "random"  # what weights_file holds: --weights of compile-trt and vision-serve
    log_dir: Path | None = None  # where servers write their logs; None: ``work``

    @property
    def images(self) -> list[bytes]:
        return read_images(self.images_dir)


def artifact_key(backend: str, precision: str) -> str:
    """How ``Inputs.artifacts`` names an artifact: ``inductor-fp32``, ``onnx-fp32``."""
    return f"{backend}-{precision}"


def prepare_inputs(
    model: str,
    work: Path,
    weights: str = "random",
    precisions: Sequence[str] = (),
    backends: Sequence[str] = ("inductor",),
    batch: tuple[int, int, int] = (1, CPU_MAX_BATCH, CPU_MAX_BATCH),
) -> Inputs:
    """Photos, a weights file and one CPU artifact per backend and precision (those the backend builds)."""
    work.mkdir(parents=True, exist_ok=True)
    images_dir = work / "images"
    if not images_dir.is_dir():
        write_benchmark_images(images_dir)
    # "-v3": random weights since their residual branches start small and the head is scaled
    # (compile/weights.py); a work folder from before keeps its older file, which runs zero weights.
    version = "-v3" if weights == "random" else ""
    weights_file = work / f"{model}-{weights.replace('/', '_')}{version}.pt"
    if not weights_file.exists():
        # One file for every contender; `random` is seeded, so reruns serve the same model.
        loaded = load_model(get_model_entry(model), weights)
        torch.save(loaded.module.state_dict(), weights_file)
    inputs = Inputs(model, work, images_dir, weights_file, weights=weights)
    for backend in backends:
        for precision in precisions:
            try:
                get_backend(backend).check_precision(precision, torch.device("cpu"))
            except BackendUnavailable as exc:
                logger.warning("No %s %s artifact: %s", backend, precision, exc)
                continue
            try:
                artifact = compile_artifact(inputs, precision, backend=backend, batch=batch)
            except subprocess.CalledProcessError as exc:
                if exc.returncode != EXIT_GATE_FAILED:
                    raise
                logger.warning("No %s %s artifact: it failed the accuracy gate (above).", backend, precision)
                continue
            inputs.artifacts[artifact_key(backend, precision)] = artifact
    return inputs


def compile_artifact(
    inputs: Inputs,
    precision: str,
    device: str = "cpu",
    backend: str = "inductor",
    batch: tuple[int, int, int] = (1, CPU_MAX_BATCH, CPU_MAX_BATCH),
) -> Path:
    """``compile-trt`` into the work folder; instant when the artifact is already there (its cache key)."""
    device_suffix = "" if device == "cpu" else f"-{device.split(':')[0]}"
    batch_suffix = "" if batch == (1, CPU_MAX_BATCH, CPU_MAX_BATCH) else "-batch" + "-".join(map(str, batch))
    output = inputs.work / f"{inputs.model}-{backend}-{precision}{device_suffix}{batch_suffix}"
    # Random weights by name, not by their file: the same seeded model, and compile-trt then gates
    # it on its logits (a random model's top-1 is a near tie: compile/_defaults.RANDOM_WEIGHTS_GATED).
    weights = "random" if inputs.weights == "random" else str(inputs.weights_file)
    command = [
        sys.executable, "-m", "compile.cli", "--model", inputs.model, "--weights", weights,
        "--backend", backend, "--precision", precision, "--device", device, "--batch", ",".join(map(str, batch)),
        "--output", str(output), "--log-level", "warning",
    ]  # fmt: skip
    logger.info("compile-trt %s %s %s on %s (cached in %s)", inputs.model, backend, precision, device, output)
    subprocess.run(command, check=True)
    return output


@dataclass(frozen=True)
class ServerConfig:
    """One vision-serve configuration under test."""

    label: str
    device: str = "cpu"
    precision: str = "fp32"
    compiled: bool = False  # serve the ``backend`` artifact of ``precision`` instead of the eager model
    backend: str = "inductor"
    max_batch_size: int = CPU_MAX_BATCH
    batch_timeout_ms: float | None = None  # None: the server's default
    workers_per_device: int = 1
    preprocess: str | None = None  # None: the server's default (auto)
    extra_args: tuple[str, ...] = ()

    @property
    def artifact_key(self) -> str:
        return artifact_key(self.backend, self.precision)

    def args(self, inputs: Inputs) -> list[str]:
        if self.compiled:
            source = ["--artifact", str(inputs.artifacts[self.artifact_key])]
        elif self.precision == "fp32":
            source = ["--model", inputs.model, "--weights", str(inputs.weights_file)]
        else:
            raise ValueError(f"{self.label}: eager serving is fp32 only; compile {self.precision} (compiled=True).")
        args = [
            *source, "--device", self.device, "--max-batch-size", str(self.max_batch_size),
            "--workers-per-device", str(self.workers_per_device), "--log-level", "warning",
            "--request-timeout-s", str(BENCH_REQUEST_TIMEOUT_S), "--max-queue", str(BENCH_MAX_QUEUE),
        ]  # fmt: skip
        if self.batch_timeout_ms is not None:
            args += ["--batch-timeout-ms", str(self.batch_timeout_ms)]
        if self.preprocess is not None:
            args += ["--preprocess", self.preprocess]
        return [*args, *self.extra_args]


@contextlib.contextmanager
def vision_serve(config: ServerConfig, inputs: Inputs) -> Iterator[str]:
    """A running vision-serve for ``config``; yields its predict URL. The server dies with this
    process, however this process dies (a benchmark killed at its time limit leaves no server behind
    to take the cores of the next)."""
    log_dir = inputs.log_dir or inputs.work
    log_dir.mkdir(parents=True, exist_ok=True)
    stem = f"server-{config.label.replace(' ', '_').replace('/', '_')}"
    log_path = log_dir / f"{stem}.log"
    for n in itertools.count(2):  # a second server of the same label keeps the first one's log
        if not log_path.exists():
            break
        log_path = log_dir / f"{stem}-{n}.log"
    with ServerProcess(config.args(inputs), log_path=log_path, with_parent=True) as server:
        yield f"{server.url}/predict"


def load_runs(url: str, images: Sequence[bytes], specs: Sequence[LoadSpec], label: str) -> list[LoadResult]:
    results = []
    for spec in specs:
        result = run_load(url, images, spec)
        logger.info("%s\n%s", label, format_summary(result.summary()))
        results.append(result)
    return results


MIN_WARMUP_REQUESTS = 16  # TorchScript (the TorchServe peer) specializes on the first calls of each shape


def closed(requests: int, concurrency: int, warmup: int | None = None) -> LoadSpec:
    """A closed-loop run after a warm-up (connections, first batches) of two rounds of ``concurrency``
    requests, at least ``MIN_WARMUP_REQUESTS``."""
    warmup = max(2 * concurrency, MIN_WARMUP_REQUESTS) if warmup is None else warmup
    return LoadSpec(requests, concurrency=concurrency, warmup_requests=warmup)


def run_record(result: LoadResult) -> dict:
    """A run's summary plus its raw latencies (for CDF plots), without the per-sample detail."""
    return {**result.summary(), "latencies_ms": [round(s.latency_ms, 2) for s in result.ok]}


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
