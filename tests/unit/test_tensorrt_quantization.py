"""The tensorrt engine's int8/fp8 path at its seams. ModelOpt's quantizers run on a CPU, so they are
real here: our config and forward loop calibrate a small CNN, and the scales are checked against the
calibration data. What cannot run here is the rest: ModelOpt's export to TensorRT's Q/DQ ops (it
needs CUDA tensors) and TensorRT's build, so no test claims an engine was built."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from compile.backends import BackendUnavailable, get_backend
from compile.backends.tensorrt import tensorrt_compile_kwargs
from compile.quantization.modelopt import fp8_problem, modelopt_config, quantize_for_tensorrt
from compile.settings import CompileSettings

CUDA0 = torch.device("cuda:0")


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).eval()


def test_modelopt_config_is_a_copy_of_its_int8_preset_calibrated_by_max() -> None:
    mtq = pytest.importorskip("modelopt.torch.quantization")
    config = modelopt_config("int8", "minmax")
    assert config == mtq.INT8_DEFAULT_CFG and config is not mtq.INT8_DEFAULT_CFG and config["algorithm"] == "max"
    assert modelopt_config("fp8", "minmax")["quant_cfg"] == mtq.FP8_DEFAULT_CFG["quant_cfg"]
    with pytest.raises(ValueError, match="not 'entropy'"):
        modelopt_config("int8", "entropy")


def test_calibration_sets_per_tensor_input_and_per_channel_weight_scales_with_real_modelopt() -> None:
    pytest.importorskip("modelopt.torch.quantization")
    model = small_cnn()
    batches = [torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(i)) * (i + 1) for i in range(3)]
    returned = quantize_for_tensorrt(model, "int8", "minmax", iter(batches), torch.device("cpu"))
    conv = returned[0]
    # The first convolution's input range is the largest magnitude of every calibration run: all were fed.
    assert conv.input_quantizer.amax.item() == pytest.approx(max(b.abs().max().item() for b in batches), rel=1e-6)
    weights = conv.weight_quantizer.amax.flatten()
    assert weights.shape == (8,)  # one scale per output channel (axis 0), what TensorRT takes
    assert torch.allclose(weights, conv.weight.detach().abs().amax(dim=(1, 2, 3)), rtol=1e-6)
    with torch.no_grad():
        quantized, reference = returned(batches[0]), small_cnn()(batches[0])
    assert not torch.equal(quantized, reference)  # it computes through the quantizers now
    assert torch.allclose(quantized, reference, atol=0.05 * reference.abs().max().item())


def test_fp8_needs_compute_capability_8_9() -> None:
    assert fp8_problem((9, 0)) is None and fp8_problem((8, 9)) is None
    problem = fp8_problem((8, 0))
    assert "compute capability 8.9" in problem and "this one is 8.0" in problem and "int8" in problem


def test_tensorrt_offers_int8_and_fp8_with_minmax_only() -> None:
    backend = get_backend("tensorrt")
    assert backend.resolve_calibration_method("int8", "auto") == "minmax"
    assert backend.resolve_calibration_method("fp8", "minmax") == "minmax"
    with pytest.raises(BackendUnavailable, match="no 'percentile' calibration; it offers minmax"):
        backend.resolve_calibration_method("int8", "percentile")


def test_tensorrt_refuses_quantized_precisions_without_modelopt(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "modelopt.torch.quantization", None)  # import raises ImportError
    with pytest.raises(BackendUnavailable, match=r"quantizes with NVIDIA ModelOpt.*vision-serve\[tensorrt-quant\]"):
        get_backend("tensorrt").check_precision("int8", CUDA0)
    get_backend("tensorrt").check_precision("fp16", CUDA0)  # other precisions do not need it


def test_a_quantized_tensorrt_build_must_convert_fully_and_records_its_preset() -> None:
    int8 = CompileSettings(device="cuda", precision="int8", calibration="/tmp")
    assert tensorrt_compile_kwargs(int8, CUDA0)["require_full_compilation"] is True
    assert tensorrt_compile_kwargs(CompileSettings(device="cuda"), CUDA0)["require_full_compilation"] is False
    config = get_backend("tensorrt").config(int8, CUDA0)
    assert config["modelopt"] == {"preset": "INT8_DEFAULT_CFG", "calibration": "minmax"}
    assert "enabled_precisions" not in config  # the graph's types carry the precision (torch_tensorrt 2.13+)
