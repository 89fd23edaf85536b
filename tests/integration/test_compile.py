"""compile-trt end to end on CPU: AOTInductor artifacts of a small pretrained model, the gate, the cache,
serving an artifact over HTTP, and the errors users meet. TensorRT is not installable here: its seams
are tested in tests/unit/test_compile_units.py without it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

from compile import _defaults
from compile.backends.tensorrt import torch_tensorrt_status
from compile.build import compile_artifact
from compile.cli import EXIT_GATE_FAILED, EXIT_UNAVAILABLE
from compile.cli import main as compile_main
from compile.devices import cpu_has_bf16_units
from compile.manifest import Manifest, read_manifest, sha256_file
from compile.settings import CompileSettings
from preprocessing.pil_backend import PilPreprocessor
from preprocessing.spec import PreprocessSpec
from service.client.launcher import ServerProcess
from service.client.vision_client import VisionClient
from service.worker.engine import load_artifact
from tests.conftest import CAT_LABELS

# How each line of the server's text log starts: its timestamp (service/logs.py).
LOG_RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
LITE = ["--model", "efficientnet-lite0", "--device", "cpu"]


@pytest.fixture(scope="module")
def fp32_artifact(tmp_path_factory):
    """Compiled once through the console entry point, as a user runs it."""
    output = tmp_path_factory.mktemp("artifacts") / "lite0-fp32"
    command = [sys.executable, "-m", "compile.cli", *LITE, "--backend", "inductor", "--output", str(output)]
    # A temp dir of its own (inductor's compile cache kept where it is, shared with other tests).
    temp = tmp_path_factory.mktemp("compile-temp")
    env = {**os.environ, "TMPDIR": str(temp), "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache_dir())}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "accuracy gate passed" in done.stdout
    # The gate loaded the package: what AOTInductor unpacked for it went with the process. (Inductor
    # keeps its precompiled headers in the temp dir whatever its cache dir: a cache, not a leftover.)
    leftovers = [path.name for path in temp.iterdir() if not path.name.startswith("torchinductor_")]
    assert not leftovers, leftovers
    return output


@pytest.fixture(scope="module")
def bf16_artifact(tmp_path_factory):
    output = tmp_path_factory.mktemp("artifacts") / "lite0-bf16"
    settings = CompileSettings(
        model="efficientnet-lite0", backend="inductor", precision="bf16", device="cpu", output=str(output)
    )
    result = compile_artifact(settings)
    assert not result.cached
    return output


def test_fp32_artifact_manifest_records_what_was_built(fp32_artifact) -> None:
    manifest = read_manifest(fp32_artifact)
    assert (manifest.backend, manifest.precision, manifest.engine_name) == ("inductor", "fp32", "inductor-fp32")
    assert (manifest.batch_min, manifest.batch_opt, manifest.batch_max) == _defaults.DEFAULT_BATCH
    assert manifest.device_type == "cpu" and manifest.device_capability == torch.backends.cpu.get_cpu_capability()
    assert sha256_file(fp32_artifact / manifest.engine_file) == manifest.engine_sha256
    assert manifest.weights_sha256_of == "file" and len(manifest.weights_sha256) == 64
    assert manifest.versions["torch"] == torch.__version__
    assert len(manifest.labels) == 1000 and manifest.preprocess.crop_size == 224
    validation = manifest.validation
    assert validation["passed"] and validation["metrics"]["top1_agreement"] == 1.0
    assert validation["samples"]["batch_sizes"] == [1, 8, 32]
    chelsea = next(item for item in validation["real_images"] if item["name"] == "chelsea")
    assert chelsea["compiled"] in CAT_LABELS and chelsea["compiled"] == chelsea["reference"]
    # Nothing but the artifact and its lock file is left next to it (the staging directory is gone).
    assert sorted(p.name for p in fp32_artifact.parent.iterdir()) == [f".{fp32_artifact.name}.lock", fp32_artifact.name]


@pytest.mark.slow  # the bf16 AOTInductor compile: about 100 s
def test_bf16_artifact_passes_its_gate_and_keeps_the_labels(bf16_artifact) -> None:
    manifest = read_manifest(bf16_artifact)
    metrics = manifest.validation["metrics"]
    assert manifest.engine_name == "inductor-bf16"
    # bf16 is not bit-exact: the gate measured a real difference and accepted it.
    assert 0 < metrics["max_rel_error"] <= _defaults.GATE_THRESHOLDS["bf16"]["max_rel_error"]
    assert metrics["real_top1_agreement"] == 1.0


def test_repeated_compile_is_a_cache_hit(fp32_artifact, capsys) -> None:
    engine = fp32_artifact / read_manifest(fp32_artifact).engine_file
    before = (engine.stat().st_mtime_ns, (fp32_artifact / "manifest.json").read_text())
    code = compile_main([*LITE, "--backend", "inductor", "--output", str(fp32_artifact)])
    assert code == 0
    assert "cache hit" in capsys.readouterr().out
    assert (engine.stat().st_mtime_ns, (fp32_artifact / "manifest.json").read_text()) == before


@pytest.mark.parametrize("which", ["fp32_artifact", pytest.param("bf16_artifact", marks=pytest.mark.slow)])
def test_served_artifact_classifies_chelsea_as_a_cat(which, request, chelsea_jpeg, coffee_jpeg, tmp_path) -> None:
    artifact = request.getfixturevalue(which)
    manifest = read_manifest(artifact)
    # Not under tmp_path: the server's multiprocessing manager puts a Unix socket in its temp dir, and
    # tmp_path (deeper under pytest-xdist) can pass the 107 bytes a socket path may have.
    temp = Path(tempfile.mkdtemp(prefix="served-"))
    request.addfinalizer(lambda: shutil.rmtree(temp, ignore_errors=True))
    server = ServerProcess(
        ["--artifact", str(artifact)],
        log_path=tmp_path / "server.log",
        env={"TMPDIR": str(temp), "TORCHINDUCTOR_CACHE_DIR": inductor_cache_dir()},
    )
    with server:
        with VisionClient(server.url) as client:
            cat, coffee = client.classify(chelsea_jpeg), client.classify(coffee_jpeg)
        info = httpx.get(f"{server.url}/info").json()["model"]
    assert cat.top1.label in CAT_LABELS and coffee.top1.label == "espresso"
    assert cat.engine == manifest.engine_name and cat.model == "efficientnet-lite0"
    assert info["engine"] == manifest.engine_name
    assert info["artifact"]["backend"] == "inductor" and info["artifact"]["precision"] == manifest.precision
    # bf16 on a CPU without bf16 units runs emulated: /info (and the log) says so, and only then.
    emulated = manifest.precision == "bf16" and not cpu_has_bf16_units()
    assert ("emulated" in info["artifact"].get("warning", "")) is emulated
    assert ("bf16 runs emulated on this CPU" in server.log_text()) is emulated
    assert PreprocessSpec.from_dict(info["preprocess_spec"]) == manifest.preprocess
    # Serving an AOTInductor artifact loads torch's inductor (and OpenAI Triton) in the workers: its
    # exit, like everything else the server printed, must be log records, not library noise.
    log = (tmp_path / "server.log").read_text(errors="replace").splitlines()
    noise = [line for line in log if line.strip() and not LOG_RECORD.match(line)]
    assert not noise, noise[:10]
    # Each worker unpacked the engine (the size of the model); a stopped server leaves nothing in the temp dir.
    assert not any(temp.iterdir()), sorted(temp.rglob("*"))[:10]


def test_loaded_engine_pads_and_splits_batches_outside_its_range(fp32_artifact, chelsea_jpeg) -> None:
    served = load_artifact(fp32_artifact, torch.device("cpu"))
    served.batch_min, served.batch_max = 4, 8  # as if compiled with --batch 4,8,8; the file accepts 1..32
    calls = []
    run = served.run
    served.run = lambda images: calls.append(len(images)) or run(images)
    one = PilPreprocessor(served.entry.preprocess)([chelsea_jpeg]).images
    with torch.inference_mode():
        single = served(one)
        many = served(one.expand(11, -1, -1, -1).contiguous(memory_format=torch.channels_last))
    assert calls == [4, 8, 4]  # 1 padded to 4; 11 split into 8 + 3, the 3 padded to 4
    assert single.shape == (1, 1000) and many.shape == (11, 1000)
    assert served.entry.labels[int(single.argmax())] in CAT_LABELS
    torch.testing.assert_close(many, single.expand(11, -1), rtol=1e-4, atol=1e-4)
    # The engine was traced channels_last and does not check strides: NCHW input must be converted.
    nchw = one.expand(4, -1, -1, -1).contiguous()  # 4: within the range, so nothing pads it
    with torch.inference_mode():
        torch.testing.assert_close(served(nchw), single.expand(4, -1), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_gate_failure_exits_nonzero_and_keeps_the_previous_artifact(fp32_artifact, tmp_path, capsys) -> None:
    """bf16 held to fp32-grade thresholds must fail, and must not replace what --output held."""
    output = tmp_path / "artifact"
    shutil.copytree(fp32_artifact, output)
    before = (output / "manifest.json").read_text()
    args = [*LITE, "--backend", "eager", "--precision", "bf16", "--output", str(output)]
    code = compile_main([*args, "--gate-min-cosine", "0.999999", "--gate-max-rel-error", "1e-5"])
    err = capsys.readouterr().err
    assert code == EXIT_GATE_FAILED
    assert "accuracy gate FAILED" in err and "max_rel_error" in err and "FAIL" in err
    assert (output / "manifest.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".artifact.lock", "artifact"]


@pytest.mark.slow
def test_gate_failure_leaves_no_artifact(tmp_path, capsys) -> None:
    output = tmp_path / "new"
    args = [*LITE, "--backend", "eager", "--precision", "bf16", "--output", str(output)]
    code = compile_main([*args, "--gate-min-top1-agreement", "1", "--gate-max-rel-error", "0"])
    assert code == EXIT_GATE_FAILED and not output.exists()
    assert [p.name for p in tmp_path.iterdir()] == [".new.lock"]  # the lock file only: no staging left


@pytest.mark.skipif(torch_tensorrt_status()[0], reason="torch_tensorrt is installed here")
def test_tensorrt_backend_without_torch_tensorrt_says_where_it_exists(tmp_path, capsys) -> None:
    code = compile_main([*LITE, "--backend", "tensorrt", "--output", str(tmp_path / "trt")])
    assert code == EXIT_UNAVAILABLE
    assert "Dockerfile.gpu" in capsys.readouterr().err
    assert not (tmp_path / "trt").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch", "8,4,2"], "1 <= MIN <= OPT <= MAX"),
        (["--batch", "1,x,8"], "MIN,OPT,MAX as integers"),
        (["--batch", "1,2"], "three numbers"),
        (["--precision", "fp64"], "invalid choice: 'fp64'"),
        (["--backend", "openvino"], "invalid choice: 'openvino'"),
        (["--optimization-level", "9"], "0..5"),
        (["--model", "resnet125"], "Did you mean"),
        (["--gate-min-cosine", "1.5"], "must be in 0..1"),
        (["--gate-images", "/nonexistent/folder"], "not a directory of images"),
        (["--weights", "/nonexistent/w.pt"], "Weights file not found"),
    ],
)
def test_bad_arguments_explain_the_fix(args, message, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        compile_main(["--model", "efficientnet-lite0", "--device", "cpu", "--output", str(tmp_path / "a"), *args])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_device_without_a_gpu_is_a_clear_error(capsys) -> None:
    with pytest.raises(SystemExit):
        compile_main(["--model", "efficientnet-lite0", "--device", "cuda"])
    assert "torch sees none" in capsys.readouterr().err


def test_output_that_is_not_an_artifact_is_never_replaced(tmp_path, capsys) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        compile_main([*LITE, "--backend", "eager", "--output", str(tmp_path)])
    assert "only replaces its own artifacts" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine"


def edited_copy(artifact, tmp_path, **changes) -> str:
    """A copy of ``artifact`` whose manifest has ``changes``; the engine file is linked, not copied."""
    copy = tmp_path / "edited"
    copy.mkdir()
    data = json.loads((artifact / "manifest.json").read_text())
    (copy / data["engine_file"]).symlink_to(artifact / data["engine_file"])
    for key, value in changes.items():
        data[key] = value
    (copy / "manifest.json").write_text(json.dumps(data))
    return str(copy)


# Each case plans in a process of its own (5 s, torch imported): two in make test, the rest slow.
@pytest.mark.parametrize(
    ("changes", "flags", "message"),
    [
        ({"versions": {"torch": "2.9.0"}}, [], "compiled with torch 2.9.0"),
        pytest.param(
            {"device_type": "cuda"},
            ["--device", "cpu"],
            "compiled for cuda and the server runs on cpu",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            {"backend": "tensorrt", "versions": {"torch": torch.__version__, "tensorrt": "10.9"}},
            [],
            "tensorrt",
            marks=pytest.mark.slow,
        ),
        pytest.param({"format_version": 99}, [], "format_version 99", marks=pytest.mark.slow),
        pytest.param({"preprocess": {"crop": 1}}, [], "invalid preprocess", marks=pytest.mark.slow),
        ({"engine_file": "../../model.pt2"}, [], "must be a file name inside the artifact"),
    ],
)
def test_server_refuses_an_artifact_it_cannot_run(fp32_artifact, tmp_path, capsys, changes, flags, message) -> None:
    from service.cli import main as serve_main

    with pytest.raises(SystemExit) as exited:
        serve_main(["--artifact", edited_copy(fp32_artifact, tmp_path, **changes), *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_server_rejects_flags_the_artifact_decides(fp32_artifact, capsys) -> None:
    from service.cli import main as serve_main

    with pytest.raises(SystemExit):
        serve_main(["--artifact", str(fp32_artifact), "--model", "resnet50"])
    assert "Drop --model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_main(["--artifact", str(fp32_artifact), "--weights", "random"])
    assert "Drop --weights" in capsys.readouterr().err


def test_manifest_round_trips_through_json(fp32_artifact) -> None:
    manifest = read_manifest(fp32_artifact)
    assert Manifest.from_dict(json.loads(json.dumps(manifest.to_dict()))) == manifest


def test_server_settings_follow_the_artifact(fp32_artifact) -> None:
    from service.settings import ServeSettings
    from service.supervisor.planning.planner import apply_artifact

    settings, manifest = apply_artifact(ServeSettings(artifact=str(fp32_artifact), max_batch_size=64), cuda_count=0)
    assert settings.max_batch_size == manifest.batch_max == 32  # clamped to what the engine accepts
    assert settings.device == "cpu" and settings.model == "efficientnet-lite0"


def test_tensorrt_artifact_is_served_on_one_gpu_without_a_gpu(fp32_artifact, tmp_path) -> None:
    """The device choice only (no GPU, no TensorRT here): a TensorRT engine is bound to one GPU."""
    from service.settings import ServeSettings
    from service.supervisor.planning.planner import apply_artifact

    trt = {"backend": "tensorrt", "device_type": "cuda", "versions": {"torch": torch.__version__}}
    settings, _ = apply_artifact(ServeSettings(artifact=edited_copy(fp32_artifact, tmp_path, **trt)), cuda_count=4)
    assert settings.device == "cuda:0"
