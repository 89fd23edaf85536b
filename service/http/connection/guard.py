"""The guarded protocol: uvicorn's httptools protocol with deadlines for a request's headers and body,
caps on its headers, a bound on a chunked body's framing, and a ``Departure`` per request, told when
its client leaves (service/http/connection/__init__.py says why each is needed)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from service.http.base.request_scope import BODY_CUT_OFF, DEPARTURE, Departure
from service.http.connection.pipelining import PipelineHold
from service.http.connection.refusals import (
    FRAMING_ALLOWANCE_BYTES,
    FRAMING_BYTES_PER_CHUNK,
    FREE_CHUNKS,
    MAX_HEADER_FIELDS,
    MIN_MEAN_CHUNK_BYTES,
    ConnectionLimits,
    ConnectionRefusals,
    Refusal,
    Refused,
)
from service.http.connection.sweep import SWEEP_INTERVAL_S, sweep


def guarded_http_protocol(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with ``limits`` (pass it as ``uvicorn.Config(http=...)``)."""
    namespace = {"limits": limits, "refusals": ConnectionRefusals.under(limits), "_sweeping": set()}
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), namespace)


class GuardedHttpToolsProtocol(PipelineHold):
    """uvicorn's httptools protocol under the limits of the subclass ``guarded_http_protocol`` makes
    (the deadlines, the header caps, the chunk framing; PipelineHold bounds pipelining)."""

    limits: ClassVar[ConnectionLimits]
    refusals: ClassVar[ConnectionRefusals]
    # (monotonic deadline, refusal) of the phase the connection is in; None between requests,
    # where uvicorn's keep-alive timeout applies.
    _deadline: tuple[float, Refusal] | None = None
    _header_bytes = 0  # raw bytes of the request whose headers are arriving; -1 once they are complete
    _refusing: Refusal | None = None  # raised from a callback, sent by send_400_response
    # The request being parsed: its header lines and their bytes; for a chunked body, its chunks,
    # data bytes, and raw bytes received since its headers (data and framing).
    _message_header_bytes = _header_fields = 0
    _chunked_body = False
    _chunks = _body_bytes = _framing_bytes = 0
    # The event loops this class's sweep runs on (one per process and server): each subclass has its own.
    _sweeping: ClassVar[set[asyncio.AbstractEventLoop]]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # This connection's requests whose answers are not complete: the running one, then those
        # parsed behind it (uvicorn's ``cycle`` is only the newest).
        self._open: deque = deque()
        self._expect_headers()
        if self.loop not in self._sweeping:
            self._sweeping.add(self.loop)
            self.loop.call_later(SWEEP_INTERVAL_S, sweep, self.connections, self.loop)

    def _expect_headers(self) -> None:
        self._deadline = (time.monotonic() + self.limits.header_timeout_s, self.refusals.header_timeout)
        self._header_bytes = 0

    def _parse(self, data: bytes) -> None:
        if self._header_bytes >= 0:
            end = data.find(b"\r\n\r\n")
            self._header_bytes += len(data) if end < 0 else end
            if self._header_bytes > self.limits.max_header_bytes:
                self._refuse(self.refusals.too_large)
                return
        elif self._chunked_body:
            # Checked on what the parser has seen so far, before this data: what it holds of the
            # body is counted by on_body only once fed.
            framing = self._framing_bytes - self._body_bytes
            if framing > FRAMING_ALLOWANCE_BYTES + FRAMING_BYTES_PER_CHUNK * self._chunks:
                self._refuse(self.refusals.heavy_framing)
                return
            self._framing_bytes += len(data)
        self._feed_parser(data)

    def send_400_response(self, msg: str) -> None:
        refusal, self._refusing = self._refusing, None
        if refusal is None:
            super().send_400_response(msg)
        else:
            self._refuse(refusal)

    def _stop_parsing(self, refusal: Refusal) -> None:
        self._refusing = refusal
        raise Refused(refusal.detail)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_bytes < 0:  # the next request on a kept-alive connection
            self._expect_headers()
        self._message_header_bytes = self._header_fields = 0
        self._chunked_body = False
        self._chunks = self._body_bytes = self._framing_bytes = 0

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._count_header_bytes(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._header_fields += 1
        if self._header_fields > MAX_HEADER_FIELDS:
            self._stop_parsing(self.refusals.too_many_fields)
        self._count_header_bytes(len(name) + len(value) + 4)

    def _count_header_bytes(self, count: int) -> None:
        # Every request's, pipelined ones too: the raw count in data_received sees only the first
        # request of each chunk read.
        self._message_header_bytes += count
        if self._message_header_bytes > self.limits.max_header_bytes:
            self._stop_parsing(self.refusals.too_large)

    def on_headers_complete(self) -> None:
        self._header_bytes = -1
        self._deadline = (time.monotonic() + self.limits.body_timeout_s, self.refusals.body_timeout)
        super().on_headers_complete()
        self.scope[DEPARTURE] = Departure()  # type: ignore[literal-required]
        self._chunked_body = any(name == b"transfer-encoding" for name, _ in self.headers)
        while self._open and self._open[0].response_complete:
            self._open.popleft()
        if self.cycle is not None and self.cycle.scope is self.scope:
            self._open.append(self.cycle)

    def on_chunk_header(self) -> None:
        # Called before the chunk's data: the data of the chunks before it is counted.
        self._chunks += 1
        if self._body_bytes < (self._chunks - FREE_CHUNKS) * MIN_MEAN_CHUNK_BYTES:
            self._stop_parsing(self.refusals.tiny_chunks)

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        _client_left(self._open)
        self._open.clear()

    def on_message_complete(self) -> None:
        self._deadline = None
        self._chunked_body = False
        super().on_message_complete()
        # uvicorn pauses reading while a body over 64 KiB is buffered and may leave it paused once
        # the request is complete; a paused socket never reports the client's close, so a client
        # that left would not be noticed until its answer was written. Reading stays paused when a
        # request is parsed behind the running one (uvicorn's own bound on pipelining); the
        # sweep then watches for the client's close. Bytes held unparsed keep it paused too.
        if not self.pipeline and not self._held:
            self.flow.resume_reading()

    def _refuse(self, refusal: Refusal) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        # The refused request's own cycle once its headers are complete; before, it has none yet
        # (``cycle`` is then the previous request on a kept-alive connection).
        refused = self.cycle if self._header_bytes < 0 else None
        if refused is not None:
            # The route reading the body learns why it stopped, and counts the request by it.
            refused.scope[BODY_CUT_OFF] = (refusal.status, refusal.detail)  # type: ignore[literal-required]
        if _may_answer(self._open, refused):
            self.transport.write(refusal.wire)
        self.transport.close()


def _may_answer(open_cycles: deque, refused: RequestResponseCycle | None) -> bool:
    """Whether a refusal may be written: only where no other answer is still owed on the connection and
    the refused request's own has not begun, so that a response never lands inside another."""
    owed = any(not cycle.response_complete for cycle in open_cycles if cycle is not refused)
    return not owed and (refused is None or not refused.response_started)


def _client_left(open_cycles: deque) -> None:
    """The client left before these answers were complete. uvicorn marks only its newest request
    (``cycle``) disconnected: one running behind it would write its answer into the closed transport
    (uvloop raises there). Each is marked and told, and work still queued for it is dropped."""
    for cycle in open_cycles:
        if not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
            departure = cycle.scope.get(DEPARTURE)
            if departure is not None:
                departure.leave()
