"""Post-training static quantization (--precision int8, fp8): the calibration and evaluation sets
(datasets.py) and one quantizer per engine: ONNX Runtime's QDQ (onnx_qdq.py), PyTorch 2 export
quantization for AOTInductor (pt2e.py), NVIDIA ModelOpt for TensorRT (modelopt.py).

Every quantizer writes explicit quantize/dequantize pairs with per-channel weight scales: the form
TensorRT 10+ builds strongly typed engines from, and the one ONNX Runtime runs with int8 kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compile import _defaults
from compile.quantization.datasets import DatasetError, ImageFiles

__all__ = ["Calibration", "DatasetError", "ImageFiles"]


@dataclass(frozen=True)
class Calibration:
    """What a quantizer calibrates with: the preprocessed images and how ranges are read from them."""

    images: torch.Tensor  # float32 NCHW, normalized as served, on the CPU
    method: str  # resolved: one of _defaults.CALIBRATION_METHODS other than "auto"
    files: ImageFiles

    def batches(self, size: int = _defaults.CALIBRATION_BATCH):
        """The images in runs of ``size`` rows: one run's activations are held at a time."""
        for start in range(0, len(self.images), size):
            yield self.images[start : start + size]
