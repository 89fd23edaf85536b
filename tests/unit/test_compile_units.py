"""compile-trt's pure parts: settings, the TensorRT argument building (TensorRT itself is NOT run:
it cannot be installed here), gate measures, compatibility checks, manifest errors, progress."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from compile import _defaults
from compile.backends import BackendUnavailable, PrecisionCast, resolve_compile_backend
from compile.backends.tensorrt import (
    tensorrt_compile_kwargs,
    tensorrt_input_spec,
    tensorrt_save_kwargs,
)
from compile.batch_export import export_example_size
from compile.compat import device_problems, version_problems
from compile.devices import cpu_capability_runs_here
from compile.gate import GateInputs, compare_logits, gate_batch_sizes, run_gate, threshold_failures
from compile.manifest import ManifestError, cache_key, read_manifest
from compile.progress import Progress
from compile.settings import CompileSettings, parse_batch
from compile.versions import major_minor

CUDA0 = torch.device("cuda:0")


def test_tensorrt_input_spec_covers_the_batch_range_without_tensorrt() -> None:
    spec = tensorrt_input_spec((1, 8, 32), (224, 224))
    assert spec["min_shape"] == (1, 3, 224, 224)
    assert spec["opt_shape"] == (8, 3, 224, 224)
    assert spec["max_shape"] == (32, 3, 224, 224)
    assert spec["dtype"] is torch.float32 and spec["name"] == "images"


def test_tensorrt_input_spec_is_height_by_width_for_a_non_square_input_without_tensorrt() -> None:
    spec = tensorrt_input_spec((1, 8, 32), (48, 64))  # 48 high, 64 wide: torch_tensorrt.Input's (N, C, H, W)
    assert (spec["min_shape"], spec["opt_shape"], spec["max_shape"]) == (
        (1, 3, 48, 64),
        (8, 3, 48, 64),
        (32, 3, 48, 64),
    )


def test_tensorrt_build_exports_and_declares_a_non_square_input_mock_seam(tmp_path, monkeypatch) -> None:
    """TensorRTBackend.build at its seam with torch_tensorrt: a stand-in module (MOCK: TensorRT cannot be
    installed here) records what build hands it; the export before it is real torch.export on the CPU."""
    import types

    from compile.backends import tensorrt as tensorrt_backend

    calls: dict = {}

    class Input:
        def __init__(self, **kwargs) -> None:
            calls["input"] = kwargs

    def compile_(exported, arg_inputs, **kwargs):
        calls["exported"], calls["arg_inputs"] = exported, arg_inputs
        return exported

    def save(compiled, path, **kwargs):
        calls["save"] = kwargs

    fake = types.ModuleType("torch_tensorrt")
    fake.Input, fake.dynamo, fake.save = Input, types.SimpleNamespace(compile=compile_), save
    monkeypatch.setitem(sys.modules, "torch_tensorrt", fake)
    # The CUDA-only part of the seam: its kwargs refuse a CPU device, and the example batch stays on the CPU.
    monkeypatch.setattr(tensorrt_backend, "tensorrt_compile_kwargs", lambda settings, device: {"device": device})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()).eval()
    settings = CompileSettings(backend="tensorrt", batch=(1, 4, 8))
    tensorrt_backend.TensorRTBackend().build(model, settings, torch.device("cpu"), (48, 64), tmp_path / "model.ep")

    assert calls["input"]["min_shape"] == (1, 3, 48, 64) and calls["input"]["max_shape"] == (8, 3, 48, 64)
    (example,) = calls["save"]["arg_inputs"]
    assert tuple(example.shape) == (4, 3, 48, 64)
    exported = calls["exported"]
    (image,) = [n for n in exported.graph.nodes if n.name in exported.graph_signature.user_inputs]
    assert list(image.meta["val"].shape[1:]) == [3, 48, 64]  # the program was traced at height x width


def test_tensorrt_compile_kwargs_map_settings_without_tensorrt() -> None:
    settings = CompileSettings(precision="fp16", workspace_gib=2.5, optimization_level=5, device="cuda")
    kwargs = tensorrt_compile_kwargs(settings, CUDA0)
    assert kwargs["workspace_size"] == int(2.5 * 2**30)
    assert kwargs["optimization_level"] == 5
    assert kwargs["device"] == CUDA0 and kwargs["min_block_size"] == 1
    # torch_tensorrt 2.13+ removed enabled_precisions: precision is carried by the graph (PrecisionCast).
    assert "enabled_precisions" not in kwargs and "use_explicit_typing" not in kwargs
    assert kwargs["cache_built_engines"] is False and kwargs["reuse_cached_engines"] is False
    assert kwargs["disable_tf32"] is False  # fp16 layers are unaffected; fp32 would mean IEEE fp32:
    assert tensorrt_compile_kwargs(CompileSettings(device="cuda"), CUDA0)["disable_tf32"] is True


def test_tensorrt_compile_kwargs_refuse_a_cpu_device_without_tensorrt() -> None:
    with pytest.raises(BackendUnavailable, match="--backend inductor"):
        tensorrt_compile_kwargs(CompileSettings(), torch.device("cpu"))


def test_tensorrt_save_kwargs_keep_the_batch_dynamic_without_tensorrt() -> None:
    example = torch.zeros(8, 3, 4, 4)
    kwargs = tensorrt_save_kwargs((1, 8, 32), example)
    assert kwargs["output_format"] == "exported_program" and kwargs["arg_inputs"] == [example]
    (dims,) = kwargs["dynamic_shapes"]
    assert dims[0].min == 1 and dims[0].max == 32
    assert "dynamic_shapes" not in tensorrt_save_kwargs((8, 8, 8), example)  # a static engine


def test_major_minor_handles_local_and_dev_suffixes() -> None:
    assert major_minor("2.14.0+cu130") == (2, 14)
    assert major_minor("2.11.0.dev20250101") == (2, 11)
    assert major_minor("2.12.0rc1") == (2, 12)
    assert major_minor("10") == (10, 0)


def test_auto_backend_on_cpu_is_onnx_at_fp32_and_inductor_below(monkeypatch) -> None:
    pytest.importorskip("onnxruntime")
    cpu = torch.device("cpu")
    assert resolve_compile_backend("auto", cpu)[0] == "onnx"  # this environment has ONNX Runtime
    assert resolve_compile_backend("auto", cpu, "bf16")[0] == "inductor"
    assert resolve_compile_backend("auto", cpu, "fp16")[0] == "inductor"
    monkeypatch.setattr("compile.backends.onnx_status", lambda: (False, "not installed"))
    backend, reason = resolve_compile_backend("auto", cpu)
    assert backend == "inductor" and "vision-serve[onnx]" in reason
    assert resolve_compile_backend("eager", torch.device("cpu")) == ("eager", "chosen explicitly")


def test_export_example_batch_is_never_one_for_a_dynamic_range() -> None:
    assert export_example_size((1, 1, 32)) == 2  # export would specialize a dimension seen as 1
    assert export_example_size((1, 8, 32)) == 8
    assert export_example_size((4, 4, 4)) == 4


def test_precision_cast_keeps_a_float32_interface() -> None:
    model = PrecisionCast(torch.nn.Linear(4, 3), torch.bfloat16)
    out = model(torch.randn(2, 4))
    assert out.dtype is torch.float32 and model.model.weight.dtype is torch.bfloat16


@pytest.mark.parametrize(("text", "expected"), [("1,8,32", (1, 8, 32)), ("16", (16, 16, 16)), (" 2, 4 ,8", (2, 4, 8))])
def test_parse_batch(text, expected) -> None:
    assert parse_batch(text) == expected


def test_gate_thresholds_follow_precision_and_overrides() -> None:
    assert CompileSettings(precision="bf16").gate_thresholds() == _defaults.GATE_THRESHOLDS["bf16"]
    custom = CompileSettings(precision="fp16", gate_min_cosine=0.5).gate_thresholds()
    assert custom["cosine"] == 0.5 and custom["max_rel_error"] == _defaults.GATE_THRESHOLDS["fp16"]["max_rel_error"]


class NearlyTiedLogits(torch.nn.Module):
    """Logits like a random model's: within +-0.3, with the top two classes 5e-4 apart on every input."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        logits = images.mean(dim=(2, 3)).repeat(1, 4)[:, :10]  # [N, 10], about +-0.3
        logits[:, 0] = logits.amax(dim=1) + 5e-4
        return logits


