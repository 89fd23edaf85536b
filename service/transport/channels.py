"""Requests to the inference workers and answers back: ZeroMQ over Unix sockets, no broker.

LitServe moves every request and every answer through multiprocessing-manager queues: each hop is
a blocking, pickled round trip through a third process, made on the HTTP process's event loop. Here
each side talks to the other directly.

Here:
- every worker binds one PULL socket for its requests, and holds one PUSH socket per HTTP
  process for the answers;
- every HTTP process binds one PULL socket for its answers, and holds one PUSH socket per worker.
  It picks the worker itself (the ready one with the fewest of its requests unanswered), so it
  always knows which worker holds which request: when a worker dies, ``fail_worker`` answers its
  requests at once and drops what was still queued for it.

Messages go in batches both ways: the requests an HTTP process submits in one turn of its event
loop leave as one message per worker (sent at the end of that turn), and a batch's answers leave as
one message per HTTP process: each ZeroMQ send wakes an I/O thread on both sides, a cost to pay
per message rather than per request.

Sends never block (``NOBLOCK``): a full pipe is an overload, and its requests are answered 503.
Messages are the pickled types of service/wire.py: ``RequestBatch`` one way, ``AnswerBatch`` the
other.

A request whose client left (service/http/base/request_scope.py) is dropped wherever it still is: taken
out of this turn's message if it was not sent yet, else named to its worker on a third socket, the
worker's cancel socket, which the worker reads before it prepares each batch (requests wait in the
request pipe; a cancel behind them there would arrive too late).

Every request a worker receives is answered exactly once, also one it drops (a 504 past its deadline,
``DROPPED`` for one whose client left): until then the HTTP process holds it (``ApiChannel``), with
its admission slot (``release``), even after its client had its 504 or left. So what ``--max-queue``
admits bounds every image buffered anywhere on the way (this turn's message, the pipe, the worker's
queue, its batch), whatever the deadlines: a 504 does not make room for another image while its own
still waits in the pipe.

Workers come and go with model loads (service/supervisor/pool/workers.py): an HTTP process connects to a
worker on its first request, and ``retire`` sends a worker the final message after everything else
this process sent it, so the worker can tell when it has answered all it will ever get (``drained``).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import shutil
import tempfile
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio

from service.errors import ClientClosed, Overloaded, Unavailable
from service.metrics import metrics
from service.transport.held_requests import HeldRequests
from service.transport.worker_queue import WorkerQueue
from service.wire import AbandonedRequests, Answer, AnswerBatch, ImageRequest, QueuedRequest, RequestBatch, answer_for

logger = logging.getLogger(__name__)

# Far above what admission lets in (--max-queue): a full pipe means a worker that stopped reading.
SEND_HIGH_WATER_MARK = 100_000
PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL
# A worker's answer for a request it dropped because its client left: nobody reads it, but it tells the
# HTTP process the image is gone, and its admission slot comes back.
DROPPED = answer_for(ClientClosed("Dropped unrun: its client left."))
GONE = answer_for(Unavailable("The inference worker holding this request is gone; retrying it is safe."))


@dataclass(frozen=True)
class ChannelConfig:
    """Where the sockets live; made in the main process and handed to every process of the server."""

    directory: str
    api_servers: int

    @classmethod
    def create(cls, api_servers: int) -> ChannelConfig:
        return cls(tempfile.mkdtemp(prefix="vision-serve-ipc-"), api_servers)

    def request_address(self, worker_id: int) -> str:
        return f"ipc://{self.directory}/requests-{worker_id}"

    def cancel_address(self, worker_id: int) -> str:
        return f"ipc://{self.directory}/cancels-{worker_id}"

    def answer_address(self, api_server: int) -> str:
        return f"ipc://{self.directory}/answers-{api_server}"

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class WorkerChannel:
    """The inference worker's end: requests in, answers out."""

    def __init__(self, config: ChannelConfig, worker_id: int) -> None:
        self._context = zmq.Context()
        self._requests = self._context.socket(zmq.PULL)
        self._requests.bind(config.request_address(worker_id))
        self._cancels = self._context.socket(zmq.PULL)
        self._cancels.bind(config.cancel_address(worker_id))
        self._answers = []
        for api_server in range(config.api_servers):
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER_MARK)
            socket.setsockopt(zmq.LINGER, 1000)  # answers still queued at exit get a second to leave
            socket.connect(config.answer_address(api_server))
            self._answers.append(socket)
        # A pipelined worker answers from two threads (expired requests from the one that takes
        # them); a ZeroMQ socket must not be used by two threads at once.
        self._answer_lock = threading.Lock()
        self._received = WorkerQueue()  # received and not taken yet; and the cancels not matched yet
        self._dropped: list[QueuedRequest] = []  # dropped for their cancel, not yet answered ``DROPPED``
        self._api_servers = config.api_servers
        self._finished: set[int] = set()  # HTTP processes that sent their final message

    @property
    def drained(self) -> bool:
        """Every HTTP process said it sends nothing more, and every request taken was handed out."""
        return len(self._finished) >= self._api_servers and not self._received

    def receive(self, timeout_s: float | None, newest: bool = False) -> QueuedRequest | None:
        """The next request: the oldest received, or the newest (call ``read_pending`` first, so that
        it is the newest sent); ``None`` if none came within ``timeout_s`` (0: only one already here),
        or at once once ``drained``."""
        while not self._received:
            if self.drained:
                return None
            if timeout_s is not None and not self._requests.poll(max(0, round(timeout_s * 1000))):
                return None
            self._take_message()
        return self._received.take(newest)

    def read_pending(self) -> None:
        """Receive every message already sent, without waiting."""
        while self._requests.poll(0):
            self._take_message()

    def _take_message(self) -> None:
        batch: RequestBatch = pickle.loads(self._requests.recv())
        self._received.add(batch)
        if batch.final:
            self._finished.add(batch.api_server)

    def take_expired(self) -> list[QueuedRequest]:
        """The received requests whose deadline passed, taken out (to be answered 504)."""
        return self._received.take_expired()

    def read_cancels(self) -> int:
        """Take in the cancels the HTTP processes sent; returns how many requests they name. Those queued
        here are dropped now, the others when taken (``abandoned``)."""
        by_api_server: dict[int, list[int]] = {}
        while True:
            try:
                message: AbandonedRequests = pickle.loads(self._cancels.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            by_api_server.setdefault(message.api_server, []).extend(message.uids)
        dropped: list[QueuedRequest] = []  # one pass over the queue per HTTP process, however many messages it sent
        for api_server, uids in by_api_server.items():
            dropped += self._received.cancel(api_server, uids)
        if dropped:
            metrics().requests_abandoned.labels(where="worker").inc(len(dropped))
            self._dropped += dropped
        return sum(len(uids) for uids in by_api_server.values())

    def abandoned(self, queued: QueuedRequest) -> bool:
        """Whether ``queued``'s client left (as of the last ``read_cancels``): drop it unrun (its
        ``DROPPED`` answer leaves at the next ``answer_dropped``)."""
        if self._received.abandoned(queued):
            self._dropped.append(queued)
            return True
        return False

    def drop_abandoned(self, batch: list[QueuedRequest]) -> list[QueuedRequest]:
        """``batch`` without the requests whose client left, by the cancels read now."""
        self.read_cancels()
        kept = [queued for queued in batch if not self.abandoned(queued)]
        if len(kept) < len(batch):
            metrics().requests_abandoned.labels(where="worker").inc(len(batch) - len(kept))
        self._received.forget_matched()
        return kept

    def answer_dropped(self) -> None:
        """Answer ``DROPPED`` to the requests dropped for their cancel since the last call: one message
        per HTTP process, which then frees their admission slots."""
        if self._dropped:
            dropped, self._dropped = self._dropped, []
            self.answer_many([(queued, DROPPED) for queued in dropped])

    def answer(self, request: QueuedRequest, answer: Answer) -> None:
        self.answer_many([(request, answer)])

    def answer_many(self, answers: list[tuple[QueuedRequest, Answer]]) -> None:
        """Each request with its answer: one message per HTTP process, whatever their number (a
        batch's answers cost one send each way, not one per request)."""
        by_api_server: dict[int, AnswerBatch] = {}
        for request, answer in answers:
            batch = by_api_server.get(request.api_server)
            if batch is None:
                batch = by_api_server[request.api_server] = AnswerBatch([], [])
            batch.uids.append(request.uid)
            batch.answers.append(answer)
        for api_server, batch in by_api_server.items():
            message = pickle.dumps(batch, PICKLE_PROTOCOL)
            try:
                with self._answer_lock:
                    self._answers[api_server].send(message, zmq.NOBLOCK)
            except zmq.Again:
                # That HTTP process stopped reading (it is gone): nobody is waiting for these answers.
                logger.debug("Dropped %d answer(s): HTTP process %d does not read.", len(batch.uids), api_server)

    def close(self, linger_ms: int = 0) -> None:
        """Close the sockets; answers still queued get ``linger_ms`` to leave."""
        self._context.destroy(linger=linger_ms)


def _push_socket(context: zmq.Context, address: str) -> zmq.Socket:
    """A PUSH socket to a worker, connected: what it holds is discarded when closed (see ``close``)."""
    socket = context.socket(zmq.PUSH)
    socket.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER_MARK)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    return socket


