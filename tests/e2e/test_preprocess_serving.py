"""`vision-serve --preprocess NAME` end to end, for every backend that runs here: a real server on
loopback, efficientnet-lite0, one batch of 8 requests of which 2 are corrupt."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from compile.catalog import get_model_entry
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
    assert metadata["preprocess_spec"]["crop_size"] == get_model_entry("efficientnet-lite0").preprocess.crop_size