def test_random_weights_gate_on_logits_so_rounding_noise_at_near_ties_cannot_fail_it() -> None:
    """An fp16-sized error (1e-3) flips the top-1 of nearly tied logits on every input: with real
    weights that fails the gate; with random weights (meaningless ranks) only the logits are gated."""
    reference = NearlyTiedLogits()

    def engine(images: torch.Tensor) -> torch.Tensor:
        logits = reference(images)
        logits[:, 0] -= 1e-3  # now just below the runner-up
        return logits

    images = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    inputs = GateInputs(images, [f"random-{i}" for i in range(6)], real_count=0)

    def gate(weights: str):
        thresholds = CompileSettings(weights=weights, precision="fp16").gate_thresholds()
        labels = tuple(str(i) for i in range(10))
        return run_gate(engine, reference, inputs, (1, 2, 3), thresholds, torch.device("cpu"), labels)

    trained = gate("imagenet")
    assert trained.metrics["top1_agreement"] == 0.0
    assert trained.failures[0].startswith("top1_agreement = 0, needs >= 0.95")
    random_weights = gate("random")
    assert random_weights.passed, random_weights.failures
    assert set(random_weights.thresholds) == set(_defaults.RANDOM_WEIGHTS_GATED)
    assert "top1_agreement         0  (not gated)" in random_weights.summary()
    # The logit measures still bind: an engine that computes something else fails.
    broken = run_gate(lambda x: -reference(x), reference, inputs, (1, 2, 3), random_weights.thresholds,
                      torch.device("cpu"), tuple(str(i) for i in range(10)))  # fmt: skip
    assert [f.split(" ")[0] for f in broken.failures] == ["cosine", "max_rel_error"]
    # An explicit flag still applies to random weights.
    forced = CompileSettings(weights="random", precision="fp16", gate_min_top1_agreement=0.9).gate_thresholds()
    assert forced["top1_agreement"] == 0.9


