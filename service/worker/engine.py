"""What the server runs: the eager model, or a compiled artifact, behind one interface."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from compile.backends import EngineCallable, get_backend
from compile.catalog import ModelEntry, entry_from_manifest
from compile.compat import check_artifact_files, describe_problems, device_problems, version_problems
from compile.devices import describe_device
from compile.engine import use_exact_fp32
from compile.manifest import Manifest, read_manifest
from compile.model_request import ModelRequest
from compile.model_source import resolve_model
from compile.versions import library_versions
from compile.weights import load_model

logger = logging.getLogger(__name__)

ENGINE_EAGER = "torch-eager-fp32"
ENGINE_ONNX_FILE = "onnxruntime-fp32"


@dataclass
class ServedModel:
    """A model ready to serve: its catalog facts, a name for responses, and the batch sizes it takes."""

    entry: ModelEntry
    engine_name: str
    run: EngineCallable
    batch_min: int = 1
    batch_max: int | None = None  # None: any size
    description: str = ""
    # The layout the engine reads: channels_last for torch's engines, NCHW for ONNX Runtime.
    memory_format: torch.memory_format = torch.channels_last
    # On a CPU with several workers: the engine on the cores of all of them, for a lone image
    # (``with_lone_engine``); None: every batch runs on the worker's own share.
    lone_run: EngineCallable | None = None

    def __call__(self, images: torch.Tensor, alone: bool = False) -> torch.Tensor:
        """Logits for ``images``; pads a batch below the engine's minimum and splits one above its maximum.
        ``alone``: no other worker is running a batch, so a single image may use their cores too."""
        # Compiled engines assume the layout they were traced with (channels_last) and do not check
        # strides: an NCHW-contiguous batch would give wrong logits. A no-op when it is in that layout.
        images = images.contiguous(memory_format=self.memory_format)
        count = len(images)
        if self.batch_max is not None and count > self.batch_max:
            return torch.cat([self(images[i : i + self.batch_max]) for i in range(0, count, self.batch_max)])
        if count < self.batch_min:
            # An engine built for MIN..MAX rejects smaller batches: repeat the last image, drop its rows.
            padding = images[-1:].expand(self.batch_min - count, *images.shape[1:])
            images = torch.cat([images, padding]).contiguous(memory_format=self.memory_format)
        run = self.lone_run if alone and count == 1 and self.lone_run is not None else self.run
        return run(images)[:count]


def bind_worker_device(device: torch.device) -> None:
    """Make ``device`` this process's current CUDA device (a no-op on a CPU); before any CUDA work.

    Code that takes no device argument uses the current device, which is GPU 0 in every process
    until set: CV-CUDA and nvImageCodec, ``torch.cuda.current_stream()``, a tensor made on "cuda".
    In the worker for GPU N that would launch work on GPU 0 against memory on GPU N.
    """
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def set_worker_threads(device: torch.device, threads: int) -> None:
    """On a CPU, run the engine on ``threads`` threads: the worker's share of the cores, which the
    planner chose (service/supervisor/planning/sizing.py). Workers of one machine share its cores,
    and oversubscribing them only adds contention. ONNX Runtime sessions take the same number."""
    if device.type == "cpu":
        torch.set_num_threads(max(1, threads))


def with_lone_engine(
    served: ServedModel, threads: int, lone_threads: int, load_again: Callable[[], ServedModel]
) -> ServedModel:
    """``served`` with a ``lone_run`` on ``lone_threads`` (the cores of all the model's workers).

    Several single-threaded workers serve a small model fastest under load, but a lone request then
    runs on one core where one worker with every thread ran it faster. A batch of one image while no
    other worker is running (service/worker/runner.py) takes their idle cores. torch's engines switch
    their thread count for the call; an ONNX Runtime session's threads are fixed when it opens, so it
    gets a second session (``load_again`` with torch set to ``lone_threads``: the session takes
    torch's count), which for the small models that get several workers costs a few MB.
    """
    if lone_threads <= threads:
        return served
    if served.engine_name.startswith("onnxruntime"):
        torch.set_num_threads(lone_threads)
        try:
            lone = load_again().run
        finally:
            torch.set_num_threads(threads)
    else:
        shared = served.run

        def lone(images: torch.Tensor) -> torch.Tensor:
            torch.set_num_threads(lone_threads)
            try:
                return shared(images)
            finally:
                torch.set_num_threads(threads)

    return dataclasses.replace(served, lone_run=lone)


def decode_threads(engine_threads: int, device: torch.device) -> int | None:
    """The threads the worker's decoders may use: on a CPU its share of the cores, as its engine (a
    CPU worker decodes a batch, then runs it: the two never compete); on a GPU the backend's own."""
    return engine_threads if device.type == "cpu" and engine_threads > 0 else None


def artifact_versions(manifest: Manifest) -> dict[str, str]:
    return library_versions(get_backend(manifest.backend).extra_versions())


def ensure_servable(
    manifest: Manifest, directory: str | Path, device_type: str, device_info: dict[str, str] | None
) -> None:
    """``ValueError`` saying why and how to fix it, if this environment cannot serve ``manifest``.

    ``device_info`` None skips the device model check: the server's main process checks a GPU
    artifact without creating a GPU context, and the worker checks the GPU when it loads the engine.
    """
    problems = device_problems(manifest, device_type, device_info)
    problems += version_problems(manifest, artifact_versions(manifest))
    if problems:
        raise ValueError(describe_problems(str(directory), problems))
    check_artifact_files(manifest, directory)


def load_artifact(directory: str | Path, device: torch.device, name: str = "") -> ServedModel:
    """The engine of a compile-trt artifact, served as ``name`` (default: the manifest's name)."""
    directory = Path(directory).expanduser()
    manifest = read_manifest(directory)
    ensure_servable(manifest, directory, device.type, describe_device(device))
    backend = get_backend(manifest.backend)
    run = backend.load(directory / manifest.engine_file, manifest, device)
    return ServedModel(
        entry=dataclasses.replace(entry_from_manifest(manifest), name=name or manifest.served_name),
        engine_name=manifest.engine_name,
        run=run,
        batch_min=manifest.batch_min,
        batch_max=manifest.batch_max,
        description=f"artifact {directory} ({manifest.weights_source})",
        memory_format=backend.input_memory_format,
    )


def eager_engine_name(family: str) -> str:
    """What an uncompiled model serves as: an ONNX file runs in ONNX Runtime, the rest in PyTorch."""
    return ENGINE_ONNX_FILE if family == "onnx" else ENGINE_EAGER


def load_eager(request: ModelRequest, weights: str, device: torch.device) -> ServedModel:
    """The model ``request`` names, uncompiled: PyTorch in IEEE fp32 as its engine name says (no TF32
    on a GPU), or an ONNX file in ONNX Runtime as it is."""
    use_exact_fp32("fp32", device)
    entry = resolve_model(request)
    loaded = load_model(entry, weights)
    if entry.family == "onnx":
        from compile.backends.onnx import OnnxSessionEngine, open_session

        session, _ = open_session(Path(entry.model), device, torch.get_num_threads())
        run: EngineCallable = OnnxSessionEngine(session, device)
        return ServedModel(
            entry, ENGINE_ONNX_FILE, run, description=f"file {entry.model}", memory_format=torch.contiguous_format
        )
    module = loaded.module.to(device).to(memory_format=torch.channels_last)

    def run_module(images: torch.Tensor) -> torch.Tensor:
        return module(images)

    return ServedModel(entry, ENGINE_EAGER, run_module, description=f"weights {loaded.weights_source}")
