"""Eager PyTorch at the chosen precision: no compilation, the baseline every other engine is gated against."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from compile.backends.base import CompileBackend
from compile.catalog import entry_from_manifest
from compile.engine import PRECISION_DTYPES, EngineCallable, PrecisionCast, use_exact_fp32
from compile.manifest import Manifest
from compile.settings import CompileSettings

if TYPE_CHECKING:
    from compile.quantization import Calibration


class EagerBackend(CompileBackend):
    name = "eager"
    engine_file = "state_dict.pt"
    runtime_libraries = ("torch", "torchvision")
    native_code = False

    def build(
        self,
        model: nn.Module,
        settings: CompileSettings,
        device: torch.device,
        input_size: tuple[int, int],
        path: Path,
        calibration: Calibration | None = None,
    ) -> None:
        # The weights at their final precision; the architecture comes back from the catalog at load.
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, path)

    def load(self, path: Path, manifest: Manifest, device: torch.device) -> EngineCallable:
        from compile.weights import build_architecture

        use_exact_fp32(manifest.precision, device)
        model = PrecisionCast(build_architecture(entry_from_manifest(manifest)), PRECISION_DTYPES[manifest.precision])
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        model = model.eval().to(device).to(memory_format=torch.channels_last)

        def run(images: torch.Tensor) -> torch.Tensor:
            with torch.inference_mode():
                return model(images)

        return run
