"""compile-trt's stages: resolve -> load weights -> (cache hit?) -> compile -> accuracy gate -> artifact.

The artifact is written to a temporary directory next to ``--output`` and renamed into place only
after the gate passes, so a failed compile never leaves (or replaces) an artifact.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import hashlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from compile import _defaults
from compile.backends import PRECISION_DTYPES, CompileBackend, PrecisionCast, get_backend, resolve_backend
from compile.catalog import ModelEntry, get_model_entry
from compile.features import describe_device, library_versions
from compile.gate import GateReport, gate_inputs, run_gate, sample_photos
from compile.manifest import Manifest, ManifestError, cache_key, read_manifest, sha256_file, write_manifest
from compile.progress import Progress
from compile.settings import CompileSettings
from compile.weights import LoadedModel, load_model

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


def resolve_compile_device(device: str, cuda_count: int) -> torch.device:
    if device == "auto":
        return torch.device("cuda:0" if cuda_count else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if cuda_count == 0:
        raise ValueError(f"--device {device} asks for a GPU, but torch sees none. Use --device cpu or auto.")
    if device == "cuda":
        return torch.device("cuda:0")
    index = device.removeprefix("cuda:")
    if not index.isdigit() or int(index) >= cuda_count:
        raise ValueError(f"--device {device}: there are {cuda_count} GPUs, so use cuda:0 .. cuda:{cuda_count - 1}.")
    return torch.device(f"cuda:{index}")


def default_output(model: str, backend: str, precision: str, device: torch.device) -> Path:
    return Path(_defaults.DEFAULT_OUTPUT_ROOT) / f"{model}-{backend}-{precision}-{device.type}"


def check_output_dir(output: Path) -> None:
    """Refuse to replace a directory that is not an artifact: it may hold someone's files."""
    if output.exists() and not output.is_dir():
        raise ValueError(f"--output {output} is a file; give a directory path (it is created).")
    if output.is_dir() and any(output.iterdir()) and not (output / _defaults.MANIFEST_FILE).exists():
        raise ValueError(
            f"--output {output} is a non-empty directory without a {_defaults.MANIFEST_FILE}; compile-trt only "
            "replaces its own artifacts. Choose a new or empty directory."
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


def compile_artifact(settings: CompileSettings, progress: Progress | None = None) -> CompileResult:
    """Compile per ``settings``; returns the artifact (a cache hit returns the existing one)."""
    progress = progress or Progress(live=False)
    started = time.perf_counter()
    device = resolve_compile_device(settings.device, torch.cuda.device_count())
    backend_name, reason = resolve_backend(settings.backend, device)
    backend = get_backend(backend_name)
    backend.check_available(device)
    entry = get_model_entry(settings.model)
    output = (
        Path(settings.output)
        if settings.output
        else default_output(entry.name, backend_name, settings.precision, device)
    )
    check_output_dir(output)
    thresholds = settings.gate_thresholds()
    photos = sample_photos(settings.gate_images)  # fail fast on a bad --gate-images
    logger.info(
        "Compiling %s with %s (%s), precision %s, batch %s, on %s -> %s",
        entry.name,
        backend_name,
        reason,
        settings.precision,
        ",".join(map(str, settings.batch)),
        device,
        output,
    )

    with progress.stage(f"Loading {entry.name} weights ({settings.weights})"):
        loaded = load_model(entry, settings.weights)
        weights_sha256, sha256_of = weights_digest(loaded)
    versions = library_versions(backend.extra_versions())
    device_info = describe_device(device)
    key_parts = {
        "format": _defaults.MANIFEST_FORMAT_VERSION,
        "model": entry.name,
        "weights_sha256": weights_sha256,
        "backend": backend_name,
        "precision": settings.precision,
        "batch": list(settings.batch),
        "device": device_info,
        "versions": versions,
        "gate": {"thresholds": thresholds, "images": settings.gate_images},
    }
    if backend_name == "tensorrt":
        key_parts["tensorrt"] = {"workspace_gib": settings.workspace_gib, "level": settings.optimization_level}
    key = cache_key(key_parts)
    if not settings.force and (manifest := cached_artifact(output, key, backend)) is not None:
        logger.info("Cache hit: %s already holds this engine (cache key %s); --force rebuilds it.", output, key)
        return CompileResult(manifest, output, cached=True)

    staging = output.parent / f".{output.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        reference = loaded.module.to(device).to(memory_format=torch.channels_last).eval()
        engine_path = staging / backend.engine_file
        compile_started = time.perf_counter()
        with progress.stage(f"Compiling with {backend_name} ({settings.precision})"):
            model = PrecisionCast(copy.deepcopy(reference), PRECISION_DTYPES[settings.precision]).eval()
            backend.build(model, settings, device, entry.preprocess.crop_size, engine_path)
            del model
        compile_seconds = time.perf_counter() - compile_started
        manifest = _manifest(
            settings, entry, loaded, backend, device_info, versions, key, weights_sha256, sha256_of, compile_seconds
        )
        manifest = dataclasses.replace(manifest, engine_sha256=sha256_file(engine_path))
        with progress.stage("Accuracy gate (compiled vs eager fp32)"):
            gate_started = time.perf_counter()
            engine = backend.load(engine_path, manifest, device)
            inputs = gate_inputs(entry, photos, _defaults.GATE_RANDOM_INPUTS, _defaults.GATE_SEED)
            report = run_gate(engine, reference, inputs, settings.batch, thresholds, device, entry.labels)
            report.seconds = time.perf_counter() - gate_started
        if not report.passed:
            raise GateFailed(report)
        manifest = dataclasses.replace(manifest, validation=report.to_dict())
        write_manifest(staging, manifest)
        _move_into_place(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("Artifact written to %s in %.1f s", output, time.perf_counter() - started)
    return CompileResult(manifest, output, cached=False)


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
    compile_seconds: float,
) -> Manifest:
    low, opt, high = settings.batch
    return Manifest(
        format_version=_defaults.MANIFEST_FORMAT_VERSION,
        model=entry.name,
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
        engine_file=backend.engine_file,
        engine_sha256="",
        versions=versions,
        compiled_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        compile_seconds=round(compile_seconds, 2),
        compile_settings=settings.as_dict(),
        validation={},
        cache_key=key,
    )


def _move_into_place(staging: Path, output: Path) -> None:
    """Replace ``output`` with ``staging``; the old artifact is removed only once the new one is there."""
    previous = None
    if output.exists():
        previous = output.parent / f".{output.name}.old-{os.getpid()}"
        output.rename(previous)
    staging.rename(output)
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)
