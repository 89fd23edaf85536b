"""Every use of uvicorn's internals, in one place, checked against the versions it was written for.

Limits on each HTTP connection that uvicorn does not set: how long a request's headers and body may
take to arrive, how large its headers may be, how much one connection may have parsed and waiting,
and how a chunked body may be framed. Runs in each HTTP process, inside uvicorn.

uvicorn (with httptools) accepts headers of any size and number and waits for them, and for a body,
forever; its only timer closes idle kept-alive connections. A server without a proxy in front would
be held by slow or idle sockets and grown by huge headers. ``guarded_http_protocol`` is uvicorn's
httptools protocol with:

- a deadline for each request's headers, from the connection's opening or the request's first byte
  (``--header-timeout-s``): past it, 408 and the connection closes;
- a cap on the bytes of a request's headers (``--max-header-bytes``) and on their number
  (``MAX_HEADER_FIELDS``), for every request, pipelined ones too: past it, 431 and close;
- a deadline for the body, from the end of the headers (``--body-timeout-s``): past it, 408 and
  close (neither deadline runs while the server itself does not read the connection). The route
  reading the body then sees the connection gone and counts the request by the refusal's status
  (service/http/base/limits.py);
- a chunked body framed to cost the server per byte what a plain one does: chunks of at least
  ``MIN_MEAN_CHUNK_BYTES`` on average once there are more than ``FREE_CHUNKS``, and framing (chunk
  sizes, extensions) within ``FRAMING_ALLOWANCE_BYTES`` plus ``FRAMING_BYTES_PER_CHUNK`` a chunk:
  else 400 and close;
- pipelining bounded without refusing it: while a request runs, the connection reads on only until
  one more request is parsed (the rest waits in the socket, as in uvicorn itself), and at most
  ``MAX_PIPELINED`` requests parsed from what was already read wait behind it. The rest of that read
  is held unparsed (one read: ``MAX_HELD_BYTES`` at most) and fed to the parser as the requests
  ahead are answered, so every pipelined request is answered, in order, at a bounded cost;
- a ``Departure`` in each request's scope, told when the connection is lost before that request's
  answer is complete: the request running and those parsed behind it alike, so that work for a
  client that left is dropped (service/request_scope.py). A connection whose reading is paused
  (a request parsed behind the running one) does not see the client close, so the sweep asks the
  kernel whether the peer hung up (``POLLRDHUP``).

One sweep per process every ``SWEEP_INTERVAL_S`` checks the deadlines of every open connection, so
a request pays for a few clock reads, not for timers of its own.

It subclasses uvicorn's non-public ``HttpToolsProtocol`` and reads its ``cycle``, ``connections``,
``transport``, ``loop``, ``flow`` and ``pipeline``: the import checks the installed uvicorn against the
range pyproject.toml pins, and tests/unit/test_uvicorn_bridge.py holds a contract test per internal
used, so an upgrade that moves one fails there, by name.
"""

from __future__ import annotations

import asyncio
import json
import select
import time
from collections import deque
from dataclasses import dataclass

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from service import _defaults
from service.request_scope import BODY_CUT_OFF, DEPARTURE, Departure

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
# Header lines in one request (Apache's LimitRequestFields is 100): thousands of tiny headers cost
# the server a Python object each.
MAX_HEADER_FIELDS = 256
# A chunked body: this many chunks are free; beyond, their mean size must be at least
# MIN_MEAN_CHUNK_BYTES, since every chunk costs the server two Python calls whatever its size.
FREE_CHUNKS = 1024
MIN_MEAN_CHUNK_BYTES = 256
# Bytes of a chunked body's framing (sizes, extensions, line ends) beyond its data: extensions are
# never read by the server, so a client that sends megabytes of them only burns its parser.
FRAMING_ALLOWANCE_BYTES = 64 * 1024
FRAMING_BYTES_PER_CHUNK = 32
# select.POLLRDHUP is Linux's; elsewhere a paused connection's departure is seen when its answer is written.
_PEER_GONE = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR


@dataclass(frozen=True)
class ConnectionLimits:
    """The flags of the same names; the keep-alive timeout is uvicorn's own (``timeout_keep_alive``)."""

    max_header_bytes: int = _defaults.MAX_HEADER_BYTES
    header_timeout_s: float = _defaults.HEADER_TIMEOUT_S
    body_timeout_s: float = _defaults.BODY_TIMEOUT_S


@dataclass(frozen=True)
class Refusal:
    """What the guard answers (when it may) before it closes a connection: ``wire`` is the response."""

    status: int
    detail: str
    wire: bytes


