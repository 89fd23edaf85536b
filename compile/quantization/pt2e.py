"""INT8 for the inductor engine: PyTorch 2 export quantization for x86 CPUs (``X86InductorQuantizer``),
then AOTInductor as for the other precisions.

torch 2.14 no longer ships ``torch.ao.quantization.quantize_pt2e``: the flow lives in ``torchao``
(``torchao.quantization.pt2e``). Importing its x86 quantizer also registers the Inductor passes that
fuse the Q/DQ pairs into oneDNN's int8 convolutions and linears (``onednn.qconv_pointwise``), so it
is imported before AOTInductor compiles. The package that comes out runs without torchao.

Weights are int8 per output channel (symmetric); activations uint8 per tensor (affine: the ReLU
outputs use all 256 levels), the form oneDNN's VNNI kernels take.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any

import torch
from torch import nn

from compile.batch_export import batch_dynamic_shapes
from compile.engine import BackendUnavailable
from compile.settings_errors import SettingsError

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'vision-serve[quantize]' (torchao)"
# Our method names -> the activation observer of the x86 config. "histogram" is the quantizer's
# own default (HistogramObserver: the range with the least L2 quantization error).
ACTIVATION_OBSERVERS = {"histogram": "HistogramObserver", "minmax": "MinMaxObserver"}


@functools.cache
def torchao_status() -> tuple[bool, str]:
    """(importable, why not) for the PT2E flow and its x86 quantizer."""
    try:
        importlib.import_module("torchao.quantization.pt2e.quantize_pt2e")
        importlib.import_module("torchao.quantization.pt2e.quantizer.x86_inductor_quantizer")
    except Exception as exc:  # ImportError, or an install built for another torch raising anything
        return False, f"{type(exc).__name__}: {exc}"
    return True, "torchao's PT2E flow imports"


def check_pt2e(device: torch.device) -> None:
    """``BackendUnavailable`` unless the int8 inductor engine can be built here (a CPU, torchao)."""
    if device.type != "cpu":
        raise BackendUnavailable(
            "--backend inductor builds int8 for CPUs (oneDNN's x86 kernels). On a GPU use --backend tensorrt "
            "--precision int8, or --backend onnx --precision int8 (ONNX Runtime's CUDA provider)."
        )
    importable, reason = torchao_status()
    if not importable:
        raise BackendUnavailable(
            f"--backend inductor --precision int8 quantizes with torchao's PT2E flow, which does not import here "
            f"({reason}). Install it: {INSTALL_HINT}; or use --backend onnx --precision int8."
        )


def reduced_range() -> bool:
    """Whether activations are quantized to 7 bits (0..127): on a CPU without VNNI, whose int8 kernels
    add u8 x s8 products in pairs in 16 bits and saturate on full-range activations (compile/devices.py)."""
    from compile.devices import cpu_has_vnni

    return not cpu_has_vnni()


def quantization_config(method: str, reduce_range: bool = False) -> Any:
    """The x86 quantizer's config: its default (per-channel int8 weights, per-tensor uint8
    activations, in 7 bits with ``reduce_range``) with the activation observer ``method`` names."""
    if method not in ACTIVATION_OBSERVERS:
        raise SettingsError(
            "--calibration-method",
            method,
            f"inductor int8 calibrates with {', '.join(ACTIVATION_OBSERVERS)}, not {method!r}.",
            "Use --calibration-method auto: each engine's measured best.",
        )
    x86 = importlib.import_module("torchao.quantization.pt2e.quantizer.x86_inductor_quantizer")
    config = x86.get_default_x86_inductor_quantization_config(is_qat=False, is_dynamic=False, reduce_range=reduce_range)
    if method == "histogram":
        return config
    quantizer = importlib.import_module("torchao.quantization.pt2e.quantizer")
    observers = importlib.import_module("torchao.quantization.pt2e")
    activation = config.input_activation
    minmax = quantizer.QuantizationSpec(
        dtype=activation.dtype,
        quant_min=activation.quant_min,
        quant_max=activation.quant_max,
        qscheme=activation.qscheme,
        is_dynamic=False,
        observer_or_fake_quant_ctr=observers.MinMaxObserver.with_args(eps=2**-12),
    )
    return quantizer.QuantizationConfig(minmax, minmax, config.weight, config.bias, False)


def quantize_pt2e(
    model: nn.Module, example: torch.Tensor, batch: tuple[int, int, int], method: str, batches
) -> torch.export.ExportedProgram:
    """``model`` quantized to int8 and exported with the batch dynamic over MIN..MAX: export,
    insert observers, run the calibration batches, convert to Q/DQ, export again for AOTInductor."""
    pt2e = importlib.import_module("torchao.quantization.pt2e.quantize_pt2e")
    x86 = importlib.import_module("torchao.quantization.pt2e.quantizer.x86_inductor_quantizer")
    shapes = batch_dynamic_shapes(batch)
    with torch.no_grad():
        # strict=True: the non-strict export leaves no source_fn_stack on the nodes, and the x86
        # quantizer (which matches source partitions) then quantizes no convolution at all.
        graph = torch.export.export(model, (example,), dynamic_shapes=shapes, strict=True).module()
        config = quantization_config(method, reduced_range())
        prepared = pt2e.prepare_pt2e(graph, x86.X86InductorQuantizer().set_global(config))
        for images in batches:
            prepared(images)
        converted = pt2e.convert_pt2e(prepared)
        exported = torch.export.export(converted, (example,), dynamic_shapes=shapes, strict=False)
    logger.info("PT2E quantized the model to int8 (%s calibration)", method)
    return exported
