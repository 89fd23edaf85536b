"""What to serve and how, resolved once from the settings, the machine and the artifact: ``ServePlan``.

Resolving it needs torch (how many GPUs, what this CPU runs), the model catalog, the artifact's
manifest checked against this machine and the preprocessing backends. The main process must not
import those: its HTTP processes are forked from it, and would each carry torch (hundreds of MB, and
OpenAI Triton through it) for nothing. So the plan is made in a short-lived child process,
``python -m service.supervisor.plan``, which reads the settings as JSON on stdin and writes the plan
(or the error that says what to fix) as JSON on stdout; ``start_planning`` starts it, and the main
process imports its web stack meanwhile.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from compile.cli_flags import visible_device
from service import _defaults
from service.model_info import ModelInfo
from service.settings import ServeSettings, resolve_api_servers, resolve_pipeline_depth

if TYPE_CHECKING:
    from compile.manifest import Manifest

logger = logging.getLogger(__name__)

PLANNER = (sys.executable, "-m", "service.supervisor.plan")


@dataclass(frozen=True)
class ServePlan:
    """The settings with what the artifact and the machine decided (model, device, largest batch,
    pipeline depth), and how LitServe lays out the processes."""

    settings: ServeSettings
    accelerator: str  # "cpu" or "cuda"
    devices: int | str  # LitServer's: a number of GPUs, or "auto" on a CPU
    worker_env: dict[str, str]  # set before the workers spawn: CUDA_VISIBLE_DEVICES for one chosen GPU
    workers: int
    api_servers: int
    model: ModelInfo

    def to_json(self) -> str:
        """Without the API key: the plan crosses a pipe, and the key never needs to."""
        plan = asdict(self)
        plan["settings"]["api_key"] = ""
        return json.dumps(plan)

    @classmethod
    def from_json(cls, text: str, api_key: str = "") -> ServePlan:
        plan = json.loads(text)
        settings = ServeSettings(**{**plan.pop("settings"), "api_key": api_key})
        return cls(settings=settings, model=ModelInfo(**plan.pop("model")), **plan)


def resolve_device(
    device: str, cuda_count: int, visible_devices: str | None = None
) -> tuple[str, int | str, dict[str, str]]:
    """``--device`` -> (LitServer accelerator, devices, environment for the workers).

    ``visible_devices`` is the CUDA_VISIBLE_DEVICES already in force: torch numbers GPUs within it.
    """
    from compile.devices import ALL_GPUS, parse_device

    index = parse_device(device, cuda_count)
    if index is None:
        return "cpu", "auto", {}
    if index == ALL_GPUS:
        return "cuda", cuda_count, {}
    # One chosen GPU: show the worker only that one, and it becomes its cuda:0.
    return "cuda", 1, {"CUDA_VISIBLE_DEVICES": visible_device(index, visible_devices)}


# Flags an artifact's manifest decides (the served name may still be chosen at serving time).
ARTIFACT_FIXED_FLAGS = ("labels", "resize_size", "crop_size", "mean", "std", "interpolation")


def apply_artifact(settings: ServeSettings, cuda_count: int) -> tuple[ServeSettings, Manifest]:
    """Settings adjusted to the artifact's manifest, which wins over flags; ``ValueError`` if they conflict."""
    import torch

    from compile.devices import describe_device
    from compile.manifest import read_manifest
    from service.worker.engine import ensure_servable

    manifest = read_manifest(settings.artifact)
    device = settings.device
    if device == "auto":
        device = manifest.device_type  # serve where it was compiled for
    if manifest.backend == "tensorrt" and device == "cuda" and cuda_count > 1:
        # A deserialized TensorRT engine is bound to one GPU; a worker per GPU would each need its own.
        logger.warning(
            "TensorRT artifacts are served on one GPU per server: using cuda:0 of %d. Run one vision-serve "
            "per GPU with --device cuda:N to use them all.",
            cuda_count,
        )
        device = "cuda:0"
    device_type = "cpu" if device == "cpu" else "cuda"
    # Describing the CPU is cheap; describing a GPU would create a CUDA context in this process.
    here = describe_device(torch.device("cpu")) if device_type == "cpu" else None
    ensure_servable(manifest, settings.artifact, device_type, here)
    if settings.model not in (_defaults.MODEL, manifest.model):
        raise ValueError(
            f"--model {settings.model} conflicts with --artifact {settings.artifact}, which holds {manifest.model}. "
            "Drop --model: the artifact decides the model."
        )
    fixed = [f for f in ARTIFACT_FIXED_FLAGS if getattr(settings, f)]
    if fixed:
        flags = ", ".join(f"--{f.replace('_', '-')}" for f in fixed)
        raise ValueError(
            f"{flags}: the artifact {settings.artifact} fixes its labels and preprocessing (the accuracy gate checked "
            "them). Drop the flags, or compile a new artifact with them: compile-trt --model ... " + flags + "."
        )
    if settings.weights != _defaults.WEIGHTS:
        raise ValueError(
            f"--weights has no effect with --artifact: the engine was compiled with {manifest.weights_source}. "
            "Drop --weights, or compile a new artifact with compile-trt --weights."
        )
    max_batch_size = settings.max_batch_size
    if max_batch_size > manifest.batch_max:
        logger.warning(
            "--max-batch-size %d is above the artifact's largest batch %d; using %d. Compile with "
            "compile-trt --batch MIN,OPT,%d to batch more.",
            max_batch_size,
            manifest.batch_max,
            manifest.batch_max,
            max_batch_size,
        )
        max_batch_size = manifest.batch_max
    adjusted = dataclasses.replace(
        settings,
        model=manifest.model,
        name=settings.name or manifest.served_name,
        device=device,
        max_batch_size=max_batch_size,
    )
    return adjusted, manifest