class WorkerSockets:
    """An HTTP process's request sockets, one per worker id, made on first use (workers start and
    stop with model loads), each in a ZeroMQ context of its own: see ``close``."""

    def __init__(self, config: ChannelConfig) -> None:
        self._config = config
        self._sockets: dict[int, zmq.Socket] = {}
        self._cancel_sockets: dict[int, zmq.Socket] = {}

    def __getitem__(self, worker_id: int) -> zmq.Socket:
        socket = self._sockets.get(worker_id)
        if socket is None:
            socket = self._sockets[worker_id] = _push_socket(zmq.Context(), self._config.request_address(worker_id))
        return socket

    def cancels(self, worker_id: int) -> zmq.Socket:
        """The socket to ``worker_id``'s cancel channel, in the context of its request socket."""
        socket = self._cancel_sockets.get(worker_id)
        if socket is None:
            context = self[worker_id].context
            socket = self._cancel_sockets[worker_id] = _push_socket(context, self._config.cancel_address(worker_id))
        return socket

    def close(self, worker_id: int) -> None:
        """Close the socket to ``worker_id`` and discard what is queued in it, before returning.

        ``zmq_close`` alone only hands the socket to its context's reaper thread: until that thread
        gets to it, the socket's connection keeps retrying the worker's address (every 100 ms), and a
        restarted worker that binds in that window receives the queued requests. So each worker's
        socket has a context of its own, and terminating that context waits until the socket and its
        queue are gone. A restarted worker binds only once it is ready, after this process has seen
        it not ready and purged here (service/http/base/worker_watch.py).
        """
        self._cancel_sockets.pop(worker_id, None)  # in the same context
        socket = self._sockets.pop(worker_id, None)
        if socket is not None:
            socket.context.destroy(linger=0)

    def close_all(self) -> None:
        for worker_id in list(self._sockets):
            self.close(worker_id)


