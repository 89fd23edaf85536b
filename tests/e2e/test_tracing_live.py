"""Tracing on a real server (EfficientNet-Lite0 on the CPU, loopback): one request is one trace across
the HTTP process and the inference worker, exported over OTLP/gRPC to a real receiver
(tests/otlp_receiver.py), with the client's W3C traceparent honoured on HTTP and gRPC.
"""

from __future__ import annotations

import os

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http

from service.client.launcher import ServerProcess, free_port
from tests.conftest import CAT_LABELS
from tests.otlp_receiver import OtlpReceiver, SpanRecord

MODEL = "efficientnet-lite0"
SERVER_KIND = 2
HTTP_STAGES = {"parse", "wait", "answer"}
WORKER_STAGES = {"queue", "preprocess", "engine"}
# Between processes, epoch times come from each process's own clock offsets: a little slack.
TOLERANCE_NS = 5_000_000


def new_trace() -> tuple[str, str]:
    """A client's trace id and span id."""
    return os.urandom(16).hex(), os.urandom(8).hex()


def names(spans: list[SpanRecord]) -> set[str]:
    return {span.name for span in spans}


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as running:
        yield running


def traced_server(receiver: OtlpReceiver, log_path, schedule_delay_ms: int, grpc_port: int = 0) -> ServerProcess:
    args = ["--model", MODEL, "--max-batch-size", "4", "--trace-sample-rate", "1", "--otlp-endpoint", receiver.endpoint]
    if grpc_port:
        args += ["--grpc-port", str(grpc_port)]
    # How long a process keeps its ended spans before it exports them (OpenTelemetry's own variable).
    return ServerProcess(args, log_path=log_path, env={"OTEL_BSP_SCHEDULE_DELAY": str(schedule_delay_ms)})


@pytest.fixture(scope="module")
def server(receiver, tmp_path_factory):
    grpc_port = free_port()
    log_path = tmp_path_factory.mktemp("tracing") / "server.log"
    with traced_server(receiver, log_path, schedule_delay_ms=100, grpc_port=grpc_port) as running:
        running.grpc_url = f"127.0.0.1:{grpc_port}"
        running.http_url = f"127.0.0.1:{running.port}"
        yield running


def predict(server: ServerProcess, image: bytes, headers: dict[str, str]) -> httpx.Response:
    response = httpx.post(
        f"{server.url}/predict", content=image, headers={"content-type": "image/jpeg", **headers}, timeout=60
    )
    assert response.status_code == 200, response.text
    return response


def one_trace(receiver: OtlpReceiver, trace_id: str, root_name: str, stages: set[str]) -> dict[str, SpanRecord]:
    """The trace's spans by name, once its root and ``stages`` all arrived; each name once."""
    spans = receiver.wait_for(lambda s: {root_name, *stages} <= names(s), trace_id=trace_id)
    assert len(spans) == len(names(spans)), sorted(s.name for s in spans)  # one image: each span once
    return {span.name: span for span in spans}


def assert_one_request_across_two_processes(spans: dict[str, SpanRecord], root_name: str) -> None:
    """The HTTP process's spans under the root, the worker's under the ``wait`` span that
    ``current_traceparent`` named for the image, with sane, nested timestamps."""
    root, wait = spans[root_name], spans["wait"]
    http = [root, *(spans[name] for name in HTTP_STAGES)]
    worker = [spans[name] for name in WORKER_STAGES]
    assert root.kind == SERVER_KIND
    assert all(span.parent_span_id == root.span_id for span in http[1:])
    assert all(span.parent_span_id == wait.span_id for span in worker)
    # Two processes: their resources say so.
    assert {span.resource["vision_serve.role"].partition("-")[0] for span in http} == {"http"}
    assert {span.resource["vision_serve.role"].partition("-")[0] for span in worker} == {"worker"}
    assert len({span.resource["process.pid"] for span in http}) == 1
    assert {span.resource["process.pid"] for span in worker}.isdisjoint({root.resource["process.pid"]})
    assert all(span.resource["service.name"] == "vision-serve" for span in http + worker)
    for span in worker:
        assert span.attributes["model"] == MODEL and span.attributes["engine"]
        assert span.attributes["batch.size"] >= 1 and isinstance(span.attributes["worker.id"], int)
    # Timestamps: each span ends after it starts; the worker's lie in the wait span, in stage order.
    assert all(span.start_ns <= span.end_ns for span in http + worker)
    assert all(root.start_ns <= span.start_ns and span.end_ns <= root.end_ns for span in http[1:])
    for span in worker:
        assert wait.start_ns - TOLERANCE_NS <= span.start_ns and span.end_ns <= wait.end_ns + TOLERANCE_NS, span
    queue, preprocess, engine = spans["queue"], spans["preprocess"], spans["engine"]
    assert queue.end_ns <= preprocess.start_ns + TOLERANCE_NS and preprocess.end_ns <= engine.start_ns + TOLERANCE_NS
    assert spans["parse"].end_ns <= wait.start_ns and wait.end_ns <= spans["answer"].start_ns


