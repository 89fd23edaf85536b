"""Submit: admitted images to ready workers, and their answers back by one deadline.

Each image is its own batch item: the workers batch images, not requests, so a request of 64 images
fills two batches of 32 and shares them with other requests. A client that leaves while they wait
(its connection closes: service/request_scope.py; its gRPC call is cancelled) has them dropped
wherever they are, unrun.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Sequence

from service.errors import ClientClosed, DeadlineExceeded
from service.logs import REQUEST_ID
from service.metrics import metrics
from service.request_scope import Departure
from service.tracing import current_traceparent, wait_span
from service.transport.channels import ApiChannel
from service.wire import Answer, ImageRequest, answer_for

# The answer of an image whose client left before it was ready: nobody reads it, but the access log
# and vision_serve_requests_total count the request as 499.
CLIENT_LEFT = answer_for(ClientClosed("The client left before its answer was ready."))


class Submission:
    """Sends each image to a worker and waits for every answer until ``timeout_s``. One per HTTP
    process's pipeline: its uids are unique in the process, which is all the answers need (they come
    back to this process only)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._uids = itertools.count()

    async def submit(
        self,
        channel: ApiChannel,
        ready: Sequence[int],
        images: Sequence[bytes],
        top_k: int,
        departure: Departure | None,
    ) -> tuple[list[Answer], float]:
        """Each image's ``Answer`` in input order (a 504 ``Answer`` for one not answered by the
        deadline, ``CLIENT_LEFT`` once ``departure`` is told), and the milliseconds from the submit
        to the last answer. ``ready``: the workers that may take them."""
        # The whole wait in one span, so that current_traceparent() below names it (traced requests,
        # service/tracing/): the workers' spans become its children.
        with wait_span():
            # The worker drops images older than the deadline instead of running them, so timed-out
            # work does not pile up.
            queued_at = time.monotonic()
            request_id = REQUEST_ID.get()
            trace_parent = current_traceparent()  # None unless the request is traced
            uids = [next(self._uids) for _ in images]
            left = True  # until every answer is in: an exception or a cancellation on the way means nobody waits
            try:
                futures = []
                for uid, image in zip(uids, images, strict=True):
                    # Picked per image: each pick counts the images before it, so several workers share a request.
                    worker_id = channel.pick_worker(ready)
                    request = ImageRequest(image, top_k, queued_at, request_id, trace_parent)
                    futures.append(channel.submit(worker_id, uid, request))
                # One timer on the futures themselves: asyncio.wait_for adds a future and callbacks per image.
                expiry = asyncio.get_running_loop().call_later(self.timeout_s, _expire, futures, self.timeout_s)
                if departure is not None:
                    departure.listener = functools.partial(_settle_all, futures, CLIENT_LEFT)
                try:
                    answers = [await future for future in futures]
                    left = departure is not None and departure.gone
                finally:
                    expiry.cancel()
                    if departure is not None:
                        departure.listener = None
            finally:
                if left:
                    channel.abandon(uids)  # what is still queued for them is dropped unrun
                else:
                    for uid in uids:
                        channel.forget(uid)  # a late answer then finds no one waiting and is dropped
                # Every admitted request, answered or not: the stage a dashboard's p99 is read from.
                total_ms = (time.monotonic() - queued_at) * 1e3
                metrics().observe_stages({"total": total_ms})
        return answers, total_ms


def _expire(futures: Sequence[asyncio.Future[Answer]], timeout_s: float) -> None:
    timed_out = answer_for(
        DeadlineExceeded(
            f"No answer within the {timeout_s:g} s deadline (--request-timeout-s): the server is overloaded "
            "or its batches are too slow."
        )
    )
    _settle_all(futures, timed_out)


def _settle_all(futures: Sequence[asyncio.Future[Answer]], answer: Answer) -> None:
    """Answer each of ``futures`` not answered yet with ``answer`` (the deadline, a client that left)."""
    for future in futures:
        if not future.done():
            future.set_result(answer)
