"""How the inference worker takes a batch from its request channel, and drops the requests whose
deadline passed while they queued.

LitServe 0.2.19's batched loop polls: it asks its queue for one request with a 1 ms timeout, over
and over, until the batch window ends, and each ask is a round trip to a multiprocessing manager.
``BatchCollector`` blocks on the first request instead (service/transport/channels.py: a socket of
its own), then takes whatever else is already queued without waiting, and only then waits out the
batch window (``--batch-timeout-ms``) if the batch is not full. With the default window of 0 that is
greedy batching: an idle server runs a lone request at once, and under load batches fill from the
requests that queued while the model was busy.

Requests whose client left (service/transport/channels.py: the cancel channel) are left out of the
batch unrun, before it is prepared, and the batch fills with others in their place; each is answered
``DROPPED``, which nobody reads but which frees its admission slot in its HTTP process. Clients that
leave also say the queue has grown older than they wait: first come, first served would then answer
the oldest, who give up as their answer is computed, while the newest give up waiting behind them.
So while clients keep leaving (for ``LEAVING_FOR_S``, then until ``NEWEST_FIRST_HOLD_S`` after the
last one left), batches take the newest requests first (Facebook's "adaptive LIFO"); the oldest
are dropped when their clients leave, or answered 504 at their deadline. A deadline that passes in
the queue (the client's own, or --request-timeout-s) says the same as a client leaving. Requests
whose deadline passed while queued are answered 504 here and left out of the batch;
``ExpiredRequestLog`` counts them in ``vision_serve_requests_expired_total`` and logs them as one
summary line at most every few seconds.
"""

from __future__ import annotations

import logging
import time

from service.errors import DeadlineExceeded
from service.metrics import metrics
from service.transport.channels import WorkerChannel
from service.wire import ImageRequest, QueuedRequest, answer_for
from service.worker.contract import BatchPolicy

logger = logging.getLogger(__name__)

# How long one blocking wait for the first request lasts before the loop goes round again; it
# wakes at once when a request arrives, so this only bounds idle wake-ups.
IDLE_WAIT_S = 1.0
EXPIRED_LOG_INTERVAL_S = 10.0
# Clients that keep leaving for LEAVING_FOR_S make the collector take the newest requests first, until
# NEWEST_FIRST_HOLD_S after the last one left.
LEAVING_FOR_S = 1.0
NEWEST_FIRST_HOLD_S = 5.0
# A request that expired in the queue says the queue is older than clients wait only if its client
# waited a while: a client that sets a 1 ms deadline must not turn the order round for all the others.
SIGNALLING_TIMEOUT_S = 0.25


