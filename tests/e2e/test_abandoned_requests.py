"""Work for clients that left is not done: a real server on loopback (EfficientNet-Lite0), its worker
held while impatient clients give up (HTTP clients that time out and close their connection, gRPC
calls past their deadline), then resumed. Their images must be dropped unrun; a patient client in
the same queue still gets its answer."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from service.client.launcher import ServerProcess, free_port
from tests.conftest import inference_workers
from tests.worker_hold import in_flight, wait_until, worker_held

MODEL = "efficientnet-lite0"
IMPATIENT_HTTP = 4
IMPATIENT_GRPC = 2
CLIENT_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    grpc_port = free_port()
    # A batch window, so that the worker, once resumed, has read its cancel channel before it prepares
    # the batch (both channels' messages wait in the stopped process's sockets).
    args = ["--model", MODEL, "--max-batch-size", "8", "--batch-timeout-ms", "300", "--grpc-port", str(grpc_port)]
    with ServerProcess(args, log_path=tmp_path_factory.mktemp("server") / "server.log") as running:
        running.grpc_url = f"127.0.0.1:{grpc_port}"
        yield running


def samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(values: dict, name: str, **labels: str) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def grpc_infer(url: str, image: bytes) -> str:
    client = triton_grpc.InferenceServerClient(url)
    tensor = triton_grpc.InferInput("IMAGE", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([image], dtype=np.object_))
    try:
        client.infer(MODEL, [tensor], client_timeout=CLIENT_TIMEOUT_S)
    except InferenceServerException as exc:
        return str(exc.status())
    finally:
        client.close()
    return "answered"


def impatient_post(url: str, image: bytes) -> str:
    try:
        httpx.post(f"{url}/predict", content=image, timeout=CLIENT_TIMEOUT_S)
    except httpx.TimeoutException:
        return "gave up"  # httpx closes the connection
    return "answered"


def test_images_of_clients_that_left_are_dropped_unrun_and_a_patient_client_is_answered(
    server, chelsea_jpeg, coffee_jpeg
) -> None:
    before = samples(server.url)
    worker = inference_workers(server)[0]
    with ThreadPoolExecutor(IMPATIENT_HTTP + IMPATIENT_GRPC + 1) as pool:
        with worker_held(worker.pid):
            patient = pool.submit(httpx.post, f"{server.url}/predict", content=chelsea_jpeg, timeout=60)
            impatient = [pool.submit(impatient_post, server.url, coffee_jpeg) for _ in range(IMPATIENT_HTTP)]
            impatient += [pool.submit(grpc_infer, server.grpc_url, coffee_jpeg) for _ in range(IMPATIENT_GRPC)]
            outcomes = [future.result() for future in impatient]
            assert outcomes == ["gave up"] * IMPATIENT_HTTP + ["StatusCode.DEADLINE_EXCEEDED"] * IMPATIENT_GRPC
            # Their admission slots came back while the worker was still stopped: only the patient one is in.
            wait_until(lambda: in_flight(server.url) == 1, "the impatient clients' slots are released", timeout=5)
        response = patient.result()
    assert response.status_code == 200, response.text
    assert response.json()["predictions"][0]["index"] in range(281, 286)  # a cat
    time.sleep(0.5)  # a scrape after the worker's counters are written
    after = samples(server.url)
    left = IMPATIENT_HTTP + IMPATIENT_GRPC

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert (
        delta("vision_serve_requests_abandoned_total", where="worker")
        + delta("vision_serve_requests_abandoned_total", where="http")
        == left
    ), "every image of a client that left is dropped before its batch is prepared"
    assert delta("vision_serve_images_total") == 1, "only the patient client's image ran"
    assert delta("vision_serve_images_unclaimed_total") == 0
    assert delta("vision_serve_requests_total", code="499") == left, "each client that left is counted 499"
    assert delta("vision_serve_requests_total", code="200") == 1
