"""The planner: what to serve and how, resolved once from the settings, the machine and the artifact
(``plan_serving``: a ``ServePlan``), for every version of a repository (``plan_repository``).

Runs in the planner child process (service/supervisor/planning/__main__.py), and in tests. Resolving
a plan needs torch (how many GPUs, what this CPU runs), the model catalog, the artifact's manifest
checked against this machine and the preprocessing backends. The main process must not import
those: its HTTP processes are forked from it, and would each carry torch (hundreds of MB, and
OpenAI Triton through it) for nothing. So it imports this module's types only
(service/supervisor/planning/plans.py) and starts the child (service/supervisor/planning/launch.py).
The pipeline depth is resolved here, once; the workers use the plan's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from compile.cli_flags import visible_device
from compile.devices import emulated_bf16
from compile.preprocess_flags import PREPROCESS_FIELDS
from compile.settings_errors import SettingsError
from service import _defaults
from service.model_info import ModelInfo, resolve_activation
from service.repository.layout import (
    ModelConfig,
    model_names,
    parse_config_override,
    read_model_folder,
)
from service.settings import ServeSettings, resolve_pipeline_depth
from service.supervisor.planning.cores import usable_cores
from service.supervisor.planning.memory import check_memory
from service.supervisor.planning.plans import LoadRequest, ServePlan, VersionPlan
from service.supervisor.planning.sizing import ModelCost, choose_sizing, measure_cost

if TYPE_CHECKING:
    from compile.catalog import ModelEntry
    from compile.manifest import Manifest

logger = logging.getLogger(__name__)


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
ARTIFACT_FIXED_FLAGS = ("labels", *PREPROCESS_FIELDS)


def apply_artifact(settings: ServeSettings, cuda_count: int) -> tuple[ServeSettings, Manifest]:
    """Settings adjusted to the artifact's manifest, which wins over flags; ``SettingsError`` if they conflict."""
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
        raise SettingsError(
            "--model",
            settings.model,
            f"--model {settings.model} conflicts with --artifact {settings.artifact}, which holds {manifest.model}.",
            "Drop --model: the artifact decides the model.",
        )
    fixed = [f for f in ARTIFACT_FIXED_FLAGS if getattr(settings, f)]
    if fixed:
        flags = ", ".join(f"--{f.replace('_', '-')}" for f in fixed)
        raise SettingsError(
            flags,
            ", ".join(str(getattr(settings, f)) for f in fixed),
            f"{flags}: the artifact {settings.artifact} fixes its labels and preprocessing (the accuracy gate checked "
            "them).",
            f"Drop the flags, or compile a new artifact with them: compile-trt --model ... {flags}.",
        )
    if settings.weights != _defaults.WEIGHTS:
        raise SettingsError(
            "--weights",
            settings.weights,
            f"--weights {settings.weights} has no effect with --artifact: the engine was compiled with "
            f"{manifest.weights_source}.",
            "Drop --weights, or compile a new artifact with compile-trt --weights.",
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


def model_cost(entry: ModelEntry, manifest: Manifest | None, artifact: str) -> ModelCost:
    """What one image costs the model ``entry`` (an artifact's, or the eager one) to run."""
    from compile.weights import FILE_FAMILIES, build_architecture

    model_file = None
    if entry.family in FILE_FAMILIES:
        model_file = Path(artifact) / manifest.engine_file if manifest is not None else Path(entry.model)
    return measure_cost(entry.family, lambda: build_architecture(entry), model_file, entry.preprocess.input_size)


def plan_serving(settings: ServeSettings, cuda_count: int | None = None, cores: int | None = None) -> ServePlan:
    """The plan for ``settings`` on this machine; ``ValueError`` says what to change (a ``SettingsError``
    when it is a setting's value). Imports torch.

    ``cores``: those this plan's workers may use (default: every core this process may use)."""
    import torch

    from compile.catalog import entry_from_manifest
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
    try:
        preprocess, reason = resolve_preprocess_backend(settings.preprocess, worker_device)
    except ValueError as exc:  # preprocessing/ knows no flags; its message says what to use instead
        raise SettingsError("--preprocess", settings.preprocess, str(exc), "") from None
    if manifest is not None:
        spec, labels_source, labels = manifest.preprocess, manifest.labels_source, manifest.labels
        weights, engine = manifest.weights_source, manifest.engine_name
        entry = entry_from_manifest(manifest)
    else:
        # Fail fast on a bad name, labels file or model file, before spawning workers.
        entry = resolve_model(ModelRequest.from_settings(settings))
        spec, labels_source, labels = entry.preprocess, entry.labels_source, entry.labels
        weights, engine = settings.weights, eager_engine_name(entry.family)
        settings = dataclasses.replace(settings, name=entry.name)
    # The cost decides only what a CPU leaves to the server: skip counting it otherwise.
    chooses = accelerator == "cpu" and not (settings.workers_per_device and settings.engine_threads)
    cost = model_cost(entry, manifest, settings.artifact) if chooses else ModelCost(None, "not needed")
    sizing = choose_sizing(
        settings.workers_per_device,
        settings.engine_threads,
        accelerator,
        1 if accelerator == "cpu" else int(devices),
        usable_cores() if cores is None else cores,
        cost,
    )
    logger.info("Serving %s: %s", settings.name, sizing.describe())
    slow = None if manifest is None else emulated_bf16(manifest.precision, accelerator)
    if slow:
        logger.warning(
            "Serving %s from %s: %s For this machine, compile an fp32 or int8 artifact.",
            settings.name,
            settings.artifact,
            slow,
        )
    settings = dataclasses.replace(
        settings, workers_per_device=sizing.workers_per_device, engine_threads=sizing.engine_threads
    )
    model = ModelInfo(
        model=settings.name,
        weights=weights,
        engine=engine,
        preprocess=preprocess,
        preprocess_reason=reason,
        preprocess_spec=spec.to_dict(),
        preprocess_summary=spec.describe(),
        labels_source=labels_source,
        device="cpu" if accelerator == "cpu" else ("cuda" if settings.device == "auto" else settings.device),
        max_batch_size=settings.max_batch_size,
        batch_timeout_ms=settings.batch_timeout_ms,
        artifact=None
        if manifest is None
        else artifact_facts(settings.artifact, manifest) | ({"warning": slow} if slow else {}),
        source=settings.model,
        labels=labels,
        sizing=sizing.to_dict(),
        activation=resolve_activation(settings.activation, entry.activation),
    )
    workers = (1 if accelerator == "cpu" else devices) * settings.workers_per_device
    settings = dataclasses.replace(
        settings, pipeline_depth=resolve_pipeline_depth(settings.pipeline_depth, accelerator)
    )
    # The HTTP processes are counted for the whole server, from every version's workers
    # (service/supervisor/planning/layout.py).
    return ServePlan(settings, accelerator, devices, worker_env, workers, model)


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
        activation=config.activation or settings.activation,
        worker_isolation=config.isolation or settings.worker_isolation,
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
        chosen = []
        for folder, override in folders:
            config = folder.config.merged(override)
            for version in config.policy.select(list(folder.versions)):
                chosen.append((folder, version, config))
        # The versions that start together share the cores; a later load sizes its own as if alone.
        # Versions in shared worker processes take turns there (service/worker/turns.py): together
        # they count once, each on every core of its processes.
        isolated = sum((config.isolation or settings.worker_isolation) == "process" for _, _, config in chosen)
        groups = isolated + (isolated < len(chosen))
        cores = max(1, usable_cores() // max(1, groups))
        plans = []
        for folder, version, config in chosen:
            try:
                version_plan = plan_serving(
                    version_settings(settings, folder.name, folder.versions[version], config), cuda_count, cores
                )
            except (ValueError, OSError) as exc:
                error = SettingsError.of(exc)
                raise error.with_message(f"Model {folder.name!r} version {version}: {error.message}") from None
            plans.append(VersionPlan(folder.name, version, version_plan))
    if load is None and settings.model_repository and settings.model_control == "none":
        # Served on demand: the main process loads what its memory budget holds, the rest when asked
        # for (service/supervisor/pool/on_demand.py); a repository larger than memory is no error.
        return plans
    try:
        check_memory(plans)
    except ValueError:
        # Workers the server chose, not the user: one each (their threads take the cores) before
        # refusing. What the user set is refused with the numbers, as before.
        fewer = [one_worker(plan) for plan in plans]
        if fewer == plans:
            raise
        check_memory(fewer)
        logger.warning("Not enough free memory for the workers chosen for this machine: one worker per model.")
        plans = fewer
    return plans


def one_worker(plan: VersionPlan) -> VersionPlan:
    """``plan`` with one worker on all its cores, if it runs on a CPU with several workers it chose."""
    serve_plan, sizing = plan.serve_plan, plan.serve_plan.model.sizing or {}
    chose = sizing.get("workers_per_device", {}).get("source") == "auto"
    if serve_plan.accelerator != "cpu" or not chose or serve_plan.workers == 1:
        return plan
    settings = serve_plan.settings
    threads = settings.engine_threads * settings.workers_per_device
    settings = dataclasses.replace(settings, workers_per_device=1, engine_threads=threads)
    sizing = {
        **sizing,
        "workers_per_device": {"value": 1, "source": "auto"},
        "engine_threads": {"value": threads, "source": sizing["engine_threads"]["source"]},
        "why": f"{sizing['why']}; then one worker: the free memory holds no more",
    }
    model = dataclasses.replace(serve_plan.model, sizing=sizing)
    return dataclasses.replace(
        plan, serve_plan=dataclasses.replace(serve_plan, settings=settings, workers=1, model=model)
    )
