"""What an engine is, whichever backend built it, and the pieces every backend and quantizer shares.

Every engine has the same contract: float32 NCHW images in, float32 logits out, any batch size in the
artifact's MIN..MAX. Lower precisions cast inside the graph (``PrecisionCast``), so the server and
the preprocessing never change with the precision.

Below both compile/backends/ and compile/quantization/: the quantizers raise ``BackendUnavailable``
too, and the backends call the quantizers, so this lives under both and imports neither.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# The dtype a model computes in at each precision. A quantized engine's int8 (fp8) layers are the
# quantizer's; what it leaves unquantized runs in fp32 (int8: what the CPU kernels pair with) or fp16
# (fp8: TensorRT on the GPUs that have fp8).
PRECISION_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": torch.float32,
    "fp8": torch.float16,
}

# What an engine is to the server: a callable from a float32 batch to float32 logits.
EngineCallable = Callable[[torch.Tensor], torch.Tensor]


class BackendUnavailable(RuntimeError):
    """The backend cannot run here (library missing, wrong device); the message says where it can."""


class PrecisionCast(nn.Module):
    """Runs ``model`` in ``dtype`` behind a float32 interface: cast in, compute, cast logits back."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.model = model.to(dtype)
        self.dtype = dtype

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images.to(self.dtype)).float()


def use_exact_fp32(precision: str, device: torch.device) -> None:
    """fp32 means IEEE fp32: no TF32 in cuDNN convolutions or cuBLAS matmuls on this process's GPU.

    cuDNN allows TF32 by default, which moves logits by ~1e-3 relative on Ampere and later: enough
    to fail the fp32 accuracy gate, and not what a user asking for fp32 expects. fp16/bf16 engines
    are unaffected. The one place TF32 is switched off (fp32 engines as they compile and load, the
    gate's eager reference), and for the whole process: cuDNN reads the flag when a convolution
    runs, long after the engine was loaded.
    """
    if precision == "fp32" and device.type == "cuda":
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
