"""The CUDA path. Skipped where torch sees no GPU (our CI); run on a GPU machine with `pytest -m gpu`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from compile.catalog import get_model_entry
from preprocessing.pil_backend import PilPreprocessor
from service.client.launcher import ServerProcess
from service.client.vision_client import VisionClient
from tests.conftest import CAT_LABELS
from tests.e2e.test_preprocess_serving import check_batch_of_8_with_2_corrupt
from tests.e2e.test_reliability import check_a_broken_device_restarts_the_worker

pytestmark = pytest.mark.gpu

RESNET = get_model_entry("resnet152").preprocess


def test_pil_batch_is_normalized_on_the_gpu_like_on_the_cpu(chelsea_jpeg: bytes, truncated_jpeg: bytes) -> None:
    on_cpu = PilPreprocessor(RESNET, "cpu")([chelsea_jpeg, truncated_jpeg, chelsea_jpeg])
    on_gpu = PilPreprocessor(RESNET, "cuda")([chelsea_jpeg, truncated_jpeg, chelsea_jpeg])
    assert on_gpu.images.device.type == "cuda"
    assert on_gpu.errors == on_cpu.errors
    assert torch.allclose(on_gpu.images.cpu(), on_cpu.images, atol=1e-5)


def test_served_on_one_gpu(tmp_path, chelsea_jpeg: bytes, coffee_jpeg: bytes) -> None:
    args = ["--model", "efficientnet-lite0", "--device", "cuda:0"]
    with ServerProcess(args, log_path=tmp_path / "server.log") as server, VisionClient(server.url) as client:
        assert client.classify(chelsea_jpeg).top1.label in CAT_LABELS
        assert client.classify(coffee_jpeg).top1.label == "espresso"
        assert httpx.get(f"{server.url}/info").json()["server"]["devices"] == ["cuda:0"]
        metrics = {
            family.name: family.samples[0]
            for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
            if family.name.startswith("vision_serve_gpu_memory")
        }
    used, total = metrics["vision_serve_gpu_memory_used_bytes"], metrics["vision_serve_gpu_memory_total_bytes"]
    assert used.labels == {"device": "cuda:0"} and 0 < used.value < total.value  # the model is on it


@pytest.mark.parametrize("depth", ["1", "2"], ids=["one-batch-at-a-time", "pipelined"])
def test_pipelined_worker_answers_like_the_sequential_one(tmp_path, depth: str) -> None:
    # Depth 2 prepares the next batch on a CUDA stream of its own while the engine runs this one:
    # the answers, the bad-item isolation and the shared batch must not change.
    args = ["--model", "efficientnet-lite0", "--device", "cuda:0", "--preprocess", "torch", "--max-batch-size", "8"]
    args += ["--batch-timeout-ms", "500", "--pipeline-depth", depth]
    with ServerProcess(args, log_path=tmp_path / "server.log") as server:
        assert httpx.get(f"{server.url}/info").json()["server"]["pipeline_depth"] == int(depth)
        check_batch_of_8_with_2_corrupt(server, f"pipeline depth {depth}")


def test_a_real_device_side_assert_restarts_the_worker_and_serving_resumes(tmp_path, chelsea_jpeg: bytes) -> None:
    """Nothing faked: a kernel indexes out of bounds, the device-side assert breaks the worker's CUDA
    context, the real check notices, and the worker is replaced (tests/sticky_device_server.py)."""
    args = ["--model", "efficientnet-lite0", "--device", "cuda:0"]
    check_a_broken_device_restarts_the_worker(tmp_path, args, chelsea_jpeg, "device-assert")


def compile_lite0(output: Path, backend: str, precision: str) -> Path:
    """compile-trt as its own process, as users run it: on a GPU it restarts itself with the compiler's
    libstdc++ preloaded (compile/libstdcxx.py), which a call inside pytest's process cannot do."""
    args = ["--model", "efficientnet-lite0", "--device", "cuda:0", "--backend", backend, "--precision", precision]
    subprocess.run([sys.executable, "-m", "compile.cli", *args, "--output", str(output)], check=True)
    return output


def serve_and_classify(artifact: Path, log_path: Path, chelsea_jpeg: bytes, engine: str) -> None:
    with ServerProcess(["--artifact", str(artifact)], log_path=log_path) as server:
        with VisionClient(server.url) as client:
            result = client.classify(chelsea_jpeg)
        info = httpx.get(f"{server.url}/info").json()["model"]
    assert result.top1.label in CAT_LABELS and result.engine == engine
    assert info["artifact"]["device"]["type"] == "cuda"


@pytest.fixture(scope="module")
def lite0_inductor_fp16(tmp_path_factory) -> Path:
    """One AOTInductor fp16 build of Lite0 on cuda:0 for the tests below (a compile takes a minute)."""
    return compile_lite0(tmp_path_factory.mktemp("artifacts") / "lite0-inductor-fp16", "inductor", "fp16")


def test_inductor_fp16_artifact_compiles_and_serves_on_the_gpu(tmp_path, lite0_inductor_fp16, chelsea_jpeg) -> None:
    serve_and_classify(lite0_inductor_fp16, tmp_path / "server.log", chelsea_jpeg, "inductor-fp16")


def test_inductor_fp16_artifact_with_nvjpeg_decoding_isolates_bad_images_in_a_batch(tmp_path, lite0_inductor_fp16):
    """The GPU path end to end: batched nvJPEG decode (``--preprocess torch``) feeding the fp16 engine,
    one batch of 8 with 2 corrupt images: the 6 good ones get correct top-5, the 2 bad ones a 400."""
    args = ["--artifact", str(lite0_inductor_fp16), "--preprocess", "torch",
            "--max-batch-size", "8", "--batch-timeout-ms", "2000"]  # fmt: skip
    with ServerProcess(args, log_path=tmp_path / "server.log") as server:
        check_batch_of_8_with_2_corrupt(server, "torch + inductor-fp16")
        metadata = httpx.get(f"{server.url}/info", timeout=10).json()["model"]
    assert metadata["preprocess"] == "torch" and metadata["artifact"]["device"]["type"] == "cuda"


def test_tensorrt_fp16_artifact_compiles_and_serves_on_the_gpu(tmp_path, chelsea_jpeg: bytes) -> None:
    from compile.backends.tensorrt import torch_tensorrt_status

    if not torch_tensorrt_status()[0]:
        pytest.skip("torch_tensorrt is not installed (it ships in the Dockerfile.gpu image)")
    artifact = compile_lite0(tmp_path / "lite0-tensorrt-fp16", "tensorrt", "fp16")
    serve_and_classify(artifact, tmp_path / "server.log", chelsea_jpeg, "tensorrt-fp16")
