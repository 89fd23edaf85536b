"""Loading on demand, as an HTTP process sees it: a request for a model version that is not resident
(a repository served under a memory budget: service/supervisor/pool/on_demand.py) asks the main
process to load it, and waits, within its deadline, until the routing table this process follows
serves it. The requests of one HTTP process that wait for the same model share one call.
"""

from __future__ import annotations

import asyncio
import time

from service.errors import Unavailable
from service.http.base.deadlines import ClientDeadline, within
from service.transport.control_channel import ENSURE, ControlReply, ControlRequest, call_main_process


class ModelLoads:
    """One call to the main process per model at a time, shared by every request that waits for it
    (a client that gives up does not cancel it for the others)."""

    def __init__(self, channels_directory: str, timeout_s: float) -> None:
        """``timeout_s``: the longest a load may take before the waiting requests get a 503
        (--request-timeout-s: a request waits no longer for anything)."""
        self.directory = channels_directory
        self.timeout_s = timeout_s
        self._calls: dict[str, asyncio.Task[ControlReply]] = {}

    def start(self, name: str) -> asyncio.Task[ControlReply]:
        """The call that brings ``name`` in: the one already under way, or a new one."""
        call = self._calls.get(name)
        if call is None:
            call = asyncio.ensure_future(self._call(name))
            self._calls[name] = call
            call.add_done_callback(lambda _done: self._calls.pop(name, None))
        return call

    async def wait(self, name: str, deadline: ClientDeadline | None) -> float:
        """Until ``name`` is loaded and this process's table serves it; the milliseconds waited.
        ``Unavailable`` (503) with the main process's reason when it could not be loaded;
        ``DeadlineExceeded`` (504) when the client's deadline passes first."""
        started = time.monotonic()
        reply = await within(deadline, asyncio.shield(self.start(name)))
        if reply.status != 200:
            raise Unavailable(reply.error)
        return (time.monotonic() - started) * 1e3

    async def _call(self, name: str) -> ControlReply:
        return await call_main_process(self.directory, ControlRequest(ENSURE, name), self.timeout_s)
