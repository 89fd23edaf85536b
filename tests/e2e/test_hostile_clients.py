"""Hostile and broken clients against a live server, on every protocol (issue 29): client faults are
never counted or logged as server errors, slow or oversized requests are cut off by the connection
limits, malformed gRPC is INVALID_ARGUMENT, images whose decode would cost far more than their size
are refused before decoding, and ordinary requests keep being answered meanwhile.

Raw sockets for what no HTTP client library would send. Short limits (1 s) keep the test fast; the
defaults are in docs/configuration.md.
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.http as triton_http
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from benchmarks.hostile_soak import predict_head, raw_exchange
from benchmarks.soak import rss_mb, server_processes
from service.client.launcher import ServerProcess, free_port
from tests.bad_inputs import bad_inputs
from tests.conftest import CAT_LABELS, inference_workers
from tests.unit.test_uvicorn_bridge import FRAMING_ABUSE, exchange_once, send_for
from tests.worker_hold import in_flight, worker_held
from tests.worker_hold import wait_until as hold_until

TIMEOUT_S = 1.0
MAX_HEADER_BYTES = 8192
DECODE_COST_BOMBS = (
    "jpeg_frame_claims_9000x9000",
    "jpeg_progressive_1500_scans",
    "png_20000_empty_chunks",
    "tiff_10000_strips",
    "gif_20000_comment_blocks",
)
SERVICE = "/inference.GRPCInferenceService/"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    grpc_port = free_port()
    args = ["--model", "efficientnet-lite0", "--grpc-port", str(grpc_port), "--api-servers", "1"]
    args += ["--header-timeout-s", str(TIMEOUT_S), "--body-timeout-s", str(TIMEOUT_S)]
    args += ["--max-header-bytes", str(MAX_HEADER_BYTES)]
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with ServerProcess(args, log_path=log_path) as running:
        running.grpc_url = f"127.0.0.1:{grpc_port}"
        yield running


def request_counts(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        sample.labels["code"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "vision_serve_requests"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def added(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {code: after[code] - before.get(code, 0) for code in after if after[code] != before.get(code, 0)}


def status_line(response: bytes) -> str:
    return response.split(b"\r\n", 1)[0].decode("latin-1")


def wait_until(condition, what: str, timeout_s: float = 10.0) -> None:
    """Poll ``condition`` until it holds; fail saying ``what`` was awaited if it does not in time."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.05)


class ServerLog:
    """The lines the server logged since one test began: what that test's requests made it write,
    not what the module's earlier tests did (one server error then fails the test that caused it)."""

    def __init__(self, server: ServerProcess) -> None:
        self.path = server.log_path
        self.start = self.path.stat().st_size

    def lines(self) -> list[str]:
        with self.path.open("rb") as log:
            log.seek(self.start)
            return log.read().decode(errors="replace").splitlines()

    def count(self, text: str) -> int:
        return sum(text in line for line in self.lines())


@pytest.fixture
def log(server) -> ServerLog:
    return ServerLog(server)


def server_errors_logged(log: ServerLog) -> list[str]:
    return [line for line in log.lines() if "Traceback" in line or "Exception in ASGI" in line]


