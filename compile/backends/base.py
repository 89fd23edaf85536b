"""The interface every compile backend implements. What an engine is, whichever backend built it,
is compile/engine.py; the batch-dynamic export the exporting backends share, compile/batch_export.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from compile.engine import BackendUnavailable, EngineCallable
from compile.manifest import Manifest
from compile.settings import CompileSettings

if TYPE_CHECKING:
    from compile.quantization import Calibration

# Where each quantized precision is built, for the messages that refuse one.
QUANTIZED_ENGINES_HINT = (
    "int8 engines: --backend onnx (ONNX Runtime, CPU or GPU), inductor (CPU) or tensorrt (GPU); "
    "fp8: --backend tensorrt on a GPU of compute capability 8.9 or later."
)


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
        input_size: tuple[int, int],
        path: Path,
        calibration: Calibration | None = None,
    ) -> None:
        """Compile ``model`` (float32 interface, on ``device``, eval mode) into the file ``path``, for
        batches of ``input_size`` = (height, width) images (``PreprocessSpec.input_size``, which may be
        non-square); quantized precisions are calibrated on ``calibration``."""

    @abstractmethod
    def load(self, path: Path, manifest: Manifest, device: torch.device) -> EngineCallable:
        """The engine stored at ``path``, ready to run on ``device``."""
