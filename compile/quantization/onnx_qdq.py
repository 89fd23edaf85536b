"""INT8 for the onnx engine: ONNX Runtime's ``quantize_static`` writes a QDQ model from an fp32 one.

The fp32 model is first pre-processed as ONNX Runtime's quantization guide asks
(``quant_pre_process``: shape inference, and graph optimization, which folds batch norms into the
convolutions so that they are quantized once). Weights are int8 per output channel, activations int8
per tensor; both symmetric (zero point 0), the form TensorRT requires of a Q/DQ network, so the same
``model.onnx`` serves on ONNX Runtime's CPU kernels (VNNI where the CPU has it) and builds a strongly
typed TensorRT engine.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from compile import _defaults
from compile.quantization import Calibration
from compile.settings_errors import SettingsError

logger = logging.getLogger(__name__)

# The calibrators of onnxruntime.quantization.CalibrationMethod, by our names.
ORT_CALIBRATION_METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile"}


def quantize_options(method: str, reduce_range: bool = False) -> dict[str, Any]:
    """Keyword arguments of ``quantize_static`` besides the models and the data reader (JSON-able
    names for the enums, as the manifest records them). Pure, so it is unit-tested.

    ``reduce_range``: weights in 7 bits, as ONNX Runtime's quantization guide advises for CPUs without
    VNNI (``needs_reduced_range``): there its int8 kernels add u8 x s8 products in pairs in 16 bits,
    which full-range weights saturate (EfficientNet-Lite0 then fails the accuracy gate outright)."""
    if method not in ORT_CALIBRATION_METHODS:
        raise SettingsError(
            "--calibration-method",
            method,
            f"ONNX Runtime has no {method!r} calibration; it has {', '.join(ORT_CALIBRATION_METHODS)}.",
            "Use --calibration-method auto: each engine's measured best.",
        )
    return {
        "quant_format": "QDQ",
        "per_channel": True,
        "reduce_range": reduce_range,
        "activation_type": "QInt8",
        "weight_type": "QInt8",
        "calibrate_method": ORT_CALIBRATION_METHODS[method],
        "extra_options": {
            "ActivationSymmetric": True,
            "WeightSymmetric": True,
            "CalibPercentile": _defaults.CALIBRATION_PERCENTILE,
            # quantize_static feeds the calibrator one stride (one run of rows) per collect_data call:
            # without it every activation of every calibration image is held in memory at once, which
            # for ResNet-152 and a few hundred images is tens of GB.
            "CalibStridedMinMax": 1,
        },
    }


class CalibrationReader:
    """``onnxruntime.quantization.CalibrationDataReader`` over the calibration runs; ``set_range``
    and ``len`` let quantize_static collect one run at a time (CalibStridedMinMax)."""

    def __init__(self, calibration: Calibration, input_name: str) -> None:
        self.batches = [batch.numpy().astype(np.float32) for batch in calibration.batches()]
        self.input_name = input_name
        self.set_range(0, len(self.batches))

    def __len__(self) -> int:
        return len(self.batches)

    def set_range(self, start_index: int, end_index: int) -> None:
        self._pending = iter(self.batches[start_index:end_index])

    def get_next(self) -> dict[str, np.ndarray] | None:
        batch = next(self._pending, None)
        return None if batch is None else {self.input_name: batch}

    def rewind(self) -> None:
        self.set_range(0, len(self.batches))


def needs_reduced_range(device_type: str) -> bool:
    """Whether an int8 engine for ``device_type`` (``cpu``, ``cuda``) is quantized with 7-bit weights:
    on a CPU without VNNI (compile/devices.py). GPUs (TensorRT) take full-range int8."""
    from compile.devices import cpu_has_vnni

    return device_type == "cpu" and not cpu_has_vnni()


def quantize_onnx(
    fp32_model: Path, output: Path, calibration: Calibration, reduce_range: bool = False
) -> dict[str, Any]:
    """Write the QDQ int8 model of ``fp32_model`` to ``output``; returns the options it was made with."""
    onnx = importlib.import_module("onnx")
    quantization = importlib.import_module("onnxruntime.quantization")
    from onnxruntime.quantization.shape_inference import quant_pre_process

    options = quantize_options(calibration.method, reduce_range)
    with tempfile.TemporaryDirectory(prefix="vision-serve-qdq-", dir=output.parent) as scratch:
        prepared = Path(scratch) / "prepared.onnx"
        quant_pre_process(str(fp32_model), str(prepared), skip_symbolic_shape=True)
        input_name = onnx.load(str(prepared), load_external_data=False).graph.input[0].name
        # The calibrators print their progress to stdout (a line per run of rows), which would break
        # compile-trt's JSON log stream; our progress stage reports the step instead.
        with contextlib.redirect_stdout(io.StringIO()):
            quantization.quantize_static(
                str(prepared),
                str(output),
                CalibrationReader(calibration, input_name),
                quant_format=getattr(quantization.QuantFormat, options["quant_format"]),
                per_channel=options["per_channel"],
                reduce_range=options["reduce_range"],
                activation_type=getattr(quantization.QuantType, options["activation_type"]),
                weight_type=getattr(quantization.QuantType, options["weight_type"]),
                calibrate_method=getattr(quantization.CalibrationMethod, options["calibrate_method"]),
                extra_options=dict(options["extra_options"]),
            )
    logger.info(
        "Quantized %s to int8 QDQ (%s calibration, %d images)",
        fp32_model.name,
        calibration.method,
        len(calibration.images),
    )
    return options
