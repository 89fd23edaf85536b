"""INT8 and FP8 for the tensorrt engine: NVIDIA ModelOpt's post-training quantization, then the
Torch-TensorRT build the other precisions use.

The flow is Torch-TensorRT's documented one (``examples/dynamo/vgg16_ptq.py``): ``mtq.quantize``
inserts quantizers and calibrates them on the forward loop; the model is exported under ModelOpt's
``export_torch_mode`` so that they become ``tensorrt.quantize_op`` nodes (explicit Q/DQ), which
Torch-TensorRT converts into a strongly typed network. No precision flag is passed: the graph's
types say it (torch_tensorrt 2.13 removed ``enabled_precisions``).

TensorRT cannot be installed where this project is developed, so what runs here is the pure part
(the ModelOpt config) and the order of the calls, against stand-ins at the ModelOpt and
Torch-TensorRT boundary (tests/unit/test_tensorrt_quantization.py); it has not run on a GPU.
"""

from __future__ import annotations

import copy
import importlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from compile.settings_errors import SettingsError

logger = logging.getLogger(__name__)

# ModelOpt's preset per precision. Its INT8 preset is per-channel (axis 0) int8 weights and
# per-tensor int8 activations, calibrated by "max" (our "minmax"); its FP8 preset is per-tensor E4M3.
MODELOPT_CONFIGS = {"int8": "INT8_DEFAULT_CFG", "fp8": "FP8_DEFAULT_CFG"}
# FP8 tensor cores: Ada (8.9) and Hopper (9.0) and later (ModelOpt's and Torch-TensorRT's requirement).
FP8_MIN_CAPABILITY = (8, 9)
INSTALL_HINT = "pip install 'vision-serve[tensorrt-quant]' (nvidia-modelopt) in the GPU image"


def modelopt_config(precision: str, method: str) -> dict[str, Any]:
    """The ModelOpt quantization config for ``precision``: a copy of its preset (presets are module
    constants, shared by every caller). Only "minmax" is offered: ModelOpt's histogram calibrators
    (entropy, percentile) need a calibration loop outside ``mtq.quantize`` that we cannot run here."""
    if method != "minmax":
        raise SettingsError(
            "--calibration-method",
            method,
            f"TensorRT engines calibrate with minmax (ModelOpt's 'max'), not {method!r}.",
            "Use --calibration-method auto: each engine's measured best.",
        )
    mtq = importlib.import_module("modelopt.torch.quantization")
    config = copy.deepcopy(getattr(mtq, MODELOPT_CONFIGS[precision]))
    config["algorithm"] = "max"
    return config


def fp8_problem(capability: tuple[int, int]) -> str | None:
    """Why this GPU cannot run fp8 engines, or None."""
    if capability >= FP8_MIN_CAPABILITY:
        return None
    have = ".".join(map(str, capability))
    need = ".".join(map(str, FP8_MIN_CAPABILITY))
    return (
        f"--precision fp8 needs a GPU with fp8 tensor cores (compute capability {need}: Ada, Hopper and later); "
        f"this one is {have}. Use --precision int8 or fp16."
    )


def forward_loop(batches: Iterable[torch.Tensor], device: torch.device) -> Callable[[nn.Module], None]:
    """What ``mtq.quantize`` calls to calibrate: every calibration run through the model on ``device``."""

    def run(model: nn.Module) -> None:
        with torch.no_grad():
            for batch in batches:
                model(batch.to(device))

    return run


def quantize_for_tensorrt(
    model: nn.Module, precision: str, method: str, batches: Iterable[torch.Tensor], device: torch.device
) -> nn.Module:
    """``model`` with ModelOpt's quantizers inserted and calibrated (in place; returned)."""
    mtq = importlib.import_module("modelopt.torch.quantization")
    config = modelopt_config(precision, method)
    model = mtq.quantize(model, config, forward_loop=forward_loop(list(batches), device))
    logger.info("ModelOpt quantized the model to %s (%s calibration)", precision, method)
    return model


def export_mode():
    """ModelOpt's context in which ``torch.export`` writes its quantizers as TensorRT Q/DQ ops."""
    return importlib.import_module("modelopt.torch.quantization.utils").export_torch_mode()
