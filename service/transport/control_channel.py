"""The supervisor's control channel: the one way anything reaches the main process, over a ZeroMQ
socket in the channels' directory (``ipc://<channels dir>/control``).

Two kinds of message travel on it, each answered:

- ``WorkerReport``, from an inference worker: it is loaded and ready, or its setup failed and why
  (service/worker/process.py sends them). The main process keeps every worker's state
  (service/supervisor/pool/states.py) and publishes it to the HTTP processes in the routing table
  (service/repository/table.py): worker readiness, failure and restart travel this one way.
- ``ControlRequest``, from an HTTP process (or the gRPC service in it): Triton's repository extension
  (index, load, unload; service/repository/http_calls.py). Loads take seconds to minutes, so each
  call has a socket of its own and a timeout, and the main process runs each in a thread of its own
  (service/supervisor/pool/repository_operations.py).

Only vision-serve's own processes connect (the directory is private to the server); a message that
cannot be read is logged and dropped, never fatal.
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
# From an HTTP process with a request for a model that is not resident (a repository served on
# demand): load it, making room if the memory budget is short, and answer once this table serves it.
ENSURE = "ensure"
POLL_INTERVAL_MS = 50
# How long a worker waits for the main process to take its report: it is there unless it is stopping.
REPORT_TIMEOUT_MS = 10_000

# A worker's states, as the main process keeps them and /ready shows them. UNRESPONSIVE is the main
# process's own verdict, never a report: no heartbeat, or one batch held far too long
# (service/supervisor/pool/hangs.py).
STARTING, READY, ERROR, UNRESPONSIVE = "starting", "ready", "error", "unresponsive"
# Reported by a model slot of a shared worker process whose loop ended (its version drained, or the
# main process stopped it): the process goes on serving its other models (service/worker/host.py).
EXITED = "exited"


@dataclass(frozen=True)
class ControlRequest:
    op: str  # INDEX, LOAD, UNLOAD or ENSURE
    model: str = ""
    config: str = ""  # a load's parameters.config: Triton's model config as JSON, or ""
    ready_only: bool = False  # an index of the loaded models only


@dataclass(frozen=True)
class ControlReply:
    status: int = 200  # an HTTP status; 400 for a load or unload that failed, as Triton answers
    error: str = ""
    index: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class WorkerReport:
    """An inference worker's state change: READY once loaded and warm, ERROR when its setup failed
    (``detail``: why, for the load call or the startup error that answers for it)."""

    worker_id: int
    state: str  # READY, ERROR or EXITED
    detail: str = ""
    # READY: what loading the model grew the worker process by (its engine, arena and warm-up), in bytes;
    # 0 when unknown. The memory budget counts it (service/supervisor/pool/).
    memory_bytes: int = 0
    # READY on a GPU: the device memory loading the model took (what cudaMemGetInfo saw go), in bytes.
    device_memory_bytes: int = 0
    exit_code: int = 0  # EXITED: 0 when its loop ended (drained or stopped), 1 when its model failed to load


ACK = b"ok"


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


def report_to_main_process(directory: str, report: WorkerReport, timeout_ms: int = REPORT_TIMEOUT_MS) -> bool:
    """Send a worker's ``report`` and wait until the main process took it; ``False`` if it did not
    within ``timeout_ms`` (it is stopping: the worker's exit is then all it needs to know)."""
    context = zmq.Context()
    socket = context.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(control_address(directory))
        socket.send(pickle.dumps(report, pickle.HIGHEST_PROTOCOL))
        return bool(socket.poll(timeout_ms)) and socket.recv() == ACK
    finally:
        socket.close()
        context.term()


class ControlServer:
    """The main process's end: a thread that takes every message. A ``WorkerReport`` goes to
    ``on_report`` at once (a dictionary update and a table write); a ``ControlRequest`` runs
    ``handle`` in a thread of its own (a load of one model must not hold up an index, another model's
    unload, or a worker's report)."""

    def __init__(
        self,
        directory: str,
        handle: Callable[[ControlRequest], ControlReply],
        on_report: Callable[[WorkerReport], None],
    ) -> None:
        self._address = control_address(directory)
        self._handle = handle
        self._on_report = on_report
        self._replies: queue.Queue[tuple[list[bytes], bytes]] = queue.Queue()
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="vision-serve-control", daemon=True)

    def start(self) -> None:
        """Start serving; returns once the socket is bound (workers may report from then on)."""
        self._thread.start()
        self._bound.wait()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(2.0)

    def _serve(self) -> None:
        context = zmq.Context()
        socket = context.socket(zmq.ROUTER)
        try:
            socket.bind(self._address)
        finally:
            self._bound.set()
        try:
            while not self._stop.is_set():
                if socket.poll(POLL_INTERVAL_MS):
                    *envelope, payload = socket.recv_multipart()
                    self._take(envelope, payload)
                while not self._replies.empty():
                    envelope, reply = self._replies.get_nowait()
                    socket.send_multipart([*envelope, reply])
        finally:
            context.destroy(linger=0)

    def _take(self, envelope: list[bytes], payload: bytes) -> None:
        try:
            message = pickle.loads(payload)
        except Exception:  # only our own processes connect; still, never die on a message
            logger.exception("A control message could not be read.")
            return
        if isinstance(message, WorkerReport):
            try:
                self._on_report(message)
            except Exception:
                logger.exception("Worker %d's report could not be taken.", message.worker_id)
            self._replies.put((envelope, ACK))
        elif isinstance(message, ControlRequest):
            threading.Thread(
                target=self._run, args=(envelope, message), name=f"vision-serve-{message.op}", daemon=True
            ).start()
        else:
            logger.error("A control message of an unknown kind (%s) was dropped.", type(message).__name__)

    def _run(self, envelope: list[bytes], request: ControlRequest) -> None:
        try:
            reply = self._handle(request)
        except Exception as exc:
            logger.exception("The repository %s call for %r failed.", request.op, request.model)
            reply = ControlReply(500, f"The {request.op} call failed inside the server: {exc!r}; see its log.")
        self._replies.put((envelope, pickle.dumps(reply, pickle.HIGHEST_PROTOCOL)))
