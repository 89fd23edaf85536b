"""The user's own classifier, end to end: a fine-tuned model of custom classes through every import
route (a state_dict with its labels file on each backend that runs here, its ExportedProgram, its
ONNX file) and a timm model: compiled with compile-trt, gated, served, and asked over /predict,
the Open Inference Protocol over HTTP (its classification extension too) and gRPC.

The fine-tuned model is real (tests/finetuned.py): a head trained in the fixture on crops of the
sample photos. Each held-back crop must come back with its custom label from every server.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from compile.model_files import read_model_file
from service.client.launcher import ServerProcess, free_port
from tests.finetuned import LABELS, FineTuned, make_finetuned

SERVED_NAME = "pets"
# Eleven compiles (three of them AOTInductor, four int8) and twelve servers: about eleven minutes on 2 cores.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory) -> FineTuned:
    return make_finetuned(tmp_path_factory.mktemp("finetuned"))


def compile_trt(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "compile.cli", "--log-level", "warning", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def compiled(output, *args: str):
    completed = compile_trt(*args, "--output", str(output))
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "accuracy gate passed" in completed.stdout
    return output


def serving(args: list[str], log_path):
    grpc_port = free_port()
    server = ServerProcess([*args, "--grpc-port", str(grpc_port), "--api-servers", "1"], log_path=log_path)
    server.grpc_url = f"127.0.0.1:{grpc_port}"
    return server


def text(value: bytes | str) -> str:
    """tritonclient gives BYTES as bytes from binary data, as str from JSON."""
    return value.decode() if isinstance(value, bytes) else value


def assert_every_crop_answered_right(server, finetuned: FineTuned, name: str) -> None:
    """Each held-back crop's custom label over /predict, OIP HTTP (with its classification
    extension) and gRPC; the model's metadata under its served name."""
    images = [data for data, _ in finetuned.held_back]
    expected = [label for _, label in finetuned.held_back]
    files = [("image", (f"crop{i}.jpg", data)) for i, data in enumerate(images)]
    results = httpx.post(f"{server.url}/predict", files=files, data={"top_k": "4"}, timeout=120).json()["results"]
    assert [r["predictions"][0]["label"] for r in results] == expected
    assert {p["label"] for p in results[0]["predictions"]} == set(LABELS)  # its labels, nothing else
    assert all(r["model"] == name for r in results)

    http_client = triton_http.InferenceServerClient(f"127.0.0.1:{server.port}")
    tensor = triton_http.InferInput("IMAGE", [len(images)], "BYTES")
    tensor.set_data_from_numpy(np.array(images, dtype=np.object_), binary_data=True)
    outputs = [triton_http.InferRequestedOutput("PROBABILITIES", class_count=1, binary_data=False)]
    result = http_client.infer(name, [tensor], outputs=outputs)
    # The classification extension's "score:index:label", with our labels.
    assert [text(row[0]).split(":", 2)[2] for row in result.as_numpy("PROBABILITIES")] == expected

    grpc_client = triton_grpc.InferenceServerClient(server.grpc_url)
    assert grpc_client.is_model_ready(name)
    with pytest.raises(InferenceServerException, match="NOT_FOUND"):
        grpc_client.is_model_ready("efficientnet-lite0")  # the architecture's name is not the served one
    tensor = triton_grpc.InferInput("IMAGE", [len(images)], "BYTES")
    tensor.set_data_from_numpy(np.array(images, dtype=np.object_))
    labels = grpc_client.infer(name, [tensor]).as_numpy("LABELS")
    assert [text(row[0]) for row in labels] == expected


