"""Deadlines that clients set: how long a client will wait for its answer, read from the request.

A client that gives up after 300 ms has no use for an image run at 400 ms. Each protocol says so its
own way, and the request pipeline (service/http/pipeline/submit.py) takes the earliest of them and of
the server's own ``--request-timeout-s``: at that moment the request is answered 504 and dropped
unrun wherever it still waits, as the request of a client that left is.

- HTTP, every inference route: ``X-Request-Timeout-Ms`` (this server's), and Envoy's
  ``x-envoy-expected-rq-timeout-ms``, which Envoy and Istio set on what they forward;
- the Open Inference Protocol's ``timeout`` request parameter, in microseconds, as Triton reads it
  (tritonclient's ``infer(timeout=...)``), over HTTP and gRPC;
- gRPC's own deadline (the client's ``timeout=`` / ``grpc-timeout``).

Each counts from when the server received the request. 0 means none, as Triton reads ``timeout``.
Every wait on a request's way is bounded by it: the upload and the cache lookup (``within``), the
queue and the batch (submit.py).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from service.errors import DeadlineExceeded, InvalidInput

T = TypeVar("T")

TIMEOUT_HEADER = "x-request-timeout-ms"
ENVOY_TIMEOUT_HEADER = "x-envoy-expected-rq-timeout-ms"
TIMEOUT_PARAMETER = "timeout"  # the Open Inference Protocol's, in microseconds
GRPC_DEADLINE = "the gRPC deadline"
_TIMEOUT_HEADERS = frozenset({TIMEOUT_HEADER.encode(), ENVOY_TIMEOUT_HEADER.encode()})
# A client's own timer ends its call before the server's copy of the deadline passes, by the time the
# request took to arrive: a call cancelled this close to its deadline was ended by that deadline.
CANCEL_SLACK_S = 0.05
MAX_TIMEOUT_US = 10**15  # 30 years: far past any --request-timeout-s, which caps it anyway
# More digits than any timeout needs: int() of a long digit string costs time, and 12 digits of
# milliseconds are 30 years.
MAX_DIGITS = 12


@dataclass(slots=True)
class ClientDeadline:
    """When the client of one request stops waiting (``time.monotonic()``), and what said so.

    ``at`` is ``None`` while no client deadline is known: the server's own timeout then applies.
    """

    received_at: float = field(default_factory=time.monotonic)
    at: float | None = None
    timeout_s: float = 0.0  # the one that set ``at``
    source: str = ""  # and where it came from, for the 504's detail

    def tighten(self, timeout_s: float | None, source: str) -> None:
        """Take ``timeout_s`` (from ``received_at``) if it ends sooner than the deadline so far."""
        if timeout_s is None:
            return
        at = self.received_at + timeout_s
        if self.at is None or at < self.at:
            self.at, self.timeout_s, self.source = at, timeout_s, source

    def passed(self) -> bool:
        """Whether the client's deadline has passed (``False`` when it set none)."""
        return self.at is not None and ended_by(self.at)

    def detail(self) -> str:
        """The 504's detail when this deadline passes."""
        return f"No answer within the client's {self.timeout_s * 1e3:g} ms deadline ({self.source})."


async def within(deadline: ClientDeadline | None, step: Awaitable[T]) -> T:
    """What ``step`` returns, if it does before the client's ``deadline``; else ``DeadlineExceeded``
    (504) the moment it passes, ``step`` cancelled. No deadline (or none set yet): ``step`` as it is."""
    if deadline is None or deadline.at is None:
        return await step
    if sys.version_info < (3, 11):  # asyncio.timeout is 3.11's; wait_for runs the step as a task
        try:
            return await asyncio.wait_for(step, deadline.at - time.monotonic())
        except asyncio.TimeoutError:
            if time.monotonic() < deadline.at:
                raise  # the step's own
            raise DeadlineExceeded(deadline.detail()) from None
    timeout = asyncio.timeout(deadline.at - time.monotonic())  # from the loop's clock: it may not be time's
    try:
        async with timeout:
            return await step
    except TimeoutError:
        if timeout.expired():
            raise DeadlineExceeded(deadline.detail()) from None
        raise  # the step's own


def ended_by(deadline_at: float) -> bool:
    """Whether a call cancelled now was ended by the deadline ``deadline_at`` (``time.monotonic()``),
    within ``CANCEL_SLACK_S``."""
    return time.monotonic() >= deadline_at - CANCEL_SLACK_S


def header_deadline(raw_headers: Iterable[tuple[bytes, bytes]]) -> ClientDeadline | None:
    """The deadline an HTTP request's headers set (the ASGI scope's, names lowercased), ``None`` if
    neither header is there; ``ServiceError`` 400 for a value that is not a whole number of
    milliseconds. One pass over the raw headers: most requests carry neither, and pay only that."""
    deadline = None
    for name, value in raw_headers:
        if name in _TIMEOUT_HEADERS:
            deadline = deadline or ClientDeadline()
            text = name.decode("latin-1")
            deadline.tighten(_milliseconds(text, value.decode("latin-1")), f"the {text} header")
    return deadline


def parameter_timeout_s(value: object) -> float | None:
    """The ``timeout`` parameter (microseconds) in seconds; ``None`` if absent or 0; ``ServiceError``
    400 unless it is a whole number >= 0."""
    if value is None:
        return None
    # The cap: a JSON integer may have thousands of digits, which no float holds.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TIMEOUT_US:
        raise InvalidInput(
            f"Parameter '{TIMEOUT_PARAMETER}' must be a whole number of microseconds from 0 to {MAX_TIMEOUT_US}, "
            f"got {str(value)[:40]!r}."
        )
    return value / 1e6 if value else None


def _milliseconds(name: str, value: str) -> float | None:
    value = value.strip()
    # isascii first: "²".isdigit() is true, and int() refuses it.
    if not (value.isascii() and value.isdigit() and len(value) <= MAX_DIGITS):
        raise InvalidInput(f"Header {name} must be a whole number of milliseconds >= 0, got {value[:40]!r}.")
    milliseconds = int(value)
    return milliseconds / 1e3 if milliseconds else None
