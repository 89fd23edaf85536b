"""One sweep per process and event loop over every open connection: deadlines, and clients that hung
up while their connection's reading was paused."""

from __future__ import annotations

import asyncio
import select
import time

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

import service.http.connection.uvicorn_version  # noqa: F401  (refuses an unchecked uvicorn first)

SWEEP_INTERVAL_S = 0.25
# select.POLLRDHUP is Linux's; elsewhere a paused connection's departure is seen when its answer is written.
_PEER_GONE = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR


def _peer_hung_up(transport: asyncio.Transport) -> bool:
    """Whether the kernel says the client closed or reset the connection (no read needed)."""
    sock = transport.get_extra_info("socket")
    if sock is None or not _PEER_GONE:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), _PEER_GONE)
    return any(events & _PEER_GONE for _, events in poller.poll(0))


def sweep(connections: set, loop: asyncio.AbstractEventLoop, last: float | None = None) -> None:
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
    loop.call_later(SWEEP_INTERVAL_S, sweep, connections, loop, now)


def _gone_while_paused(connection: HttpToolsProtocol) -> bool:
    """A connection whose reading is paused (a request parsed behind the running one) never reads its
    client's close: ask the kernel, for one with requests still open."""
    open_cycles = getattr(connection, "_open", ())
    waiting = any(not cycle.response_complete for cycle in open_cycles)
    return waiting and connection.flow.read_paused and _peer_hung_up(connection.transport)
