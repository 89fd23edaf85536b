"""Turning tracing on in one process, and off at its end with its last spans exported.

``configure_tracing`` runs once in each HTTP process (service/http/process.py) and each inference
worker (service/worker/entry.py), never in the main process (the HTTP processes fork from it, and an
exporter's thread does not survive a fork). It imports OpenTelemetry only when the rate is above 0.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading

from service.tracing.state import TRACING

logger = logging.getLogger(__name__)

# Longest wait for the last spans to reach the collector when a process ends normally, and when a
# worker gets SIGTERM (LitServe's shutdown kills a worker 5 s after its SIGTERM).
SHUTDOWN_TIMEOUT_S = 5.0
TERMINATE_FLUSH_TIMEOUT_S = 2.0
MISSING_EXTRA = (
    "--trace-sample-rate > 0 needs OpenTelemetry, the `tracing` extra: pip install 'vision-serve[tracing]' "
    "(or set --trace-sample-rate 0)."
)

_atexit_registered = False
_lock = threading.Lock()


def configure_tracing(sample_rate: float, endpoint: str, role: str, *, worker_id: int | None = None) -> None:
    """Trace ``sample_rate`` of this process's requests (a client's traceparent decides for its own)
    and export the spans to the OTLP/gRPC collector at ``endpoint`` (``http://host:4317``: plaintext).

    ``role`` tells the processes apart in the spans' resource (``http-0``, ``worker-3``), with the
    pid; ``service.name`` is vision-serve unless ``OTEL_SERVICE_NAME`` says otherwise. A rate of 0
    does nothing (and imports nothing). Called again, it replaces the previous configuration.
    """
    global _atexit_registered
    if sample_rate <= 0:
        return
    try:
        from service.tracing.otel import OtelBackend
    except ImportError as exc:
        raise RuntimeError(MISSING_EXTRA) from exc
    with _lock:
        if TRACING.backend is not None:
            _shut_down(SHUTDOWN_TIMEOUT_S)
        TRACING.backend = OtelBackend(sample_rate, endpoint, role, worker_id)
        TRACING.on = True
        if not _atexit_registered:  # a spawned worker's normal exit; forked processes call shutdown_tracing
            atexit.register(shutdown_tracing)
            _atexit_registered = True
    logger.info("Tracing %g of requests to %s (OTLP/gRPC) as %s.", sample_rate, endpoint, role)


def shutdown_tracing(timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Stop tracing here, after exporting what is queued (waiting at most ``timeout_s``). Safe to call
    when tracing is off, and more than once."""
    with _lock:
        _shut_down(timeout_s)


def _shut_down(timeout_s: float) -> None:
    backend = TRACING.backend
    TRACING.on = False  # first: no new spans while the last ones leave
    TRACING.backend = None
    if backend is not None:
        try:
            backend.shutdown(timeout_s)
        except Exception:  # a process that ends must not fail for its spans
            logger.warning("Exporting the last spans failed.", exc_info=True)


def flush_on_terminate() -> None:
    """On SIGTERM (how the main process stops a worker), export the last spans before dying of it as
    before. Only where tracing is on; call it from the main thread."""
    if not TRACING.on:
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_terminate(signum: int, _frame: object) -> None:
        # Not under _lock: a signal handler must not wait on a lock its own thread may hold.
        _shut_down(TERMINATE_FLUSH_TIMEOUT_S)
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_terminate)
