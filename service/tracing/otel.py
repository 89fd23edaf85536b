"""Every use of OpenTelemetry, in one module that only ``configure_tracing`` imports (tracing on).

``OtelBackend`` owns this process's ``TracerProvider`` (not the global one: a library in the same
process keeps its own), its sampler (``ParentBased(TraceIdRatioBased(rate))``: a client's W3C
traceparent decides for its own request, the rate for the others), its ``BatchSpanProcessor`` (the
``OTEL_BSP_*`` variables tune it) and OTLP/gRPC exporter. The rest of service/tracing/ holds its
spans as opaque objects and calls the methods below.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from service.tracing.stages import PREPROCESS, QUEUE, BatchTrace, Stage, TracedRequest

DEFAULT_SERVICE_NAME = "vision-serve"
INSTRUMENTATION = "vision-serve"
Attributes = Mapping[str, str | int | float | bool]


def process_resource(role: str, worker_id: int | None) -> Resource:
    """``service.name`` vision-serve unless ``OTEL_SERVICE_NAME`` (or ``OTEL_RESOURCE_ATTRIBUTES``)
    names one, plus what tells this process apart: its role (``http-0``, ``worker-3``) and pid."""
    attributes: dict[str, str | int] = {"vision_serve.role": role, "process.pid": os.getpid()}
    if worker_id is not None:
        attributes["vision_serve.worker.id"] = worker_id
    resource = Resource.create(attributes)
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return resource


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    """The W3C ``traceparent`` header value (version 00) of a span."""
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


def by_trace_parent(requests: Sequence[TracedRequest]) -> dict[str, list[TracedRequest]]:
    """A batch's traced images by request (their traceparent), in batch order."""
    groups: dict[str, list[TracedRequest]] = {}
    for request in requests:
        groups.setdefault(request.trace_parent, []).append(request)
    return groups


class OtelBackend:
    """This process's spans: made by ``configure_tracing``, ended by ``shutdown``."""

    def __init__(self, sample_rate: float, endpoint: str, role: str, worker_id: int | None = None) -> None:
        self.provider = TracerProvider(
            resource=process_resource(role, worker_id),
            sampler=ParentBased(root=TraceIdRatioBased(sample_rate)),
            shutdown_on_exit=False,  # shutdown_tracing does it, with a bounded wait
        )
        # http:// is a plaintext collector; for anything else the exporter decides (https: TLS, or the
        # OTEL_EXPORTER_OTLP_INSECURE variable).
        insecure = True if endpoint.startswith("http://") else None
        self.processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=insecure))
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer(INSTRUMENTATION)
        self.propagator = TraceContextTextMapPropagator()
        self.worker_attributes: dict[str, int] = {} if worker_id is None else {"worker.id": worker_id}

    # -- the HTTP process: a request's SERVER span and its stages ----------------------------------
    def start_server(self, name: str, carrier: Mapping[str, str], attributes: Attributes) -> Span | None:
        """A request's SERVER span, the child of the client's ``traceparent`` in ``carrier`` if any;
        None when the sampler drops it (the client's flag 00, or outside the rate)."""
        parent = self.propagator.extract(carrier) if carrier else None
        span = self.tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)
        return span if span.is_recording() else None

    def start_child(self, parent: Span, name: str) -> Span:
        return self.tracer.start_span(name, context=set_span_in_context(parent))

    @staticmethod
    def traceparent(span: Span) -> str:
        context = span.get_span_context()
        return format_traceparent(context.trace_id, context.span_id, context.trace_flags)

    @staticmethod
    def end(span: Span, error: BaseException | None = None) -> None:
        """End ``span``; ``error``: what escaped it (recorded, and the span's status is ERROR)."""
        if error is not None:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:300]))
        span.end()

    @staticmethod
    def end_server(span: Span, attributes: Attributes, failed: bool) -> None:
        span.set_attributes(attributes)
        if failed:
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    # -- the worker: one batch's stages, for each traced request in it ------------------------------
    def record_batch(
        self, trace: BatchTrace, stages: Sequence[Stage], attributes: Attributes, failed: Mapping[int, str]
    ) -> None:
        """Spans with the batch's own timestamps, children of each traced request's HTTP span:
        ``queue`` (admission in the HTTP process to the batch's start), then ``stages``. One set per
        request, however many of its images the batch holds (``images``: how many). ``failed``
        (index -> why: the image did not decode) marks the request's ``preprocess`` ERROR; a request
        none of whose images decoded ends there."""
        # Clock offsets taken once per batch: monotonic (system-wide on Linux, so the HTTP process's
        # queued_at reads on it) and perf_counter times become epoch nanoseconds.
        now_ns = time.time_ns()
        monotonic_offset = now_ns - time.monotonic_ns()
        perf_offset = now_ns - time.perf_counter_ns()
        taken_ns = int(trace.taken_at * 1e9) + monotonic_offset
        stage_ns = [(name, int(start * 1e9) + perf_offset, int(end * 1e9) + perf_offset) for name, start, end in stages]
        common = {**attributes, **self.worker_attributes}
        for trace_parent, requests in by_trace_parent(trace.requests).items():
            parent = self.propagator.extract({"traceparent": trace_parent})
            first = requests[0]
            span_attributes = {**common, "images": len(requests)}
            if first.request_id:
                span_attributes["request.id"] = first.request_id
            if first.queued_at is not None:  # the same for all of them: admitted together
                start = int(first.queued_at * 1e9) + monotonic_offset
                self._span(parent, QUEUE, min(start, taken_ns), taken_ns, span_attributes)
            errors = [failed[r.index] for r in requests if r.index in failed]
            for name, start, end in stage_ns:
                if errors and name == PREPROCESS:
                    why = errors[0] if len(errors) == 1 else f"{len(errors)} images did not decode; first: {errors[0]}"
                    self._span(parent, name, start, end, span_attributes, why)
                    if len(errors) == len(requests):
                        break  # none of its images went further
                    continue
                self._span(parent, name, start, end, span_attributes)

    def _span(
        self, parent: object, name: str, start_ns: int, end_ns: int, attributes: Attributes, error: str | None = None
    ) -> None:
        span = self.tracer.start_span(name, context=parent, start_time=start_ns, attributes=attributes)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error[:300]))
        span.end(end_time=max(start_ns, end_ns))

    def shutdown(self, timeout_s: float) -> None:
        """Export what is queued and stop, waiting at most ``timeout_s`` (a collector that does not
        answer must not hold up a process that ends: the exporter itself would retry for longer)."""
        stopping = threading.Thread(target=self.provider.shutdown, name="vision-serve-trace-shutdown", daemon=True)
        stopping.start()
        stopping.join(timeout_s)
