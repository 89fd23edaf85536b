"""compile-trt's stages: resolve -> load weights -> (cache hit?) -> compile -> accuracy gate -> artifact.

The artifact is written to a temporary directory next to ``--output`` and renamed into place only
after the gate passes, so a failed compile never leaves (or replaces) an artifact.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from compile import _defaults
from compile.backends import (
    PRECISION_DTYPES,
    BackendUnavailable,
    CompileBackend,
    PrecisionCast,
    get_backend,
    resolve_compile_backend,
)
from compile.catalog import ModelEntry
from compile.devices import describe_device, emulated_bf16, parse_device
from compile.gate import GateInputs, GateReport, gate_inputs, gate_photos, run_gate
from compile.manifest import Manifest, ManifestError, cache_key, read_manifest, sha256_file, write_manifest
from compile.model_files import read_model_file
from compile.model_request import ModelRequest
from compile.model_source import resolve_model
from compile.pretrained_folders import FOLDER_FAMILIES
from compile.progress import Progress
from compile.quantization import Calibration
from compile.quantization.datasets import ImageFiles, check_disjoint, files_digest, preprocess_files, read_image_folder
from compile.settings import CompileSettings
from compile.settings_errors import SettingsError
from compile.versions import PROJECT_DISTRIBUTION, library_versions, package_version
from compile.weights import LoadedModel, load_model
from preprocessing.spec import PreprocessSpec

logger = logging.getLogger(__name__)


class GateFailed(RuntimeError):
    """The compiled engine disagrees with eager fp32 beyond the thresholds; no artifact was written."""

    def __init__(self, report: GateReport) -> None:
        super().__init__("; ".join(report.failures))
        self.report = report


@dataclass
class CompileResult:
    manifest: Manifest
    directory: Path
    cached: bool
    triton_repository: Path | None = None


def resolve_compile_device(device: str, cuda_count: int) -> torch.device:
    """One device to compile on: ``cuda`` and ``auto`` mean the first GPU."""
    index = parse_device(device, cuda_count)
    if index is None:
        return torch.device("cpu")
    return torch.device(f"cuda:{max(index, 0)}")


def default_output(model: str, backend: str, precision: str, device: torch.device) -> Path:
    return Path(_defaults.DEFAULT_OUTPUT_ROOT) / f"{model}-{backend}-{precision}-{device.type}"


def is_artifact_dir(directory: Path) -> bool:
    """Whether ``directory`` holds a compile-trt artifact (of any format version): safe to replace."""
    try:
        data = json.loads((directory / _defaults.MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"format_version", "cache_key", "engine_file"} <= data.keys()


def check_output_dir(output: Path) -> None:
    """Refuse to replace a directory that is not an artifact: it may hold someone's files."""
    if output.exists() and not output.is_dir():
        raise SettingsError(
            "--output", str(output), f"--output {output} is a file.", "Give a directory path (it is created)."
        )
    if output.is_dir() and any(output.iterdir()) and not is_artifact_dir(output):
        raise SettingsError(
            "--output",
            str(output),
            f"--output {output} is a non-empty directory that is not a compile-trt artifact (no valid "
            f"{_defaults.MANIFEST_FILE}); compile-trt only replaces its own artifacts.",
            "Choose a new or empty directory.",
        )


def weights_digest(loaded: LoadedModel) -> tuple[str, str]:
    """(sha256, of what): the weights file where there is one, else the tensors of the state_dict."""
    if loaded.weights_file is not None:
        return sha256_file(loaded.weights_file), "file"
    digest = hashlib.sha256()
    for name, tensor in loaded.module.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest(), "state_dict"


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def cached_artifact(output: Path, key: str, backend: CompileBackend) -> Manifest | None:
    """The manifest at ``output`` if it was built from the same inputs and its engine is intact."""
    try:
        manifest = read_manifest(output)
    except ManifestError:
        return None
    engine = output / manifest.engine_file
    if manifest.cache_key != key or manifest.engine_file != backend.engine_file or not engine.is_file():
        return None
    if sha256_file(engine) != manifest.engine_sha256:
        logger.warning("%s does not match the sha256 in its manifest; recompiling.", engine)
        return None
    return manifest


