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
from pathlib import Path
from typing import TYPE_CHECKING

from compile.cli_flags import visible_device
from service import _defaults
from service.model_info import ModelInfo
from service.repository.layout import (
    ModelConfig,
    model_names,
    parse_config_override,
    read_model_folder,
)
from service.settings import ServeSettings, resolve_api_servers, resolve_pipeline_depth
from service.supervisor.memory import check_memory

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
        """Without the keys: the plan crosses a pipe, and the keys never need to."""
        plan = asdict(self)
        plan["settings"]["api_key"] = plan["settings"]["admin_api_key"] = ""
        return json.dumps(plan)

    @classmethod
    def from_json(cls, text: str, keys: ServeSettings | None = None) -> ServePlan:
        """``keys``: the settings whose API keys the plan gets back."""
        plan = json.loads(text)
        secrets = {} if keys is None else {"api_key": keys.api_key, "admin_api_key": keys.admin_api_key}
        settings = ServeSettings(**{**plan.pop("settings"), **secrets})
        return cls(settings=settings, model=ModelInfo(**plan.pop("model")), **plan)


@dataclass(frozen=True)
class VersionPlan:
    """One version of one model of the repository, planned: a single --model or --artifact is
    version 1 of a one-model repository."""

    name: str
    version: int
    plan: ServePlan

    def to_dict(self) -> dict:
        return {"name": self.name, "version": self.version, "plan": json.loads(self.plan.to_json())}

    @classmethod
    def from_dict(cls, data: dict, keys: ServeSettings | None = None) -> VersionPlan:
        return cls(data["name"], data["version"], ServePlan.from_json(json.dumps(data["plan"]), keys))


@dataclass(frozen=True)
class LoadRequest:
    """What a repository load asks the planner for: one model, with a load call's config override."""

    model: str
    config: str = ""  # Triton's model config as JSON, or ""


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


def version_settings(settings: ServeSettings, name: str, artifact: Path, config: ModelConfig) -> ServeSettings:
    """The server's settings for one version of a repository model: its artifact, its served name,
    and the flags its config.toml (or a load call) sets for it. (The repository flags stay with the
    server's own settings: a version is served as one --artifact.)"""
    return dataclasses.replace(
        settings,
        model_repository="",
        model_control="none",
        default_model="",
        artifact=str(artifact),
        name=name,
        workers_per_device=config.workers_per_device or settings.workers_per_device,
        max_batch_size=config.max_batch_size or settings.max_batch_size,
        batch_timeout_ms=settings.batch_timeout_ms if config.batch_timeout_ms is None else config.batch_timeout_ms,
    )


def plan_repository(
    settings: ServeSettings, load: LoadRequest | None = None, cuda_count: int | None = None
) -> list[VersionPlan]:
    """The versions to serve: of every model in ``--model-repository`` at start (``load`` None), or
    of the one model a load call names; of the single --model or --artifact without a repository.
    ``ValueError`` says what to fix; a load that would not fit in memory is refused here."""
    if not settings.model_repository:
        plan = plan_serving(settings, cuda_count)
        plans = [VersionPlan(plan.settings.served_name, 1, plan)]
    else:
        repository = Path(settings.model_repository).expanduser()
        if load is None:
            folders = [(read_model_folder(repository, name), ModelConfig()) for name in model_names(repository)]
        else:
            override = parse_config_override(load.config) if load.config else ModelConfig()
            folders = [(read_model_folder(repository, load.model), override)]
        plans = []
        for folder, override in folders:
            config = folder.config.merged(override)
            for version in config.policy.select(list(folder.versions)):
                try:
                    chosen = version_settings(settings, folder.name, folder.versions[version], config)
                    plan = plan_serving(chosen, cuda_count)
                except (ValueError, OSError) as exc:
                    raise ValueError(f"Model {folder.name!r} version {version}: {exc}") from None
                plans.append(VersionPlan(folder.name, version, plan))
    check_memory(plans)
    return plans


class PlanningFailed(RuntimeError):
    """The planner process failed for a reason other than the settings (its output says why)."""


class Planning:
    """The planner process, started; ``result()`` waits for its ``VersionPlan``s."""

    def __init__(self, settings: ServeSettings, load: LoadRequest | None = None) -> None:
        self._keys = settings
        public = dataclasses.replace(settings, api_key="", admin_api_key="")
        self._process = subprocess.Popen(
            PLANNER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self._input = json.dumps({"settings": asdict(public), "load": None if load is None else asdict(load)})

    def result(self, timeout_s: float | None = None) -> list[VersionPlan]:
        """The plans; ``ValueError`` with the planner's message when the settings cannot be served."""
        try:
            stdout, stderr = self._process.communicate(self._input, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.communicate()
            raise ValueError(f"Planning took longer than {timeout_s:g} s (--load-timeout-s).") from None
        if stderr.strip():
            sys.stderr.write(stderr)  # its log records and warnings, as if this process had written them
        try:
            answer = json.loads(stdout)
        except ValueError:
            raise PlanningFailed(f"the planner exited with code {self._process.returncode}; see above.") from None
        if "error" in answer:
            raise ValueError(answer["error"])
        return [VersionPlan.from_dict(plan, self._keys) for plan in answer["plans"]]


def start_planning(settings: ServeSettings, load: LoadRequest | None = None) -> Planning:
    return Planning(settings, load)


def main() -> None:
    """The planner: ``{"settings", "load"}`` JSON on stdin -> ``{"plans": [...]}`` or ``{"error": message}``."""
    import torch  # noqa: F401  (planning needs it; imported first so its logger can be adopted)

    from service.logs import adopt_torch_logger, configure_logging

    request = json.loads(sys.stdin.read())
    settings = ServeSettings(**request["settings"])
    load = None if request["load"] is None else LoadRequest(**request["load"])
    configure_logging(settings.log_level, settings.log_format)
    adopt_torch_logger()
    try:
        answer = {"plans": [plan.to_dict() for plan in plan_repository(settings, load)]}
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