def test_compare_logits_identical_and_disagreeing() -> None:
    reference = torch.randn(6, 1000, generator=torch.Generator().manual_seed(1))
    same = compare_logits(reference.clone(), reference)
    assert same == {
        "top1_agreement": 1.0,
        "top5_overlap": 1.0,
        "top5_agreement": 1.0,
        "mean_prob_drop": 0.0,
        "cosine": pytest.approx(1.0),
        "max_rel_error": 0.0,
    }
    flipped = reference.clone()
    flipped[0] = -flipped[0]  # one row now ranks every class backwards
    measures = compare_logits(flipped, reference)
    assert measures["top1_agreement"] == pytest.approx(5 / 6)
    assert measures["top5_overlap"] == pytest.approx(5 / 6)
    assert measures["top5_agreement"] == pytest.approx(5 / 6)
    assert measures["cosine"] == pytest.approx(-1.0)
    assert measures["max_rel_error"] == pytest.approx(2.0)


def test_threshold_failures_name_the_measure_and_the_bound() -> None:
    thresholds = _defaults.GATE_THRESHOLDS["fp32"]
    ok = {"top1_agreement": 1.0, "top5_overlap": 1.0, "cosine": 1.0, "max_rel_error": 1e-6}
    assert threshold_failures(ok, thresholds) == []
    failures = threshold_failures({**ok, "max_rel_error": 0.5, "cosine": 0.9}, thresholds)
    assert failures == ["cosine = 0.9, needs >= 0.9999", "max_rel_error = 0.5, needs <= 0.001"]


def test_gate_batch_sizes_are_the_distinct_range_points() -> None:
    assert gate_batch_sizes((1, 8, 32)) == [1, 8, 32]
    assert gate_batch_sizes((4, 4, 4)) == [4]


def test_cache_key_is_stable_and_sensitive() -> None:
    parts = {"model": "resnet152", "precision": "fp16", "batch": [1, 8, 32]}
    assert cache_key(parts) == cache_key(dict(reversed(list(parts.items()))))
    assert cache_key(parts) != cache_key({**parts, "precision": "bf16"})


