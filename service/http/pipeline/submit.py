"""Submit: admitted images to ready workers, and their answers back by one deadline.

Each image is its own batch item: the workers batch images, not requests, so a request of 64 images
fills two batches of 32 and shares them with other requests. A client that leaves while they wait
(its connection closes: service/http/base/request_scope.py; its gRPC call is cancelled) has them dropped
wherever they are, unrun; so does one whose deadline passes (its own, service/http/base/deadlines.py,
or the server's --request-timeout-s), and it is answered 504 at that moment. An image whose deadline
passed before it is submitted (a slow upload or cache lookup) is answered 504 at once and never sent.

The admission slots of the images sent are the channel's from then on (service/transport/channels.py):
each comes back when the worker answers or drops its image, not when its client stops waiting, so
that what --max-queue admits bounds what waits anywhere on the way to the workers.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Callable, Sequence

from service.errors import ClientClosed, DeadlineExceeded
from service.http.base.deadlines import ClientDeadline, ended_by
from service.http.base.request_scope import Departure
from service.logs import REQUEST_ID
from service.metrics import metrics
from service.tracing import current_traceparent, wait_span
from service.transport.channels import ApiChannel
from service.wire import Answer, ImageRequest, answer_for

# The answer of an image whose client left before it was ready: nobody reads it, but the access log
# and vision_serve_requests_total count the request as 499.
CLIENT_LEFT = answer_for(ClientClosed("The client left before its answer was ready."))


class Submission:
    """Sends each image to a worker and waits for every answer until its deadline: the client's if it
    set one (service/http/base/deadlines.py), capped by ``timeout_s`` (``--request-timeout-s``). One
    per HTTP process's pipeline: its uids are unique in the process, which is all the answers need
    (they come back to this process only).

    ``release``: the admission gate's. ``submit`` is given images already admitted; it releases the
    slots of those it does not send, and the channel those of the images it sent."""

    def __init__(self, timeout_s: float, release: Callable[[int], None]) -> None:
        self.timeout_s = timeout_s
        self._release = release
        self._uids = itertools.count()

    async def submit(
        self,
        channel: ApiChannel,
        ready: Sequence[int],
        images: Sequence[bytes],
        top_k: int,
        departure: Departure | None,
        deadline: ClientDeadline | None = None,
        logits: bool = False,
    ) -> tuple[list[Answer], float]:
        """Each image's ``Answer`` in input order (a 504 ``Answer`` for one not answered by the
        deadline, ``CLIENT_LEFT`` once ``departure`` is told), and the milliseconds from the submit
        to the last answer. ``ready``: the workers that may take them. The images' admission slots
        are taken already: see the class. ``logits``: the request asked for the model's whole output,
        which the workers then send back with each answer."""
        # The whole wait in one span, so that current_traceparent() below names it (traced requests,
        # service/tracing/): the workers' spans become its children.
        with wait_span():
            queued_at = time.monotonic()
            expiry = Expiry(queued_at + self.timeout_s, self.timeout_s, deadline)
            if expiry.at <= queued_at:  # the client's deadline passed in this process (a slow upload or lookup)
                self._release(len(images))  # nothing sent: nothing to wait for
                return expiry.answer_all(len(images)), 0.0
            request_id = REQUEST_ID.get()
            trace_parent = current_traceparent()  # None unless the request is traced
            uids = [next(self._uids) for _ in images]
            left = True  # until every answer is in: an exception or a cancellation on the way means nobody waits
            futures = expiry.futures
            try:
                for uid, image in zip(uids, images, strict=True):
                    # Picked per image: each pick counts the images before it, so several workers share a request.
                    worker_id = channel.pick_worker(ready)
                    # The worker drops an image past its deadline instead of running it (its answer
                    # is already out), so timed-out work does not pile up.
                    request = ImageRequest(image, top_k, queued_at, request_id, trace_parent, expiry.at, logits)
                    futures.append(channel.submit(worker_id, uid, request))  # its slot is the channel's now
                # One timer on the futures themselves: asyncio.wait_for adds a future and callbacks per image.
                timer = asyncio.get_running_loop().call_later(expiry.at - queued_at, expiry)
                if departure is not None:
                    departure.listener = functools.partial(_settle_all, futures, CLIENT_LEFT)
                try:
                    answers = [await future for future in futures]
                    left = departure is not None and departure.gone
                finally:
                    timer.cancel()
                    if departure is not None:
                        departure.listener = None
            finally:
                if len(futures) < len(images):  # an exception before every image was sent
                    self._release(len(images) - len(futures))
                if left or expiry.fired:
                    # What is still queued for them is dropped unrun: in this process if not sent yet, else
                    # by their worker (told on its cancel channel when the client left; past the deadline
                    # it drops them by their own), whose answer then frees their slots. Expired once the
                    # deadline passed, whoever noticed first (gRPC cancels a call at its deadline too).
                    channel.abandon(uids[: len(futures)], expired=expiry.fired or ended_by(expiry.at))
                # Every admitted request, answered or not: the stage a dashboard's p99 is read from.
                total_ms = (time.monotonic() - queued_at) * 1e3
                metrics().observe_stages({"total": total_ms})
        return answers, total_ms


class Expiry:
    """The deadline of one submission: the client's if it ends first, else the server's; as a timer
    callback, it answers every image not answered yet with a 504 that says which deadline passed."""

    __slots__ = ("_client", "_server_timeout_s", "at", "fired", "futures")

    def __init__(self, server_at: float, server_timeout_s: float, client: ClientDeadline | None) -> None:
        use_client = client is not None and client.at is not None and client.at < server_at
        self.at: float = client.at if use_client else server_at  # type: ignore[union-attr,assignment]
        self._client = client if use_client else None
        self._server_timeout_s = server_timeout_s
        self.fired = False
        self.futures: list[asyncio.Future[Answer]] = []

    def __call__(self) -> None:
        self.fired = True
        _settle_all(self.futures, self._answer())

    def answer_all(self, count: int) -> list[Answer]:
        """``count`` 504s, for images never submitted: counted as the workers count the ones they drop."""
        metrics().requests_expired.inc(count)
        return [self._answer()] * count

    def _answer(self) -> Answer:
        if self._client is not None:
            return answer_for(DeadlineExceeded(self._client.detail()))
        return answer_for(
            DeadlineExceeded(
                f"No answer within the {self._server_timeout_s:g} s deadline (--request-timeout-s): the server is "
                "overloaded or its batches are too slow."
            )
        )


def _settle_all(futures: Sequence[asyncio.Future[Answer]], answer: Answer) -> None:
    """Answer each of ``futures`` not answered yet with ``answer`` (the deadline, a client that left)."""
    for future in futures:
        if not future.done():
            future.set_result(answer)
