"""Work for clients that left, or that said how long they would wait, is not done: a real server on
loopback (EfficientNet-Lite0), its worker held while impatient clients give up (HTTP clients that time
out and close their connection, gRPC calls past their deadline) or their deadlines pass (a header, the
Open Inference Protocol's ``timeout``), then resumed. Their images must be dropped unrun, their
clients answered 504 at the deadline; a patient client in the same queue still gets its answer."""

from __future__ import annotations

import base64
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from service.client.launcher import ServerProcess, free_port
from tests.conftest import inference_workers
from tests.worker_hold import in_flight, wait_until, worker_held

MODEL = "efficientnet-lite0"
IMPATIENT_HTTP = 4
IMPATIENT_GRPC = 2
CLIENT_TIMEOUT_S = 1.0
# The server's own deadline: long enough for a patient request held behind the impatient ones, short
# enough to see it cap a client's longer one.
REQUEST_TIMEOUT_S = 6.0
DEADLINE_MS = 300


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    grpc_port = free_port()
    # A batch window, so that the worker, once resumed, has read its cancel channel before it prepares
    # the batch (both channels' messages wait in the stopped process's sockets).
    args = ["--model", MODEL, "--max-batch-size", "8", "--batch-timeout-ms", "300", "--grpc-port", str(grpc_port),
            "--request-timeout-s", str(REQUEST_TIMEOUT_S), "--workers-per-device", "1"]  # fmt: skip
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
            # Their images wait in the stopped worker's pipe: they keep their admission slots until it drops them.
            assert in_flight(server.url) > 1
        response = patient.result()
        wait_until(lambda: in_flight(server.url) == 0, "the impatient images dropped, their slots back", timeout=10)
    assert response.status_code == 200, response.text
    assert response.json()["predictions"][0]["index"] in range(281, 286)  # a cat
    time.sleep(0.5)  # a scrape after the worker's counters are written
    after = samples(server.url)
    left = IMPATIENT_HTTP + IMPATIENT_GRPC

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    # A gRPC call carries its deadline: ended by it (grpc's cancel or the server's own timer, whichever
    # comes first), it counts as expired, 504; a cancel that beats the server's copy of the deadline by
    # more than CANCEL_SLACK_S, as a client that left, 499. Either way it is dropped unrun.
    assert (
        delta("vision_serve_requests_abandoned_total", where="worker")
        + delta("vision_serve_requests_abandoned_total", where="http")
        + delta("vision_serve_requests_expired_total")
        == left
    ), "every image of a client that left is dropped before its batch is prepared"
    assert delta("vision_serve_images_total") == 1, "only the patient client's image ran"
    assert delta("vision_serve_images_unclaimed_total") == 0
    assert delta("vision_serve_requests_total", code="499") >= IMPATIENT_HTTP, "each client that left is counted 499"
    assert delta("vision_serve_requests_total", code="499") + delta("vision_serve_requests_total", code="504") == left
    assert delta("vision_serve_requests_total", code="200") == 1


# --- deadlines that clients set ------------------------------------------------------------------


def http_deadline(header: str) -> Callable[[str, bytes], tuple[int, str]]:
    def post(url: str, image: bytes) -> tuple[int, str]:
        response = httpx.post(f"{url}/predict", content=image, headers={header: str(DEADLINE_MS)}, timeout=30)
        return response.status_code, response.json()["detail"]

    return post


def oip_http_timeout(url: str, image: bytes) -> tuple[int, str]:
    client = triton_http.InferenceServerClient(url.removeprefix("http://"), network_timeout=30)
    tensor = triton_http.InferInput("IMAGE", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([image], dtype=np.object_))
    try:
        client.infer(MODEL, [tensor], timeout=DEADLINE_MS * 1000)  # microseconds, as Triton reads it
    except InferenceServerException as exc:
        return int(exc.status()), exc.message()
    finally:
        client.close()
    return 200, ""


def grpc_timeout_parameter(url: str, image: bytes) -> tuple[int, str]:
    """The ``timeout`` parameter alone (no gRPC deadline): the server answers DEADLINE_EXCEEDED itself."""
    client = triton_grpc.InferenceServerClient(url)
    tensor = triton_grpc.InferInput("IMAGE", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([image], dtype=np.object_))
    try:
        client.infer(MODEL, [tensor], timeout=DEADLINE_MS * 1000)
    except InferenceServerException as exc:
        return {"StatusCode.DEADLINE_EXCEEDED": 504}.get(str(exc.status()), 0), exc.message()
    finally:
        client.close()
    return 200, ""


DEADLINE_CLIENTS = {
    "x-request-timeout-ms": (http_deadline("X-Request-Timeout-Ms"), "x-request-timeout-ms header"),
    "envoy-expected-rq-timeout": (http_deadline("x-envoy-expected-rq-timeout-ms"), "x-envoy-expected-rq-timeout-ms"),
    "oip-http-timeout": (oip_http_timeout, "'timeout' parameter"),
    "oip-grpc-timeout": (grpc_timeout_parameter, "'timeout' parameter"),
}


