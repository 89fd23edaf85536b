"""How the inference worker takes a batch from the request queue.

LitServe 0.2.19's batched loop polls: it asks the queue for one request with a 1 ms timeout, over
and over, until the batch window ends. Its queue lives in a multiprocessing manager, so every poll
is a round trip between two processes: 1,000 a second while idle (measured: 8 % of a core in the
worker and 12 % in the manager with nothing to do), and with ``batch_timeout=0`` a tight loop that
never blocks. On a CPU box those cycles come out of the model's OpenMP threads.

This loop blocks on the first request instead, then takes whatever else is already queued without
waiting, and only then waits out the batch window (``--batch-timeout-ms``) if the batch is not
full. With the default window of 0 that is greedy batching: an idle server runs a lone request at
once, and under load batches fill from the requests that queued while the model was busy.

Requests whose deadline passed while queued are answered 504 here, counted in
``vision_serve_requests_expired_total`` and logged as one summary line at most every few seconds:
LitServe logs an ERROR line per request, which floods the log exactly when the server is overloaded.

The loop also serves ``--max-batch-size 1`` (a batch of one), so there is one request path.
"""

from __future__ import annotations

import logging
import time
from queue import Empty, Queue

from fastapi import HTTPException
from litserve import LitAPI
from litserve.loops.base import _SENTINEL_VALUE, _StopLoopError
from litserve.loops.simple_loops import BatchedLoop
from litserve.transport.base import MessageTransport
from litserve.utils import LitAPIStatus, LoopResponseType

from service.metrics import metrics

logger = logging.getLogger(__name__)

# How long one blocking wait for the first request lasts before the loop goes round again; it
# wakes at once when a request (or the shutdown sentinel) arrives, so this only bounds idle wake-ups.
IDLE_WAIT_S = 1.0
EXPIRED_LOG_INTERVAL_S = 10.0

Payload = tuple[str, str, object]  # (response queue id, request uid, request)


class GreedyBatchedLoop(BatchedLoop):
    def __init__(self) -> None:
        super().__init__()
        self._expired_unlogged = 0
        self._expired_logged_at = 0.0

    def get_batch_requests(
        self, lit_api: LitAPI, request_queue: Queue, transport: MessageTransport
    ) -> tuple[list[Payload], list[tuple[str, str]]]:
        """Up to ``max_batch_size`` requests; ``([], [])`` after ``IDLE_WAIT_S`` with none.

        Expired requests are answered here, so the second element (LitServe's to answer) is always empty.
        """
        payloads: list[Payload] = []
        expired = 0
        first_taken = window_ends = None
        apply_timeout = lit_api.request_timeout not in (-1, False)
        while len(payloads) < lit_api.max_batch_size:
            try:
                if first_taken is None:
                    item = request_queue.get(timeout=IDLE_WAIT_S)
                elif window_ends is None:
                    item = request_queue.get_nowait()
                else:
                    remaining = window_ends - time.monotonic()
                    if remaining <= 0:
                        break
                    item = request_queue.get(timeout=remaining)
            except Empty:
                if first_taken is None:
                    break  # idle: the caller loops and comes back
                if window_ends is None and lit_api.batch_timeout > 0:
                    window_ends = first_taken + lit_api.batch_timeout  # queue drained: now wait out the window
                    continue
                break
            if item == _SENTINEL_VALUE:
                raise _StopLoopError()
            first_taken = first_taken or time.monotonic()
            response_queue_id, uid, queued_at, request = item
            # START tells the HTTP process which worker holds the request (service/worker_watch.py).
            self.put_response(transport, response_queue_id, uid, (), LitAPIStatus.START, LoopResponseType.REGULAR)
            if apply_timeout and time.monotonic() - queued_at > lit_api.request_timeout:
                # Its client already got a 504 from the HTTP process: do not run it.
                self.put_response(
                    transport,
                    response_queue_id,
                    uid,
                    HTTPException(504, "Request timed out"),
                    LitAPIStatus.ERROR,
                    LoopResponseType.REGULAR,
                )
                expired += 1
            else:
                payloads.append((response_queue_id, uid, request))
        if expired:
            self._note_expired(expired, lit_api.request_timeout)
        return payloads, []

    def _note_expired(self, count: int, timeout_s: float) -> None:
        metrics().requests_expired.inc(count)
        self._expired_unlogged += count
        now = time.monotonic()
        if now - self._expired_logged_at >= EXPIRED_LOG_INTERVAL_S:
            logger.warning(
                "Dropped %d request(s) that waited longer than the %g s deadline (--request-timeout-s) before "
                "running: the server is overloaded. Counted in vision_serve_requests_expired_total.",
                self._expired_unlogged,
                timeout_s,
            )
            self._expired_unlogged = 0
            self._expired_logged_at = now
