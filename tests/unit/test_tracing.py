"""service/tracing/: off costs nothing and imports nothing; on, the spans reach a real OTLP/gRPC receiver
(tests/otlp_receiver.py) with the client's traceparent honoured, the HTTP side's stages and current
traceparent right, and the worker's batch spans as children of the span the HTTP process named.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from starlette.responses import PlainTextResponse

from service.http.base.observer import HttpObserver
from service.tracing import (
    ENGINE,
    NO_SPAN,
    PREPROCESS,
    TRACING,
    configure_tracing,
    current_traceparent,
    record_batch,
    shutdown_tracing,
    stage_span,
    start_server_span,
    trace_batch,
    wait_span,
)
from service.wire import ImageRequest
from tests.otlp_receiver import OtlpReceiver, SpanRecord

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SERVER_KIND = 2
TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def client_traceparent(flags: str = "01", trace_id: str = TRACE_ID) -> str:
    return f"00-{trace_id}-{CLIENT_SPAN}-{flags}"


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as running:
        yield running


@pytest.fixture
def tracing(receiver):
    """``tracing(rate, role="http-0", **kwargs)`` turns tracing on here; it is shut down after the test."""
    receiver.clear()

    def configure(rate: float, role: str = "http-0", **kwargs: object) -> None:
        configure_tracing(rate, receiver.endpoint, role, **kwargs)

    yield configure
    shutdown_tracing()


def by_name(spans: list[SpanRecord]) -> dict[str, SpanRecord]:
    return {span.name: span for span in spans}


OFF_PATH = """
import asyncio, sys
# The `tracing` extra is not installed here. (FastAPI itself depends on opentelemetry-api, so the API
# may be loaded; the SDK, the exporter and our module that uses them must not be.)
EXTRA = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.proto")
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.startswith(EXTRA):
            raise ImportError(f"{name}: the tracing extra is not installed")
sys.meta_path.insert(0, Blocked())
from service.tracing import NO_SPAN, TRACING, configure_tracing, current_traceparent, stage_span, trace_batch, wait_span
from service.http.base.observer import HttpObserver
import service.http.process, service.http.grpc.service, service.worker.entry
from service.wire import ImageRequest

configure_tracing(0.0, "", "http-0")
assert not TRACING.on
assert stage_span("parse") is NO_SPAN and wait_span() is NO_SPAN and current_traceparent() is None
request = ImageRequest(b"x", queued_at=1.0, trace_parent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
assert trace_batch([request], 2.0) is None

async def app(scope, receive, send):
    assert stage_span("parse") is NO_SPAN and current_traceparent() is None
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})

async def nothing(message):
    pass

headers = [(b"traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")]
scope = {"type": "http", "method": "POST", "path": "/predict", "headers": headers}
asyncio.run(HttpObserver(app, ["/predict"])(scope, None, nothing))
loaded = sorted(name for name in sys.modules if name.startswith(EXTRA) or name == "service.tracing.otel")
print("LOADED", loaded)
sys.exit(1 if loaded else 0)
"""

ONLY_TRACING = """
import sys
import service.tracing, service.http.base.observer
loaded = sorted(name for name in sys.modules if name.partition(".")[0] == "opentelemetry")
sys.exit(f"LOADED {loaded}" if loaded else 0)
"""


def test_off_imports_no_opentelemetry_and_every_call_is_a_no_op() -> None:
    """A traced request through the observer, the HTTP process's and the worker's modules, tracing off:
    OpenTelemetry is never imported (a server without the `tracing` extra runs)."""
    run = subprocess.run([sys.executable, "-c", OFF_PATH], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    # And service/tracing/ itself imports no part of OpenTelemetry, the API included.
    run = subprocess.run([sys.executable, "-c", ONLY_TRACING], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]


MISSING_EXTRA = """
import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "opentelemetry":
            raise ImportError(f"{name} is not installed")
sys.meta_path.insert(0, Blocked())
from service.tracing import configure_tracing
try:
    configure_tracing(1.0, "http://127.0.0.1:4317", "http-0")
except RuntimeError as exc:
    print(exc)
    sys.exit(0)
