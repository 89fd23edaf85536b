"""Every use of uvicorn's internals, in one place, checked against the versions it was written for.

Limits on each HTTP connection that uvicorn does not set: how long a request's headers and body may
take to arrive, and how large its headers may be. Runs in each HTTP process, inside uvicorn.

uvicorn (with httptools) accepts headers of any size and waits for them, and for a body, forever; its
only timer closes idle kept-alive connections. A server without a proxy in front would be held by
slow or idle sockets and grown by huge headers. ``guarded_http_protocol`` is uvicorn's httptools
protocol with:

- a deadline for each request's headers, from the connection's opening or the request's first byte
  (``--header-timeout-s``): past it, 408 and the connection closes;
- a cap on the bytes of a request's headers (``--max-header-bytes``): past it, 431 and close;
- a deadline for the body, from the end of the headers (``--body-timeout-s``): past it, 408 and
  close. The route reading the body then sees the connection gone and counts the request as 408
  (service/http/base/limits.py);
- a ``Departure`` in each request's scope, told when the connection is lost before the answer is
  complete, so that work for a client that left is dropped (service/http/base/departure.py).

One sweep per process every ``SWEEP_INTERVAL_S`` checks the deadlines of every open connection, so
a request pays for a few clock reads, not for timers of its own.

It subclasses uvicorn's non-public ``HttpToolsProtocol`` and reads its ``cycle``, ``connections``,
``transport`` and ``loop``: the import checks the installed uvicorn against the range pyproject.toml
pins, and tests/unit/test_uvicorn_bridge.py holds a contract test per internal used, so an upgrade
that moves one fails there, by name.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service import _defaults
from service.http.base.departure import DEPARTURE, Departure

# The versions this file was checked against, as pyproject.toml pins them: [oldest, first not supported).
SUPPORTED_UVICORN = ((0, 30), (0, 55))


def check_uvicorn_version(installed: str) -> None:
    low, high = SUPPORTED_UVICORN
    release = tuple(int(part) for part in installed.split(".")[:2] if part.isdigit())
    if not low <= release < high:
        raise ImportError(
            f"vision-serve subclasses uvicorn's HttpToolsProtocol, checked against uvicorn>={low[0]}.{low[1]},"
            f"<{high[0]}.{high[1]}, but {installed} is installed: pip install 'uvicorn>={low[0]}.{low[1]},"
            f"<{high[0]}.{high[1]}'. To move to a new version, run tests/unit/test_uvicorn_bridge.py against it "
            "and fix service/uvicorn_bridge.py."
        )


check_uvicorn_version(uvicorn.__version__)

SWEEP_INTERVAL_S = 0.25
# Set in a request's ASGI scope when its body did not arrive in time (read by read_body).
BODY_TIMED_OUT = "vision_serve.body_timed_out"


@dataclass(frozen=True)
class ConnectionLimits:
    """The flags of the same names; the keep-alive timeout is uvicorn's own (``timeout_keep_alive``)."""

    max_header_bytes: int = _defaults.MAX_HEADER_BYTES
    header_timeout_s: float = _defaults.HEADER_TIMEOUT_S
    body_timeout_s: float = _defaults.BODY_TIMEOUT_S


def _refusal(status: int, reason: str, detail: str) -> bytes:
    body = json.dumps({"detail": detail}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


def guarded_http_protocol(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with ``limits`` (pass it as ``uvicorn.Config(http=...)``)."""
    header_timeout = _refusal(
        408,
        "Request Timeout",
        f"The request's headers did not arrive within {limits.header_timeout_s:g} s (server flag --header-timeout-s).",
    )
    body_timeout = _refusal(
        408,
        "Request Timeout",
        f"The request's body did not arrive within {limits.body_timeout_s:g} s (server flag --body-timeout-s).",
    )
    too_large = _refusal(
        431,
        "Request Header Fields Too Large",
        f"The request's headers are larger than {limits.max_header_bytes:,} bytes (server flag --max-header-bytes).",
    )

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        # (monotonic deadline, refusal) of the phase the connection is in; None between requests,
        # where uvicorn's keep-alive timeout applies.
        _deadline: tuple[float, bytes] | None = None
        _header_bytes = 0  # of the request whose headers are arriving; -1 once they are complete
        _sweeping: set[asyncio.AbstractEventLoop] = set()  # noqa: RUF012  (per process, shared on purpose)

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._expect_headers()
            if self.loop not in self._sweeping:
                self._sweeping.add(self.loop)
                self.loop.call_later(SWEEP_INTERVAL_S, self._sweep, self.connections, self.loop)

        def _expect_headers(self) -> None:
            self._deadline = (time.monotonic() + limits.header_timeout_s, header_timeout)
            self._header_bytes = 0

        def data_received(self, data: bytes) -> None:
            if self._header_bytes >= 0:
                end = data.find(b"\r\n\r\n")
                self._header_bytes += len(data) if end < 0 else end
                if self._header_bytes > limits.max_header_bytes:
                    self._refuse(too_large)
                    return
            super().data_received(data)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._header_bytes < 0:  # the next request on a kept-alive connection
                self._expect_headers()

        def on_headers_complete(self) -> None:
            self._header_bytes = -1
            self._deadline = (time.monotonic() + limits.body_timeout_s, body_timeout)
            super().on_headers_complete()
            self.scope[DEPARTURE] = Departure()  # type: ignore[literal-required]

        def connection_lost(self, exc: Exception | None) -> None:
            cycle = self.cycle
            super().connection_lost(exc)
            # The client left before its answer was complete: work still queued for it is dropped.
            if cycle is not None and not cycle.response_complete:
                departure = cycle.scope.get(DEPARTURE)
                if departure is not None:
                    departure.leave()

        def on_message_complete(self) -> None:
            self._deadline = None
            super().on_message_complete()
            # uvicorn pauses reading while a body over 64 KiB is buffered and may leave it paused once
            # the request is complete; a paused socket never reports the client's close, so a client
            # that left would not be noticed until its answer was written. A pipelined request read
            # from here on pauses reading again (uvicorn's own check).
            self.flow.resume_reading()

        def _refuse(self, refusal: bytes) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if refusal is body_timeout:
                if cycle is not None:
                    cycle.scope[BODY_TIMED_OUT] = True  # type: ignore[literal-required]
                answer = cycle is None or not cycle.response_started
            else:
                # Headers phase: this request has no cycle yet, and ``cycle`` is the previous one on a
                # kept-alive connection; answer unless that one's response is still being written.
                answer = cycle is None or cycle.response_complete
            if answer:
                self.transport.write(refusal)
            self.transport.close()

        @staticmethod
        def _sweep(connections: set, loop: asyncio.AbstractEventLoop) -> None:
            now = time.monotonic()
            for connection in list(connections):
                deadline = getattr(connection, "_deadline", None)
                if deadline is not None and now > deadline[0]:
                    connection._refuse(deadline[1])
            loop.call_later(SWEEP_INTERVAL_S, GuardedHttpToolsProtocol._sweep, connections, loop)

    return GuardedHttpToolsProtocol