def images_answered_by_a_model(url: str) -> dict[str, float]:
    """``vision_serve_model_images_total`` by code: images a model version's workers answered. The
    HTTP process counts each answer a worker sends back; an image it refuses itself (its header
    check, service/http/pipeline/checks.py) never reaches a worker and is not counted here."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        sample.labels["code"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "vision_serve_model_images"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def test_a_client_that_leaves_mid_body_is_counted_499_not_500(server, log, chelsea_jpeg) -> None:
    before = request_counts(server.url)
    for _ in range(5):
        raw_exchange(server.port, predict_head(len(chelsea_jpeg)) + chelsea_jpeg[:1000], reset_after_send=True)
    deadline = time.monotonic() + 10
    while added(before, request_counts(server.url)).get("499", 0) < 5:
        assert time.monotonic() < deadline, added(before, request_counts(server.url))
        time.sleep(0.1)
    assert set(added(before, request_counts(server.url))) == {"499"}
    assert not server_errors_logged(log)


def test_malformed_chunked_bodies_get_400_and_no_server_error(server, log) -> None:
    before = request_counts(server.url)
    for chunk_size in (b"zz", b"ffffffffffffffffffff", b"-1"):
        head = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nTransfer-Encoding: chunked\r\n\r\n"
        response = raw_exchange(server.port, head + b"4\r\nabcd\r\n" + chunk_size + b"\r\nxyz\r\n")
        assert status_line(response).startswith("HTTP/1.1 400"), response[:200]
    unknown = b"POST /predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked, br\r\n\r\n0\r\n\r\n"
    assert status_line(raw_exchange(server.port, unknown))[9:10] == "4"
    # Each of the four is a protocol error uvicorn logs; the three that reached /predict are counted
    # as their handlers finish. Wait for both before reading the counts and the log.
    wait_until(lambda: log.count("Invalid HTTP request received") >= 4, "4 protocol errors logged")
    wait_until(lambda: sum(added(before, request_counts(server.url)).values()) >= 3, "3 /predict requests counted")
    assert not {code for code in added(before, request_counts(server.url)) if code.startswith("5")}
    assert not server_errors_logged(log)


def test_slow_headers_idle_connections_and_slow_bodies_get_408_and_are_closed(server, log, chelsea_jpeg) -> None:
    before = request_counts(server.url)
    started = time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        idle = pool.submit(raw_exchange, server.port, b"")
        slow_headers = pool.submit(raw_exchange, server.port, b"POST /predict HTTP/1.1\r\nHost: x\r\n")
        slow_body = pool.submit(raw_exchange, server.port, predict_head(len(chelsea_jpeg)) + chelsea_jpeg[:100])
        answers = [f.result() for f in (idle, slow_headers, slow_body)]
    assert all(status_line(a).startswith("HTTP/1.1 408") and not a.endswith(b"<still open>") for a in answers), answers
    assert b"--header-timeout-s" in answers[1] and b"--body-timeout-s" in answers[2]
    assert time.monotonic() - started < 8  # closed by the server, well before the client's own 10 s wait
    wait_until(lambda: "408" in added(before, request_counts(server.url)), "408 counted")
    assert added(before, request_counts(server.url)) == {"408": 1}  # the slow body was a /predict request
    assert not server_errors_logged(log)


def test_oversized_headers_get_431_and_ordinary_ones_pass(server, chelsea_jpeg) -> None:
    # Just past the limit, and nothing after: the server reads it all before it answers and closes
    # (unread bytes would make the kernel reset the connection, losing the answer).
    huge = predict_head(0, "X-Padding: " + "a" * (MAX_HEADER_BYTES + 100) + "\r\n")
    assert status_line(raw_exchange(server.port, huge)).startswith("HTTP/1.1 431")
    trickled = []
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: ")
        for _ in range(4):  # 12 KB in pieces, each under the limit alone
            sock.sendall(b"a" * 3000)
            time.sleep(0.05)
        trickled.append(sock.recv(65536))
    assert status_line(trickled[0]).startswith("HTTP/1.1 431")
    fine = predict_head(len(chelsea_jpeg), "X-Padding: " + "a" * 4000 + "\r\nConnection: close\r\n") + chelsea_jpeg
    assert status_line(raw_exchange(server.port, fine)).startswith("HTTP/1.1 200")


def test_held_sockets_do_not_stop_ordinary_requests(server, chelsea_jpeg) -> None:
    sockets = []
    try:
        for _ in range(100):  # slow clients holding connections half-sent
            sock = socket.create_connection(("127.0.0.1", server.port))
            sock.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\n")
            sockets.append(sock)
        response = httpx.post(f"{server.url}/predict", content=chelsea_jpeg, timeout=30)
        assert response.status_code == 200 and response.json()["predictions"][0]["label"] in CAT_LABELS
    finally:
        for sock in sockets:
            sock.close()


@pytest.mark.parametrize("name", DECODE_COST_BOMBS)
def test_images_whose_decode_would_cost_too_much_are_refused_before_decoding(server, name) -> None:
    """Refused by the HTTP process's header check: no worker ever sees the image (the worker's own
    probe would refuse it too, with the same 400, after it crossed to a worker and took a queue slot)."""
    item = next(i for i in bad_inputs() if i.name == name)
    before = images_answered_by_a_model(server.url)
    response = httpx.post(f"{server.url}/predict", content=item.body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["detail"]
    assert images_answered_by_a_model(server.url) == before  # counted before the answer is sent, if at all


def test_an_ordinary_request_is_answered_while_expensive_images_arrive(server, chelsea_jpeg) -> None:
    bombs = [i.body for i in bad_inputs() if i.name in DECODE_COST_BOMBS] * 4
    with ThreadPoolExecutor(4) as pool:
        refused = [pool.submit(httpx.post, f"{server.url}/predict", content=b, timeout=30) for b in bombs]
        started = time.monotonic()
        ordinary = httpx.post(f"{server.url}/predict", content=chelsea_jpeg, timeout=30)
        ordinary_s = time.monotonic() - started
        assert all(f.result().status_code == 400 for f in refused)
    assert ordinary.status_code == 200
    assert ordinary_s < 10, ordinary_s  # against seconds per bomb if any reached a decoder


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.grpc_url) as opened:
        yield opened


def raw_call(channel: grpc.Channel, method: str, body: bytes) -> grpc.RpcError:
    call = channel.unary_unary(SERVICE + method)  # no serializers: the bytes go as they are
    with pytest.raises(grpc.RpcError) as caught:
        call(body, timeout=10)
    return caught.value


def test_grpc_bytes_that_are_not_protobuf_are_invalid_argument_without_a_traceback(server, log, channel) -> None:
    good = service_pb2.ModelInferRequest(model_name="efficientnet-lite0", id="x" * 50).SerializeToString()
    bodies = {
        "random": bytes(range(256)) * 4,
        "truncated": good[:-10],
        "bad varint": b"\x08" + b"\xff" * 11,
        "invalid UTF-8 in a string field": b"\x0a\x02\xc3\x28",
        "deep nesting": b"\x7b" * 500,  # start-group tags of an unknown field, nested past the parser's limit
    }
    before = request_counts(server.url)
    for name, body in bodies.items():
        error = raw_call(channel, "ModelInfer", body)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, error.code(), error.details())
        assert error.details() == "The ModelInfer request is not a valid protobuf message."
    assert added(before, request_counts(server.url)) == {"400": len(bodies)}
    assert not server_errors_logged(log)


@pytest.mark.parametrize("method", ["ModelConfig", "ModelStatistics", "SystemSharedMemoryStatus", "TraceSetting"])
def test_grpc_unimplemented_rpcs_say_so_without_a_traceback(server, log, channel, method) -> None:
    error = raw_call(channel, method, b"")
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED and method in error.details()
    assert not server_errors_logged(log)


def test_grpc_repository_calls_without_explicit_mode_say_how_to_turn_them_on(server, log, channel) -> None:
    error = raw_call(channel, "RepositoryIndex", b"")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "--model-control explicit" in error.details()
    assert not server_errors_logged(log)


def test_grpc_streaming_infer_is_unimplemented_without_a_traceback(server, log, channel) -> None:
    stream = channel.stream_stream(SERVICE + "ModelStreamInfer")
    with pytest.raises(grpc.RpcError) as caught:
        list(stream(iter([b""]), timeout=10))
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert not server_errors_logged(log)


def test_grpc_errors_quoting_huge_client_values_stay_short(server, channel) -> None:
    request = service_pb2.ModelInferRequest(model_name="m" * 1_000_000)
    error = raw_call(channel, "ModelInfer", request.SerializeToString())
    # Not RESOURCE_EXHAUSTED from the client's own 8 KiB metadata limit: the real answer arrives.
    assert error.code() == grpc.StatusCode.NOT_FOUND, (error.code(), error.details()[:200])
    assert len(error.details()) <= 1000


def test_a_jpeg_frame_larger_than_its_coded_data_is_refused_beside_an_ordinary_photo(server, chelsea_jpeg) -> None:
    """1x65000 passes the HTTP process's length bound; the worker's strict pass refuses it, and the
    photo decoded in the same batch is answered as usual."""
    lying = next(i.body for i in bad_inputs() if i.name == "jpeg_frame_claims_1x65000")
    files = [("image", ("lying.jpg", lying)), ("image", ("cat.jpg", chelsea_jpeg))]
    before = images_answered_by_a_model(server.url)
    response = httpx.post(f"{server.url}/predict", files=files, timeout=30)
    results = response.json()["results"]
    assert [r["status_code"] for r in results] == [400, 200], results
    assert "1x65000" in results[0]["detail"] and results[1]["predictions"][0]["label"] in CAT_LABELS
    # Both reached the worker: the count that stays still for an image refused before a worker moves here.
    assert added(before, images_answered_by_a_model(server.url)) == {"400": 1, "200": 1}


@pytest.mark.parametrize("name", ["jpeg_frame_claims_9000x9000", "jpeg_frame_claims_1x65000"])
def test_grpc_lying_jpeg_is_invalid_argument(server, channel, name) -> None:
    item = next(i for i in bad_inputs() if i.name == name)
    tensor = service_pb2.ModelInferRequest.InferInputTensor(name="IMAGE", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append(item.body)
    request = service_pb2.ModelInferRequest(model_name="efficientnet-lite0", inputs=[tensor])
    before = images_answered_by_a_model(server.url)
    error = raw_call(channel, "ModelInfer", request.SerializeToString())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and name.rsplit("_", 1)[1] in error.details()
    # 9000x9000 is refused by the HTTP process's header check; 1x65000 passes it and the worker refuses it.
    reached_a_worker = {"400": 1} if name == "jpeg_frame_claims_1x65000" else {}
    assert added(before, images_answered_by_a_model(server.url)) == reached_a_worker


# --- the Open Inference Protocol over HTTP: the same rules on its routes ---


def test_oip_http_a_client_that_leaves_mid_body_is_counted_499(server, log, chelsea_jpeg) -> None:
    before = request_counts(server.url)
    head = (
        f"POST /v2/models/efficientnet-lite0/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {100_000}\r\n\r\n"
    ).encode()
    raw_exchange(server.port, head + b'{"inputs": [' + b" " * 500, reset_after_send=True)
    deadline = time.monotonic() + 10
    while added(before, request_counts(server.url)) != {"499": 1}:
        assert time.monotonic() < deadline, added(before, request_counts(server.url))
        time.sleep(0.1)
    assert not server_errors_logged(log)


def test_oip_http_lying_and_expensive_images_are_refused(server) -> None:
    """By the HTTP process's header check: no worker sees them."""
    client = triton_http.InferenceServerClient(f"127.0.0.1:{server.port}")
    before = images_answered_by_a_model(server.url)
    for name in ("jpeg_frame_claims_9000x9000", "png_20000_empty_chunks"):
        body = next(i.body for i in bad_inputs() if i.name == name)
        tensor = triton_http.InferInput("IMAGE", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([body], dtype=np.object_), binary_data=True)
        with pytest.raises(InferenceServerException) as caught:
            client.infer("efficientnet-lite0", [tensor])
        assert caught.value.status() == "400", caught.value.message()
    assert "9000x9000" not in caught.value.message() and "chunks" in caught.value.message()
    assert images_answered_by_a_model(server.url) == before


