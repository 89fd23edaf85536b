"""Compile backends behind one interface (compile/backends/base.py), chosen by name or by ``auto``."""

from __future__ import annotations

import torch

from compile.backends.base import (
    PRECISION_DTYPES,
    BackendUnavailable,
    CompileBackend,
    EngineCallable,
    PrecisionCast,
)
from compile.backends.eager import EagerBackend
from compile.backends.inductor import InductorBackend
from compile.backends.tensorrt import TensorRTBackend, torch_tensorrt_status

BACKENDS: dict[str, type[CompileBackend]] = {
    "tensorrt": TensorRTBackend,
    "inductor": InductorBackend,
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


def resolve_compile_backend(name: str, device: torch.device) -> tuple[str, str]:
    """``(compile backend, reason)`` for compile-trt's ``--backend`` (``auto`` or a name) on ``device``."""
    if name != "auto":
        return name, "chosen explicitly"  # get_backend() rejects an unknown name
    if device.type != "cuda":
        return "inductor", f"auto on {device.type}: TensorRT needs a GPU"
    if torch_tensorrt_status()[0]:
        return "tensorrt", "auto: torch_tensorrt imports and a GPU is present"
    return "inductor", "auto: torch_tensorrt is not installed here"


def get_backend(name: str) -> CompileBackend:
    try:
        return BACKENDS[name]()
    except KeyError:
        raise ValueError(f"Unknown backend {name!r}; choose one of {', '.join(BACKENDS)}.") from None