def artifact_facts(directory: str, manifest: Manifest) -> dict:
    return {
        "directory": directory,
        "backend": manifest.backend,
        "precision": manifest.precision,
        "batch": {"min": manifest.batch_min, "opt": manifest.batch_opt, "max": manifest.batch_max},
        "device": {
            "type": manifest.device_type,
            "name": manifest.device_name,
            "capability": manifest.device_capability,
        },
        "weights_sha256": manifest.weights_sha256,
        "compiled_at": manifest.compiled_at,
        "versions": manifest.versions,
        "validation": manifest.validation.get("metrics", {}),
        "cache_key": manifest.cache_key,
        "backend_config": manifest.backend_config,
    }


def plan_serving(settings: ServeSettings, cuda_count: int | None = None, cpu_count: int | None = None) -> ServePlan:
    """The plan for ``settings`` on this machine; ``ValueError`` says what to change. Imports torch."""
    import torch

    from compile.model_request import ModelRequest
    from compile.model_source import resolve_model
    from preprocessing import resolve_preprocess_backend
    from service.worker.engine import eager_engine_name

    cuda_count = torch.cuda.device_count() if cuda_count is None else cuda_count
    manifest = None
    if settings.artifact:
        settings, manifest = apply_artifact(settings, cuda_count)
    accelerator, devices, worker_env = resolve_device(
        settings.device, cuda_count, os.environ.get("CUDA_VISIBLE_DEVICES")
    )
    worker_device = "cpu" if accelerator == "cpu" else "cuda:0"
    preprocess, reason = resolve_preprocess_backend(settings.preprocess, worker_device)
    if manifest is not None:
        spec, labels_source = manifest.preprocess, manifest.labels_source
        weights, engine = manifest.weights_source, manifest.engine_name
    else:
        # Fail fast on a bad name, labels file or model file, before spawning workers.
        entry = resolve_model(ModelRequest.from_settings(settings))
        spec, labels_source = entry.preprocess, entry.labels_source
        weights, engine = settings.weights, eager_engine_name(entry.family)
        settings = dataclasses.replace(settings, name=entry.name)
    model = ModelInfo(
        model=settings.name,
        weights=weights,
        engine=engine,
        preprocess=preprocess,
        preprocess_reason=reason,
        preprocess_spec=spec.to_dict(),
        labels_source=labels_source,
        device="cpu" if accelerator == "cpu" else ("cuda" if settings.device == "auto" else settings.device),
        max_batch_size=settings.max_batch_size,
        batch_timeout_ms=settings.batch_timeout_ms,
        artifact=None if manifest is None else artifact_facts(settings.artifact, manifest),
        source=settings.model,
    )
    workers = (1 if accelerator == "cpu" else devices) * settings.workers_per_device
    settings = dataclasses.replace(
        settings, pipeline_depth=resolve_pipeline_depth(settings.pipeline_depth, accelerator)
    )
    api_servers = resolve_api_servers(settings.api_servers, accelerator, workers, cpu_count or os.cpu_count() or 1)
    return ServePlan(settings, accelerator, devices, worker_env, workers, api_servers, model)


class PlanningFailed(RuntimeError):
    """The planner process failed for a reason other than the settings (its output says why)."""


class Planning:
    """The planner process, started; ``result()`` waits for its ``ServePlan``."""

    def __init__(self, settings: ServeSettings) -> None:
        self._api_key = settings.api_key
        public = dataclasses.replace(settings, api_key="")
        self._process = subprocess.Popen(
            PLANNER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self._input = json.dumps(asdict(public))

    def result(self) -> ServePlan:
        """The plan; ``ValueError`` with the planner's message when the settings cannot be served."""
        stdout, stderr = self._process.communicate(self._input)
        if stderr.strip():
            sys.stderr.write(stderr)  # its log records and warnings, as if this process had written them
        try:
            answer = json.loads(stdout)
        except ValueError:
            raise PlanningFailed(f"the planner exited with code {self._process.returncode}; see above.") from None
        if "error" in answer:
            raise ValueError(answer["error"])
        return ServePlan.from_json(json.dumps(answer["plan"]), self._api_key)


def start_planning(settings: ServeSettings) -> Planning:
    return Planning(settings)


def main() -> None:
    """The planner: settings JSON on stdin -> ``{"plan": ...}`` or ``{"error": message}`` on stdout."""
    import torch  # noqa: F401  (planning needs it; imported first so its logger can be adopted)

    from service.logs import adopt_torch_logger, configure_logging

    settings = ServeSettings(**json.loads(sys.stdin.read()))
    configure_logging(settings.log_level, settings.log_format)
    adopt_torch_logger()
    try:
        answer = {"plan": json.loads(plan_serving(settings).to_json())}
    except ValueError as exc:
        answer = {"error": str(exc)}
    sys.stdout.write(json.dumps(answer))
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter shutdown: libraries torch loads (OpenAI Triton's nanobind) can report "leaked"
    # objects at exit, which would reach the server's log as if they were ours.
    os._exit(0)


if __name__ == "__main__":
    main()