def _refusal(status: int, reason: str, detail: str) -> Refusal:
    body = json.dumps({"detail": detail}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return Refusal(status, detail, head.encode("latin-1") + body)


class _Refused(Exception):
    """Raised from a parser callback to stop parsing; httptools re-raises it as a parser error, which
    uvicorn answers through ``send_400_response``, where the guard sends its own refusal instead."""


def _peer_hung_up(transport: asyncio.Transport) -> bool:
    """Whether the kernel says the client closed or reset the connection (no read needed)."""
    sock = transport.get_extra_info("socket")
    if sock is None or not _PEER_GONE:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), _PEER_GONE)
    return any(events & _PEER_GONE for _, events in poller.poll(0))


TOO_MUCH_HELD = _refusal(
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
    too_many_fields = _refusal(
        431,
        "Request Header Fields Too Large",
        f"The request has more than {MAX_HEADER_FIELDS} header lines.",
    )
    tiny_chunks = _refusal(
        400,
        "Bad Request",
        f"The chunked body's chunks are smaller than {MIN_MEAN_CHUNK_BYTES} bytes on average; send larger chunks "
        "or a Content-Length body.",
    )
    heavy_framing = _refusal(
        400,
        "Bad Request",
        "The chunked body's framing (chunk sizes and extensions) is far larger than its data; drop the extensions.",
    )

    class GuardedHttpToolsProtocol(PipelineHold):
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
        _sweeping: set[asyncio.AbstractEventLoop] = set()  # noqa: RUF012  (per process, shared on purpose)

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            # This connection's requests whose answers are not complete: the running one, then those
            # parsed behind it (uvicorn's ``cycle`` is only the newest).
            self._open: deque = deque()
            self._expect_headers()
            if self.loop not in self._sweeping:
                self._sweeping.add(self.loop)
                self.loop.call_later(SWEEP_INTERVAL_S, _sweep, self.connections, self.loop)

        def _expect_headers(self) -> None:
            self._deadline = (time.monotonic() + limits.header_timeout_s, header_timeout)
            self._header_bytes = 0

        def _parse(self, data: bytes) -> None:
            if self._header_bytes >= 0:
                end = data.find(b"\r\n\r\n")
                self._header_bytes += len(data) if end < 0 else end
                if self._header_bytes > limits.max_header_bytes:
                    self._refuse(too_large)
                    return
            elif self._chunked_body:
                # Checked on what the parser has seen so far, before this data: what it holds of the
                # body is counted by on_body only once fed.
                framing = self._framing_bytes - self._body_bytes
                if framing > FRAMING_ALLOWANCE_BYTES + FRAMING_BYTES_PER_CHUNK * self._chunks:
                    self._refuse(heavy_framing)
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
            raise _Refused(refusal.detail)

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
                self._stop_parsing(too_many_fields)
            self._count_header_bytes(len(name) + len(value) + 4)

        def _count_header_bytes(self, count: int) -> None:
            # Every request's, pipelined ones too: the raw count in data_received sees only the first
            # request of each chunk read.
            self._message_header_bytes += count
            if self._message_header_bytes > limits.max_header_bytes:
                self._stop_parsing(too_large)

        def on_headers_complete(self) -> None:
            self._header_bytes = -1
            self._deadline = (time.monotonic() + limits.body_timeout_s, body_timeout)
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
                self._stop_parsing(tiny_chunks)

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

    return GuardedHttpToolsProtocol


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


def _sweep(connections: set, loop: asyncio.AbstractEventLoop, last: float | None = None) -> None:
    """Every ``SWEEP_INTERVAL_S``: refuse what passed its deadline; close a paused connection whose client
    hung up with requests open (connection_lost then tells their departures). While the server does not
    read a connection (requests queued behind the running one, bytes held, a body not yet consumed), its
    deadline stands still: the wait is the server's, not the client's."""
    now = time.monotonic()
    for connection in list(connections):
        deadline = getattr(connection, "_deadline", None)
        if deadline is not None and last is not None and connection.flow.read_paused:
            connection._deadline = deadline = (deadline[0] + now - last, deadline[1])
        if deadline is not None and now > deadline[0]:
            connection._refuse(deadline[1])
        elif _gone_while_paused(connection):
            connection.transport.close()
    loop.call_later(SWEEP_INTERVAL_S, _sweep, connections, loop, now)


def _gone_while_paused(connection: HttpToolsProtocol) -> bool:
    """A connection whose reading is paused (a request parsed behind the running one) never reads its
    client's close: ask the kernel, for one with requests still open."""
    open_cycles = getattr(connection, "_open", ())
    waiting = any(not cycle.response_complete for cycle in open_cycles)
    return waiting and connection.flow.read_paused and _peer_hung_up(connection.transport)
