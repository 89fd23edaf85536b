"""The HTTP process's side: a traced request's SERVER span, its stage spans, and the traceparent its
images carry to the workers. Nothing here imports OpenTelemetry.

Every function checks ``TRACING.on`` first: with tracing off each call is one attribute check and
returns the shared ``NO_SPAN`` (or None). With tracing on, a request the sampler dropped has no
current span, and the calls return the same no-op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from contextvars import Token
from types import TracebackType

from service.tracing.state import CURRENT_SPAN, TRACING

TRACE_HEADERS = frozenset({"traceparent", "tracestate"})  # W3C Trace Context
WAIT = "wait"  # the span ``wait_span`` makes: images sent to the workers until the last answer


class _NoSpan:
    """What ``stage_span`` and ``wait_span`` return when there is nothing to trace: one shared object."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        return None


NO_SPAN = _NoSpan()


class _StageSpan:
    """A child span of the current one for the ``with`` block; ``current``: it is the current span
    inside the block (``current_traceparent`` then names it)."""

    __slots__ = ("current", "name", "parent", "span", "token")

    def __init__(self, name: str, parent: object, current: bool) -> None:
        self.name, self.parent, self.current = name, parent, current
        self.span: object | None = None
        self.token: Token | None = None

    def __enter__(self) -> None:
        backend = TRACING.backend
        if backend is None:  # shut down since the request started
            return
        self.span = backend.start_child(self.parent, self.name)
        if self.current:
            self.token = CURRENT_SPAN.set(self.span)

    def __exit__(self, kind: type | None, error: BaseException | None, traceback: TracebackType | None) -> None:
        if self.token is not None:
            CURRENT_SPAN.reset(self.token)
        backend = TRACING.backend
        if self.span is not None and backend is not None:
            backend.end(self.span, error)


def stage_span(name: str) -> contextlib.AbstractContextManager[None]:
    """``with stage_span("parse"): ...``: a span for one stage of the current request in this process
    ("parse", "admission", "answer"); the shared no-op when tracing is off or the request is not traced."""
    if not TRACING.on:
        return NO_SPAN
    parent = CURRENT_SPAN.get()
    return NO_SPAN if parent is None else _StageSpan(name, parent, current=False)


def wait_span() -> contextlib.AbstractContextManager[None]:
    """``with wait_span(): ...`` around sending a request's images to the workers and awaiting their
    answers. Inside the block it is the current span, so the ``current_traceparent()`` given to each
    ``ImageRequest`` names it and the workers' spans (queue, preprocess, engine) become its children."""
    if not TRACING.on:
        return NO_SPAN
    parent = CURRENT_SPAN.get()
    return NO_SPAN if parent is None else _StageSpan(WAIT, parent, current=True)


def current_traceparent() -> str | None:
    """The W3C traceparent of the current request's current span (``wait_span``'s inside one, else
    the request's SERVER span), for ``ImageRequest.trace_parent``; None when not traced."""
    if not TRACING.on:
        return None
    span = CURRENT_SPAN.get()
    backend = TRACING.backend
    return None if span is None or backend is None else backend.traceparent(span)


class ServerSpan:
    """A traced request's SERVER span, current in its task until ``end``."""

    __slots__ = ("span", "token")

    def __init__(self, span: object) -> None:
        self.span = span
        self.token = CURRENT_SPAN.set(span)

    def end(self, attributes: Mapping[str, str | int], failed: bool) -> None:
        """Set the outcome's ``attributes`` and end it (``failed``: status ERROR); call it in the task
        that started it."""
        CURRENT_SPAN.reset(self.token)
        backend = TRACING.backend
        if backend is not None:
            backend.end_server(self.span, attributes, failed)


def start_server_span(
    name: str, headers: Iterable[tuple[str, str]], attributes: Mapping[str, str | int]
) -> ServerSpan | None:
    """The request's SERVER span, a child of the client's ``traceparent`` among ``headers`` (HTTP
    headers or gRPC metadata, names in lower case) if it sent one; None when tracing is off or the
    sampler drops it (a client's sampled flag 00 is honoured)."""
    backend = TRACING.backend
    if not TRACING.on or backend is None:
        return None
    carrier = {name: value for name, value in headers if name in TRACE_HEADERS}
    span = backend.start_server(name, carrier, attributes)
    return None if span is None else ServerSpan(span)


_RAW_TRACE_HEADERS = frozenset(name.encode() for name in TRACE_HEADERS)


def http_headers(raw: Iterable[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """An ASGI scope's trace headers, decoded, for ``start_server_span``."""
    return [(name.decode("latin-1"), value.decode("latin-1")) for name, value in raw if name in _RAW_TRACE_HEADERS]
