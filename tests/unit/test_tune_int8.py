"""vision-tune's int8 engines (issue 43): --calibration puts them into the grid, through compile-trt's gate."""

from __future__ import annotations

import pytest

from compile import _defaults as compile_defaults
from compile.settings import CALIBRATION_ADVICE, CALIBRATION_NEEDED
from service.tune import _defaults
from service.tune.cli import build_parser, main, settings_from_args
from service.tune.engines import compile_arguments
from service.tune.machine import Machine, build_grid
from service.tune.settings import TuneSettings

CPU = Machine("cpu", 0, 2, True, "test CPU")
GPU = Machine("cuda", 1, 16, False, "test GPU")
# compile-trt's words, then their fix (a SettingsError's message and fix: one sentence as before).
NEEDED_TAIL = CALIBRATION_NEEDED.format(precision="int8").removeprefix("--precision int8 ") + " " + CALIBRATION_ADVICE


def settings(**values) -> TuneSettings:
    return TuneSettings(**{"p99_ms": 100.0, **values})


# ---- settings and flags ------------------------------------------------------------------------


def test_the_calibration_flags_default_to_compile_trts():
    tuned = settings()
    assert (tuned.calibration, tuned.calibration_count, tuned.calibration_method) == ("", 256, "auto")
    assert (tuned.gate_min_top5_agreement, tuned.gate_max_prob_drop) == (None, None)


def test_engines_take_every_precision_compile_trt_has():
    parsed = settings(engines="onnx-int8,inductor-int8,tensorrt-fp8", calibration="cal").grid_values()
    assert parsed["engines"] == ("onnx-int8", "inductor-int8", "tensorrt-fp8")
    with pytest.raises(ValueError, match=r"precisions: fp32, fp16, bf16, int8, fp8\); got 'onnx-int4'"):
        settings(engines="onnx-int4")


def test_a_quantized_engine_without_calibration_is_refused_in_compile_trts_words():
    with pytest.raises(ValueError) as refused:
        settings(engines="onnx-fp32,onnx-int8,tensorrt-fp8")
    assert str(refused.value) == f"--engines onnx-int8,tensorrt-fp8 {NEEDED_TAIL}"
    assert str(refused.value).startswith("--engines onnx-int8,tensorrt-fp8 needs --calibration DIR: a folder of images")


def test_calibration_with_engines_that_hold_no_quantized_engine_is_refused():
    with pytest.raises(ValueError) as refused:
        settings(engines="onnx-fp32,inductor-bf16", calibration="cal")
    assert str(refused.value) == (
        "--calibration calibrates quantized engines (int8/fp8), and --engines onnx-fp32,inductor-bf16 holds none. "
        "Add one (e.g. onnx-int8) to --engines, drop --engines to take the machine's grid with its int8 engines, "
        "or drop --calibration."
    )
    assert settings(calibration="cal").calibration == "cal"  # without --engines: it adds the int8 engines


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"calibration_count": 0}, "--calibration-count must be 1..2048, got 0"),
        ({"calibration": "cal", "calibration_count": 5000}, "--calibration-count must be 1..2048, got 5000"),
        ({"calibration_method": "kl"}, "--calibration-method must be one of auto, minmax, entropy, percentile, "),
        ({"gate_min_top5_agreement": 1.5}, "--gate-min-top5-agreement must be in 0..1, got 1.5"),
        ({"gate_max_prob_drop": -0.1}, "--gate-max-prob-drop must be in 0..1, got -0.1"),
        ({"gate_min_cosine": 2.0}, "--gate-min-cosine must be in 0..1, got 2.0"),
    ],
)
def test_calibration_and_gate_flags_are_checked_as_compile_trt_checks_them(values, message):
    with pytest.raises(ValueError) as refused:
        settings(**values)
    assert str(refused.value).startswith(message)


def test_the_calibration_flags_are_flags(capsys):
    args = build_parser().parse_args(
        ["--p99-ms", "80", "--calibration", "cal", "--calibration-count", "64", "--calibration-method", "entropy",
         "--gate-min-top5-agreement", "0.9", "--gate-max-prob-drop", "0.1", "--eval", "ev"]
    )  # fmt: skip
    tuned = settings_from_args(args)
    assert (tuned.calibration, tuned.calibration_count, tuned.calibration_method) == ("cal", 64, "entropy")
    assert (tuned.gate_min_top5_agreement, tuned.gate_max_prob_drop, tuned.gate_images) == (0.9, 0.1, "ev")
    with pytest.raises(SystemExit) as exited:
        main(["--p99-ms", "80", "--engines", "onnx-int8"])
    assert exited.value.code == 2
    assert "--engines onnx-int8 needs --calibration DIR" in capsys.readouterr().err


