"""The interface every compile backend implements, and the pieces they share.

Every engine has the same contract, whatever built it: float32 NCHW images in, float32 logits out,
any batch size in the artifact's MIN..MAX. Lower precisions cast inside the graph (PrecisionCast),
so the server and the preprocessing never change with the precision.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from compile.manifest import Manifest
from compile.settings import CompileSettings

if TYPE_CHECKING:
    from compile.quantization import Calibration

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


# Where each quantized precision is built, for the messages that refuse one.
QUANTIZED_ENGINES_HINT = (
    "int8 engines: --backend onnx (ONNX Runtime, CPU or GPU), inductor (CPU) or tensorrt (GPU); "
    "fp8: --backend tensorrt on a GPU of compute capability 8.9 or later."
)


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


def example_batch(size: int, crop_size: int, device: torch.device) -> torch.Tensor:
    """A float32 channels_last batch shaped like what the server feeds the engine."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(size, 3, crop_size, crop_size, generator=generator)
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


class CompileBackend(ABC):
    """One way of turning a model into an engine file, and of loading that file to serve it."""

    name: str
    engine_file: str  # the file name inside the artifact directory
    # Libraries whose major.minor must be the same at load time as at compile time.
    runtime_libraries: tuple[str, ...] = ("torch",)
    # Of those, the ones that must match exactly (TensorRT engines deserialize only in their own version).
    exact_version_libraries: tuple[str, ...] = ()
    # What to tell a server that lacks one of the runtime libraries (empty: nothing beyond the name).
    install_hint: str = ""
    # The memory layout the engine reads its input batch in (the server converts to it once).
    input_memory_format: torch.memory_format = torch.channels_last
    # Whether the engine holds machine code for the compiling machine's CPU instruction sets or GPU
    # architecture (AOTInductor, TensorRT), so that it runs only where those are; eager weights and
    # ONNX graphs run anywhere their runtime does.
    native_code: bool = True
    # The quantized precisions it builds (calibrated on --calibration), and its calibration methods,
    # the measured best first: what --calibration-method auto picks (docs/compiling.md#int8).
    quantized_precisions: tuple[str, ...] = ()
    calibration_methods: tuple[str, ...] = ()

    def resolve_calibration_method(self, precision: str, method: str) -> str:
        """``method`` (``auto``: this backend's default) if this backend quantizes ``precision`` with
        it; ``BackendUnavailable`` saying what it offers otherwise."""
        if precision not in self.quantized_precisions:
            offers = (
                f"builds {', '.join(self.quantized_precisions)}" if self.quantized_precisions else "quantizes nothing"
            )
            raise BackendUnavailable(
                f"--backend {self.name} cannot build --precision {precision} (it {offers}). {QUANTIZED_ENGINES_HINT}"
            )
        if method == "auto":
            return self.calibration_methods[0]
        if method not in self.calibration_methods:
            raise BackendUnavailable(
                f"--backend {self.name} has no {method!r} calibration; it offers {', '.join(self.calibration_methods)} "
                f"(auto: {self.calibration_methods[0]})."
            )
        return method

    def check_precision(self, precision: str, device: torch.device) -> None:  # noqa: B027 - most take every precision
        """Raise ``BackendUnavailable`` if this backend cannot build ``precision`` engines for ``device``."""

    def check_available(self, device: torch.device) -> None:  # noqa: B027 - most backends run anywhere
        """Raise ``BackendUnavailable`` if this backend cannot compile for ``device`` here."""

    def config(self, settings: CompileSettings, device: torch.device) -> dict[str, Any]:
        """The backend's own options that shape the engine (part of the cache key); JSON-serializable."""
        return {}

    def extra_versions(self) -> tuple[str, ...]:
        """Packages (beyond torch/torchvision) whose versions go into the manifest and cache key."""
        return ()

    @abstractmethod
    def build(
        self,
        model: nn.Module,
        settings: CompileSettings,
        device: torch.device,
        crop_size: int,
        path: Path,
        calibration: Calibration | None = None,
    ) -> None:
        """Compile ``model`` (float32 interface, on ``device``, eval mode) into the file ``path``;
        quantized precisions are calibrated on ``calibration``."""

    @abstractmethod
    def load(self, path: Path, manifest: Manifest, device: torch.device) -> EngineCallable:
        """The engine stored at ``path``, ready to run on ``device``."""
