"""The inference worker's side: which requests of a batch are traced, and their spans once it ran.

``trace_batch`` is called as a batch starts preparing; it returns None (and does nothing per
request) when tracing is off in this worker. Otherwise it keeps the requests that carry a
``trace_parent`` (their HTTP span's W3C traceparent): the spans are recorded after the batch ran,
with the batch's own timestamps, by ``record_batch``. Nothing here imports OpenTelemetry.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from service.tracing.stages import BatchTrace, Stage, TracedRequest
from service.tracing.state import TRACING

if TYPE_CHECKING:
    from service.wire import ImageRequest

logger = logging.getLogger(__name__)


def trace_batch(requests: Sequence[ImageRequest], taken_at: float) -> BatchTrace | None:
    """The batch's traced requests; None when tracing is off here or none of them is traced."""
    if not TRACING.on:
        return None
    traced = [
        TracedRequest(i, request.trace_parent, request.queued_at, request.request_id)
        for i, request in enumerate(requests)
        if request.trace_parent
    ]
    return BatchTrace(traced, taken_at) if traced else None


def record_batch(
    trace: BatchTrace,
    stages: Sequence[Stage],
    attributes: Mapping[str, str | int | float | bool],
    failed: Mapping[int, str] | None = None,
) -> None:
    """Export each traced request's ``queue`` span and ``stages`` (with ``attributes``: batch size,
    model, engine); ``failed``: index -> why, for images that did not decode (their ``preprocess``
    span is an error, and they have no later stage). Never raises: tracing must not fail a batch."""
    backend = TRACING.backend
    if backend is None:  # shut down meanwhile (the worker is stopping)
        return
    try:
        backend.record_batch(trace, stages, attributes, failed or {})
    except Exception:
        logger.warning("Recording the spans of a batch failed; serving goes on.", exc_info=True)
