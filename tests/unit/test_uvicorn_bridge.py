"""One contract test per uvicorn internal that service/uvicorn_bridge.py uses, and its version check.

The behavioural tests run the guarded protocol inside a real uvicorn server on loopback (a thread of
this process, a trivial ASGI app, limits of a fraction of a second), so an upgrade that renames a
callback or an attribute fails here by name instead of leaving connections unguarded.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.client.launcher import free_port
from service.http.base.departure import departure_of
from service.uvicorn_bridge import (
    BODY_TIMED_OUT,
    SUPPORTED_UVICORN,
    ConnectionLimits,
    check_uvicorn_version,
    guarded_http_protocol,
)

LIMITS = ConnectionLimits(max_header_bytes=2048, header_timeout_s=0.3, body_timeout_s=0.3)
# The deadline plus one sweep, and a margin for a busy machine.
LATE_S = 3.0


def test_the_callbacks_the_guard_overrides_exist_with_their_signatures() -> None:
    expected = {
        "connection_made": ["transport"],
        "data_received": ["data"],
        "on_message_begin": [],
        "on_headers_complete": [],
        "on_message_complete": [],
        "connection_lost": ["exc"],
    }
    for name, parameters in expected.items():
        method = getattr(HttpToolsProtocol, name)
        assert [p for p in inspect.signature(method).parameters if p != "self"] == parameters, name


def test_the_attributes_the_guard_reads_are_set_by_uvicorn() -> None:
    """``cycle``, ``connections``, ``transport`` and ``loop``: read from uvicorn's own __init__ and
    connection_made (a rename there would leave every deadline unchecked)."""
    source = inspect.getsource(HttpToolsProtocol.__init__) + inspect.getsource(HttpToolsProtocol.connection_made)
    for attribute in ("self.cycle", "self.connections", "self.transport", "self.loop"):
        assert attribute in source, attribute
    cycle_source = inspect.getsource(inspect.getmodule(HttpToolsProtocol))
    for attribute in ("self.response_started", "self.response_complete", "self.scope"):
        assert attribute in cycle_source, attribute


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
                self.body_timed_out.append(bool(scope.get(BODY_TIMED_OUT)))
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
    reply = exchange(port, (b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nabc", 0))
    assert reply.startswith(b"HTTP/1.1 408") and b"--body-timeout-s" in reply
    deadline = time.monotonic() + LATE_S
    while not app.body_timed_out and time.monotonic() < deadline:
        time.sleep(0.01)
    assert app.body_timed_out == [True]  # the route read the disconnect as the guard's 408


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
