"""The CUDA path. Skipped where torch sees no GPU (our CI); run on a GPU machine with `pytest -m gpu`."""

from __future__ import annotations

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from compile.catalog import get_model_entry
from preprocessing.pil_backend import PilPreprocessor
from service.client import VisionClient
from service.process import ServerProcess
from tests.conftest import CAT_LABELS

pytestmark = pytest.mark.gpu

RESNET = get_model_entry("resnet152").preprocess


def test_pil_batch_is_normalized_on_the_gpu_like_on_the_cpu(chelsea_jpeg: bytes, truncated_jpeg: bytes) -> None:
    on_cpu = PilPreprocessor(RESNET, "cpu")([chelsea_jpeg, truncated_jpeg, chelsea_jpeg])
    on_gpu = PilPreprocessor(RESNET, "cuda")([chelsea_jpeg, truncated_jpeg, chelsea_jpeg])
    assert on_gpu.images.device.type == "cuda"
    assert on_gpu.errors == on_cpu.errors
    assert torch.allclose(on_gpu.images.cpu(), on_cpu.images, atol=1e-5)


@pytest.mark.slow
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


def compile_and_serve(tmp_path, chelsea_jpeg: bytes, backend: str, precision: str) -> None:
    from compile.cli import main as compile_main

    artifact = tmp_path / f"lite0-{backend}-{precision}"
    args = ["--model", "efficientnet-lite0", "--device", "cuda:0", "--backend", backend, "--precision", precision]
    assert compile_main([*args, "--output", str(artifact)]) == 0
    with ServerProcess(["--artifact", str(artifact)], log_path=tmp_path / "server.log") as server:
        with VisionClient(server.url) as client:
            result = client.classify(chelsea_jpeg)
        info = httpx.get(f"{server.url}/info").json()["model"]
    assert result.top1.label in CAT_LABELS and result.engine == f"{backend}-{precision}"
    assert info["artifact"]["device"]["type"] == "cuda"


@pytest.mark.slow
def test_inductor_fp16_artifact_compiles_and_serves_on_the_gpu(tmp_path, chelsea_jpeg: bytes) -> None:
    compile_and_serve(tmp_path, chelsea_jpeg, "inductor", "fp16")


@pytest.mark.slow
def test_tensorrt_fp16_artifact_compiles_and_serves_on_the_gpu(tmp_path, chelsea_jpeg: bytes) -> None:
    from compile.features import torch_tensorrt_status

    if not torch_tensorrt_status()[0]:
        pytest.skip("torch_tensorrt is not installed (it ships in the Dockerfile.gpu image)")
    compile_and_serve(tmp_path, chelsea_jpeg, "tensorrt", "fp16")
