"""Torch-TensorRT (dynamo frontend): an ExportedProgram whose subgraphs run as TensorRT engines.

Written against the documented torch_tensorrt API of the release that matches our torch (2.14; the
``save(..., dynamic_shapes=...)`` form exists from 2.11). TensorRT cannot be installed on the
machines this project is developed on, so only the argument-building below is tested here; the
calls into torch_tensorrt run in the GPU image (Dockerfile.gpu).

Precision is carried by the graph (PrecisionCast casts to fp16/bf16 inside it): torch_tensorrt
2.10+ type the network explicitly from the graph's dtypes, and 2.13 removed ``enabled_precisions``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from compile.backends.base import CompileBackend
from compile.batch_export import batch_dynamic_shapes, example_batch, export_dynamic_batch, export_example_size
from compile.engine import BackendUnavailable, EngineCallable
from compile.manifest import Manifest
from compile.quantization.modelopt import INSTALL_HINT as MODELOPT_INSTALL_HINT
from compile.quantization.modelopt import MODELOPT_CONFIGS, export_mode, fp8_problem, quantize_for_tensorrt
from compile.settings import CompileSettings

if TYPE_CHECKING:
    from compile.quantization import Calibration
from compile.versions import major_minor, package_version

INPUT_NAME = "images"
MIN_TORCH_TENSORRT = (2, 11)  # first release whose save() takes dynamic_shapes

# The only place that says where TensorRT exists: our machines' package registry has no TensorRT
# libraries, the NGC PyTorch image does.
TENSORRT_HOME = (
    "torch_tensorrt is not installed here. It ships in the NGC PyTorch image: build the GPU image with "
    "`docker build -f Dockerfile.gpu -t vision-serve-gpu .` and run compile-trt inside it, "
    "or use --backend inductor (works everywhere)."
)


@functools.cache
def torch_tensorrt_status() -> tuple[bool, str]:
    """(importable, why not) for torch_tensorrt. Importing it also registers its ops for loading."""
    try:
        importlib.import_module("torch_tensorrt")
    except Exception as exc:  # ImportError, or a broken CUDA/TensorRT install raising anything
        return False, f"{TENSORRT_HOME} (import failed: {type(exc).__name__}: {exc})"
    return True, "torch_tensorrt imports"


def tensorrt_input_spec(batch: tuple[int, int, int], input_size: tuple[int, int]) -> dict[str, Any]:
    """Keyword arguments of ``torch_tensorrt.Input``: the dynamic batch range of the image input, each
    shape ``(N, 3, height, width)`` for ``input_size`` = (height, width)."""
    low, opt, high = batch
    height, width = input_size
    shape = (3, height, width)
    return {
        "min_shape": (low, *shape),
        "opt_shape": (opt, *shape),
        "max_shape": (high, *shape),
        "dtype": torch.float32,  # the engine's interface is float32 at every precision
        "name": INPUT_NAME,
    }


def tensorrt_compile_kwargs(settings: CompileSettings, device: torch.device) -> dict[str, Any]:
    """Keyword arguments of ``torch_tensorrt.dynamo.compile`` for ``settings`` (``arg_inputs`` aside).

    Pure: no torch_tensorrt import, so it is unit-tested on machines without TensorRT.
    """
    if device.type != "cuda":
        raise BackendUnavailable(f"TensorRT compiles for a CUDA device, not {device}. Use --backend inductor on CPU.")
    return {
        "device": device,
        "workspace_size": int(settings.workspace_gib * (1 << 30)),
        "optimization_level": settings.optimization_level,
        # Convert every supported op, even a lone one: fewer PyTorch <-> TensorRT boundaries.
        "min_block_size": 1,
        # ResNet-152 converts fully; a model that does not still runs, with PyTorch in between. Not a
        # quantized one: a Q/DQ pair left to PyTorch would need ModelOpt in every server that loads it.
        "require_full_compilation": settings.quantized,
        # Engines are tied to this GPU model and this TensorRT version (the manifest records both
        # and the server checks them), which lets TensorRT use every tactic it has.
        "hardware_compatible": False,
        "version_compatible": False,
        # The artifact directory is our cache; torch_tensorrt's own engine cache would duplicate it.
        "cache_built_engines": False,
        "reuse_cached_engines": False,
        "truncate_double": True,
        # fp32 means IEEE fp32: TensorRT would otherwise run fp32 layers in TF32 on Ampere and later.
        "disable_tf32": settings.precision == "fp32",
    }


def tensorrt_save_kwargs(batch: tuple[int, int, int], example: torch.Tensor) -> dict[str, Any]:
    """Keyword arguments of ``torch_tensorrt.save`` that keep the batch dimension dynamic in the file."""
    kwargs: dict[str, Any] = {"output_format": "exported_program", "arg_inputs": [example]}
    if (shapes := batch_dynamic_shapes(batch)) is not None:
        kwargs["dynamic_shapes"] = shapes
    return kwargs


class TensorRTBackend(CompileBackend):
    name = "tensorrt"
    engine_file = "model.ep"
    runtime_libraries = ("torch", "torch_tensorrt", "tensorrt")
    exact_version_libraries = ("tensorrt",)  # we build with version_compatible=False
    install_hint = TENSORRT_HOME
    quantized_precisions = ("int8", "fp8")
    # ModelOpt's documented calibration; its histogram ones (entropy, percentile) are not offered
    # until they can be run on a GPU here (compile/quantization/modelopt.py).
    calibration_methods = ("minmax",)

    def check_precision(self, precision: str, device: torch.device) -> None:
        if precision not in self.quantized_precisions:
            return
        try:
            importlib.import_module("modelopt.torch.quantization")
        except Exception as exc:  # ImportError, or a broken install raising anything
            raise BackendUnavailable(
                f"--precision {precision} with --backend tensorrt quantizes with NVIDIA ModelOpt, which does not "
                f"import here ({type(exc).__name__}: {exc}). Install it: {MODELOPT_INSTALL_HINT}."
            ) from None
        if precision == "fp8" and (problem := fp8_problem(torch.cuda.get_device_capability(device))):
            raise BackendUnavailable(problem)

    def check_available(self, device: torch.device) -> None:
        importable, reason = torch_tensorrt_status()
        if not importable:
            raise BackendUnavailable(reason)
        if device.type != "cuda":
            raise BackendUnavailable(f"TensorRT compiles for a CUDA device, not {device}. Use --backend inductor.")
        version = package_version("torch_tensorrt") or "0.0"
        if major_minor(version) < MIN_TORCH_TENSORRT:
            raise BackendUnavailable(
                f"torch_tensorrt {version} is older than {'.'.join(map(str, MIN_TORCH_TENSORRT))}, the first "
                "release whose save() keeps a dynamic batch. Use the image from Dockerfile.gpu."
            )

    def config(self, settings: CompileSettings, device: torch.device) -> dict[str, Any]:
        kwargs = tensorrt_compile_kwargs(settings, device)
        kwargs["device"] = str(device)
        if settings.quantized:
            method = self.resolve_calibration_method(settings.precision, settings.calibration_method)
            kwargs["modelopt"] = {"preset": MODELOPT_CONFIGS[settings.precision], "calibration": method}
        return kwargs

    def extra_versions(self) -> tuple[str, ...]:
        return ("torch_tensorrt", "tensorrt")

    def build(
        self,
        model: nn.Module,
        settings: CompileSettings,
        device: torch.device,
        input_size: tuple[int, int],
        path: Path,
        calibration: Calibration | None = None,
    ) -> None:
        torch_tensorrt = importlib.import_module("torch_tensorrt")
        example = example_batch(export_example_size(settings.batch), input_size, device)
        export_context: contextlib.AbstractContextManager = contextlib.nullcontext()
        if calibration is not None:
            model = quantize_for_tensorrt(model, settings.precision, calibration.method, calibration.batches(), device)
            export_context = export_mode()  # the quantizers export as TensorRT's Q/DQ ops
        with torch.no_grad(), export_context:
            exported = export_dynamic_batch(model, example, settings.batch)
        compiled = torch_tensorrt.dynamo.compile(
            exported,
            arg_inputs=[torch_tensorrt.Input(**tensorrt_input_spec(settings.batch, input_size))],
            **tensorrt_compile_kwargs(settings, device),
        )
        torch_tensorrt.save(compiled, str(path), **tensorrt_save_kwargs(settings.batch, example))

    def load(self, path: Path, manifest: Manifest, device: torch.device) -> EngineCallable:
        # The import registers torch.ops.tensorrt.execute_engine, which the saved graph calls.
        torch_tensorrt = importlib.import_module("torch_tensorrt")
        # No .to(device): the TensorRT engines inside are bound to the GPU they were built on, which
        # the server checked is this one (same architecture; CUDA_VISIBLE_DEVICES maps it to cuda:0).
        module = torch_tensorrt.load(str(path)).module()

        def run(images: torch.Tensor) -> torch.Tensor:
            with torch.inference_mode():
                return module(images)

        return run
