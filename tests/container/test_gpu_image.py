"""Dockerfile.gpu, built on a stand-in for its NGC base (deploy/podman/ngc-standin.Containerfile: Debian's
Python with the GPU machine's torch and torchvision) so that every step after FROM runs here, then started
on the CPU: no GPU, no TensorRT. DALI's CPU pipeline preprocesses, ONNX Runtime (the -gpu build's CPU
provider) infers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.harness.podman import Build, Container, podman, run_container
from tests.conftest import CAT_LABELS

ROOT = Path(__file__).resolve().parents[2]
STANDIN = (ROOT / "benchmarks/gpu/standin.txt").read_text()
ARTIFACT = "/var/lib/vision-serve/artifacts/efficientnet-lite0-onnx-fp32"
CPU_SERVE = {
    "VISION_SERVE_ARTIFACT": ARTIFACT,
    "VISION_SERVE_COMPILE_ARGS": "--model efficientnet-lite0 --backend onnx --precision fp32 --device cpu",
    "VISION_SERVE_DEVICE": "cpu",
    "VISION_SERVE_PREPROCESS": "dali",
}


def pinned(name: str) -> str:
    (line,) = [line for line in STANDIN.splitlines() if line.startswith(f"{name}==")]
    return line.split("==", 1)[1]


def python_in(image: str, code: str) -> str:
    return podman("run", "--rm", "--entrypoint", "python", image, "-c", code, timeout=300).strip()


def test_the_base_images_torch_is_kept_and_the_gpu_libraries_are_installed(gpu_image: Build) -> None:
    code = (
        "import importlib.metadata as m, json; "
        "print(json.dumps({n: m.version(n) for n in ('torch', 'torchvision', 'nvidia-dali-cuda130', "
        "'cvcuda-cu13', 'nvidia-nvimgcodec-cu13', 'onnxruntime-gpu', 'vision-serve')}))"
    )
    versions = json.loads(python_in(gpu_image.reference, code))
    # The stand-in's torch, as NGC's would be: requirements-gpu.txt and the constraints left it alone.
    assert versions["torch"].split("+")[0] == pinned("torch"), versions
    assert versions["torchvision"].split("+")[0] == pinned("torchvision"), versions
    assert versions["nvidia-dali-cuda130"].startswith("2.4.") and versions["cvcuda-cu13"].startswith("0.19.")
    # DALI and nvImageCodec import without a GPU (cvcuda needs the driver's libcuda.so.1, absent here).
    imported = python_in(gpu_image.reference, "import nvidia.dali, nvidia.nvimgcodec, onnxruntime; print('ok')")
    assert imported.endswith("ok")


@pytest.fixture(scope="module")
def gpu_server(gpu_image: Build, run_id: str) -> Iterator[Container]:
    volume = f"vs-test-{run_id}-gpu"
    podman("volume", "create", volume)
    container = run_container(gpu_image.reference, f"vs-test-{run_id}-gpu", volume, env=CPU_SERVE)
    try:
        container.wait_answering("/ready", 900)
        yield container
    finally:
        container.remove()
        podman("volume", "rm", "--force", volume, check=False)


def test_the_gpu_image_compiles_and_serves_the_cat_on_the_cpu_with_dali(
    gpu_server: Container, chelsea_jpeg: bytes
) -> None:
    response = httpx.post(f"{gpu_server.url}/predict", content=chelsea_jpeg, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["predictions"][0]["label"] in CAT_LABELS, response.json()
    log = gpu_server.logs()
    assert "Preprocessing backend: dali" in log, log[-3000:]
    users = podman("top", gpu_server.name, "user").splitlines()[1:]
    assert users and set(map(str.strip, users)) == {"vision"}, users
