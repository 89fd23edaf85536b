"""ONNX: ``torch.onnx.export`` (dynamo exporter) into ``model.onnx``, run by ONNX Runtime.

The file is portable (the same ``model.onnx`` goes into a Triton model repository as it is, see
compile/triton_repository.py); the artifact still records the device it was gated on, like every
artifact. The session is set up for serving: all graph optimizations, one intra-op thread pool the
size of the worker's share of the cores, no spinning threads between batches, and IO binding so
that inputs and logits stay in torch's memory (on a GPU, on the device) instead of being copied
through numpy.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from compile import _defaults
from compile.backends.base import CompileBackend
from compile.batch_export import batch_dynamic_shapes, example_batch, export_example_size
from compile.engine import BackendUnavailable, EngineCallable
from compile.manifest import Manifest
from compile.quantization.onnx_qdq import needs_reduced_range, quantize_onnx, quantize_options
from compile.settings import CompileSettings

if TYPE_CHECKING:
    from compile.quantization import Calibration

logger = logging.getLogger(__name__)

CPU_PROVIDER = "CPUExecutionProvider"
# The session config entry that makes a session allocate from the environment's registered allocators.
USE_ENV_ALLOCATORS = "session.use_env_allocators"
CUDA_PROVIDER = "CUDAExecutionProvider"
INSTALL_HINT = "pip install 'vision-serve[onnx]' (CPU) or 'vision-serve[onnx-gpu]' (CUDA execution provider)"
# Why two precisions are refused (tests/unit/test_onnx_units.py checks that both reasons still hold,
# so the refusals can go when they stop holding):
# - bf16: Conv has no bfloat16 type in opset 18, the one we export (opset 22 added it), so ONNX
#   Runtime rejects the graph when it loads it, whatever the provider.
# - fp16 on a CPU: the CPU provider has no fp16 convolution kernels on x86; it inserts casts and runs
#   every convolution in fp32 ("InsertedPrecisionFreeCast"), so the engine is not fp16 and is slower
#   than fp32 (EfficientNet-Lite0's gate ran 4.0 s vs 1.1 s) and it failed the fp16 gate (top-1
#   agreement 0.934): benchmarks/results/vm-2cpu-2026-11-24/onnx/efficientnet-lite0-fp16-cpu-gate.txt.
BF16_REFUSAL = (
    f"--backend onnx cannot build bf16: ONNX's Conv has no bfloat16 type at opset {_defaults.ONNX_OPSET} (the "
    "opset exported), so ONNX Runtime rejects the graph. Use --precision fp32 (or fp16 on CUDA) with --backend "
    "onnx, or --backend inductor for bf16."
)
FP8_REFUSAL = (
    "--backend onnx cannot build fp8: ONNX Runtime has no fp8 convolution kernels. fp8 is --backend tensorrt on "
    "a GPU of compute capability 8.9 or later; --precision int8 runs on ONNX Runtime (CPU or GPU)."
)
CPU_FP16_REFUSAL = (
    "--backend onnx cannot build fp16 for a CPU: ONNX Runtime's CPU provider has no fp16 convolution kernels "
    "on x86 and runs them in fp32 behind inserted casts, slower than fp32 and less accurate. Use --precision "
    "fp32 on the CPU, fp16 with --device cuda, or --backend inductor for fp16/bf16 on a CPU."
)


@functools.cache
def onnx_status() -> tuple[bool, str]:
    """(importable, why not) for the export (torch.onnx's dynamo exporter needs onnxscript) and the runtime."""
    for module in ("onnxruntime", "onnx", "onnxscript"):
        try:
            importlib.import_module(module)
        except Exception as exc:  # ImportError, or a broken install raising anything
            return False, f"--backend onnx needs {module}, which does not import here ({exc}). Install: {INSTALL_HINT}."
    return True, "onnxruntime, onnx and onnxscript import"


def execution_providers(device: torch.device, available: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """ONNX Runtime's providers for ``device``, most preferred first, with their options.

    Pure (``available`` is ``onnxruntime.get_available_providers()``), so it is unit-tested without a GPU.
    """
    if device.type == "cpu":
        return [(CPU_PROVIDER, {})]
    if CUDA_PROVIDER not in available:
        raise BackendUnavailable(
            f"ONNX Runtime here offers {', '.join(available)}, not {CUDA_PROVIDER}, so it cannot run on {device}. "
            f"Install the GPU build: {INSTALL_HINT}; or compile for --device cpu."
        )
    cuda_options = {
        "device_id": device.index or 0,
        # cuDNN's heuristic pick rather than ONNX Runtime's default EXHAUSTIVE search: that search runs
        # the first time each input shape is seen, and a server sees every batch size from 1 to MAX,
        # so requests would stall on it long after warm-up.
        "cudnn_conv_algo_search": "HEURISTIC",
        # fp32 means IEEE fp32, as for the other backends (compile/engine.py: use_exact_fp32).
        "use_tf32": 0,
    }
    # CPU after CUDA: a node the CUDA provider has no kernel for runs on the CPU instead of failing.
    return [(CUDA_PROVIDER, cuda_options), (CPU_PROVIDER, {})]


def session_settings(device: torch.device, threads: int) -> dict[str, Any]:
    """The SessionOptions a serving worker uses (JSON-able: recorded in the manifest)."""
    return {
        "graph_optimization_level": "ORT_ENABLE_ALL",
        "execution_mode": "ORT_SEQUENTIAL",  # one model, one batch at a time: parallelism is within ops
        "intra_op_num_threads": threads if device.type == "cpu" else 1,
        "inter_op_num_threads": 1,
        "config_entries": {
            # Idle pool threads sleep instead of spinning: between batches the worker's cores are
            # needed by the HTTP processes and the preprocessing, not by a busy-wait.
            "session.intra_op.allow_spinning": "0",
        },
    }


def session_options(settings: dict[str, Any]):
    """``onnxruntime.SessionOptions`` from ``session_settings``."""
    ort = importlib.import_module("onnxruntime")
    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, settings["graph_optimization_level"])
    options.execution_mode = getattr(ort.ExecutionMode, settings["execution_mode"])
    options.intra_op_num_threads = settings["intra_op_num_threads"]
    options.inter_op_num_threads = settings["inter_op_num_threads"]
    for key, value in settings["config_entries"].items():
        options.add_session_config_entry(key, value)
    return options


def export_kwargs(batch: tuple[int, int, int]) -> dict[str, Any]:
    """Keyword arguments of ``torch.onnx.export`` (besides the model, inputs and file): a dynamic batch."""
    kwargs: dict[str, Any] = {
        "dynamo": True,
        "opset_version": _defaults.ONNX_OPSET,
        "input_names": [_defaults.ONNX_INPUT_NAME],
        "output_names": [_defaults.ONNX_OUTPUT_NAME],
        # One self-contained file (an image classifier is far below protobuf's 2 GB limit): the
        # artifact's sha256 covers all of it, and Triton loads it without a side file.
        "external_data": False,
        "optimize": True,
        "verbose": False,  # compile-trt reports its own stages
    }
    if (shapes := batch_dynamic_shapes(batch)) is not None:
        kwargs["dynamic_shapes"] = shapes
    return kwargs


@contextlib.contextmanager
def quiet_exporter_logs() -> Iterator[None]:
    """The exporter's graph passes log a line per folded constant at INFO: keep them to warnings."""
    loggers = [logging.getLogger(name) for name in ("onnx_ir", "onnxscript")]
    levels = [item.level for item in loggers]
    for item in loggers:
        item.setLevel(max(item.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    finally:
        for item, level in zip(loggers, levels, strict=True):
            item.setLevel(level)


class OnnxSessionEngine:
    """An ``EngineCallable`` over an ONNX Runtime session: float32 NCHW batch in, float32 logits out.

    Inputs and outputs are bound to torch's memory (IO binding), on the CPU as on a GPU: one code
    path, tested here on the CPU.
    """

    def __init__(self, session: Any, device: torch.device) -> None:
        self.session = session
        self.device = device
        self.input_name = session.get_inputs()[0].name
        output = session.get_outputs()[0]
        self.output_name = output.name
        self.classes = int(output.shape[1])
        self.binding_device = device.type  # "cpu" or "cuda", as ONNX Runtime names them
        self.binding_index = device.index or 0

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        images = images.to(self.device, torch.float32).contiguous()  # ONNX is NCHW
        logits = torch.empty((len(images), self.classes), dtype=torch.float32, device=self.device)
        if self.device.type == "cuda":
            # ONNX Runtime computes on its own stream: what torch queued on the images must be done.
            torch.cuda.current_stream(self.device).synchronize()
        binding = self.session.io_binding()
        where = (self.binding_device, self.binding_index, np.float32)
        binding.bind_input(self.input_name, *where, tuple(images.shape), images.data_ptr())
        binding.bind_output(self.output_name, *where, tuple(logits.shape), logits.data_ptr())
        self.session.run_with_iobinding(binding)  # returns when the outputs are written
        return logits


@functools.cache
def shared_cpu_arena() -> bool:
    """Register one CPU arena with this process's ONNX Runtime environment (once); whether it is.

    Each session otherwise has an arena of its own, which grows to the largest batch's intermediate
    tensors and keeps them for the session's life: a worker process holding many models (and a model
    its second, lone-image session: service/worker/engine.py) paid that workspace once per session.
    Sessions that opt in (``USE_ENV_ALLOCATORS``) share this one, and the process holds the workspace
    of one batch at a time, which is all a worker process runs (service/worker/turns.py). The arena
    is thread-safe, so sessions that do run at once (pipelined workers) stay correct.
    """
    ort = importlib.import_module("onnxruntime")
    try:
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg({}))  # ONNX Runtime's default arena settings
    except Exception:  # an older or a stripped build: each session keeps an arena of its own
        logger.warning("ONNX Runtime could not register a shared CPU arena; each session gets its own.", exc_info=True)
        return False
    return True


def open_session(
    path: Path, device: torch.device, threads: int, shared_arena: bool = _defaults.ONNX_SHARED_CPU_ARENA
) -> tuple[Any, dict[str, Any]]:
    """An ONNX Runtime session for serving ``path`` on ``device``, and the settings it was made with;
    ``shared_arena``: on a CPU, its tensors from the process's one arena (``shared_cpu_arena``)."""
    ort = importlib.import_module("onnxruntime")
    providers = execution_providers(device, ort.get_available_providers())
    settings = session_settings(device, threads)
    if shared_arena and device.type == "cpu" and shared_cpu_arena():
        settings["config_entries"] = {**settings["config_entries"], USE_ENV_ALLOCATORS: "1"}
    session = ort.InferenceSession(str(path), sess_options=session_options(settings), providers=providers)
    wanted = providers[0][0]
    if session.get_providers()[0] != wanted:
        # ONNX Runtime falls back to the CPU silently when the CUDA provider fails to load (a CUDA or
        # cuDNN library missing): a GPU server would then run the model on its CPU, slowly.
        raise BackendUnavailable(
            f"ONNX Runtime did not enable {wanted} for {path} (it runs {session.get_providers()}): its CUDA/cuDNN "
            "libraries did not load; the log above says which. Install onnxruntime-gpu built for this CUDA."
        )
    return session, {"providers": session.get_providers(), **settings}


class OnnxBackend(CompileBackend):
    name = "onnx"
    engine_file = "model.onnx"
    runtime_libraries = ("onnxruntime",)
    install_hint = f"Install it: {INSTALL_HINT}."
    input_memory_format = torch.contiguous_format
    native_code = False  # ONNX Runtime picks its kernels for the device it runs on
    quantized_precisions = ("int8",)
    calibration_methods = ("percentile", "minmax", "entropy")

    def check_available(self, device: torch.device) -> None:
        importable, reason = onnx_status()
        if not importable:
            raise BackendUnavailable(reason)
        ort = importlib.import_module("onnxruntime")
        execution_providers(device, ort.get_available_providers())

    def check_precision(self, precision: str, device: torch.device) -> None:
        if precision == "bf16":
            raise BackendUnavailable(BF16_REFUSAL)
        if precision == "fp16" and device.type == "cpu":
            raise BackendUnavailable(CPU_FP16_REFUSAL)
        if precision == "fp8":
            raise BackendUnavailable(FP8_REFUSAL)

    def config(self, settings: CompileSettings, device: torch.device) -> dict[str, Any]:
        exported = {k: v for k, v in export_kwargs(settings.batch).items() if k != "dynamic_shapes"}
        available = importlib.import_module("onnxruntime").get_available_providers()
        config: dict[str, Any] = {
            "export": exported,
            "providers": [[name, options] for name, options in execution_providers(device, available)],
            # The thread count is set when the server loads the engine (its share of the cores).
            "session": {k: v for k, v in session_settings(device, 0).items() if k != "intra_op_num_threads"},
        }
        if settings.quantized:
            method = self.resolve_calibration_method(settings.precision, settings.calibration_method)
            config["quantize_static"] = quantize_options(method, needs_reduced_range(device.type))
        return config

    def extra_versions(self) -> tuple[str, ...]:
        return ("onnxruntime", "onnx", "onnxscript")

    def build(
        self,
        model: nn.Module,
        settings: CompileSettings,
        device: torch.device,
        input_size: tuple[int, int],
        path: Path,
        calibration: Calibration | None = None,
    ) -> None:
        from compile.weights import OnnxFileModule

        if calibration is not None:
            # An fp32 model first (the user's file, or exported as for fp32), then its QDQ int8 form.
            with tempfile.TemporaryDirectory(prefix="vision-serve-fp32-", dir=path.parent) as scratch:
                fp32_path = Path(scratch) / self.engine_file
                self.build(model, settings, device, input_size, fp32_path)
                quantize_onnx(fp32_path, path, calibration, needs_reduced_range(device.type))
            return
        if isinstance(source := getattr(model, "model", None), OnnxFileModule):
            # Served as it is (fp32 only: build.py), made one self-contained file: a model exported
            # with its weights beside it (model.onnx.data) gets them inside.
            onnx = importlib.import_module("onnx")
            onnx.save_model(onnx.load(str(source.path)), str(path), save_as_external_data=False)
            return
        # Exported on the CPU: the graph does not depend on the device, and the file is the same.
        example = example_batch(export_example_size(settings.batch), input_size, torch.device("cpu"))
        with torch.no_grad(), quiet_exporter_logs():
            torch.onnx.export(model.cpu(), (example.contiguous(),), str(path), **export_kwargs(settings.batch))

    def load(self, path: Path, manifest: Manifest, device: torch.device) -> EngineCallable:
        session, used = open_session(path, device, torch.get_num_threads())
        logger.info("ONNX Runtime session for %s: %s", path, used)
        return OnnxSessionEngine(session, device)