@pytest.mark.parametrize("backend", ["onnx", "inductor", "eager"])
def test_a_finetuned_state_dict_with_its_labels_serves_its_classes(finetuned, tmp_path, backend) -> None:
    args = ["--model", "efficientnet-lite0", "--weights", str(finetuned.weights), "--labels", str(finetuned.labels)]
    args += ["--name", SERVED_NAME, "--backend", backend, "--batch", "1,4,8"]
    artifact = compiled(tmp_path / "artifact", *args)
    with serving(["--artifact", str(artifact)], tmp_path / "server.log") as server:
        assert_every_crop_answered_right(server, finetuned, SERVED_NAME)
        info = httpx.get(f"{server.url}/info", timeout=10).json()["model"]
        assert info["labels_source"] == f"file:{finetuned.labels.resolve()}" and info["source"] == "efficientnet-lite0"
        assert f'model="{SERVED_NAME}"' in httpx.get(f"{server.url}/metrics", timeout=10).text  # build_info


def test_its_exported_program_compiles_and_serves_under_the_file_name(finetuned, tmp_path) -> None:
    args = ["--model", str(finetuned.program), "--labels", str(finetuned.labels), *finetuned.preprocess_flags]
    artifact = compiled(tmp_path / "artifact", *args, "--backend", "onnx", "--batch", "1,4,8")
    with serving(["--artifact", str(artifact)], tmp_path / "server.log") as server:
        assert_every_crop_answered_right(server, finetuned, "finetuned")  # the file's stem


def test_its_onnx_file_is_served_as_it_is_and_exported_to_triton(finetuned, tmp_path) -> None:
    repository = tmp_path / "triton"
    args = ["--model", str(finetuned.onnx), "--labels", str(finetuned.labels), *finetuned.preprocess_flags]
    args += ["--name", SERVED_NAME, "--triton-repository", str(repository)]
    artifact = compiled(tmp_path / "artifact", *args)
    # One self-contained file, though the export kept its weights beside it (finetuned.onnx.data).
    assert sorted(p.name for p in artifact.iterdir()) == ["manifest.json", "model.onnx"]
    assert (repository / SERVED_NAME / "labels.txt").read_text().splitlines() == list(LABELS)
    config = (repository / SERVED_NAME / "config.pbtxt").read_text()
    facts = read_model_file(str(finetuned.onnx))  # the file's own tensor names, not ours
    assert f'key: "{facts.input_name}"' in config and f'key: "{facts.output_name}"' in config  # the ensemble's maps
    with serving(["--artifact", str(artifact)], tmp_path / "server.log") as server:
        assert_every_crop_answered_right(server, finetuned, SERVED_NAME)


def test_vision_serve_serves_a_model_file_without_compiling(finetuned, tmp_path) -> None:
    args = ["--model", str(finetuned.onnx), "--labels", str(finetuned.labels), *finetuned.preprocess_flags]
    with serving([*args, "--name", SERVED_NAME], tmp_path / "server.log") as server:
        assert_every_crop_answered_right(server, finetuned, SERVED_NAME)
        assert httpx.get(f"{server.url}/info", timeout=10).json()["model"]["engine"] == "onnxruntime-fp32"


# (--model, served name, preprocessing): timm's pretrained_cfg (bicubic, crop_pct 0.875 of 224 -> resize
# 256) and torchvision's preset of the architecture's default weights.
ARCHITECTURES = [
    ("timm:mobilenetv3_small_100", "mobilenetv3_small_100", {"resize_size": 256, "interpolation": "bicubic"}),
    # Not mobilenet_v3_small: its random init gives logits of norm ~1e-5, where the gate's cosine means nothing.
    ("resnet18", "resnet18", {"resize_size": 256, "interpolation": "bilinear"}),
]


