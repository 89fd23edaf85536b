"""Triton's repository extension, between an HTTP process and the main process: the typed messages
and the ZeroMQ socket they travel over (``ipc://<channels dir>/control``).

An HTTP process (or the gRPC service in it) that gets ``POST /v2/repository/...`` sends a
``ControlRequest`` and awaits the ``ControlReply`` (``call_main_process``); the main process's
``ControlServer`` hands it to service/supervisor/pool/repository_operations.py, which carries it
out: loads take seconds to minutes, so each call has a socket of its own and a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

logger = logging.getLogger(__name__)

INDEX, LOAD, UNLOAD = "index", "load", "unload"
POLL_INTERVAL_MS = 50


@dataclass(frozen=True)
class ControlRequest:
    op: str  # INDEX, LOAD or UNLOAD
    model: str = ""
    config: str = ""  # a load's parameters.config: Triton's model config as JSON, or ""
    ready_only: bool = False  # an index of the loaded models only


@dataclass(frozen=True)
class ControlReply:
    status: int = 200  # an HTTP status; 400 for a load or unload that failed, as Triton answers
    error: str = ""
    index: list[dict] = field(default_factory=list)


def control_address(directory: str) -> str:
    return f"ipc://{directory}/control"


async def call_main_process(directory: str, request: ControlRequest, timeout_s: float) -> ControlReply:
    """Send ``request`` to the main process and wait for its reply (503 after ``timeout_s``)."""
    context = zmq.asyncio.Context.instance()
    socket = context.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(control_address(directory))
    try:
        await socket.send(pickle.dumps(request, pickle.HIGHEST_PROTOCOL))
        try:
            return pickle.loads(await asyncio.wait_for(socket.recv(), timeout_s))
        except TimeoutError:
            return ControlReply(503, f"The main process did not answer the {request.op} call within {timeout_s:g} s.")
    finally:
        socket.close()


class ControlServer:
    """The main process's end: a thread that takes requests and runs ``handle`` for each in a thread
    of its own (a load of one model must not hold up an index or another model's unload)."""

    def __init__(self, directory: str, handle: Callable[[ControlRequest], ControlReply]) -> None:
        self._address = control_address(directory)
        self._handle = handle
        self._replies: queue.Queue[tuple[list[bytes], ControlReply]] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="vision-serve-control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)

    def _serve(self) -> None:
        context = zmq.Context()
        socket = context.socket(zmq.ROUTER)
        socket.bind(self._address)
        try:
            while not self._stop.is_set():
                if socket.poll(POLL_INTERVAL_MS):
                    *envelope, payload = socket.recv_multipart()
                    try:
                        request = pickle.loads(payload)
                    except Exception:  # only our own processes connect; still, never die on a message
                        logger.exception("A repository control message could not be read.")
                        continue
                    threading.Thread(
                        target=self._run, args=(envelope, request), name=f"vision-serve-{request.op}", daemon=True
                    ).start()
                while not self._replies.empty():
                    envelope, reply = self._replies.get_nowait()
                    socket.send_multipart([*envelope, pickle.dumps(reply, pickle.HIGHEST_PROTOCOL)])
        finally:
            context.destroy(linger=0)

    def _run(self, envelope: list[bytes], request: ControlRequest) -> None:
        try:
            reply = self._handle(request)
        except Exception as exc:
            logger.exception("The repository %s call for %r failed.", request.op, request.model)
            reply = ControlReply(500, f"The {request.op} call failed inside the server: {exc!r}; see its log.")
        self._replies.put((envelope, reply))