def test_cpu_capability_order() -> None:
    assert cpu_capability_runs_here("AVX2", "AVX512")
    assert not cpu_capability_runs_here("AVX512", "AVX2")
    assert not cpu_capability_runs_here("ZVECTOR", "AVX512")


class FakeManifest:
    """Only the fields the compatibility checks read."""

    def __init__(self, **fields) -> None:
        defaults = {
            "backend": "inductor",
            "versions": {"torch": "2.14.1+cu130"},
            "device_type": "cuda",
            "device_name": "NVIDIA H100 80GB HBM3",
            "device_capability": "sm_90",
            "device_isa": "",
        }
        self.__dict__.update({**defaults, **fields})


def test_version_problems_compare_major_minor() -> None:
    assert version_problems(FakeManifest(), {"torch": "2.14.0"}) == []
    (problem,) = version_problems(FakeManifest(), {"torch": "2.15.0"})
    assert "compiled with torch 2.14.1+cu130" in problem and "Recompile" in problem
    trt = FakeManifest(backend="tensorrt", versions={"torch": "2.14.1", "torch_tensorrt": "2.14.0", "tensorrt": "11.1"})
    problems = version_problems(trt, {"torch": "2.14.1"})
    assert len(problems) == 2 and all("Dockerfile.gpu" in p for p in problems)
    # TensorRT engines deserialize only in the exact TensorRT version that built them.
    here = {"torch": "2.14.1", "torch_tensorrt": "2.14.0", "tensorrt": "11.1.1"}
    (problem,) = version_problems(trt, here)
    assert "only load under tensorrt 11.1." in problem
    assert version_problems(trt, {**here, "tensorrt": "11.1"}) == []


