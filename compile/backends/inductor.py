"""AOTInductor: ``torch.export`` + ``aoti_compile_and_package`` into a ``.pt2``; runs on CPU and CUDA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from compile.backends.base import (
    CompileBackend,
    EngineCallable,
    example_batch,
    export_dynamic_batch,
    export_example_size,
    use_exact_fp32,
)
from compile.manifest import Manifest
from compile.settings import CompileSettings

# Freezing folds the weights into the graph as constants: batch norm folds into the convolutions and
# oneDNN prepacks the weights on CPU. What the compiled engines gain over eager on a 2-core CPU:
# benchmarks/results/vm-2cpu-2026-11-21/compiled_throughput-resnet152-cpu.txt.
INDUCTOR_CONFIGS = {"freezing": True}


class InductorBackend(CompileBackend):
    name = "inductor"
    engine_file = "model.pt2"
    runtime_libraries = ("torch",)

    def config(self, settings: CompileSettings, device: torch.device) -> dict[str, Any]:
        return {"inductor_configs": INDUCTOR_CONFIGS, "exact_fp32": settings.precision == "fp32"}

    def build(
        self, model: nn.Module, settings: CompileSettings, device: torch.device, crop_size: int, path: Path
    ) -> None:
        use_exact_fp32(settings.precision, device)  # Triton matmul templates read it at compile time
        example = example_batch(export_example_size(settings.batch), crop_size, device)
        with torch.inference_mode():
            exported = export_dynamic_batch(model, example, settings.batch)
            torch._inductor.aoti_compile_and_package(
                exported, package_path=str(path), inductor_configs=dict(INDUCTOR_CONFIGS)
            )

    def load(self, path: Path, manifest: Manifest, device: torch.device) -> EngineCallable:
        use_exact_fp32(manifest.precision, device)  # convolutions call cuDNN, which reads it at run time
        index = device.index if device.type == "cuda" and device.index is not None else -1
        return torch._inductor.aoti_load_package(str(path), device_index=index)
