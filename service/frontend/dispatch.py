"""From checked images to their answers, in an HTTP process: admit, send to workers, wait by one deadline.

Every front end (``POST /predict`` with one image or several, the Open Inference Protocol over HTTP
and gRPC) hands its images here. Each image is its own batch item: the workers batch images, not
requests, so a request of 64 images fills two batches of 32 and shares them with other requests.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence

from fastapi import HTTPException

from service._defaults import RETRY_AFTER_S
from service.frontend.admission import AdmissionGate
from service.frontend.worker_watch import WorkerWatch
from service.logs import REQUEST_ID
from service.metrics import metrics
from service.rest.parsing import ImageRequest
from service.transport.channels import ApiChannel
from service.wire import RETRY_HEADERS, Answer, error_answer


class ImageDispatcher:
    """``channel`` and ``watch`` return the HTTP process's own (made in its lifespan; ``None`` before)."""

    def __init__(
        self,
        channel: Callable[[], ApiChannel | None],
        watch: Callable[[], WorkerWatch | None],
        gate: AdmissionGate,
        timeout_s: float,
    ) -> None:
        self.channel = channel
        self.watch = watch
        self.gate = gate
        self.timeout_s = timeout_s
        self._uids = itertools.count()

    async def classify(self, images: Sequence[bytes], top_k: int) -> tuple[list[Answer], float]:
        """Each image's ``Answer`` in input order, and the milliseconds from admission to the last one.

        Raises ``HTTPException`` 503 (with Retry-After) when no worker is ready or the images do not
        fit under ``--max-queue`` now, 413 if they never could; an image without an answer by the
        deadline gets a 504 ``Answer``.
        """
        watch, channel = self.watch(), self.channel()
        ready = () if watch is None or channel is None else watch.ready_workers
        if not ready:
            raise HTTPException(
                503,
                "No inference worker is ready (the server is starting, or restarting a worker); retry shortly.",
                headers=RETRY_HEADERS,
            )
        if len(images) > self.gate.limit:  # could never be admitted: retrying would not help
            raise HTTPException(
                413,
                f"The request has {len(images)} images; the server admits at most {self.gate.limit} at once "
                "(--max-queue). Send fewer images per request.",
            )
        if not self.gate.try_admit(len(images)):
            raise HTTPException(
                503,
                f"The server is at its limit of {self.gate.limit} queued images (--max-queue); retry after "
                f"{RETRY_AFTER_S} s.",
                headers=RETRY_HEADERS,
            )
        try:
            return await self._send_and_wait(channel, ready, images, top_k)
        finally:
            self.gate.release(len(images))

    async def _send_and_wait(
        self, channel: ApiChannel, ready: Sequence[int], images: Sequence[bytes], top_k: int
    ) -> tuple[list[Answer], float]:
        # The worker drops images older than the deadline instead of running them, so timed-out work
        # does not pile up; answers come back to this process only: a uid unique here is enough.
        queued_at = time.monotonic()
        request_id = REQUEST_ID.get()
        uids = [next(self._uids) for _ in images]
        try:
            futures = []
            for uid, image in zip(uids, images, strict=True):
                # Picked per image: each pick counts the images before it, so several workers share a request.
                worker_id = channel.pick_worker(ready)
                queued = ImageRequest(image, top_k, queued_at, request_id)
                futures.append(channel.submit(worker_id, uid, queued_at, queued))
            # One timer on the futures themselves: asyncio.wait_for adds a future and callbacks per image.
            expiry = asyncio.get_running_loop().call_later(self.timeout_s, self._expire, futures)
            try:
                answers = [await future for future in futures]
            finally:
                expiry.cancel()
        finally:
            for uid in uids:
                channel.forget(uid)  # a late answer then finds no one waiting and is dropped
            # Every admitted request, answered or not: the stage a dashboard's p99 is read from.
            total_ms = (time.monotonic() - queued_at) * 1e3
            metrics().observe_stages({"total": total_ms})
        return answers, total_ms

    def _expire(self, futures: Sequence[asyncio.Future[Answer]]) -> None:
        timed_out = error_answer(
            504,
            f"No answer within the {self.timeout_s:g} s deadline (--request-timeout-s): the server is "
            "overloaded or its batches are too slow.",
        )
        for future in futures:
            if not future.done():
                future.set_result(timed_out)
