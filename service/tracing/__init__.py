"""OpenTelemetry tracing of one request across the HTTP process and the inference worker, exported
over OTLP/gRPC (``--trace-sample-rate R --otlp-endpoint http://collector:4317``).

One traced ``POST /predict`` is one trace:

    POST /predict                 SERVER, HTTP process: the observer (service/http/base/observer.py)
    ├── parse                     the body read and parsed       (stage_span, pipeline/pipeline.py)
    ├── cache                     the response cache's lookup     (stage_span, cache/front.py; when on)
    ├── admission                 --max-queue's gate              (stage_span, base/admission.py)
    ├── wait                      images sent until the last answer (wait_span, pipeline/submit.py)
    │   ├── queue                 worker: admission to its batch's start   } one set per image,
    │   ├── preprocess            worker: decode and resize of the batch   } recorded by the worker
    │   ├── pipeline_wait         worker (--pipeline-depth 2+): prepared, waiting for the engine
    │   └── engine                worker: the model run           } batch.size, worker.id, model, engine
    └── answer                    the answer rendered            (stage_span, predict/routes.py)

The Open Inference Protocol's infer paths get the same SERVER span (named ``POST /v2/models/{name}/infer``),
and gRPC's ModelInfer one named ``inference.GRPCInferenceService/ModelInfer`` (service/http/grpc/service.py).

- **Sampling**: ``ParentBased(TraceIdRatioBased(R))``. A client that sends a W3C ``traceparent``
  (HTTP header, or gRPC metadata) decides for its own request: flag 01 traced, 00 not, whatever R;
  its span is the SERVER span's parent. Other requests are traced at rate R.
- **Across processes**: the HTTP process puts the traceparent of its current span (the ``wait``
  span) into each image's ``ImageRequest.trace_parent``; the worker records its spans as that span's
  children, with its own timestamps (service/tracing/batches.py). A request not traced carries None,
  and a batch with no traced request costs the worker nothing more.
- **Processes**: ``configure_tracing`` runs in each HTTP process and each worker (never in the main
  process), each with its own ``TracerProvider``, ``BatchSpanProcessor`` (``OTEL_BSP_*`` tune it)
  and exporter; the resource says ``service.name`` vision-serve (``OTEL_SERVICE_NAME`` wins),
  ``vision_serve.role`` (``http-0``, ``worker-3``) and ``process.pid``. ``shutdown_tracing`` exports
  the last spans as a process ends: the HTTP process's front end at its end, a worker at exit and on
  the SIGTERM that stops it (``flush_on_terminate``).
- **Off costs nothing**: with R = 0, OpenTelemetry is never imported (it is the optional ``tracing``
  extra), and each call below is one check of ``TRACING.on``; ``stage_span`` and ``wait_span`` then
  return one shared no-op object.

Use in the HTTP process's request path (the request's SERVER span is already current there)::

    with stage_span("parse"):
        parsed = await read_predict_request(request, limits)
    with wait_span():  # around sending the images and awaiting their answers
        trace_parent = current_traceparent()  # once per request; None when not traced
        ImageRequest(image, top_k, queued_at, request_id, trace_parent=trace_parent)

Module map: state.py (the switch and the current span: what every call site reads), requests.py (the
HTTP side), batches.py and stages.py (the worker side), setup.py (on and off), otel.py (every OpenTelemetry call;
imported only by ``configure_tracing``).
"""

from __future__ import annotations

from service.tracing.batches import record_batch, trace_batch
from service.tracing.requests import (
    NO_SPAN,
    ServerSpan,
    current_traceparent,
    http_headers,
    stage_span,
    start_server_span,
    wait_span,
)
from service.tracing.setup import configure_tracing, flush_on_terminate, shutdown_tracing
from service.tracing.stages import ENGINE, PIPELINE_WAIT, PREPROCESS, QUEUE, BatchTrace
from service.tracing.state import TRACING

__all__ = [
    "ENGINE",
    "NO_SPAN",
    "PIPELINE_WAIT",
    "PREPROCESS",
    "QUEUE",
    "TRACING",
    "BatchTrace",
    "ServerSpan",
    "configure_tracing",
    "current_traceparent",
    "flush_on_terminate",
    "http_headers",
    "record_batch",
    "shutdown_tracing",
    "stage_span",
    "start_server_span",
    "trace_batch",
    "wait_span",
]