@dataclass
class CompilePlan:
    """What ``settings`` resolve to on this machine, before any weights are loaded."""

    settings: CompileSettings
    device: torch.device
    backend: CompileBackend
    backend_reason: str
    entry: ModelEntry
    output: Path
    thresholds: dict[str, float]
    photos: list[tuple[str, bytes]]  # the gate's (a quantized engine's: its evaluation set)
    triton_repository: Path | None  # --triton-repository, resolved; None when not asked
    calibration_files: ImageFiles | None = None  # quantized precisions: --calibration, read
    calibration_method: str = ""  # quantized precisions: --calibration-method, resolved for the backend


def plan_compile(settings: CompileSettings) -> CompilePlan:
    """Resolve device, backend, model and output; every argument error surfaces here, before any work."""
    device = resolve_compile_device(settings.device, torch.cuda.device_count())
    backend_name, reason = resolve_compile_backend(settings.backend, device, settings.precision)
    backend = get_backend(backend_name)
    backend.check_available(device)
    backend.check_precision(settings.precision, device)
    slow = emulated_bf16(settings.precision, device.type)
    if slow:
        logger.warning("%s Here, compile --precision fp32 (the default) or int8.", slow)
    method = (
        backend.resolve_calibration_method(settings.precision, settings.calibration_method)
        if settings.quantized
        else ""
    )
    entry = resolve_model(ModelRequest.from_settings(settings))
    check_model_backend(entry, backend_name, settings)
    triton_repository = Path(settings.triton_repository).expanduser() if settings.triton_repository else None
    if triton_repository is not None:
        check_triton_export(backend_name, settings.batch, triton_repository, entry.name, entry.preprocess)
    output = Path(settings.output or default_output(entry.name, backend_name, settings.precision, device))
    output = output.expanduser()
    check_output_dir(output)
    photos = gate_photos(settings.gate_images, quantized=settings.quantized)
    calibration_files = None
    if settings.quantized:
        calibration_files = read_image_folder(settings.calibration, "--calibration", settings.calibration_count)
        if len(calibration_files.files) < _defaults.ADVISED_MIN_CALIBRATION_IMAGES:
            logger.warning(
                "--calibration %s: %d images. Ranges measured on fewer than %d images clip what they did not see; "
                "the gate will tell whether this engine holds up, but a few hundred images like the served ones "
                "calibrate better.",
                settings.calibration,
                len(calibration_files.files),
                _defaults.ADVISED_MIN_CALIBRATION_IMAGES,
            )
    return CompilePlan(
        settings,
        device,
        backend,
        reason,
        entry,
        output,
        settings.gate_thresholds(),
        photos,
        triton_repository,
        calibration_files,
        method,
    )


def check_model_backend(entry: ModelEntry, backend_name: str, settings: CompileSettings) -> None:
    """Which engines a model file can become: ``SettingsError`` with the reason, before any work.

    An ONNX file is served as it is, by ONNX Runtime at fp32 (the other engines compile PyTorch
    programs, and ONNX has no converter back to one here). An ExportedProgram compiles with every
    backend that exports (inductor, onnx, tensorrt); eager rebuilds catalog architectures only.
    """
    if entry.family == "onnx" and (backend_name != "onnx" or settings.precision not in ("fp32", "int8")):
        raise SettingsError(
            "--backend, --precision",
            f"{backend_name}, {settings.precision}",
            f"{entry.model} is an ONNX file: it is served as it is by ONNX Runtime (--backend onnx --precision fp32), "
            f"or quantized (--precision int8 --calibration DIR), not {backend_name} at {settings.precision}.",
            "For other engines or precisions export the PyTorch model with torch.export.save and compile that .pt2.",
        )
    if entry.family == "exported-program" and backend_name == "eager":
        raise SettingsError(
            "--backend",
            backend_name,
            f"--backend eager rebuilds a catalog architecture from saved weights; {entry.model} is a program.",
            f"Use --backend inductor or onnx, or serve the file without compiling: vision-serve --model {entry.model}.",
        )
    if entry.family in ("onnx", "exported-program"):
        read_model_file(entry.model).check_batch(settings.batch)


