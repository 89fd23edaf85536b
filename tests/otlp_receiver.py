"""A real OTLP/gRPC trace receiver for the tests: the collector's ``TraceService/Export``, served by
grpc on a free loopback port, keeping every span it is sent as a plain ``SpanRecord``.

``with OtlpReceiver() as receiver:`` then point the exporter at ``receiver.endpoint`` and wait for
spans with ``receiver.wait_for(predicate, timeout)``. The protocol classes are opentelemetry-proto's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue


@dataclass(frozen=True)
class SpanRecord:
    """One exported span: ids in lower-case hex (``parent_span_id`` "" for a root), times in epoch ns."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind: 1 internal, 2 server
    attributes: dict
    resource: dict
    start_ns: int
    end_ns: int
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str


def any_value(value: AnyValue) -> object:
    choice = value.WhichOneof("value")
    if choice == "array_value":
        return [any_value(item) for item in value.array_value.values]
    if choice == "kvlist_value":
        return key_values(value.kvlist_value.values)
    return None if choice is None else getattr(value, choice)


def key_values(pairs: list[KeyValue]) -> dict:
    return {pair.key: any_value(pair.value) for pair in pairs}


def span_records(request: trace_service_pb2.ExportTraceServiceRequest) -> list[SpanRecord]:
    records = []
    for resource_spans in request.resource_spans:
        resource = key_values(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                records.append(
                    SpanRecord(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        name=span.name,
                        kind=span.kind,
                        attributes=key_values(span.attributes),
                        resource=resource,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        status_code=span.status.code,
                        status_message=span.status.message,
                    )
                )
    return records


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(self, request, context) -> trace_service_pb2.ExportTraceServiceResponse:
        self.receiver.add(span_records(request))
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """The receiver, on ``127.0.0.1:<free port>`` from ``start`` (or ``with``) to ``stop``."""

    def __init__(self) -> None:
        self._spans: list[SpanRecord] = []
        self._changed = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def start(self) -> OtlpReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None).wait()

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def add(self, records: list[SpanRecord]) -> None:
        with self._changed:
            self._spans.extend(records)
            self._changed.notify_all()

    def spans(self, trace_id: str | None = None) -> list[SpanRecord]:
        """What arrived so far (of one trace, if ``trace_id``)."""
        with self._changed:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def clear(self) -> None:
        with self._changed:
            self._spans.clear()

    def wait_for(
        self, predicate: Callable[[list[SpanRecord]], bool], timeout: float = 15.0, trace_id: str | None = None
    ) -> list[SpanRecord]:
        """The spans (of ``trace_id``, if given) once ``predicate`` holds for them; ``AssertionError``
        with what did arrive after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                spans = [s for s in self._spans if trace_id is None or s.trace_id == trace_id]
                if predicate(spans):
                    return spans
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    names = sorted((s.name, s.resource.get("vision_serve.role")) for s in spans)
                    raise AssertionError(f"the spans received within {timeout:g} s do not match: {names}")
                self._changed.wait(remaining)