def test_a_predict_request_is_one_trace_across_the_http_process_and_the_worker(server, receiver, chelsea_jpeg) -> None:
    trace_id, client_span = new_trace()
    headers = {"traceparent": f"00-{trace_id}-{client_span}-01", "x-request-id": "traced-1"}
    response = predict(server, chelsea_jpeg, headers)
    assert response.json()["predictions"][0]["label"] in CAT_LABELS
    spans = one_trace(receiver, trace_id, "POST /predict", HTTP_STAGES | WORKER_STAGES)
    root = spans["POST /predict"]
    assert root.parent_span_id == client_span  # the client's span is the request's parent
    assert root.attributes["http.response.status_code"] == 200 and root.attributes["http.route"] == "/predict"
    assert root.attributes["request.id"] == "traced-1" == spans["queue"].attributes["request.id"]
    assert_one_request_across_two_processes(spans, "POST /predict")


def test_admission_is_a_stage_of_the_request(server, receiver, chelsea_jpeg) -> None:
    trace_id, client_span = new_trace()
    predict(server, chelsea_jpeg, {"traceparent": f"00-{trace_id}-{client_span}-01"})
    spans = one_trace(receiver, trace_id, "POST /predict", {"parse", "wait", "answer", "engine"})
    assert "admission" in spans and spans["admission"].parent_span_id == spans["POST /predict"].span_id
    assert spans["parse"].end_ns <= spans["admission"].start_ns <= spans["admission"].end_ns <= spans["wait"].start_ns


def test_a_client_that_does_not_sample_its_request_gets_no_spans(server, receiver, chelsea_jpeg) -> None:
    unsampled, client_span = new_trace()
    predict(server, chelsea_jpeg, {"traceparent": f"00-{unsampled}-{client_span}-00"})
    # A sampled request after it: once its spans are in, the other's would have been too.
    marker, _ = new_trace()
    predict(server, chelsea_jpeg, {"traceparent": f"00-{marker}-{client_span}-01"})
    one_trace(receiver, marker, "POST /predict", HTTP_STAGES | WORKER_STAGES)
    assert receiver.spans(unsampled) == []


def test_without_a_traceparent_the_rate_starts_a_trace(server, receiver, chelsea_jpeg) -> None:
    predict(server, chelsea_jpeg, {"x-request-id": "untraced-client-1"})

    def roots(spans: list[SpanRecord]) -> list[SpanRecord]:
        return [s for s in spans if s.kind == SERVER_KIND and s.attributes.get("request.id") == "untraced-client-1"]

    (root,) = roots(receiver.wait_for(roots))
    assert root.parent_span_id == ""  # a new trace, rooted here (--trace-sample-rate 1)
    spans = one_trace(receiver, root.trace_id, "POST /predict", HTTP_STAGES | WORKER_STAGES)
    assert_one_request_across_two_processes(spans, "POST /predict")


def bytes_input(module, image: bytes):
    tensor = module.InferInput("IMAGE", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([image], dtype=np.object_))
    return tensor


def test_a_grpc_model_infer_with_traceparent_metadata_joins_the_trace(server, receiver, chelsea_jpeg) -> None:
    trace_id, client_span = new_trace()
    client = triton_grpc.InferenceServerClient(server.grpc_url)
    result = client.infer(
        MODEL, [bytes_input(triton_grpc, chelsea_jpeg)], headers={"traceparent": f"00-{trace_id}-{client_span}-01"}
    )
    assert result.as_numpy("LABELS")[0, 0].decode() in CAT_LABELS
    root_name = "inference.GRPCInferenceService/ModelInfer"
    spans = one_trace(receiver, trace_id, root_name, HTTP_STAGES | WORKER_STAGES)
    root = spans[root_name]
    assert root.parent_span_id == client_span
    assert root.attributes["rpc.grpc.status_code"] == 0 and root.attributes["model"] == MODEL
    assert_one_request_across_two_processes(spans, root_name)


def test_an_oip_http_infer_with_traceparent_joins_the_trace(server, receiver, chelsea_jpeg) -> None:
    trace_id, client_span = new_trace()
    client = triton_http.InferenceServerClient(server.http_url)
    result = client.infer(
        MODEL, [bytes_input(triton_http, chelsea_jpeg)], headers={"traceparent": f"00-{trace_id}-{client_span}-01"}
    )
    assert result.as_numpy("LABELS")[0, 0].decode() in CAT_LABELS
    root_name = "POST /v2/models/{name}/infer"
    # No parse or answer stage here: the OIP HTTP route does not mark them.
    spans = receiver.wait_for(lambda s: {root_name, "wait", *WORKER_STAGES} <= names(s), trace_id=trace_id)
    by_name = {span.name: span for span in spans}
    assert by_name[root_name].parent_span_id == client_span and by_name[root_name].attributes["model"] == MODEL
    assert by_name["wait"].parent_span_id == by_name[root_name].span_id
    assert all(by_name[name].parent_span_id == by_name["wait"].span_id for name in WORKER_STAGES)


def test_a_stopped_server_exports_its_last_spans_from_every_process(tmp_path, chelsea_jpeg) -> None:
    """Spans still queued in the HTTP process and the worker when the server stops (SIGTERM) are
    exported as they end: nothing leaves before that here, the export delay being 10 minutes."""
    with OtlpReceiver() as receiver:
        server = traced_server(receiver, tmp_path / "server.log", schedule_delay_ms=600_000)
        with server:
            trace_id, client_span = new_trace()
            predict(server, chelsea_jpeg, {"traceparent": f"00-{trace_id}-{client_span}-01"})
            assert receiver.spans(trace_id) == []
        assert server.process.returncode == 0, server.log_tail()
        spans = one_trace(receiver, trace_id, "POST /predict", HTTP_STAGES | WORKER_STAGES)
        assert_one_request_across_two_processes(spans, "POST /predict")