def check_triton_export(
    backend_name: str, batch: tuple[int, int, int], repository: Path, model: str, spec: PreprocessSpec
) -> None:
    """Whether ``--triton-repository`` can be written for this compile (an onnx engine, a folder it may
    write, DALI installed, a preprocessing DALI reproduces), before any work."""
    from compile.triton_repository import check_exportable, check_repository
    from preprocessing.dali_backend import dali_problem, spec_problem

    check_exportable(backend_name, batch)
    check_repository(repository, model)
    problem = dali_problem()
    if problem:
        raise BackendUnavailable(f"--triton-repository writes a DALI preprocessing model: {problem}")
    unsupported = spec_problem(spec)
    if unsupported:
        raise SettingsError("--triton-repository", str(repository), f"--triton-repository: {unsupported}", "")


def engine_cache_key(
    plan: CompilePlan, weights_sha256: str, versions: dict, device_info: dict, backend_config: dict
) -> str:
    """Everything that makes one artifact differ from another, hashed."""
    settings, entry = plan.settings, plan.entry
    return cache_key(
        {
            "format": _defaults.MANIFEST_FORMAT_VERSION,
            "vision_serve": package_version(PROJECT_DISTRIBUTION),
            "model": entry.model,
            "name": entry.name,
            "family": entry.family,
            "weights_sha256": weights_sha256,
            "preprocess": entry.preprocess.to_dict(),
            "labels_sha256": sha256_text("\n".join(entry.labels)),
            "backend": plan.backend.name,
            "backend_config": backend_config,
            "precision": settings.precision,
            "batch": list(settings.batch),
            "device": device_info,
            "versions": versions,
            "gate": {
                "thresholds": plan.thresholds,
                "photos_sha256": [hashlib.sha256(data).hexdigest() for _, data in plan.photos],
                "random_inputs": gate_random_inputs(settings),
                "seed": _defaults.GATE_SEED,
            },
            "quantization": quantization_record(plan),
        }
    )


def gate_random_inputs(settings: CompileSettings) -> int:
    """Seeded random inputs the gate adds to its photos: none for a quantized engine, whose scales
    were calibrated on photos (noise falls outside their ranges and would grade the clipping)."""
    return 0 if settings.quantized else _defaults.GATE_RANDOM_INPUTS


def quantization_record(plan: CompilePlan) -> dict[str, Any]:
    """What the manifest (and the cache key) says of a quantized engine's calibration and evaluation
    sets; {} for other precisions."""
    if plan.calibration_files is None:
        return {}
    calibration: dict[str, Any] = {"method": plan.calibration_method, **plan.calibration_files.describe()}
    if plan.calibration_method == "percentile":
        calibration["percentile"] = _defaults.CALIBRATION_PERCENTILE
    evaluation = {
        "source": plan.settings.gate_images
        or f"sample photos and {_defaults.EVAL_AUGMENTATIONS_PER_PHOTO} augmentations of each",
        "count": len(plan.photos),
        "sha256": files_digest(plan.photos),
    }
    return {"calibration": calibration, "evaluation": evaluation}