def test_device_problems_name_the_fix() -> None:
    h100 = {"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "capability": "sm_90"}
    assert device_problems(FakeManifest(), "cuda", h100) == []
    (wrong_gpu,) = device_problems(FakeManifest(), "cuda", {**h100, "name": "NVIDIA A10G", "capability": "sm_86"})
    assert "Recompile it on this GPU" in wrong_gpu
    (wrong_type,) = device_problems(FakeManifest(), "cpu")
    assert "--device cuda" in wrong_type
    cpu = FakeManifest(device_type="cpu", device_capability="AVX512", device_isa="avx512 avx512_vnni avx512_bf16")
    assert "Recompile it on this machine" in device_problems(cpu, "cpu", {"capability": "AVX2", "isa": "avx2"})[0]
    # Same torch capability, but a CPU without the bf16 extension the code was built for (Skylake-SP):
    skylake = {"capability": "AVX512", "isa": "avx512"}
    assert "Recompile it on this machine" in device_problems(cpu, "cpu", skylake)[0]
    assert device_problems(cpu, "cpu", {"capability": "AVX512", "isa": "avx512 avx512_vnni avx512_bf16 amx_tile"}) == []


def test_read_manifest_errors_say_what_to_do(tmp_path) -> None:
    with pytest.raises(ManifestError, match="does not exist"):
        read_manifest(tmp_path / "missing")
    (tmp_path / "manifest.json").write_text("[1, 2]")
    with pytest.raises(ManifestError, match="not an object"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": _defaults.MANIFEST_FORMAT_VERSION}))
    with pytest.raises(ManifestError, match="lacks backend"):
        read_manifest(tmp_path)


def test_progress_logs_each_stage_and_marks_failures(caplog) -> None:
    progress = Progress(live=False)
    with caplog.at_level(logging.INFO, logger="compile.progress"):
        with progress.stage("Compiling"):
            pass
        with pytest.raises(RuntimeError), progress.stage("Gate"):
            raise RuntimeError("boom")
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "Compiling ..." and messages[1].startswith("Compiling: done in")
    assert messages[3].startswith("Gate: FAILED in")
    assert set(progress.durations) == {"Compiling", "Gate"}


def test_progress_on_a_terminal_updates_one_line() -> None:
    stream = io.StringIO()
    with Progress(stream, live=True).stage("Compiling"):
        import time

        time.sleep(0.6)  # long enough for the ticker to draw at least once
    text = stream.getvalue()
    assert "\r" in text and "Compiling ..." in text and text.endswith("Compiling: done in 0.6 s\n")


def test_tensorrt_kwargs_are_parameters_of_the_installed_torch_tensorrt() -> None:
    """Runs only where torch_tensorrt imports (the Dockerfile.gpu image); checks our names, not TensorRT."""
    torch_tensorrt = pytest.importorskip("torch_tensorrt")
    import inspect

    compile_params = inspect.signature(torch_tensorrt.dynamo.compile).parameters
    save_params = inspect.signature(torch_tensorrt.save).parameters
    kwargs = tensorrt_compile_kwargs(CompileSettings(device="cuda"), CUDA0)
    assert set(kwargs) <= set(compile_params) and "arg_inputs" in compile_params
    assert set(tensorrt_save_kwargs((1, 8, 32), torch.zeros(8, 3, 4, 4))) <= set(save_params)
    torch_tensorrt.Input(**tensorrt_input_spec((1, 8, 32), (224, 224)))


def test_interrupted_compile_leftovers_are_cleaned_and_the_old_artifact_restored(tmp_path) -> None:
    from compile.build import output_lock

    output = tmp_path / "artifact"
    (tmp_path / ".artifact.old-12345").mkdir()  # killed between moving the old artifact aside and renaming
    (tmp_path / ".artifact.old-12345" / "manifest.json").write_text("{}")
    (tmp_path / ".artifact.tmp-12345").mkdir()  # a half-built staging folder
    (tmp_path / ".other.tmp-1").mkdir()  # another output's: not ours to touch
    with output_lock(output):
        assert (output / "manifest.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".artifact.lock", ".other.tmp-1", "artifact"]


def test_two_compiles_into_one_output_take_turns(tmp_path) -> None:
    import threading

    from compile.build import output_lock

    output, order = tmp_path / "artifact", []
    first_holds = threading.Event()

    def first() -> None:
        with output_lock(output):
            first_holds.set()
            order.append("first in")
            time.sleep(0.3)
            order.append("first out")

    thread = threading.Thread(target=first)
    thread.start()
    first_holds.wait(10)
    with output_lock(output):  # a separate open of the lock file, as another process's would be
        order.append("second in")
    thread.join()
    assert order == ["first in", "first out", "second in"]


def test_failed_rename_puts_the_old_artifact_back(tmp_path) -> None:
    from compile.build import _move_into_place

    output = tmp_path / "artifact"
    output.mkdir()
    (output / "manifest.json").write_text("old")
    with pytest.raises(OSError):
        _move_into_place(tmp_path / "missing-staging", output)
    assert (output / "manifest.json").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["artifact"]


def test_a_folder_with_someone_elses_manifest_is_not_an_artifact(tmp_path) -> None:
    from compile.build import check_output_dir

    (tmp_path / "manifest.json").write_text(json.dumps({"name": "my web app"}))
    with pytest.raises(ValueError, match="not a compile-trt artifact"):
        check_output_dir(tmp_path)


def test_compile_device_is_one_device() -> None:
    from compile.build import resolve_compile_device

    assert resolve_compile_device("auto", 0) == torch.device("cpu")
    assert resolve_compile_device("auto", 2) == torch.device("cuda:0")
    assert resolve_compile_device("cuda", 2) == torch.device("cuda:0")
    assert resolve_compile_device("cuda:1", 2) == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"cuda:0 \.\. cuda:1"):
        resolve_compile_device("cuda:2", 2)
    with pytest.raises(ValueError, match="torch sees none"):
        resolve_compile_device("cuda", 0)


def test_libstdcxx_preload_goes_first_and_only_once() -> None:
    from compile.libstdcxx import OPT_OUT_ENV, RESTARTED_ENV, preload_environment

    lib = Path("/usr/lib/x86_64-linux-gnu/libstdc++.so.6")
    assert preload_environment({"A": "1"}, lib) == {"A": "1", "LD_PRELOAD": str(lib)}
    assert preload_environment({"LD_PRELOAD": "/opt/libjemalloc.so"}, lib)["LD_PRELOAD"] == f"{lib} /opt/libjemalloc.so"
    assert preload_environment({"LD_PRELOAD": f"/x:{lib}"}, lib) is None  # already there: nothing to do
    assert preload_environment({OPT_OUT_ENV: "1"}, lib) is None
    assert preload_environment({RESTARTED_ENV: "1"}, lib) is None  # a wrapper dropped LD_PRELOAD: no loop
    assert preload_environment({}, None) is None  # no compiler that knows the library


def test_the_compilers_libstdcxx_is_found() -> None:
    from compile.libstdcxx import compiler_libstdcxx

    found = compiler_libstdcxx()
    assert found is not None and found.is_absolute() and found.name.startswith("libstdc++.so.6"), found
    assert compiler_libstdcxx("/nonexistent/g++") is None
    assert compiler_libstdcxx("env g++") == found  # $CXX with a launcher in front


RESTART_PROBE = """
import os
import sys
import compile.libstdcxx as m
m.nvidia_gpu_present = lambda: True  # the one thing this CPU machine lacks
m.restart_with_preload(sys.argv[1])  # restarts this same command line, -c and argument included
print(sys.argv[1], os.environ.get(m.RESTARTED_ENV), os.environ.get("LD_PRELOAD"))
"""


@pytest.mark.parametrize(("device", "restarted"), [("cuda:0", True), ("auto", True), ("cpu", False)])
def test_compile_trt_restarts_itself_once_with_the_preload_for_gpu_work(device: str, restarted: bool) -> None:
    from compile.libstdcxx import OPT_OUT_ENV, RESTARTED_ENV, compiler_libstdcxx

    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", OPT_OUT_ENV, RESTARTED_ENV)}
    out = subprocess.run(
        [sys.executable, "-c", RESTART_PROBE, device], capture_output=True, text=True, check=True, env=env, timeout=60
    ).stdout
    # Printed once: the restarted process did not restart again.
    assert out.strip() == (f"{device} 1 {compiler_libstdcxx()}" if restarted else f"{device} None None")


def test_cpu_isa_names_the_extensions_proc_cpuinfo_lists():
    """torch moved its CPU probes (torch._C._cpu -> torch.cpu); a probe not found must not read as "absent"."""
    from pathlib import Path

    from compile.devices import CPU_FEATURE_PROBES, cpu_has, cpu_isa

    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo here")
    flags = set(next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")).split())
    for feature in CPU_FEATURE_PROBES:
        assert cpu_has(feature) == (feature in flags), feature
        assert (feature in cpu_isa().split()) == (feature in flags), feature


@pytest.mark.parametrize("units", [set(), {"avx512_bf16"}, {"amx_tile"}])
def test_bf16_on_a_cpu_without_bf16_units_is_called_emulated(units, monkeypatch, caplog):
    """A faked CPU: compile-trt and the server (service/supervisor/planning/planner.py) warn with this."""
    from compile import devices
    from compile.build import plan_compile

    monkeypatch.setattr(devices, "cpu_has", lambda feature: feature in units)
    emulated = not units
    assert devices.cpu_has_bf16_units() is not emulated
    why = devices.emulated_bf16("bf16", "cpu")
    assert (why is not None) is emulated
    if emulated:
        assert "emulated" in why and "AVX-512 bf16 or AMX" in why
    for precision, device_type in (("fp32", "cpu"), ("int8", "cpu"), ("bf16", "cuda")):
        assert devices.emulated_bf16(precision, device_type) is None
    with caplog.at_level(logging.WARNING, logger="compile.build"):
        plan_compile(CompileSettings(model="efficientnet-lite0", backend="inductor", precision="bf16", device="cpu"))
    warned = [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]
    assert (warned == [f"{why} Here, compile --precision fp32 (the default) or int8."]) if emulated else not warned


def test_cpu_isa_without_a_cxx_compiler_names_what_inductor_names():
    """The CPU image has no g++, which inductor's ISA probe builds with: the probe from torch's own CPU
    checks must give the same names (artifacts compiled elsewhere are compared against them)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    from compile.devices import probed_vec_isa

    try:
        with_compiler = str(pick_vec_isa()).split()
    except Exception as exc:
        pytest.skip(f"no C++ compiler here for inductor's probe: {exc}")
    assert probed_vec_isa() == with_compiler
