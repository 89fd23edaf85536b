"""How many inference workers each device gets, and how many engine threads each worker runs, when
the settings leave them at 0: chosen from what one image costs the engine and the cores this server
may use. Any flag, env var or config value given for either wins, and the other is fitted around it.

On a CPU one worker decodes a batch, then runs it: while it decodes (Pillow, one image per thread)
and while its Python moves requests and answers, its engine threads wait. A small model (under
SMALL_MODEL_GMACS per image) spends a large share of each image there: several single-threaded
workers keep every core busy, each decoding while another runs its engine. A large model spends
nearly all of each image in its engine, which uses every thread it gets: a worker per
CPU_LARGE_MODEL_THREADS cores, so that a request under load runs on several threads, and at least
MIN_CPU_WORKERS, so that one decodes while another runs its engine. So: small models get a worker
per core (up to MAX_CPU_WORKERS, then more threads each), large and unknown ones a worker per
CPU_LARGE_MODEL_THREADS cores, at least two. Either way workers x threads = the cores; and a lone
image, while the other workers idle, runs on all their threads (service/worker/engine.py:
``with_lone_engine``).

On a GPU one worker per device: its pipeline (depth 2) prepares the next batch while the engine runs
this one, and a second worker would hold a second copy of the engine for the same streaming
multiprocessors. Each GPU worker's CPU threads (torch's, for what runs on the host) share the cores.

Runs in the planner (service/supervisor/planning/planner.py); ``measure_cost`` builds the model's
architecture on the meta device (no weights, no memory) to count its multiply-accumulates.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from service import _defaults

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelCost:
    """What one image costs the engine: billions of multiply-accumulates (None: not known), and how
    that was found."""

    gmacs: float | None
    how: str

    @property
    def small(self) -> bool:
        return self.gmacs is not None and self.gmacs < _defaults.SMALL_MODEL_GMACS

    def describe(self) -> str:
        if self.gmacs is None:
            return f"cost per image unknown ({self.how})"
        return f"{self.gmacs:.2g} GMACs per image ({self.how})"


@dataclass(frozen=True)
class Sizing:
    """The workers per device and engine threads a plan serves with, where each came from and why."""

    workers_per_device: int
    engine_threads: int
    workers_source: str  # "auto" or "set"
    threads_source: str
    cores: int
    why: str

    def describe(self) -> str:
        """One line for the startup log and --print-config."""
        return (
            f"{self.workers_per_device} worker(s) per device ({self.workers_source}) x {self.engine_threads} engine "
            f"thread(s) ({self.threads_source}); {self.why}"
        )

    def to_dict(self) -> dict:
        return {
            "workers_per_device": {"value": self.workers_per_device, "source": self.workers_source},
            "engine_threads": {"value": self.engine_threads, "source": self.threads_source},
            "usable_cores": self.cores,
            "why": self.why,
        }


def choose_sizing(
    workers_per_device: int, engine_threads: int, accelerator: str, devices: int, cores: int, cost: ModelCost
) -> Sizing:
    """Workers per device and engine threads for a plan: the values given (> 0) kept, zeros chosen.

    ``devices``: the GPUs the plan serves on (1 on a CPU); ``cores``: those this server may use
    (service/supervisor/planning/cores.py), already shared among the versions that start together.
    """
    cores = max(1, cores)
    sources = ("set" if workers_per_device else "auto", "set" if engine_threads else "auto")
    if accelerator == "cpu":
        workers, threads, why = _cpu(workers_per_device, engine_threads, cores, cost)
    else:
        workers, threads, why = _gpu(workers_per_device, engine_threads, devices, cores)
    return Sizing(workers, threads, *sources, cores, why)


def _cpu(workers: int, threads: int, cores: int, cost: ModelCost) -> tuple[int, int, str]:
    if workers and threads:
        return workers, threads, "both set"
    if workers:
        return workers, max(1, cores // workers), f"{cores} cores shared by the {workers} workers set"
    if threads:
        return max(1, cores // threads), threads, f"as many {threads}-thread workers as fit {cores} cores"
    if cost.small:
        chosen = min(cores, _defaults.MAX_CPU_WORKERS)
        reason = (
            f"a small model ({cost.describe()}): a worker per core, so that each decodes and moves requests "
            "while the others run the engine"
        )
    else:
        # Two workers at least: one decodes and moves requests while the other runs its engine.
        chosen = max(min(_defaults.MIN_CPU_WORKERS, cores), cores // _defaults.CPU_LARGE_MODEL_THREADS)
        size = "a large model" if cost.gmacs is not None else "a model of unknown size"
        reason = (
            f"{size} ({cost.describe()}): its engine uses every thread it gets, so a worker per "
            f"{_defaults.CPU_LARGE_MODEL_THREADS} cores, and at least {_defaults.MIN_CPU_WORKERS} so that one "
            "decodes while another runs"
        )
    chosen = min(chosen, _defaults.MAX_CPU_WORKERS)
    return chosen, max(1, cores // chosen), f"{cores} usable cores, {reason}"


def _gpu(workers: int, threads: int, devices: int, cores: int) -> tuple[int, int, str]:
    chosen = workers or _defaults.GPU_WORKERS_PER_DEVICE
    reason = "set" if workers else "one per GPU: its pipeline prepares the next batch while the engine runs this one"
    host_threads = threads or max(1, min(_defaults.GPU_WORKER_MAX_THREADS, cores // (chosen * devices)))
    return chosen, host_threads, f"{devices} GPU(s), {cores} usable cores; workers: {reason}"


def measure_cost(family: str, build: object, model_file: Path | None, input_size: tuple[int, int]) -> ModelCost:
    """``build``: a callable that makes the architecture (run on the meta device) on one image of
    ``input_size`` = (height, width), the preprocessing's ``PreprocessSpec.input_size``; ``model_file``:
    for a model file (ONNX, an exported program), whose weights' size is all that is known without
    loading it."""
    import torch

    if model_file is not None:
        try:
            size = model_file.stat().st_size
        except OSError:
            return ModelCost(None, f"{model_file} unreadable")
        # A file of fp32 weights holds 4 bytes a parameter; image classifiers do 0.1-0.2 GMACs per
        # million parameters (EfficientNet-Lite0 0.08, ResNet-152 0.19): the upper end, so that a
        # large model is never taken for a small one.
        parameters = size / 4
        gmacs = parameters / 1e6 * _defaults.GMACS_PER_MILLION_PARAMETERS
        return ModelCost(gmacs, f"estimated from its {size >> 20} MiB file")
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with torch.device("meta"):
            module = build()  # type: ignore[operator]
        module.eval()
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            height, width = input_size
            module(torch.empty(1, 3, height, width, device="meta"))
    except Exception as exc:  # an architecture that cannot run on meta tensors: fall back to the safe rule
        logger.debug("Could not count the %s model's operations on the meta device: %s", family, exc)
        return ModelCost(None, "its operations could not be counted")
    return ModelCost(counter.get_total_flops() / 2e9, "counted on its architecture")