def compile_artifact(settings: CompileSettings, progress: Progress | None = None) -> CompileResult:
    """Compile per ``settings``; returns the artifact (a cache hit returns the existing one)."""
    progress = progress or Progress(live=False)
    started = time.perf_counter()
    plan = plan_compile(settings)
    entry, backend, device = plan.entry, plan.backend, plan.device
    logger.info(
        "Compiling %s with %s (%s), precision %s, batch %s, on %s -> %s",
        entry.name,
        backend.name,
        plan.backend_reason,
        settings.precision,
        ",".join(map(str, settings.batch)),
        device,
        plan.output,
    )
    with progress.stage(f"Loading {entry.name} weights ({settings.weights})"):
        loaded = load_model(entry, settings.weights)
        weights_sha256, sha256_of = weights_digest(loaded)
    versions = library_versions(backend.extra_versions())
    device_info = describe_device(device)
    backend_config = backend.config(settings, device)
    key = engine_cache_key(plan, weights_sha256, versions, device_info, backend_config)
    with output_lock(plan.output):
        if not settings.force and (manifest := cached_artifact(plan.output, key, backend)) is not None:
            logger.info("Cache hit: %s already holds this engine (key %s); --force rebuilds it.", plan.output, key)
            return CompileResult(manifest, plan.output, cached=True, triton_repository=export_triton(plan, manifest))
        staging = plan.output.parent / f"{staging_prefix(plan.output)}{os.getpid()}"
        staging.mkdir(parents=True)
        try:
            manifest = _manifest(
                settings, entry, loaded, backend, device_info, versions, key, weights_sha256, sha256_of, backend_config
            )
            manifest = build_and_gate(plan, loaded, manifest, staging, progress)
            write_manifest(staging, manifest)
            _move_into_place(staging, plan.output)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        logger.info("Artifact written to %s in %.1f s", plan.output, time.perf_counter() - started)
        return CompileResult(manifest, plan.output, cached=False, triton_repository=export_triton(plan, manifest))


def export_triton(plan: CompilePlan, manifest: Manifest) -> Path | None:
    """The Triton model repository of ``--triton-repository``, written from the artifact; None if not asked."""
    if plan.triton_repository is None:
        return None
    from compile.triton_repository import write_triton_repository

    write_triton_repository(plan.output, manifest, plan.triton_repository)
    return plan.triton_repository


def build_and_gate(
    plan: CompilePlan, loaded: LoadedModel, manifest: Manifest, staging: Path, progress: Progress
) -> Manifest:
    """Compile into ``staging``, load the engine back, and gate it; returns the completed manifest."""
    settings, backend, device, entry = plan.settings, plan.backend, plan.device, plan.entry
    reference = loaded.module.to(device).to(memory_format=torch.channels_last).eval()
    engine_path = staging / backend.engine_file
    inputs = gate_inputs(entry, plan.photos, gate_random_inputs(settings), _defaults.GATE_SEED)
    calibration = None
    if plan.calibration_files is not None:
        with progress.stage(f"Reading {len(plan.calibration_files.files)} calibration images"):
            calibration = prepare_calibration(plan, inputs)
    compile_started = time.perf_counter()
    with progress.stage(f"Compiling with {backend.name} ({settings.precision})"):
        model = PrecisionCast(copy.deepcopy(reference), PRECISION_DTYPES[settings.precision]).eval()
        try:
            backend.build(model, settings, device, entry.preprocess.input_size, engine_path, calibration)
        except BackendUnavailable:
            raise
        except Exception as exc:
            if entry.family not in FOLDER_FAMILIES:
                raise
            raise folder_export_failed(entry, backend.name, exc) from exc
        del model
    manifest = dataclasses.replace(
        manifest,
        compile_seconds=round(time.perf_counter() - compile_started, 2),
        engine_sha256=sha256_file(engine_path),
    )
    with progress.stage("Accuracy gate (compiled vs eager fp32)"):
        gate_started = time.perf_counter()
        engine = backend.load(engine_path, manifest, device)
        report = run_gate(engine, reference, inputs, settings.batch, plan.thresholds, device, entry.labels)
        report.seconds = round(time.perf_counter() - gate_started, 2)
    if not report.passed:
        raise GateFailed(report)
    return dataclasses.replace(manifest, validation=report.to_dict(), quantization=quantization_record(plan))


def folder_export_failed(entry: ModelEntry, backend_name: str, exc: Exception) -> BackendUnavailable:
    """A saved folder's architecture that this backend cannot export: the error names both."""
    from compile.pretrained_folders import architecture_of

    architecture = architecture_of(Path(entry.model), entry.family)
    reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:500]
    return BackendUnavailable(
        f"--backend {backend_name} cannot export {architecture} ({entry.model}): {reason}. Serve it eagerly "
        f"(vision-serve --model {entry.model}) or try another --backend."
    )