# ---- the grid ----------------------------------------------------------------------------------


def test_calibration_adds_the_int8_engines_to_the_cpu_grid_and_says_so():
    space, notes = build_grid(settings(calibration="/data/cal"), CPU)
    assert space.values["engine"] == ("onnx-fp32", "inductor-fp32", "inductor-bf16", "onnx-int8", "inductor-int8")
    assert "onnx-int8, inductor-int8 added: --calibration was given (calibrated on /data/cal)." in notes
    assert not any("left out" in note and "int8" in note for note in notes)


def test_without_calibration_the_cpu_grid_leaves_int8_out_and_says_how_to_add_it():
    space, notes = build_grid(settings(), CPU)
    assert space.values["engine"] == ("onnx-fp32", "inductor-fp32", "inductor-bf16")
    assert (
        "onnx-int8, inductor-int8 left out: int8 engines are calibrated on images like the served ones; "
        "--calibration DIR adds them."
    ) in notes
    old_cpu, _ = build_grid(settings(calibration="cal"), Machine("cpu", 0, 2, False, "old CPU"))
    assert old_cpu.values["engine"] == ("onnx-fp32", "inductor-fp32", "onnx-int8", "inductor-int8")


def test_calibration_adds_tensorrt_int8_to_the_gpu_grid():
    space, notes = build_grid(settings(calibration="cal"), GPU)
    assert space.values["engine"] == (*_defaults.GPU_ENGINES, "tensorrt-int8")
    assert "tensorrt-int8 added: --calibration was given (calibrated on cal)." in notes
    plain, plain_notes = build_grid(settings(), GPU)
    assert plain.values["engine"] == _defaults.GPU_ENGINES
    assert any(note.startswith("tensorrt-int8 left out:") for note in plain_notes)


def test_engines_given_are_the_grid_and_get_no_int8_note():
    space, notes = build_grid(settings(engines="onnx-int8", calibration="cal"), CPU)
    assert space.values["engine"] == ("onnx-int8",)
    assert not any("int8" in note for note in notes)


# ---- compile-trt -------------------------------------------------------------------------------


def test_a_quantized_engine_is_compiled_with_the_calibration_flags(tmp_path):
    tuned = settings(
        calibration="/data/cal", calibration_count=128, calibration_method="entropy", gate_max_prob_drop=0.1,
        gate_images="/data/eval",
    )  # fmt: skip
    arguments = compile_arguments(tuned, "onnx-int8", (1, 8, 32), tmp_path / "out", "cpu")
    assert arguments == [
        "--model", "resnet152", "--weights", "imagenet", "--gate-images", "/data/eval",
        "--gate-max-prob-drop", "0.1",
        "--calibration", "/data/cal", "--calibration-count", "128", "--calibration-method", "entropy",
        "--backend", "onnx", "--precision", "int8", "--batch", "1,8,32", "--device", "cpu",
        "--output", str(tmp_path / "out"),
    ]  # fmt: skip
    defaults = compile_arguments(settings(calibration="c"), "tensorrt-fp8", (1, 8, 32), tmp_path, "cuda")
    assert defaults[defaults.index("--calibration") :][:6] == [
        "--calibration", "c", "--calibration-count", str(compile_defaults.DEFAULT_CALIBRATION_COUNT),
        "--calibration-method", compile_defaults.DEFAULT_CALIBRATION_METHOD,
    ]  # fmt: skip


def test_a_non_quantized_engine_gets_the_command_it_got_before(tmp_path):
    tuned = settings(calibration="/data/cal", calibration_count=128, calibration_method="entropy")
    arguments = compile_arguments(tuned, "onnx-fp32", (1, 8, 32), tmp_path / "out", "cpu")
    assert arguments == [
        "--model", "resnet152", "--weights", "imagenet",
        "--backend", "onnx", "--precision", "fp32", "--batch", "1,8,32", "--device", "cpu",
        "--output", str(tmp_path / "out"),
    ]  # fmt: skip
    assert not any(a.startswith("--calibration") for a in arguments)
