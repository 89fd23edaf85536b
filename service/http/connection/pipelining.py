"""How many requests one connection may have parsed and waiting: ``PipelineHold`` parses at most
``MAX_PIPELINED`` behind the running one and holds the rest of a read as bytes, reading paused."""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

import service.http.connection.uvicorn_version  # noqa: F401  (refuses an unchecked uvicorn first)
from service.http.connection.refusals import Refusal, refusal

# Requests parsed and waiting behind the running one on a connection. uvicorn stops reading once one
# is parsed; these are the ones already read in the same chunk. Each costs the server its parsed
# headers and a request object, so what a read holds beyond them stays bytes until they are answered.
MAX_PIPELINED = 32
# What a connection may hold read but unparsed. Reading is paused while bytes are held, so this is
# one read (uvloop's and asyncio's reads are at most 256 KiB) plus slack: past it, 400 and close.
MAX_HELD_BYTES = 1024 * 1024
# The end of a request's headers; every request has one, so a read holds at most as many requests
# as it holds of these (a body may hold some too: then the bound is only tighter).
_HEADERS_END = b"\r\n\r\n"

TOO_MUCH_HELD = refusal(
    400,
    "Bad Request",
    f"More than {MAX_HELD_BYTES:,} bytes arrived while reading was paused behind pipelined requests.",
)


class PipelineHold(HttpToolsProtocol):
    """uvicorn's protocol that parses at most ``MAX_PIPELINED`` requests waiting behind the running one
    and holds the rest of a read as bytes (reading paused) until answers free room. ``_parse`` feeds the
    parser (the guard's checks first); ``_refuse`` answers and closes (the guard's).

    What it reads is fed to the parser one request's headers at a time, so that each new request is
    counted before the next one is parsed. A body of known length is skipped, not searched for the end
    of headers: searching costs about as much as the request itself for a photo's 60 KB (a chunked
    body, of unknown length, is searched)."""

    # Bytes read but not yet parsed; the last bytes fed, for a headers' end that spans two reads.
    _held = b""
    _fed_tail = b""
    # Of the body being parsed: the bytes still to come when its Content-Length says, -1 when it does
    # not (chunked); 0 between bodies.
    _body_left = 0

    def _parse(self, data: bytes) -> None:
        """Feed ``data`` to the parser; the guard checks it first."""
        self._feed_parser(data)

    def _feed_parser(self, data: bytes) -> None:
        HttpToolsProtocol.data_received(self, data)

    def _refuse(self, refusal: Refusal) -> None:
        self.transport.write(refusal.wire)
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._held:
            # Reading is paused while bytes are held; a transport may still deliver what it had.
            self._held += data
            if len(self._held) > MAX_HELD_BYTES:
                self._refuse(TOO_MUCH_HELD)
            return
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        """Parse ``data`` up to the point where ``MAX_PIPELINED`` requests wait; hold the rest."""
        keep = len(_HEADERS_END) - 1
        while data:
            if len(self.pipeline) >= MAX_PIPELINED:
                self._hold(data)
                return
            skip = self._body_left
            if skip >= len(data):
                cut = None  # all of it is the body under way
            elif skip > 0:
                at = data.find(_HEADERS_END, skip)
                cut = None if at < 0 else at + len(_HEADERS_END)
            else:
                cut = after_headers_ends(self._fed_tail, data, 1)
            piece, data = (data, b"") if cut is None else (data[:cut], data[cut:])
            self._fed_tail = piece[-keep:] if len(piece) >= keep else (self._fed_tail + piece)[-keep:]
            self._parse(piece)
            if self.transport.is_closing():
                return

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        length = -1
        for name, value in self.headers:
            if name == b"transfer-encoding":
                length = -1
                break
            if name == b"content-length" and value.isdigit():
                length = int(value)
        self._body_left = length if length >= 0 else -1

    def on_body(self, body: bytes) -> None:
        if self._body_left > 0:
            self._body_left = max(0, self._body_left - len(body))
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._body_left = 0
        super().on_message_complete()

    def _hold(self, data: bytes) -> None:
        self._held = data
        self.flow.pause_reading()

    def _release_held(self) -> None:
        """The requests ahead were answered: parse what was held (on_response_complete's call)."""
        if not self._held or self.transport.is_closing():
            return
        data, self._held = self._held, b""
        self._feed(data)
        if not self._held and not self.pipeline:
            self.flow.resume_reading()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._held:
            # uvicorn resumed reading: what the client sends next must queue behind what is held.
            self.flow.pause_reading()
            self.loop.call_soon(self._release_held)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._held = b""


def after_headers_ends(tail: bytes, data: bytes, count: int) -> int | None:
    """Where in ``data`` its ``count``-th headers' end ends, or None where it holds fewer. ``tail``: the
    last bytes fed before it, so that an end spanning two reads counts (an overcount only cuts early)."""
    start = found = 0
    spanning = (tail + data[: len(_HEADERS_END) - 1]).find(_HEADERS_END)
    if spanning >= 0:
        start, found = spanning + len(_HEADERS_END) - len(tail), 1
    while found < count:
        at = data.find(_HEADERS_END, start)
        if at < 0:
            return None
        start, found = at + len(_HEADERS_END), found + 1
    return start