class BatchCollector:
    """Takes batches of up to ``policy.max_batch_size`` requests from ``channel``."""

    def __init__(self, channel: WorkerChannel, policy: BatchPolicy) -> None:
        self.channel = channel
        self.policy = policy
        self.expired = ExpiredRequestLog()
        # time.monotonic(): until when to take the newest first; since when, and when last, clients left.
        self.newest_first_until = self.leaving_since = self.last_left = 0.0

    def get_batch(self) -> list[QueuedRequest]:
        """Up to ``max_batch_size`` requests; ``[]`` after ``IDLE_WAIT_S`` with none.

        Expired requests are answered 504 here and left out; abandoned ones are left out, answered ``DROPPED``.
        """
        channel, policy = self.channel, self.policy
        newest = time.monotonic() < self.newest_first_until
        if newest:  # the oldest wait at the far end: answer them when their deadline passes
            channel.read_pending()
            # Each one that waited a while keeps the order newest-first: the queue is still older than
            # clients wait (the batches themselves take only new requests, which have not expired).
            if self._answer_expired(channel.take_expired()):
                self.clients_leaving()
        batch: list[QueuedRequest] = []
        abandoned = expired = 0
        first_taken = window_ends = None
        while len(batch) < policy.max_batch_size:
            if first_taken is None:
                queued = channel.receive(IDLE_WAIT_S, newest)
            elif window_ends is None:
                queued = channel.receive(0, newest)
            else:
                remaining = window_ends - time.monotonic()
                queued = channel.receive(remaining, newest) if remaining > 0 else None
                if queued is None:
                    break
            if queued is None:
                if first_taken is None:
                    break  # idle: the caller loops and comes back
                if window_ends is None and policy.batch_timeout_s > 0:
                    window_ends = first_taken + policy.batch_timeout_s  # queue drained: now wait out the window
                    continue
                break
            if first_taken is None:
                first_taken = time.monotonic()
                if channel.read_cancels():  # once per batch: each read is a system call
                    self.clients_leaving()
            left_abandoned, left_expired = self._admit(queued, batch)
            abandoned += left_abandoned
            expired += left_expired
        return self._close(batch, abandoned, expired)

    def top_up(self, batch: list[QueuedRequest]) -> list[QueuedRequest]:
        """``batch`` with the requests that queued since it was taken, up to ``max_batch_size``,
        without waiting for more; those whose client left meanwhile are dropped from it."""
        channel = self.channel
        newest = time.monotonic() < self.newest_first_until
        if channel.read_cancels():
            self.clients_leaving()
        abandoned = expired = 0
        while len(batch) < self.policy.max_batch_size:
            queued = channel.receive(0, newest)
            if queued is None:
                break
            left_abandoned, left_expired = self._admit(queued, batch)
            abandoned += left_abandoned
            expired += left_expired
        return self._close(batch, abandoned, expired)

    def _admit(self, queued: QueuedRequest, batch: list[QueuedRequest]) -> tuple[int, int]:
        """Add ``queued`` to ``batch``, or leave it out: (1, 0) if its client left; (0, 1) if its
        deadline passed after it waited a while (answered 504 here), (0, 0) if it passed sooner."""
        if queued.request.expired(time.monotonic()):
            # Its client already got a 504 from the HTTP process: do not run it.
            return 0, self._answer_expired([queued])
        if self.channel.abandoned(queued):
            return 1, 0  # its client left: nobody waits for an answer, and its place goes to another
        batch.append(queued)
        return 0, 0

    def _close(self, batch: list[QueuedRequest], abandoned: int, expired: int) -> list[QueuedRequest]:
        """Count what was left out, and drop from ``batch`` the requests cancelled while it was taken."""
        if abandoned:
            metrics().requests_abandoned.labels(where="worker").inc(abandoned)
        if abandoned or expired:  # a deadline that passed in the queue says what a client leaving does
            self.clients_leaving()
        # Again at the end, for cancels sent while this batch was collected (its window, if any).
        if batch:
            batch = self.channel.drop_abandoned(batch)
        self.channel.answer_dropped()  # so that the HTTP processes free the dropped requests' slots
        return batch

    def clients_leaving(self) -> None:
        """Clients gave up on queued requests. If they have kept doing so for ``LEAVING_FOR_S``, the queue
        is older than they wait: take the newest first for a while, who can still be answered in time,
        while the oldest would be answered to nobody. (One burst of departures, such as a load
        generator stopping, says nothing of the queue's age.)"""
        now = time.monotonic()
        if now - self.last_left > NEWEST_FIRST_HOLD_S:
            self.leaving_since = now  # the first departure in a while
        self.last_left = now
        if now - self.leaving_since >= LEAVING_FOR_S:
            self.newest_first_until = now + NEWEST_FIRST_HOLD_S

    def _answer_expired(self, expired: list[QueuedRequest]) -> int:
        """Answer ``expired`` 504 and count them; how many of them say clients are leaving
        (``waited_a_while``)."""
        if not expired:
            return 0
        # Seen only if the worker gets there before the HTTP process's own 504, which names the deadline.
        timed_out = answer_for(DeadlineExceeded("The request's deadline passed while it was queued."))
        self.channel.answer_many([(queued, timed_out) for queued in expired])
        self.expired.add(len(expired))
        return sum(waited_a_while(queued.request) for queued in expired)


def waited_a_while(request: ImageRequest) -> bool:
    """Whether ``request``'s deadline gave it at least ``SIGNALLING_TIMEOUT_S`` in the queue."""
    return request.queued_at is not None and request.deadline - request.queued_at >= SIGNALLING_TIMEOUT_S


class ExpiredRequestLog:
    """How many requests were dropped for their deadline: counted in the metric at once, logged as
    one warning per ``EXPIRED_LOG_INTERVAL_S`` at most (an overload drops many)."""

    def __init__(self) -> None:
        self._unlogged = 0
        self._logged_at = 0.0

    def add(self, count: int) -> None:  # from either thread of a pipelined loop: a few ints
        metrics().requests_expired.inc(count)
        self._unlogged += count
        now = time.monotonic()
        if now - self._logged_at >= EXPIRED_LOG_INTERVAL_S:
            logger.warning(
                "Dropped %d request(s) whose deadline (their client's, or --request-timeout-s) passed before "
                "they ran: the server is overloaded. Counted in vision_serve_requests_expired_total.",
                self._unlogged,
            )
            self._unlogged = 0
            self._logged_at = now
