"""The LitServe API in-process: httpx over ASGI to a real LitServer with a real worker and model.

The inference worker is a real spawned process running efficientnet-lite0, so batching, per-item
errors and the response schema are exercised exactly as in production, minus the TCP socket.
"""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import litserve as ls
import pytest
from asgi_lifespan import LifespanManager
from litserve.utils import wrap_litserve_start

from service.litserve_api import ClassifierLitAPI
from service.settings import ServeSettings
from tests.bad_inputs import bad_inputs
from tests.conftest import CAT_LABELS
from tests.inprocess import started_in_process
from tests.worker_hold import HOLD_TIMEOUT_S, worker_held

# The worker is held while a test's requests queue (tests/worker_hold.py); the window only has to
# cover the hand-over of the messages already sent when it resumes.
BATCH_WINDOW_S = 1.0


def start(settings: ServeSettings):
    return started_in_process(settings)


@pytest.fixture(scope="module")
def batching_server():
    settings = ServeSettings(model="efficientnet-lite0", max_batch_size=4, batch_timeout_ms=BATCH_WINDOW_S * 1000)
    with start(settings) as server:
        yield server


async def wait_ready(client: httpx.AsyncClient, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while (await client.get("/ready")).status_code != 200:
        assert time.monotonic() < deadline, "worker did not become ready"
        await asyncio.sleep(0.1)


def call(server, requests: list[dict]) -> list[httpx.Response]:
    """Send the requests concurrently (each a dict of httpx.post kwargs) and return the responses.

    The worker is held until every request is admitted (or already answered, if rejected before
    the queue): they then reach it together, as requests that queue while it is busy do.
    """

    async def go() -> list[httpx.Response]:
        async with LifespanManager(server.app) as manager:
            transport = httpx.ASGITransport(app=manager.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
                await wait_ready(client)
                with worker_held(server.inference_workers[0].pid):
                    tasks = [asyncio.create_task(client.post("/predict", **kw)) for kw in requests]
                    deadline = time.monotonic() + HOLD_TIMEOUT_S
                    while server.frontend.gate.admitted + sum(t.done() for t in tasks) < len(tasks):
                        assert time.monotonic() < deadline, "requests were not admitted"
                        await asyncio.sleep(0.01)
                return await asyncio.gather(*tasks)

    return asyncio.run(go())


def raw(data: bytes, **params) -> dict:
    return {"content": data, "headers": {"Content-Type": "image/jpeg"}, "params": params}


def test_concurrent_requests_form_one_batch(batching_server, chelsea_jpeg, coffee_jpeg) -> None:
    responses = call(batching_server, [raw(chelsea_jpeg), raw(coffee_jpeg), raw(chelsea_jpeg), raw(coffee_jpeg)])
    assert [r.status_code for r in responses] == [200] * 4
    # X-Batch-Size is the number of requests in the batch that predict() received.
    assert [r.headers["X-Batch-Size"] for r in responses] == ["4"] * 4
    assert responses[0].json()["predictions"][0]["label"] in CAT_LABELS
    assert responses[1].json()["predictions"][0]["label"] == "espresso"
    assert responses[0].json() == responses[2].json()  # batch position does not change the answer


def test_one_corrupt_image_fails_alone(batching_server, chelsea_jpeg, coffee_jpeg, truncated_jpeg) -> None:
    responses = call(batching_server, [raw(chelsea_jpeg), raw(truncated_jpeg), raw(coffee_jpeg), raw(chelsea_jpeg)])
    assert [r.status_code for r in responses] == [200, 400, 200, 200]
    assert {r.headers["X-Batch-Size"] for r in responses} == {"4"}
    assert "truncated" in responses[1].json()["detail"]
    assert responses[0].json()["predictions"][0]["label"] in CAT_LABELS
    assert responses[2].json()["predictions"][0]["label"] == "espresso"


def test_a_batch_of_only_bad_images(batching_server, truncated_jpeg) -> None:
    broken = next(item for item in bad_inputs() if item.name == "jpeg_broken_huffman_table")
    responses = call(batching_server, [raw(truncated_jpeg), raw(broken.body)])  # headers parse, pixels do not
    assert [r.status_code for r in responses] == [400, 400]
    assert all(set(r.json()) == {"detail"} for r in responses)
    assert {r.headers["X-Batch-Size"] for r in responses} == {"2"}  # both went through one batch


def test_bad_headers_are_answered_before_the_batch(batching_server) -> None:
    responses = call(batching_server, [raw(b"not an image"), raw(b"\x89PNG\r\n\x1a\n")])
    assert [r.status_code for r in responses] == [415, 400]
    assert all("X-Batch-Size" not in r.headers for r in responses)  # no worker time spent on them


def test_response_schema_and_per_request_top_k(batching_server, chelsea_jpeg) -> None:
    multipart = {"files": {"image": ("chelsea.jpg", chelsea_jpeg, "image/jpeg")}, "data": {"top_k": "3"}}
    as_json = {"json": {"image": base64.b64encode(chelsea_jpeg).decode(), "top_k": 10}}
    responses = call(batching_server, [raw(chelsea_jpeg), multipart, as_json, raw(chelsea_jpeg, top_k=1000)])
    assert [r.status_code for r in responses] == [200] * 4
    bodies = [r.json() for r in responses]
    assert [len(b["predictions"]) for b in bodies] == [5, 3, 10, 1000]
    first = bodies[0]
    assert set(first) == {"predictions", "model", "model_version", "engine"}
    assert first["model_version"] == "1"  # a one-model server serves version 1
    assert first["model"] == "efficientnet-lite0" and first["engine"] == "torch-eager-fp32"
    for p in first["predictions"]:
        assert set(p) == {"index", "label", "probability"}
        assert isinstance(p["index"], int) and isinstance(p["label"], str) and 0.0 <= p["probability"] <= 1.0
    probabilities = [p["probability"] for p in bodies[3]["predictions"]]
    assert probabilities == sorted(probabilities, reverse=True)
    assert sum(probabilities) == pytest.approx(1.0, abs=1e-3)
    # The same image answers the same whichever way it was sent.
    assert bodies[1]["predictions"] == first["predictions"][:3]
    assert bodies[2]["predictions"][:5] == first["predictions"]
    assert "preprocess;dur=" in responses[0].headers["Server-Timing"]


def test_malformed_request_is_rejected_before_the_batch(batching_server, chelsea_jpeg) -> None:
    responses = call(batching_server, [raw(chelsea_jpeg, top_k=0), {"json": {"image": "%%%"}}, raw(chelsea_jpeg)])
    assert [r.status_code for r in responses] == [422, 400, 200]
    assert "X-Batch-Size" not in responses[0].headers  # never reached a worker
    assert responses[2].headers["X-Batch-Size"] == "1"


def test_batching_off_uses_the_single_request_path(chelsea_jpeg, truncated_jpeg) -> None:
    settings = ServeSettings(model="efficientnet-lite0", max_batch_size=1)
    with start(settings) as server:
        responses = call(server, [raw(chelsea_jpeg), raw(truncated_jpeg), raw(chelsea_jpeg, top_k=2)])
    assert [r.status_code for r in responses] == [200, 400, 200]
    assert {r.headers["X-Batch-Size"] for r in responses} == {"1"}
    assert len(responses[2].json()["predictions"]) == 2


def test_dynamic_batches_form_under_load_with_the_default_greedy_batching(chelsea_jpeg) -> None:
    """With no window (the default), requests that queue while the worker is busy (here: held) still
    share a batch."""
    settings = ServeSettings(model="efficientnet-lite0", max_batch_size=8)
    with start(settings) as server:
        responses = call(server, [raw(chelsea_jpeg)] * 16)
    assert all(r.status_code == 200 for r in responses)
    sizes = [int(r.headers["X-Batch-Size"]) for r in responses]
    assert max(sizes) > 1 and max(sizes) <= 8


def test_the_classifier_serves_under_a_plain_litserver(chelsea_jpeg, truncated_jpeg) -> None:
    # What a LitServe user gets by mounting ClassifierLitAPI in their own server: LitServe's own
    # request path (its queues and batched loop), a JSON base64 body, and our answer format.
    settings = ServeSettings(model="efficientnet-lite0", max_batch_size=4)
    server = ls.LitServer(ClassifierLitAPI(settings), accelerator="cpu")
    with wrap_litserve_start(server) as started:

        async def go() -> list[httpx.Response]:
            async with LifespanManager(started.app) as manager:
                transport = httpx.ASGITransport(app=manager.app)
                async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
                    deadline = time.monotonic() + 120
                    while (await client.get("/health")).text != "ok":
                        assert time.monotonic() < deadline, "worker did not become ready"
                        await asyncio.sleep(0.1)
                    bodies = [chelsea_jpeg, truncated_jpeg]
                    return [
                        await client.post("/predict", json={"image": base64.b64encode(b).decode(), "top_k": 3})
                        for b in bodies
                    ]

        good, bad = asyncio.run(go())
    assert good.status_code == 200, good.text
    body = good.json()
    assert body["predictions"][0]["label"] in CAT_LABELS and len(body["predictions"]) == 3
    assert body["model"] == "efficientnet-lite0"
    assert bad.status_code == 400 and "truncated" in bad.json()["detail"]