def http_process_rss_mb(server: ServerProcess) -> float:
    """Resident memory of the server's one HTTP process (the fixture runs --api-servers 1)."""
    (rss,) = [
        rss_mb({pid: entry})[pid] for pid, entry in server_processes(server.process.pid).items() if entry[0] == "http"
    ]
    return rss


def test_pipelined_requests_behind_a_running_predict_do_not_grow_the_server(server, log, chelsea_jpeg) -> None:
    """On main, 8,000 pipelined GET /info with 12 KB headers behind a held /predict were all read and
    kept: +112 MiB in 5 s. Now the HTTP process reads on only until one more is parsed (or closes the
    connection when one read holds more than it lets wait), and other connections are served meanwhile.
    (The flooding client's own close is not seen until its /predict is answered: its FIN waits in its
    kernel behind the bytes the server declined to read.)"""
    rss_before = http_process_rss_mb(server)
    worker = inference_workers(server)[0]
    padded = b"GET /info HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (MAX_HEADER_BYTES - 1000) + b"\r\n\r\n"
    with worker_held(worker.pid), socket.create_connection(("127.0.0.1", server.port), timeout=10) as connection:
        connection.sendall(predict_head(len(chelsea_jpeg)) + chelsea_jpeg)
        hold_until(lambda: in_flight(server.url) == 1, "the /predict admitted")
        sent = send_for(connection, padded, 8_000, seconds=3.0)
        assert sent < 8_000, "the server read everything the client pipelined"
        assert http_process_rss_mb(server) - rss_before < 10
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    hold_until(lambda: in_flight(server.url) == 0, "the held /predict answered once the worker runs")
    response = httpx.post(f"{server.url}/predict", content=chelsea_jpeg, timeout=30)
    assert response.status_code == 200 and response.json()["predictions"][0]["label"] in CAT_LABELS
    assert http_process_rss_mb(server) - rss_before < 10
    assert not server_errors_logged(log)


