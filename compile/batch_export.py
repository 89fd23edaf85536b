"""``torch.export`` of a model whose batch dimension spans the artifact's MIN..MAX, and the example
batch it is traced with: shared by the backends that export (AOTInductor, ONNX, TensorRT) and by the
PT2E quantizer (compile/quantization/pt2e.py), so it lives below both."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def example_batch(size: int, input_size: tuple[int, int], device: torch.device) -> torch.Tensor:
    """A float32 channels_last batch shaped like what the server feeds the engine: ``size`` images of
    ``input_size`` = (height, width), the preprocessing's ``PreprocessSpec.input_size``."""
    height, width = input_size
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(size, 3, height, width, generator=generator)
    return images.to(device).contiguous(memory_format=torch.channels_last)


def batch_dynamic_shapes(batch: tuple[int, int, int]) -> tuple[dict[int, Any]] | None:
    """``dynamic_shapes`` of a one-input model whose batch dimension spans MIN..MAX; None when static."""
    low, _, high = batch
    if low == high:
        return None
    return ({0: torch.export.Dim("batch", min=low, max=high)},)


def export_dynamic_batch(module: nn.Module, example: torch.Tensor, batch: tuple[int, int, int]):
    """``torch.export`` with the batch dimension dynamic over MIN..MAX (static when MIN == MAX).

    Export specializes a dimension seen with size 1, so the example batch must be >= 2
    (``export_example_size``)."""
    return torch.export.export(module, (example,), dynamic_shapes=batch_dynamic_shapes(batch), strict=False)


def export_example_size(batch: tuple[int, int, int]) -> int:
    low, opt, high = batch
    if low == high:
        return low
    return max(2, min(opt, high))
