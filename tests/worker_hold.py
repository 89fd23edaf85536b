"""Hold an inference worker while requests queue, so that they share a batch whatever the machine's speed.

A batch window alone makes concurrent requests share a batch only if they all arrive within it,
which a loaded 2-core machine does not promise. Stopping the worker (SIGSTOP) while the requests
are admitted, then resuming it, does: every request is queued for it before it takes its next
batch, and the batch window only has to cover the hand-over of messages already sent.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Callable, Iterator

import httpx

HOLD_TIMEOUT_S = 60.0
# A held worker sends no heartbeat: the servers of the tests that hold one must not take it for hung
# (service/supervisor/pool/hangs.py: by default 5 s marks it unresponsive, 10 s kills it) while it is
# held, up to HOLD_TIMEOUT_S. tests/conftest.py sets it for every server the suite starts as a
# subprocess; tests/e2e/test_hung_workers.py gives its own.
HOLD_SAFE_ENV = {"VISION_SERVE_WORKER_HEARTBEAT_TIMEOUT_S": str(2 * HOLD_TIMEOUT_S)}


@contextlib.contextmanager
def worker_held(*pids: int) -> Iterator[None]:
    """The worker processes stopped for the block; resumed after it, also on error.

    Hold every worker that serves the route: one left running answers the requests meant to queue.
    """
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def wait_until(condition: Callable[[], bool], what: str, timeout: float = HOLD_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


def gauge(url: str, name: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, f"no {name} in /metrics"
    return int(float(match.group(1)))


def in_flight(url: str) -> int:
    """Images the server has admitted and not answered (the ``vision_serve_requests_in_flight`` gauge)."""
    return gauge(url, "vision_serve_requests_in_flight")


def queue_depth(url: str) -> int:
    """Images admitted and not in a running batch (the ``vision_serve_queue_depth`` gauge)."""
    return gauge(url, "vision_serve_queue_depth")