def prepare_calibration(plan: CompilePlan, inputs: GateInputs) -> Calibration:
    """The calibration images preprocessed as served, after checking that none is in the gate's set."""
    assert plan.calibration_files is not None
    images = preprocess_files(plan.calibration_files, plan.entry.preprocess, "--calibration")
    real = inputs.real_count
    check_disjoint(images, plan.calibration_files.names, inputs.images[:real], inputs.names[:real])
    return Calibration(images, plan.calibration_method, plan.calibration_files)


def staging_prefix(output: Path) -> str:
    return f".{output.name}.tmp-"


def old_prefix(output: Path) -> str:
    return f".{output.name}.old-"


def lock_path(output: Path) -> Path:
    return output.parent / f".{output.name}.lock"


@contextlib.contextmanager
def output_lock(output: Path) -> Iterator[None]:
    """Hold an exclusive lock for ``output`` while checking, building and replacing it.

    Two compiles into the same folder take turns (an identical second one then finds a cache hit):
    pods sharing one artifact volume compile once. Under the lock, leftovers of a compile that was
    killed are cleaned up: a half-built staging folder is removed, and an old artifact that was
    moved aside but not replaced is put back. The lock is a regular file opened for writing: on
    NFS (the usual shared volume) Linux emulates flock with POSIX locks, which need a writable file.
    """
    output.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path(output), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("Another compile-trt is writing into %s; waiting for it.", output.parent)
            fcntl.flock(fd, fcntl.LOCK_EX)
        _clean_leftovers(output)
        yield
    finally:
        os.close(fd)  # releases the lock


def _clean_leftovers(output: Path) -> None:
    old = sorted(output.parent.glob(old_prefix(output) + "*"), key=lambda p: p.stat().st_mtime)
    if old and not output.exists():
        logger.warning("Restoring %s from %s, left by a compile that was interrupted.", output, old[-1])
        old[-1].rename(output)
    for leftover in [*output.parent.glob(staging_prefix(output) + "*"), *output.parent.glob(old_prefix(output) + "*")]:
        shutil.rmtree(leftover, ignore_errors=True)


def _manifest(
    settings: CompileSettings,
    entry: ModelEntry,
    loaded: LoadedModel,
    backend: CompileBackend,
    device_info: dict[str, str],
    versions: dict[str, str],
    key: str,
    weights_sha256: str,
    sha256_of: str,
    backend_config: dict[str, Any],
) -> Manifest:
    """The manifest as far as it is known before the build; build_and_gate fills in the rest."""
    low, opt, high = settings.batch
    return Manifest(
        format_version=_defaults.MANIFEST_FORMAT_VERSION,
        model=entry.model,
        name=entry.name,
        model_family=entry.family,
        weights_source=loaded.weights_source,
        weights_sha256=weights_sha256,
        weights_sha256_of=sha256_of,
        preprocess=entry.preprocess,
        labels_source=entry.labels_source,
        labels=entry.labels,
        backend=backend.name,
        precision=settings.precision,
        batch_min=low,
        batch_opt=opt,
        batch_max=high,
        device_type=device_info["type"],
        device_name=device_info["name"],
        device_capability=device_info["capability"],
        device_isa=device_info.get("isa", ""),
        engine_file=backend.engine_file,
        engine_sha256="",
        versions=versions,
        compiled_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        compile_seconds=0.0,
        compile_settings=settings.as_dict(),
        validation={},
        cache_key=key,
        backend_config=backend_config,
        activation=entry.activation,
    )


def _move_into_place(staging: Path, output: Path) -> None:
    """Replace ``output`` with ``staging``; if that fails, the old artifact is put back."""
    previous = None
    if output.exists():
        previous = output.parent / f"{old_prefix(output)}{os.getpid()}"
        output.rename(previous)
    try:
        staging.rename(output)
    except OSError:
        if previous is not None:
            previous.rename(output)
        raise
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)
