"""A transformers classifier trained on the sample photos' custom classes and saved with
save_pretrained, served from its folder (vision-serve --model FOLDER) and compiled from it
(compile-trt --model FOLDER --backend onnx): every held-back crop gets its class."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from service.client.launcher import ServerProcess
from tests.finetuned import LABELS

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from tests.hf_finetuned import make_hf_finetuned

    return make_hf_finetuned(tmp_path_factory.mktemp("hf") / "resnet-photos")


def assert_every_crop_answered_right(server, held_back, name: str) -> None:
    files = [("image", (f"crop{i}.jpg", data)) for i, (data, _) in enumerate(held_back)]
    results = httpx.post(f"{server.url}/predict", files=files, data={"top_k": "4"}, timeout=120).json()["results"]
    assert [r["predictions"][0]["label"] for r in results] == [label for _, label in held_back]
    assert {p["label"] for p in results[0]["predictions"]} == set(LABELS)
    assert all(r["model"] == name for r in results)


def test_the_folder_is_served_eagerly_with_its_own_labels(trained, tmp_path) -> None:
    folder, held_back = trained
    with ServerProcess(["--model", str(folder), "--api-servers", "1"], log_path=tmp_path / "server.log") as server:
        assert_every_crop_answered_right(server, held_back, "resnet-photos")
        info = httpx.get(f"{server.url}/info", timeout=10).json()["model"]
        assert info["labels_source"].endswith("config.json:id2label")


def test_the_folder_compiles_to_onnx_and_serves(trained, tmp_path) -> None:
    folder, held_back = trained
    output = tmp_path / "artifact"
    command = [sys.executable, "-m", "compile.cli", "--log-level", "warning", "--model", str(folder)]
    done = subprocess.run(
        [*command, "--backend", "onnx", "--batch", "1,4,8", "--device", "cpu", "--output", str(output)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "accuracy gate passed" in done.stdout
    with ServerProcess(["--artifact", str(output), "--api-servers", "1"], log_path=tmp_path / "server.log") as server:
        assert_every_crop_answered_right(server, held_back, "resnet-photos")
