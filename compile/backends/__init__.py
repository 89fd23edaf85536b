"""Compile backends behind one interface (compile/backends/base.py), chosen by name or by ``auto``."""

from __future__ import annotations

import torch

from compile.backends.base import CompileBackend
from compile.backends.eager import EagerBackend
from compile.backends.inductor import InductorBackend
from compile.backends.onnx import OnnxBackend, onnx_status
from compile.backends.tensorrt import TensorRTBackend, torch_tensorrt_status
from compile.engine import PRECISION_DTYPES, BackendUnavailable, EngineCallable, PrecisionCast
from compile.quantization.pt2e import torchao_status

BACKENDS: dict[str, type[CompileBackend]] = {
    "tensorrt": TensorRTBackend,
    "inductor": InductorBackend,
    "onnx": OnnxBackend,
    "eager": EagerBackend,
}

__all__ = [
    "BACKENDS",
    "PRECISION_DTYPES",
    "BackendUnavailable",
    "CompileBackend",
    "EngineCallable",
    "PrecisionCast",
    "get_backend",
    "resolve_compile_backend",
]


def resolve_compile_backend(name: str, device: torch.device, precision: str = "fp32") -> tuple[str, str]:
    """``(compile backend, reason)`` for compile-trt's ``--backend`` (``auto`` or a name) on ``device``.

    ``auto`` is the fastest engine measured where it runs (docs/compiling.md#which-engine): on a GPU,
    TensorRT where torch_tensorrt imports, else AOTInductor; on a CPU at fp32, ONNX Runtime (ahead of
    AOTInductor on both catalog models and every batch size measured); on a CPU at fp16/bf16,
    AOTInductor (ONNX cannot express a bf16 convolution, and ONNX Runtime's CPU fp16 failed the gate);
    on a CPU at int8, AOTInductor's PT2E engine where torchao imports (served 2.4x ONNX Runtime fp32 on
    ResNet-152, ONNX Runtime's int8 1.1x), else ONNX Runtime's.
    """
    if name != "auto":
        return name, "chosen explicitly"  # get_backend() rejects an unknown name
    if device.type == "cuda":
        if torch_tensorrt_status()[0]:
            return "tensorrt", "auto: torch_tensorrt imports and a GPU is present"
        return "inductor", "auto: torch_tensorrt is not installed here"
    if precision == "int8":
        if torchao_status()[0]:
            return "inductor", "auto on cpu at int8: PT2E + AOTInductor measured fastest"
        return "onnx", "auto on cpu at int8: torchao is not installed here (pip install 'vision-serve[quantize]')"
    try:
        OnnxBackend().check_precision(precision, device)
    except BackendUnavailable:
        return "inductor", f"auto on {device.type} at {precision}: ONNX Runtime has no {precision} that passes the gate"
    if onnx_status()[0]:
        return "onnx", f"auto on {device.type} at {precision}: ONNX Runtime measured fastest"
    return "inductor", f"auto on {device.type} at {precision}: no ONNX Runtime here (pip install 'vision-serve[onnx]')"


def get_backend(name: str) -> CompileBackend:
    try:
        return BACKENDS[name]()
    except KeyError:
        raise ValueError(f"Unknown backend {name!r}; choose one of {', '.join(BACKENDS)}.") from None