def test_fifty_pipelined_health_checks_in_one_write_are_all_answered_in_order(server, log) -> None:
    """Issue 60: fifty pipelined GET /v2/health/live written at once got no answer (the connection was
    closed once one read held more than 32). Plain uvicorn answers all fifty; so does the server, with
    at most 32 parsed at a time (their order: tests/unit/test_uvicorn_bridge.py)."""
    paths = [b"/v2/health/live", b"/v2/health/ready"] * 25
    requests = [b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path for path in paths[:-1]]
    requests.append(b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % paths[-1])
    reply = raw_exchange(server.port, b"".join(requests))
    assert reply.count(b"HTTP/1.1 200 OK") == 50, reply[-300:]
    live = triton_http.InferenceServerClient(f"127.0.0.1:{server.port}")
    assert live.is_server_live() and live.is_server_ready()
    assert not server_errors_logged(log)


def test_a_client_that_leaves_with_requests_queued_behind_its_predict_has_it_dropped(server, log, chelsea_jpeg) -> None:
    """Reading is paused while requests wait behind the running /predict; its client's close is still
    seen (the kernel's hang-up flag, checked by the connection sweep) and the /predict is dropped
    unrun, counted 499, while the worker is still stopped."""
    before = request_counts(server.url)
    worker = inference_workers(server)[0]
    with worker_held(worker.pid):
        connection = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        connection.sendall(predict_head(len(chelsea_jpeg)) + chelsea_jpeg)
        hold_until(lambda: in_flight(server.url) == 1, "the /predict admitted")
        connection.sendall(b"GET /info HTTP/1.1\r\nHost: x\r\n\r\n" * 4)
        time.sleep(0.2)
        connection.close()
        wait_until(lambda: added(before, request_counts(server.url)).get("499") == 1, "the /predict counted 499")
        # Its image waits in the stopped worker's pipe: it keeps its admission slot until the worker drops it.
        assert in_flight(server.url) == 1
    hold_until(lambda: in_flight(server.url) == 0, "the /predict's slot freed once the worker dropped it", timeout=10)
    assert "200" not in added(before, request_counts(server.url)), "nothing pipelined behind it ran"
    assert not server_errors_logged(log)


@pytest.mark.parametrize("name", list(FRAMING_ABUSE))
def test_framing_abuse_on_predict_gets_a_4xx_or_a_close_and_costs_nothing_lasting(server, log, name) -> None:
    payload, status = FRAMING_ABUSE[name]
    rss_before = http_process_rss_mb(server)
    reply = exchange_once(server.port, payload.replace(b"POST / ", b"POST /predict ").replace(b"GET / ", b"GET /info "))
    assert reply.startswith(status), reply[:300]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert http_process_rss_mb(server) - rss_before < 10
    assert not server_errors_logged(log)
