"""One contract test per uvicorn internal that the connection guard (service/http/connection/) uses,
and its version check.

The behavioural tests run the guarded protocol inside a real uvicorn server on loopback (a thread of
this process, a trivial ASGI app, limits of a fraction of a second), so an upgrade that renames a
callback or an attribute fails here by name instead of leaving connections unguarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.client.launcher import free_port
from service.http.base.request_scope import BODY_CUT_OFF, departure_of
from service.http.connection.guard import guarded_http_protocol
from service.http.connection.pipelining import MAX_PIPELINED, after_headers_ends
from service.http.connection.refusals import ConnectionLimits
from service.http.connection.sweep import SWEEP_INTERVAL_S
from service.http.connection.uvicorn_version import SUPPORTED_UVICORN, check_uvicorn_version

LIMITS = ConnectionLimits(max_header_bytes=2048, header_timeout_s=0.3, body_timeout_s=0.3)
# The deadline plus one sweep, and a margin for a busy machine.
LATE_S = 3.0


def test_the_callbacks_the_guard_overrides_exist_with_their_signatures() -> None:
    expected = {
        "connection_made": ["transport"],
        "data_received": ["data"],
        "send_400_response": ["msg"],
        "on_message_begin": [],
        "on_url": ["url"],
        "on_header": ["name", "value"],
        "on_headers_complete": [],
        "on_body": ["body"],
        "on_message_complete": [],
        "on_response_complete": [],
        "connection_lost": ["exc"],
    }
    for name, parameters in expected.items():
        method = getattr(HttpToolsProtocol, name)
        assert [p for p in inspect.signature(method).parameters if p != "self"] == parameters, name


def test_the_attributes_the_guard_reads_are_set_by_uvicorn() -> None:
    """``cycle``, ``connections``, ``transport``, ``loop``, ``flow``, ``pipeline`` and ``headers``: read
    from uvicorn's own __init__ and connection_made (a rename there would leave every deadline
    unchecked); a cycle's ``disconnected`` and ``message_event``, set for requests queued behind the
    newest; the flow's ``read_paused`` and ``resume_reading``; the parser's use of the pipeline."""
    source = inspect.getsource(HttpToolsProtocol.__init__) + inspect.getsource(HttpToolsProtocol.connection_made)
    for attribute in ("self.cycle", "self.connections", "self.transport", "self.loop", "self.flow", "self.pipeline"):
        assert attribute in source, attribute
    assert "self.headers" in inspect.getsource(HttpToolsProtocol.on_message_begin)
    assert "self.pipeline.appendleft" in inspect.getsource(HttpToolsProtocol.on_headers_complete)
    # Bytes held behind the cap are fed after the answer that frees room: uvicorn resumes reading there.
    response_complete = inspect.getsource(HttpToolsProtocol.on_response_complete)
    assert "self.flow.resume_reading()" in response_complete and "self.pipeline.pop()" in response_complete
    cycle_source = inspect.getsource(inspect.getmodule(HttpToolsProtocol))
    for attribute in (
        "self.response_started",
        "self.response_complete",
        "self.scope",
        "self.disconnected",
        "self.message_event",
    ):
        assert attribute in cycle_source, attribute
    flow_source = inspect.getsource(FlowControl)
    assert "self.read_paused" in flow_source and "def resume_reading" in flow_source


@pytest.mark.parametrize("installed", ["0.29.9", "0.55.0", "1.0.0"])
def test_the_version_check_refuses_what_the_bridge_was_not_checked_on(installed: str) -> None:
    with pytest.raises(ImportError, match=r"test_uvicorn_bridge\.py"):
        check_uvicorn_version(installed)


def test_the_version_check_accepts_the_range_and_the_installed_uvicorn() -> None:
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED_UVICORN
    check_uvicorn_version(f"{low_major}.{low_minor}.0")
    check_uvicorn_version(f"{high_major}.{high_minor - 1}.9")
    check_uvicorn_version(uvicorn.__version__)


class Recorder:
    """A trivial ASGI app that reads the whole body and records what the route saw."""

    def __init__(self) -> None:
        self.body_timed_out: list[bool] = []

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.body_timed_out.append(scope.get(BODY_CUT_OFF, (None,))[0] == 408)
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        answer = str(len(body)).encode()
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(answer))]}
        )
        await send({"type": "http.response.body", "body": answer})


@pytest.fixture(scope="module")
def guarded_server() -> Iterator[tuple[int, Recorder]]:
    app, port = Recorder(), free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, http=guarded_http_protocol(LIMITS), lifespan="off", log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    yield port, app
    server.should_exit = True
    thread.join(5)


def exchange(port: int, *parts: tuple[bytes, float]) -> bytes:
    """Send each part after its pause; return everything the server wrote until it closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=LATE_S) as connection:
        for data, pause_s in parts:
            time.sleep(pause_s)
            connection.sendall(data)
        received = b""
        while chunk := connection.recv(65536):
            received += chunk
        return received