@pytest.mark.parametrize(("model", "name", "preprocess"), ARCHITECTURES, ids=["timm", "torchvision"])
def test_an_architecture_gets_a_head_of_the_labels_size_from_a_weights_file(
    finetuned, tmp_path, model, name, preprocess
) -> None:
    """No trained weights of these offline: a seeded state_dict of the 4-class architecture, saved as
    a user would, so the check is the contract (head size, labels, preprocessing, routes), not the
    answers' meaning."""
    from compile.model_request import ModelRequest
    from compile.model_source import resolve_model
    from compile.weights import load_model

    entry = resolve_model(ModelRequest(model, labels=str(finetuned.labels)))
    weights = tmp_path / "weights.pt"
    torch.save(load_model(entry, "random").module.state_dict(), weights)
    artifact = compiled(
        tmp_path / "artifact", "--model", model, "--weights", str(weights), "--labels", str(finetuned.labels)
    )
    with serving(["--artifact", str(artifact)], tmp_path / "server.log") as server:
        info = httpx.get(f"{server.url}/info", timeout=10).json()["model"]
        assert info["model"] == name and info["source"] == model
        assert {k: info["preprocess_spec"][k] for k in preprocess} == preprocess
        data, _ = finetuned.held_back[0]
        result = httpx.post(f"{server.url}/predict", content=data, params={"top_k": 4}, timeout=60).json()
        assert {p["label"] for p in result["predictions"]} == set(LABELS)


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    """scikit-image's other photos and their augmentations: none of the fine-tuned model's photos."""
    from compile.sample_photos import write_sample_calibration_set

    folder = tmp_path_factory.mktemp("calibration")
    write_sample_calibration_set(folder)
    return folder


def own_model_args(finetuned: FineTuned, route: str) -> list[str]:
    """The flags a user gives for each form of their model: its files, or a catalog architecture with
    their weights (preprocessing from the architecture)."""
    if route == "weights":
        return ["--model", "efficientnet-lite0", "--weights", str(finetuned.weights), "--labels", str(finetuned.labels)]
    return ["--model", str(getattr(finetuned, route)), "--labels", str(finetuned.labels), *finetuned.preprocess_flags]


@pytest.mark.parametrize(("route", "backend"), [("onnx", "onnx"), ("program", "inductor"), ("weights", "onnx")])
def test_its_model_quantizes_to_int8_and_still_serves_its_classes(
    finetuned, calibration, tmp_path, route, backend
) -> None:
    """Issue 43: the user's own model quantizes as the catalog models do (its ONNX file through ONNX
    Runtime's QDQ, its ExportedProgram through PT2E, its weights and labels on the architecture):
    gated, served, every held-back crop right."""
    args = [*own_model_args(finetuned, route), "--name", SERVED_NAME, "--backend", backend]
    args += ["--precision", "int8", "--calibration", str(calibration), "--batch", "1,4,8"]
    artifact = compiled(tmp_path / "artifact", *args)
    with serving(["--artifact", str(artifact)], tmp_path / "server.log") as server:
        assert_every_crop_answered_right(server, finetuned, SERVED_NAME)
        engine = httpx.get(f"{server.url}/info", timeout=10).json()["model"]["engine"]
    assert engine == ("onnxruntime-int8" if backend == "onnx" else "inductor-int8")


def test_a_timm_model_quantizes_to_int8_with_its_labels(finetuned, calibration, tmp_path) -> None:
    """A timm architecture with the user's labels, through PT2E: no trained timm weights offline, so
    its seeded weights are gated on their logits (cosine, relative error), and the contract is
    checked as served (its labels, its int8 engine)."""
    args = ["--model", "timm:resnet18", "--weights", "random", "--labels", str(finetuned.labels)]
    args += ["--backend", "inductor", "--precision", "int8", "--calibration", str(calibration), "--batch", "1,4,8"]
    artifact = compiled(tmp_path / "artifact", *args)
    with serving(["--artifact", str(artifact)], tmp_path / "server.log") as server:
        info = httpx.get(f"{server.url}/info", timeout=10).json()["model"]
        data, _ = finetuned.held_back[0]
        result = httpx.post(f"{server.url}/predict", content=data, params={"top_k": 4}, timeout=60).json()
    assert info["engine"] == "inductor-int8" and info["source"] == "timm:resnet18"
    assert {p["label"] for p in result["predictions"]} == set(LABELS)
