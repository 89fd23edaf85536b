"""`vision-serve --preprocess NAME` end to end, for every backend that runs here: a real server on
loopback, efficientnet-lite0, one batch of 8 requests of which 2 are corrupt; and a preprocessing set by
the flags (an exact 240x200 resize, no crop), shown by /info and served at that input size."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from compile.catalog import get_model_entry
from compile.model_request import ModelRequest
from compile.model_source import resolve_model
from preprocessing import create_preprocessor
from preprocessing.spec import PreprocessSpec
from service.client.launcher import ServerProcess
from tests.conftest import CAT_LABELS, encode, inference_workers, sample_array
from tests.unit.test_preprocessing_backends import corrupt_huffman_table
from tests.worker_hold import in_flight, wait_until, worker_held

SERVED = [
    *(pytest.param((name, "cpu"), id=f"{name}-cpu") for name in ("pil", "dali", "torch")),
    *(pytest.param((name, "cuda:0"), id=f"{name}-cuda", marks=pytest.mark.gpu) for name in ("dali", "cvcuda", "torch")),
]


@pytest.fixture(scope="module", params=SERVED)
def served(request, tmp_path_factory):
    name, device = request.param
    args = ["--model", "efficientnet-lite0", "--device", device, "--preprocess", name,
            "--max-batch-size", "8", "--batch-timeout-ms", "1000"]  # fmt: skip
    with ServerProcess(args, log_path=tmp_path_factory.mktemp("server") / "server.log") as server:
        yield name, server


def post_concurrently(server: ServerProcess, images: list[bytes]) -> list[httpx.Response]:
    """The images as concurrent requests, queued while the worker is held: they form one batch."""
    with httpx.Client(base_url=server.url, timeout=120) as client, ThreadPoolExecutor(len(images)) as pool:
        with worker_held(inference_workers(server)[0].pid):
            futures = [pool.submit(client.post, "/predict", content=data) for data in images]
            wait_until(lambda: in_flight(server.url) == len(images), f"{len(images)} requests are queued")
        return [future.result() for future in futures]


def check_batch_of_8_with_2_corrupt(server: ServerProcess, name: str) -> None:
    """8 concurrent requests that form one batch, 2 of them corrupt: 6 top-5 answers and 2 clear 400s."""
    chelsea, coffee = encode(sample_array("chelsea"), quality=90), encode(sample_array("coffee"), quality=90)
    corrupt = {
        1: corrupt_huffman_table(chelsea),  # header parses, pixel decode fails (on the device path too)
        6: coffee[: len(coffee) // 2],  # truncated upload
    }
    good = [chelsea, coffee, chelsea, coffee, chelsea, coffee]
    images = [corrupt[i] if i in corrupt else good.pop() for i in range(8)]
    responses = post_concurrently(server, images)

    codes = [r.status_code for r in responses]
    assert codes == [200, 400, 200, 200, 200, 200, 400, 200], f"{name}: {server.log_tail()}"
    assert {r.headers["X-Batch-Size"] for r in responses} == {"8"}  # one batch, shared with the bad items
    for data, response in zip(images, responses, strict=True):
        body = response.json()
        if response.status_code != 200:
            assert "corrupt" in body["detail"] or "truncated" in body["detail"]
            continue
        assert len(body["predictions"]) == 5
        top1 = body["predictions"][0]["label"]
        assert top1 in CAT_LABELS if data == chelsea else top1 == "espresso"


def test_batch_of_8_with_2_corrupt_answers_6_top5_and_2_errors(served) -> None:
    name, server = served
    check_batch_of_8_with_2_corrupt(server, name)


def test_info_reports_the_backend(served) -> None:
    name, server = served
    metadata = httpx.get(f"{server.url}/info", timeout=10).json()["model"]
    assert metadata["preprocess"] == name
    assert metadata["preprocess_reason"] == "chosen explicitly"
    own = get_model_entry("efficientnet-lite0").preprocess
    assert metadata["preprocess_spec"]["crop_size"] == own.crop_size
    assert PreprocessSpec.from_dict(metadata["preprocess_spec"]) == own  # every field, as the manifest has them
    assert metadata["preprocess_summary"] == own.describe() == "shorter 256, crop 224x224, bilinear"


# Every part of the model's own preprocessing these change: resize (mode and size), crop, resampling.
FLAGS = {"resize_size": "240x200", "crop_size": "none", "interpolation": "bicubic", "antialias": "off"}


def test_a_preprocessing_set_by_flags_is_shown_and_served_at_its_input_size(tmp_path) -> None:
    """/info shows the spec the flags made, every field and its summary; /predict answers what the model
    gives for the 240x200 input that spec makes (the default 224x224 crop would answer otherwise)."""
    from service.worker.engine import load_eager

    request = ModelRequest("efficientnet-lite0", **FLAGS)
    own = get_model_entry("efficientnet-lite0").preprocess
    spec = PreprocessSpec(0, 0, own.mean, own.std, "bicubic", "exact", 240, 200, antialias=False)
    assert resolve_model(request).preprocess == spec
    flags = [part for name, value in FLAGS.items() for part in (f"--{name.replace('_', '-')}", value)]
    args = ["--model", "efficientnet-lite0", "--device", "cpu", "--preprocess", "pil", *flags]
    chelsea = encode(sample_array("chelsea"), quality=90)
    with ServerProcess(args, log_path=tmp_path / "server.log") as server:
        info = httpx.get(f"{server.url}/info", timeout=10).json()
        answer = httpx.post(f"{server.url}/predict", content=chelsea, timeout=60)
    assert answer.status_code == 200, answer.text
    for shown in (info["model"], *info["models"]):
        assert shown["preprocess_spec"] == spec.to_dict()
        assert shown["preprocess_summary"] == "exact 240x200, no crop, bicubic, no antialias"
    # The same image through the same spec and model in this process.
    batch = create_preprocessor("pil", spec, "cpu", decode_threads=1)([chelsea]).images
    assert tuple(batch.shape) == (1, 3, 240, 200)
    with torch.inference_mode():
        probabilities = torch.softmax(load_eager(request, "imagenet", torch.device("cpu"))(batch)[0], dim=0)
    top = torch.topk(probabilities, 5)
    predictions = answer.json()["predictions"]
    assert [p["index"] for p in predictions] == top.indices.tolist()
    assert [p["probability"] for p in predictions] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert predictions[0]["label"] in CAT_LABELS
