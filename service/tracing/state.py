"""Whether this process traces, and the span the current request runs in: what the request path reads.

Nothing here imports OpenTelemetry. ``TRACING.on`` is the one attribute every traced call site
checks first; it is ``False`` until ``configure_tracing`` (service/tracing/setup.py) made a backend in
this process, so a server with tracing off pays that check and nothing else.
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.tracing.otel import OtelBackend


class TracingSwitch:
    """``on``: this process exports spans; ``backend``: what makes them (None while off)."""

    __slots__ = ("backend", "on")

    def __init__(self) -> None:
        self.on = False
        self.backend: OtelBackend | None = None


TRACING = TracingSwitch()

# The span of the request being handled in this task (its SERVER span, or the ``wait_span`` within
# it); None when the request is not traced. Set by the HTTP observer and the gRPC ModelInfer handler.
CURRENT_SPAN: contextvars.ContextVar[object | None] = contextvars.ContextVar("vision_serve_span", default=None)
