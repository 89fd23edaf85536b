"""Does a load fit? The planner's check (``check_memory``, run in the planner child process:
service/supervisor/planning/planner.py), before any worker of a new model version starts.

What one worker needs is estimated as its engine's files twice (the file read, and the weights the
runtime builds from it) plus a base for the process itself: torch and its libraries on a CPU, and a
CUDA context with the runtime's workspace on a GPU. What is free is the machine's ``MemAvailable``
for CPU workers, and ``nvidia-smi``'s free memory of the least free visible GPU for what each GPU's
workers need. During a swap the old
version still serves, so its memory is counted as used, as it is. A load that does not fit is
refused with the numbers; it never starts workers that the kernel's OOM killer would stop.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from service.supervisor.planning.plans import VersionPlan

logger = logging.getLogger(__name__)

MIB = 1 << 20
# The process besides its model: torch and its libraries' code and allocator pools (CPU), or the
# CUDA context, cuDNN/cuBLAS handles and workspace (GPU).
WORKER_BASE_BYTES = {"cpu": 400 * MIB, "cuda": 1024 * MIB}


def directory_bytes(directory: str | Path) -> int:
    path = Path(directory)
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def worker_bytes(plan: VersionPlan) -> int:
    serve_plan = plan.serve_plan
    settings = serve_plan.settings
    files = settings.artifact or (settings.weights if Path(settings.weights).is_file() else settings.model)
    copies = 2
    if (
        serve_plan.accelerator == "cpu"
        and settings.workers_per_device > 1
        and serve_plan.model.engine.startswith("onnx")
    ):
        copies += 1  # its second session, for a lone image (service/worker/engine.py: with_lone_engine)
    return copies * directory_bytes(files) + WORKER_BASE_BYTES[serve_plan.accelerator]


def available_cpu_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_gpu_bytes() -> int | None:
    """Free memory of the least free GPU the workers see, by nvidia-smi (no CUDA context here)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    which = ["-i", visible] if visible and all(part.strip().isdigit() for part in visible.split(",")) else []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=memory.free", "--format=csv,noheader,nounits", *which],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        return min(int(line) for line in out.split()) * MIB
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def check_fits(needed: int, available: int | None, where: str, what: str) -> None:
    """``ValueError`` with the numbers when ``needed`` bytes exceed ``available`` (``None``: unknown)."""
    if available is None:
        logger.warning("Free memory on %s is unknown; loading %s without checking that it fits.", where, what)
        return
    if needed > available:
        raise ValueError(
            f"Not enough memory to load {what}: it needs about {needed / MIB:,.0f} MiB on {where}, which has "
            f"{available / MIB:,.0f} MiB free. Unload a model, lower its workers_per_device, or add memory."
        )


def check_memory(plans: Sequence[VersionPlan]) -> None:
    """Refuse plans whose workers would not fit in what the machine has free now."""
    for accelerator, where, available in (
        ("cpu", "this machine's RAM", available_cpu_bytes),
        ("cuda", "the GPU", available_gpu_bytes),
    ):
        chosen = [plan for plan in plans if plan.serve_plan.accelerator == accelerator]
        if not chosen:
            continue
        # Workers spread evenly over the GPUs (workers_per_device on each): what one GPU must hold.
        per = "workers" if accelerator == "cpu" else "workers_per_device"
        needed = sum(
            worker_bytes(plan)
            * (plan.serve_plan.workers if per == "workers" else plan.serve_plan.settings.workers_per_device)
            for plan in chosen
        )
        what = ", ".join(f"{plan.name} version {plan.version}" for plan in chosen)
        check_fits(needed, available(), where, what)