@pytest.mark.parametrize("client", DEADLINE_CLIENTS, ids=list(DEADLINE_CLIENTS))
def test_a_deadline_that_passes_in_the_queue_is_answered_504_then_and_dropped_unrun(
    server, chelsea_jpeg, coffee_jpeg, client
) -> None:
    send, source = DEADLINE_CLIENTS[client]
    url = server.grpc_url if client == "oip-grpc-timeout" else server.url
    worker = inference_workers(server)[0]
    with ThreadPoolExecutor(1) as pool:
        with worker_held(worker.pid):
            patient = pool.submit(httpx.post, f"{server.url}/predict", content=chelsea_jpeg, timeout=60)
            wait_until(lambda: in_flight(server.url) == 1, "the patient request is admitted")
            before = samples(server.url)
            started = time.monotonic()
            status, detail = send(url, coffee_jpeg)
            waited = time.monotonic() - started
        response = patient.result()
    assert status == 504 and f"{DEADLINE_MS} ms" in detail and source in detail, (status, detail)
    # At the deadline, while the worker was still stopped: not at --request-timeout-s.
    assert DEADLINE_MS / 1e3 - 0.05 <= waited < REQUEST_TIMEOUT_S / 2, waited
    assert response.status_code == 200, "the request queued with it is answered"
    wait_until(lambda: counted(server.url, "vision_serve_images_total", before) >= 1, "the patient image is counted")
    time.sleep(0.5)  # and whatever else the worker would count for this batch
    after = samples(server.url)
    assert value(after, "vision_serve_images_total") - value(before, "vision_serve_images_total") == 1
    assert (
        value(after, "vision_serve_requests_expired_total") - value(before, "vision_serve_requests_expired_total") == 1
    )
    assert value(after, "vision_serve_images_unclaimed_total") == value(before, "vision_serve_images_unclaimed_total")


def counted(url: str, name: str, before: dict) -> float:
    """How much counter ``name`` rose since ``before``."""
    return value(samples(url), name) - value(before, name)


@pytest.mark.slow  # waits out the 6 s server deadline; tests/unit/test_deadlines.py checks the cap itself
def test_the_server_timeout_caps_a_client_deadline(server, coffee_jpeg) -> None:
    worker = inference_workers(server)[0]
    before = samples(server.url)
    with worker_held(worker.pid):
        started = time.monotonic()
        response = httpx.post(
            f"{server.url}/predict", content=coffee_jpeg, headers={"X-Request-Timeout-Ms": "600000"}, timeout=60
        )
        waited = time.monotonic() - started
    assert response.status_code == 504 and "--request-timeout-s" in response.json()["detail"], response.text
    assert REQUEST_TIMEOUT_S - 0.1 <= waited < REQUEST_TIMEOUT_S + 5
    # The worker, resumed, drops it: counted before the next test reads its own counts.
    wait_until(lambda: counted(server.url, "vision_serve_requests_expired_total", before) >= 1, "the drop is counted")


def test_a_deadline_that_passes_during_the_upload_cuts_it_short_with_504_and_nothing_runs(server, coffee_jpeg) -> None:
    """The body is still arriving at the deadline: the HTTP process answers 504 then, without waiting
    for the rest (the image is never sent to a worker; seen here as never run)."""
    before = samples(server.url)
    head = (
        f"POST /predict HTTP/1.1\r\nhost: x\r\ncontent-type: image/jpeg\r\ncontent-length: {len(coffee_jpeg)}\r\n"
        f"x-request-timeout-ms: 200\r\nconnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as connection:
        connection.sendall(head + coffee_jpeg[:100])  # and no more
        started = time.monotonic()
        reply = connection.recv(65536)
        waited = time.monotonic() - started
        while not reply.endswith(b"}") and (chunk := connection.recv(65536)):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 504"), reply[:300]
    assert b"200 ms deadline" in reply
    assert waited < 1.0, f"the 504 came {waited:.2f} s after the upload stalled, for a 200 ms deadline"
    time.sleep(0.5)  # a scrape after anything the worker would count
    after = samples(server.url)
    assert value(after, "vision_serve_images_total") == value(before, "vision_serve_images_total")


@pytest.mark.parametrize(
    ("headers", "parameters"),
    [
        ({"X-Request-Timeout-Ms": "0.5"}, {}),
        ({"X-Request-Timeout-Ms": "-1"}, {}),
        ({"x-envoy-expected-rq-timeout-ms": "9" * 13}, {}),
        ({}, {"timeout": 1.5}),
        ({}, {"timeout": True}),
        ({}, {"timeout": "300"}),
    ],
    ids=["fraction", "negative", "too-many-digits", "float-parameter", "bool-parameter", "text-parameter"],
)
def test_a_malformed_deadline_is_a_400_that_names_it(server, coffee_jpeg, headers, parameters) -> None:
    if parameters:
        body = {
            "inputs": [
                {"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": [base64.b64encode(coffee_jpeg).decode()]}
            ],
            "parameters": parameters,
        }
        response = httpx.post(f"{server.url}/v2/models/{MODEL}/infer", json=body, timeout=30)
        named = "'timeout'"
    else:
        response = httpx.post(f"{server.url}/predict", content=coffee_jpeg, headers=headers, timeout=30)
        named = next(iter(headers)).lower()
    assert response.status_code == 400, response.text
    detail = response.json().get("detail") or response.json().get("error")
    assert named in detail.lower(), detail


def test_a_grpc_timeout_parameter_of_the_wrong_type_is_invalid_argument(server, coffee_jpeg) -> None:
    # Built by hand: tritonclient refuses to send a "timeout" of its own making.
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="IMAGE", datatype="BYTES", shape=[1]).contents.bytes_contents.append(coffee_jpeg)
    request.parameters["timeout"].string_param = "300"
    with grpc.insecure_channel(server.grpc_url) as channel:
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=service_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=service_pb2.ModelInferResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as caught:
            infer(request, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'timeout'" in caught.value.details()