def unsend(outbox: RequestBatch | None, uid: int) -> bool:
    """Take request ``uid`` out of a message not sent yet; False if it is not there."""
    if outbox is None or uid not in outbox.uids:
        return False
    at = outbox.uids.index(uid)
    del outbox.uids[at], outbox.requests[at]
    return True


class CancelOutbox:
    """The abandoned requests an HTTP process names to their workers at its next flush: one message
    per worker, on the worker's cancel channel."""

    def __init__(self, api_server: int, sockets: WorkerSockets) -> None:
        self.api_server = api_server
        self._sockets = sockets
        self._uids: dict[int, list[int]] = {}

    def __bool__(self) -> bool:
        return bool(self._uids)

    def add(self, worker_id: int, uid: int) -> None:
        self._uids.setdefault(worker_id, []).append(uid)

    def send(self) -> None:
        queued, self._uids = self._uids, {}
        for worker_id, uids in queued.items():
            message = pickle.dumps(AbandonedRequests(self.api_server, uids), PICKLE_PROTOCOL)
            try:
                self._sockets.cancels(worker_id).send(message, zmq.NOBLOCK)
            except zmq.Again:  # the worker does not read: it will find these past their deadline
                logger.debug("Could not tell worker %d of %d abandoned request(s).", worker_id, len(uids))