sys.exit(1)
"""


def test_on_without_the_extra_says_how_to_install_it() -> None:
    run = subprocess.run([sys.executable, "-c", MISSING_EXTRA], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "pip install 'vision-serve[tracing]'" in run.stdout


def test_a_sampled_client_traceparent_parents_the_request_and_its_stages(tracing, receiver) -> None:
    tracing(1e-12)  # roots are (almost) never sampled: the client's flag decides here
    server = start_server_span("POST /predict", [("traceparent", client_traceparent())], {"http.route": "/predict"})
    assert server is not None
    outside = current_traceparent()
    with stage_span("parse"):
        pass
    with wait_span():
        inside = current_traceparent()
    assert current_traceparent() == outside  # the wait span is current only inside its block
    server.end({"http.response.status_code": 200}, failed=False)
    assert current_traceparent() is None  # the request's span is no longer current
    shutdown_tracing()

    spans = by_name(receiver.spans(TRACE_ID))
    assert set(spans) == {"POST /predict", "parse", "wait"}
    root = spans["POST /predict"]
    assert root.parent_span_id == CLIENT_SPAN and root.kind == SERVER_KIND
    assert root.attributes == {"http.route": "/predict", "http.response.status_code": 200}
    assert spans["parse"].parent_span_id == root.span_id and spans["wait"].parent_span_id == root.span_id
    assert outside == f"00-{TRACE_ID}-{root.span_id}-01"
    assert inside == f"00-{TRACE_ID}-{spans['wait'].span_id}-01"
    assert root.resource["service.name"] == "vision-serve" and root.resource["vision_serve.role"] == "http-0"
    assert root.resource["process.pid"] == os.getpid()


def test_a_client_that_does_not_sample_gets_no_span_whatever_the_rate(tracing, receiver) -> None:
    tracing(1.0)
    assert start_server_span("POST /predict", [("traceparent", client_traceparent("00"))], {}) is None
    assert stage_span("parse") is NO_SPAN and wait_span() is NO_SPAN and current_traceparent() is None
    shutdown_tracing()
    assert receiver.spans(TRACE_ID) == []


def test_without_a_traceparent_the_rate_decides(tracing, receiver) -> None:
    tracing(1e-12)
    assert start_server_span("POST /predict", [], {}) is None
    tracing(1.0)
    server = start_server_span("POST /predict", [("x-other", "1")], {})
    assert server is not None
    match = TRACEPARENT.fullmatch(current_traceparent())
    assert int(match.group(3), 16) & 1  # sampled (the SDK also sets W3C level 2's random-id flag, 02)
    server.end({}, failed=True)
    shutdown_tracing()
    (root,) = receiver.spans(match.group(1))
    assert root.parent_span_id == "" and root.span_id == match.group(2)
    assert root.status_code == 2  # failed: ERROR


def test_a_stage_that_raises_is_an_error_span(tracing, receiver) -> None:
    tracing(1.0)
    server = start_server_span("POST /predict", [("traceparent", client_traceparent())], {})
    with pytest.raises(ValueError), stage_span("parse"):
        raise ValueError("not an image")
    server.end({}, failed=False)
    shutdown_tracing()
    parse = by_name(receiver.spans(TRACE_ID))["parse"]
    assert parse.status_code == 2 and "not an image" in parse.status_message


def test_the_observer_traces_the_inference_routes_and_nothing_else(tracing, receiver) -> None:
    tracing(1.0)
    seen: dict[str, str | None] = {}

    async def app(scope, receive, send):
        with stage_span("parse"):
            seen[scope["path"]] = current_traceparent()
        await PlainTextResponse("ok", status_code=503 if scope["path"] == "/predict" else 200)(scope, receive, send)

    observer = HttpObserver(app, ["/predict"])

    async def go() -> None:
        transport = httpx.ASGITransport(app=observer)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            headers = {"traceparent": client_traceparent(), "x-request-id": "req-1"}
            await client.post("/predict", headers=headers)
            await client.post("/v2/models/resnet50/versions/2/infer", headers=headers)
            await client.get("/health", headers=headers)

    asyncio.run(go())
    shutdown_tracing()
    assert seen["/health"] is None  # not an inference route: no span, nothing current
    spans = receiver.spans(TRACE_ID)
    roots = {span.name: span for span in spans if span.kind == SERVER_KIND}
    assert set(roots) == {"POST /predict", "POST /v2/models/{name}/versions/{version}/infer"}
    predict = roots["POST /predict"]
    assert predict.attributes == {
        "http.request.method": "POST",
        "http.route": "/predict",
        "url.path": "/predict",
        "request.id": "req-1",
        "http.response.status_code": 503,
    }
    assert predict.status_code == 2 and predict.parent_span_id == CLIENT_SPAN  # a 5xx is the server's failure
    oip = roots["POST /v2/models/{name}/versions/{version}/infer"]
    assert oip.attributes["model"] == "resnet50" and oip.status_code == 0
    assert seen["/predict"] == f"00-{TRACE_ID}-{predict.span_id}-01"
    parents = {span.parent_span_id: span for span in spans if span.name == "parse"}
    assert set(parents) == {predict.span_id, oip.span_id}
    for root in (predict, oip):
        assert root.start_ns <= parents[root.span_id].start_ns <= parents[root.span_id].end_ns <= root.end_ns


def test_the_worker_records_a_batch_as_children_of_each_requests_http_span(tracing, receiver) -> None:
    tracing(1.0, role="worker-3", worker_id=3)
    http_span = "a1b2c3d4e5f60718"
    parent = f"00-{TRACE_ID}-{http_span}-01"
    other_trace = "0af7651916cd43dd8448eb211c80319c"
    admitted = time.monotonic()
    other_parent = f"00-{other_trace}-{http_span}-01"
    requests = [
        ImageRequest(b"a", queued_at=admitted, request_id="r1", trace_parent=parent),
        ImageRequest(b"b", queued_at=admitted),  # not traced
        ImageRequest(b"c", queued_at=admitted, request_id="r3", trace_parent=other_parent),
        ImageRequest(b"d", queued_at=admitted, request_id="r1", trace_parent=parent),  # r1's second image
    ]
    taken = admitted + 0.010
    trace = trace_batch(requests, taken)
    assert [(r.index, r.request_id) for r in trace.requests] == [(0, "r1"), (2, "r3"), (3, "r1")]
    start = time.perf_counter()
    stages = [(PREPROCESS, start, start + 0.002), (ENGINE, start + 0.002, start + 0.005)]
    before_ns = time.time_ns()
    record_batch(trace, stages, {"batch.size": 4, "model": "m", "engine": "eager"}, failed={2: "not a JPEG"})
    shutdown_tracing()

    traced = receiver.spans(TRACE_ID)
    assert len(traced) == 3  # one set for r1, whose two images shared the batch
    spans = by_name(traced)
    assert set(spans) == {"queue", PREPROCESS, ENGINE}
    assert all(span.parent_span_id == http_span for span in spans.values())
    assert spans["queue"].attributes == {
        "batch.size": 4,
        "model": "m",
        "engine": "eager",
        "worker.id": 3,
        "images": 2,
        "request.id": "r1",
    }
    assert spans["queue"].resource["vision_serve.role"] == "worker-3"
    queue, preprocess, engine = spans["queue"], spans[PREPROCESS], spans[ENGINE]
    assert queue.end_ns - queue.start_ns == pytest.approx(10_000_000, abs=50_000)
    assert preprocess.end_ns - preprocess.start_ns == pytest.approx(2_000_000, abs=50_000)
    assert preprocess.end_ns == pytest.approx(engine.start_ns, abs=50_000)
    # The monotonic and perf_counter times became epoch ns: the stages lie around now.
    assert abs(preprocess.start_ns - before_ns) < 50_000_000
    # The image that did not decode: an error at preprocess, and no engine span.
    failed = by_name(receiver.spans(other_trace))
    assert set(failed) == {"queue", PREPROCESS}
    assert failed[PREPROCESS].status_code == 2 and failed[PREPROCESS].status_message == "not a JPEG"


def test_a_request_with_one_bad_image_of_two_has_an_error_preprocess_and_an_engine_run(tracing, receiver) -> None:
    tracing(1.0, role="worker-0", worker_id=0)
    parent = client_traceparent()
    requests = [ImageRequest(b"a", queued_at=1.0, trace_parent=parent), ImageRequest(b"b", trace_parent=parent)]
    start = time.perf_counter()
    stages = [(PREPROCESS, start, start + 0.001), (ENGINE, start + 0.001, start + 0.002)]
    record_batch(trace_batch(requests, 2.0), stages, {"batch.size": 2}, failed={1: "truncated"})
    shutdown_tracing()
    spans = by_name(receiver.spans(TRACE_ID))
    assert set(spans) == {"queue", PREPROCESS, ENGINE}
    assert (spans[PREPROCESS].status_code, spans[PREPROCESS].status_message) == (2, "truncated")
    assert spans[ENGINE].status_code == 0 and spans[ENGINE].attributes["images"] == 2


def test_a_batch_without_traced_requests_costs_nothing(tracing) -> None:
    tracing(1.0, role="worker-0")
    assert trace_batch([ImageRequest(b"a", queued_at=1.0), ImageRequest(b"b")], 2.0) is None


def test_otel_service_name_wins(monkeypatch) -> None:
    from service.tracing.otel import process_resource

    assert process_resource("http-0", None).attributes["service.name"] == "vision-serve"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "classifier-eu")
    resource = process_resource("worker-1", 1)
    assert resource.attributes["service.name"] == "classifier-eu"
    assert resource.attributes["vision_serve.worker.id"] == 1


def test_shutdown_turns_tracing_off_and_is_safe_twice(tracing) -> None:
    tracing(1.0)
    assert TRACING.on
    shutdown_tracing()
    shutdown_tracing()
    assert not TRACING.on and TRACING.backend is None
    assert start_server_span("POST /predict", [("traceparent", client_traceparent())], {}) is None


KILLED_WORKER = """
import os, signal, sys
from service.tracing import configure_tracing, flush_on_terminate, start_server_span
configure_tracing(1.0, sys.argv[1], "worker-0", worker_id=0)
flush_on_terminate()
span = start_server_span("POST /predict", [("traceparent", sys.argv[2])], {})
span.end({}, failed=False)
os.kill(os.getpid(), signal.SIGTERM)
signal.pause()
"""


def test_a_worker_stopped_by_sigterm_exports_its_last_spans_and_dies_of_it(receiver) -> None:
    receiver.clear()
    env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "600000"}  # nothing leaves before the flush
    run = subprocess.run(
        [sys.executable, "-c", KILLED_WORKER, receiver.endpoint, client_traceparent()],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert run.returncode == -signal.SIGTERM, run.stderr[-3000:]
    (span,) = receiver.spans(TRACE_ID)
    assert span.name == "POST /predict" and span.resource["vision_serve.role"] == "worker-0"
