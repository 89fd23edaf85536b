"""AOTInductor: ``torch.export`` + ``aoti_compile_and_package`` into a ``.pt2``; runs on CPU and CUDA."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from compile.backends.base import CompileBackend
from compile.batch_export import example_batch, export_dynamic_batch, export_example_size
from compile.engine import EngineCallable, use_exact_fp32
from compile.manifest import Manifest
from compile.quantization.pt2e import ACTIVATION_OBSERVERS, check_pt2e, quantize_pt2e, reduced_range
from compile.settings import CompileSettings
from compile.unpacking import load_unpacked
from compile.versions import package_version

if TYPE_CHECKING:
    from compile.quantization import Calibration

# Freezing folds the weights into the graph as constants: batch norm folds into the convolutions and
# oneDNN prepacks the weights on CPU. What the compiled engines gain over eager on a 2-core CPU:
# benchmarks/results/vm-2cpu-2026-11-21/compiled_throughput-resnet152-cpu.txt.
INDUCTOR_CONFIGS = {"freezing": True}


class InductorBackend(CompileBackend):
    name = "inductor"
    engine_file = "model.pt2"
    runtime_libraries = ("torch",)
    quantized_precisions = ("int8",)
    calibration_methods = ("histogram", "minmax")

    def check_precision(self, precision: str, device: torch.device) -> None:
        if precision == "int8":
            check_pt2e(device)

    def config(self, settings: CompileSettings, device: torch.device) -> dict[str, Any]:
        config: dict[str, Any] = {"inductor_configs": INDUCTOR_CONFIGS, "exact_fp32": settings.precision == "fp32"}
        if settings.quantized:
            method = self.resolve_calibration_method(settings.precision, settings.calibration_method)
            config["pt2e"] = {
                "quantizer": "X86InductorQuantizer",
                "activation_observer": ACTIVATION_OBSERVERS[method],
                "reduce_range": reduced_range(),
                "torchao": package_version("torchao"),
            }
        return config

    def build(
        self,
        model: nn.Module,
        settings: CompileSettings,
        device: torch.device,
        input_size: tuple[int, int],
        path: Path,
        calibration: Calibration | None = None,
    ) -> None:
        use_exact_fp32(settings.precision, device)  # Triton matmul templates read it at compile time
        example = example_batch(export_example_size(settings.batch), input_size, device)
        if calibration is not None:
            exported = quantize_pt2e(model, example, settings.batch, calibration.method, calibration.batches())
        else:
            with torch.inference_mode():
                exported = export_dynamic_batch(model, example, settings.batch)
        with torch.inference_mode():
            torch._inductor.aoti_compile_and_package(
                exported, package_path=str(path), inductor_configs=dict(INDUCTOR_CONFIGS)
            )

    def load(self, path: Path, manifest: Manifest, device: torch.device) -> EngineCallable:
        use_exact_fp32(manifest.precision, device)  # convolutions call cuDNN, which reads it at run time
        index = device.index if device.type == "cuda" and device.index is not None else -1
        # Unpacked where this process removes it, not left in the temp dir (compile/unpacking.py).
        return load_unpacked(lambda: torch._inductor.aoti_load_package(str(path), device_index=index))