def test_a_request_within_the_limits_is_answered(guarded_server) -> None:
    port, _ = guarded_server
    reply = exchange(port, (b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\nconnection: close\r\n\r\nabc", 0))
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"\r\n\r\n3")


def test_headers_that_do_not_arrive_in_time_get_408(guarded_server) -> None:
    port, _ = guarded_server
    reply = exchange(port, (b"GET / HTTP/1.1\r\nhost: x\r\n", 0))  # never finished
    assert reply.startswith(b"HTTP/1.1 408") and b"--header-timeout-s" in reply


def test_headers_past_the_cap_get_431(guarded_server) -> None:
    port, _ = guarded_server
    reply = exchange(port, (b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 4096 + b"\r\n\r\n", 0))
    assert reply.startswith(b"HTTP/1.1 431") and b"--max-header-bytes" in reply


def test_a_body_that_does_not_arrive_in_time_gets_408_and_the_route_knows(guarded_server) -> None:
    port, app = guarded_server
    seen = len(app.body_timed_out)  # the module's server: other tests' disconnects came before
    reply = exchange(port, (b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nabc", 0))
    assert reply.startswith(b"HTTP/1.1 408") and b"--body-timeout-s" in reply
    deadline = time.monotonic() + LATE_S
    while len(app.body_timed_out) == seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert app.body_timed_out[seen:] == [True]  # the route read the disconnect as the guard's 408


def test_a_kept_alive_connection_gets_a_header_deadline_per_request(guarded_server) -> None:
    """Between requests uvicorn's keep-alive timer applies; once the next request's first byte
    arrives (on_message_begin), its headers have a deadline again."""
    port, _ = guarded_server
    first = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
    reply = exchange(port, (first, 0), (b"GET / HTTP/1.1\r\nhost:", 0.1))  # the second never finishes
    assert reply.startswith(b"HTTP/1.1 200") and reply.count(b"HTTP/1.1 408") == 1


class Waiter:
    """Reads the body, then waits (as a request waits for its workers) until its client leaves."""

    def __init__(self) -> None:
        self.left_after_s: list[float] = []

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        departure, started = departure_of(scope), time.monotonic()
        while not departure.gone and time.monotonic() - started < LATE_S:
            await asyncio.sleep(0.01)
        self.left_after_s.append(time.monotonic() - started if departure.gone else float("inf"))


@pytest.mark.parametrize("body_bytes", [1000, 300_000], ids=["small-body", "body-over-64KiB"])
def test_a_client_that_closes_while_its_answer_is_awaited_is_seen_leaving(body_bytes: int) -> None:
    """Also after a body over 64 KiB, which uvicorn reads with the socket paused: a paused socket
    would not report the close until the answer was written."""
    app, port = Waiter(), free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, http=guarded_http_protocol(ConnectionLimits()), lifespan="off",
        log_level="warning",
    )  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        head = f"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: {body_bytes}\r\n\r\n".encode()
        with socket.create_connection(("127.0.0.1", port), timeout=LATE_S) as connection:
            connection.sendall(head + b"x" * body_bytes)
            time.sleep(0.3)  # the app has the body and waits
        deadline = time.monotonic() + LATE_S + 1
        while not app.left_after_s and time.monotonic() < deadline:
            time.sleep(0.01)
        assert app.left_after_s and app.left_after_s[0] < 1.0, app.left_after_s
    finally:
        server.should_exit = True
        thread.join(5)


# --- Pipelining and framing abuse (issue 52): bounded per connection, departures seen, clear refusals.


class Holder:
    """``/hold`` waits until released (a request running in a worker) or until its client leaves;
    any other path is answered at once with its own path. Records which requests saw their client leave."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.left: list[str] = []
        self.started: list[str] = []
        self.body_bytes: list[int] = []  # of each request, as the app received it

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            return
        self.started.append(scope["path"])
        received = 0
        while True:
            message = await receive()
            received += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        self.body_bytes.append(received)
        departure = departure_of(scope)
        if scope["path"] == "/hold":
            started = time.monotonic()
            while not self.release.is_set() and not departure.gone and time.monotonic() - started < 2 * LATE_S:
                await asyncio.sleep(0.01)
        if departure.gone:
            self.left.append(scope["path"])
            if scope["path"] != "/hold":
                return
            await asyncio.sleep(0.05)  # then answers anyway, as a route finishing its own work does
        answer = scope["path"].encode()
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(answer))]}
        )
        await send({"type": "http.response.body", "body": answer})


def run_holding_server(limits: ConnectionLimits) -> Iterator[tuple[int, Holder, uvicorn.Server]]:
    app, port = Holder(), free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, http=guarded_http_protocol(limits), lifespan="off", log_level="warning",
    )  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    yield port, app, server
    app.release.set()
    server.should_exit = True
    thread.join(5)


@pytest.fixture
def holding_server() -> Iterator[tuple[int, Holder, uvicorn.Server]]:
    yield from run_holding_server(ConnectionLimits())


@pytest.fixture
def quick_holding_server() -> Iterator[tuple[int, Holder, uvicorn.Server]]:
    """Header and body deadlines of a fraction of a second (LIMITS)."""
    yield from run_holding_server(LIMITS)


def wait_for(condition, what: str, timeout_s: float = LATE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.01)


def send_for(connection: socket.socket, data: bytes, copies: int, seconds: float) -> int:
    """Send ``data`` up to ``copies`` times without blocking for more than ``seconds``, or until the
    server closes the connection; how many went."""
    connection.setblocking(False)
    sent, view, deadline = 0, memoryview(data), time.monotonic() + seconds
    while sent < copies and time.monotonic() < deadline:
        try:
            view = view[connection.send(view) :]
        except BlockingIOError:
            time.sleep(0.01)
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
        if not view:
            sent, view = sent + 1, memoryview(data)
    connection.setblocking(True)
    return sent


def parsed_waiting(server: uvicorn.Server) -> int:
    """Requests parsed and queued behind a running one, over every open connection."""
    return sum(len(connection.pipeline) for connection in server.server_state.connections)


def test_pipelined_requests_behind_a_running_one_stay_in_the_socket(holding_server) -> None:
    """A client that pipelines thousands of requests behind one that runs gets at most one chunk of
    them parsed: the server stops reading (on main it read and kept all 8,000, 112 MiB), and once the
    running one is answered the ones parsed are answered in order."""
    port, app, server = holding_server
    with socket.create_connection(("127.0.0.1", port), timeout=LATE_S) as connection:
        connection.sendall(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
        wait_for(lambda: app.started == ["/hold"], "running request")
        padded = b"GET /next HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 12_000 + b"\r\n\r\n"
        sent = send_for(connection, padded, 2_000, seconds=2.0)
        assert sent < 2_000, "the server kept reading everything the client pipelined"
        assert 1 <= parsed_waiting(server) <= MAX_PIPELINED
        assert app.started == ["/hold"]


def test_a_few_pipelined_requests_are_all_answered_in_order(holding_server) -> None:
    port, app, _ = holding_server
    with socket.create_connection(("127.0.0.1", port), timeout=LATE_S) as connection:
        connection.sendall(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
        wait_for(lambda: app.started == ["/hold"], "running request")
        connection.sendall(b"".join(b"GET /p%d HTTP/1.1\r\nhost: x\r\n\r\n" % i for i in range(5)))
        connection.sendall(b"GET /last HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        app.release.set()
        received = b""
        while chunk := connection.recv(65536):
            received += chunk
    bodies = [part.rsplit(b"\r\n\r\n", 1)[-1] for part in received.split(b"HTTP/1.1 ")[1:]]
    assert bodies == [b"/hold", b"/p0", b"/p1", b"/p2", b"/p3", b"/p4", b"/last"]


def receive_answers(connection: socket.socket, count: int) -> list[bytes]:
    """The bodies of the next ``count`` answers (each with a content-length), in the order they came."""
    received, bodies = b"", []
    while len(bodies) < count:
        chunk = connection.recv(65536)
        assert chunk, f"the connection closed after {len(bodies)} of {count} answers"
        received += chunk
        while (end := received.find(b"\r\n\r\n")) >= 0:
            head = received[:end].lower()
            length = int(head.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
            if len(received) < end + 4 + length:
                break
            bodies.append(received[end + 4 : end + 4 + length])
            received = received[end + 4 + length :]
    return bodies


def test_more_pipelined_requests_than_the_cap_in_one_read_are_all_answered_in_order(holding_server) -> None:
    """Fifty requests written in one go behind a running one (issue 60: the connection was closed):
    exactly MAX_PIPELINED are parsed while it runs, the rest wait as bytes, and all are answered in order."""
    port, app, server = holding_server
    paths = [b"/p%d" % i for i in range(50)]
    with socket.create_connection(("127.0.0.1", port), timeout=LATE_S) as connection:
        connection.sendall(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
        wait_for(lambda: app.started == ["/hold"], "running request")
        connection.sendall(b"".join(b"GET %s HTTP/1.1\r\nhost: x\r\n\r\n" % path for path in paths))
        wait_for(lambda: parsed_waiting(server) == MAX_PIPELINED, f"{MAX_PIPELINED} requests parsed")
        time.sleep(0.2)  # what was read beyond them stays unparsed
        assert parsed_waiting(server) == MAX_PIPELINED
        app.release.set()
        assert receive_answers(connection, 51) == [b"/hold", *paths]
        # The connection reads again once everything held is answered.
        connection.sendall(b"GET /after HTTP/1.1\r\nhost: x\r\n\r\n")
        assert receive_answers(connection, 1) == [b"/after"]


def test_a_pipelined_body_held_behind_the_cap_reaches_its_request(quick_holding_server) -> None:
    """A POST parsed as the last request the cap lets wait, its body held unparsed behind it: the body is
    fed whole when the POST runs, and the wait, longer than --body-timeout-s, is not the client's fault."""
    port, app, server = quick_holding_server
    body = b"b" * 5000
    post = b"POST /posted HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    with socket.create_connection(("127.0.0.1", port), timeout=LATE_S) as connection:
        connection.sendall(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
        wait_for(lambda: app.started == ["/hold"], "running request")
        connection.sendall(b"GET /p HTTP/1.1\r\nhost: x\r\n\r\n" * (MAX_PIPELINED - 1) + post + post)
        wait_for(lambda: parsed_waiting(server) == MAX_PIPELINED, f"{MAX_PIPELINED} requests parsed")
        time.sleep(LIMITS.body_timeout_s + 4 * SWEEP_INTERVAL_S)
        app.release.set()
        answers = receive_answers(connection, MAX_PIPELINED + 2)
    assert answers == [b"/hold", *[b"/p"] * (MAX_PIPELINED - 1), b"/posted", b"/posted"]
    assert app.body_bytes[-2:] == [len(body), len(body)]


def test_a_body_full_of_headers_ends_neither_counts_nor_hides_the_requests_behind_it(holding_server) -> None:
    """A body of known length is skipped, not searched, when requests are counted: its bytes (here a
    hundred thousand blank lines, more than one read) are not requests, and the requests written right
    after it are still counted one by one: exactly MAX_PIPELINED wait behind it."""
    port, app, server = holding_server
    body = b"\r\n\r\n" * 100_000
    held_post = b"POST /hold HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    with socket.create_connection(("127.0.0.1", port), timeout=LATE_S) as connection:
        connection.sendall(held_post + b"GET /p HTTP/1.1\r\nhost: x\r\n\r\n" * 40)
        wait_for(lambda: parsed_waiting(server) == MAX_PIPELINED, f"{MAX_PIPELINED} requests parsed")
        time.sleep(0.2)
        assert parsed_waiting(server) == MAX_PIPELINED
        app.release.set()
        answers = receive_answers(connection, 41)
    assert answers == [b"/hold", *[b"/p"] * 40]
    assert app.body_bytes[0] == len(body)


@pytest.mark.parametrize(
    ("tail", "data", "count", "expected"),
    [
        (b"", b"GET / HTTP/1.1\r\n\r\nGET", 1, 18),
        (b"", b"GET / HTTP/1.1\r\n\r\nGET", 2, None),
        (b"", b"A\r\n\r\nB\r\n\r\nC\r\n\r\n", 2, 10),
        (b"\r\n\r", b"\nGET", 1, 1),  # an end that spans two reads
        (b"x\r\n", b"\r\nA\r\n\r\n", 2, 7),
        (b"", b"no end here", 1, None),
    ],
)
def test_headers_ends_are_counted_across_reads(tail: bytes, data: bytes, count: int, expected) -> None:
    assert after_headers_ends(tail, data, count) == expected


@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_client_that_leaves_with_requests_queued_behind_a_running_one_is_seen_leaving(holding_server, how) -> None:
    """Reading is paused while a request waits behind the running one; the sweep still sees the client
    go, and the running request (not only the newest) is told."""
    port, app, _ = holding_server
    connection = socket.create_connection(("127.0.0.1", port), timeout=LATE_S)
    connection.sendall(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
    wait_for(lambda: app.started == ["/hold"], "running request")
    connection.sendall(b"GET /queued HTTP/1.1\r\nhost: x\r\n\r\n" * 3)
    time.sleep(0.1)
    if how == "reset":
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    connection.close()
    started = time.monotonic()
    wait_for(lambda: app.left == ["/hold"], "the running request told its client left")
    assert time.monotonic() - started < 1.5  # a sweep or two, not the running request's own end
    assert app.started == ["/hold"], "a request queued behind it never ran"


def test_the_running_request_answering_after_its_client_left_is_no_server_error(holding_server, caplog) -> None:
    """uvicorn marks only its newest request disconnected; the running one behind it, answering after
    its client left with others queued, wrote into the closed transport (a traceback under uvloop)."""
    port, app, _ = holding_server
    connection = socket.create_connection(("127.0.0.1", port), timeout=LATE_S)
    connection.sendall(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
    wait_for(lambda: app.started == ["/hold"], "running request")
    connection.sendall(b"GET /queued HTTP/1.1\r\nhost: x\r\n\r\n")
    time.sleep(0.1)
    connection.close()
    wait_for(lambda: app.left == ["/hold"], "the running request told its client left")
    time.sleep(0.3)  # its answer written (or not) meanwhile
    assert not [r for r in caplog.records if r.levelname == "ERROR"], [r.getMessage() for r in caplog.records]


def test_a_half_closed_connection_is_a_client_that_left(holding_server) -> None:
    """A client that shuts its sending side while its request runs is treated as gone (uvicorn closes
    on end of input); the request is told, and nothing is answered into the half-open socket."""
    port, app, _ = holding_server
    with socket.create_connection(("127.0.0.1", port), timeout=LATE_S) as connection:
        connection.sendall(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
        wait_for(lambda: app.started == ["/hold"], "running request")
        connection.shutdown(socket.SHUT_WR)
        assert connection.recv(65536) == b""
    wait_for(lambda: app.left == ["/hold"], "the running request told its client left")


def exchange_once(port: int, payload: bytes) -> bytes:
    """Send ``payload`` (ignoring a reset once the server closed) and read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=LATE_S) as connection:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            connection.sendall(payload)
        received = b""
        try:
            while chunk := connection.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        return received


FRAMING_ABUSE = {
    "content-length-and-chunked": (
        b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        b"HTTP/1.1 400",
    ),
    "duplicate-content-length": (
        b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ncontent-length: 3\r\n\r\nabc",
        b"HTTP/1.1 400",
    ),
    "conflicting-content-length": (
        b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabcd",
        b"HTTP/1.1 400",
    ),
    "thousands-of-tiny-headers": (
        b"GET / HTTP/1.1\r\nhost: x\r\n" + b"a:b\r\n" * 400 + b"\r\n",  # 2 KB: under the byte cap
        b"HTTP/1.1 431",
    ),
    "huge-chunk-extension": (
        b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n5;ext="
        + b"e" * 2_000_000
        + b"\r\nhello\r\n0\r\n\r\n",
        b"HTTP/1.1 400",
    ),
    "one-byte-per-chunk": (
        b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n" + b"1\r\nx\r\n" * 200_000 + b"0\r\n\r\n",
        b"HTTP/1.1 400",
    ),
}


@pytest.mark.parametrize("name", list(FRAMING_ABUSE))
def test_framing_abuse_gets_a_clear_4xx_and_the_connection_closes(guarded_server, name: str) -> None:
    port, _ = guarded_server
    payload, status = FRAMING_ABUSE[name]
    reply = exchange_once(port, payload)
    assert reply.startswith(status), reply[:300]
    assert b"connection: close" in reply.lower()


def test_a_pipelined_request_with_headers_past_the_cap_is_refused_too(guarded_server) -> None:
    """The raw header count sees only the first request of each read: the parser's own count covers
    the ones pipelined behind it in the same read. Read together, the first one's answer is still
    owed when the second is refused, so the connection closes with nothing spliced in; read apart,
    the first is answered and the second gets its 431."""
    port, _ = guarded_server
    first = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
    second = b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (LIMITS.max_header_bytes + 100) + b"\r\n\r\n"
    reply = exchange_once(port, first + second)
    answers = reply.count(b"HTTP/1.1 ")
    assert reply == b"" or (reply.startswith(b"HTTP/1.1 200") and answers == 2 and b"HTTP/1.1 431" in reply), reply


def test_ordinary_chunked_bodies_pass_the_framing_checks(guarded_server) -> None:
    """Thousands of 4 KiB chunks and a few chunks with a short extension are what clients send."""
    port, _ = guarded_server
    head = b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    many = b"1000\r\n" + b"x" * 4096 + b"\r\n"
    reply = exchange_once(port, head + many * 3000 + b"3;name=value\r\nabc\r\n0\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"\r\n\r\n%d" % (4096 * 3000 + 3)), reply[:300]