class ApiChannel:
    """The HTTP process's end: sends requests to a worker of its choice, awaits their answers.

    Each request is ``held`` (service/transport/held_requests.py) until its worker answers or drops it,
    whether or not anybody still waits for its answer; then its admission slot comes back.
    """

    def __init__(self, config: ChannelConfig, api_server: int) -> None:
        self.api_server = api_server
        self._async_context = zmq.asyncio.Context()
        self._answers = self._async_context.socket(zmq.PULL)
        self._answers.bind(config.answer_address(api_server))
        self._requests = WorkerSockets(config)
        self.held = HeldRequests()
        self._outbox: dict[int, RequestBatch] = {}
        self._cancels = CancelOutbox(api_server, self._requests)
        self._retired: set[int] = set()
        self._flush_scheduled = False

    def place_workers(self, processes: dict[int, int]) -> None:
        """Which process each worker runs in (worker id -> pid), from the routing table."""
        self.held.process_of = processes

    def pick_worker(self, ready: Sequence[int]) -> int | None:
        """The ready worker whose process holds the fewest of this process's requests, of those the
        fewest itself. By process first: a model's workers sit in the shared worker processes beside
        every other model's, and with traffic spread over many models each model's workers mostly
        hold none, so a pick by worker alone would send every model's requests to its first worker,
        all in one process, while the others idle."""
        if len(ready) < 2:
            return ready[0] if ready else None
        held = self.held
        per_process, per_worker, process = held.per_process, held.per_worker, held.process
        return min(ready, key=lambda worker: (per_process[process(worker)], per_worker[worker]))

    def submit(self, worker_id: int, uid: int, request: ImageRequest) -> asyncio.Future[Answer]:
        """Queue ``request`` on ``worker_id``; the future gets its ``Answer`` (503 if the pipe is full).

        Sent at the end of this turn of the event loop, with the others submitted in it.
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.held.add(uid, worker_id, future)
        outbox = self._outbox.get(worker_id)
        if outbox is None:
            outbox = self._outbox[worker_id] = RequestBatch(self.api_server, [], [])
        outbox.uids.append(uid)
        outbox.requests.append(request)
        if not self._flush_scheduled:
            self._schedule_flush(loop)
        return future

    def _schedule_flush(self, loop: asyncio.AbstractEventLoop) -> None:
        """Flush at the end of this turn of the event loop, once, whatever was submitted or cancelled in it."""
        self._flush_scheduled = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        """Send what was submitted since the last flush: one message per worker."""
        self._flush_scheduled = False
        if self._cancels:
            self._cancels.send()
        outboxes, self._outbox = self._outbox, {}
        held = self.held
        for worker_id, outbox in outboxes.items():
            if not outbox.uids:  # every request in it was abandoned
                continue
            try:
                self._requests[worker_id].send(pickle.dumps(outbox, PICKLE_PROTOCOL), zmq.NOBLOCK)
            except zmq.Again:
                overloaded = answer_for(
                    Overloaded(
                        f"The server is overloaded (inference worker {worker_id} is not reading its requests); retry."
                    )
                )
                held.let_go(sum(held.settle(uid, overloaded) for uid in outbox.uids))

    def abandon(self, uids: Collection[int], expired: bool = False) -> None:
        """Nobody waits for these: drop the ones not answered yet, from this turn's message if not sent, else
        by a cancel to their worker; ``expired`` ones (deadline passed) the worker drops by their deadline.
        Those sent stay held until their worker's answer (its 504 or ``DROPPED``) says they are gone."""
        held, dropped_here = self.held, 0
        for uid in uids:
            worker_id = held.worker_of(uid)
            if worker_id is None:
                continue  # answered already
            if unsend(self._outbox.get(worker_id), uid):
                held.take(uid)
                dropped_here += 1
            elif not expired:
                self._cancels.add(worker_id, uid)
        if dropped_here:
            counter = metrics().requests_expired if expired else metrics().requests_abandoned.labels(where="http")
            counter.inc(dropped_here)
            held.let_go(dropped_here)
        if self._cancels and not self._flush_scheduled:
            self._schedule_flush(asyncio.get_running_loop())

    def retire(self, worker_id: int) -> None:
        """Send ``worker_id`` what is queued for it, then the final message: it gets nothing more
        from this process (its version was replaced or unloaded). Once per worker."""
        if worker_id in self._retired:
            return
        self._retired.add(worker_id)
        self.flush()
        final = RequestBatch(self.api_server, [], [], final=True)
        try:
            self._requests[worker_id].send(pickle.dumps(final, PICKLE_PROTOCOL), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("Inference worker %d does not read; it will be stopped at its drain deadline.", worker_id)

    def drop_worker(self, worker_id: int) -> None:
        """``worker_id`` is gone for good: close its socket; what it still held is let go (a submitter
        still waiting gets ``GONE``)."""
        self.held.let_go(self.held.settle_worker(worker_id, GONE))
        self._outbox.pop(worker_id, None)
        self._requests.close(worker_id)
        self._retired.discard(worker_id)

    def fail_worker(self, worker_id: int, answer: Answer) -> int:
        """Answer every request held by ``worker_id`` with ``answer``, and drop those it never took.

        Returns how many were held.
        """
        held = self.held.settle_worker(worker_id, answer)
        self._outbox.pop(worker_id, None)
        if held:
            # Requests still queued in the pipe would otherwise reach the restarted worker and run
            # for clients that already have their 503.
            self._requests.close(worker_id)
        self.held.let_go(held)
        return held

    async def receive_answers(self) -> None:
        """Route each answer to its waiting request; runs for the life of the HTTP process."""
        held = self.held
        while True:
            batch: AnswerBatch = pickle.loads(await self._answers.recv())
            held.let_go(sum(held.settle(uid, answer) for uid, answer in zip(batch.uids, batch.answers, strict=True)))

    def close(self) -> None:
        self.held.clear()  # nothing is held once the sockets are gone
        self._async_context.destroy(linger=0)
        self._requests.close_all()
