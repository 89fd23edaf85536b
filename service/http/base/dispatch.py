"""From checked images to their answers, in an HTTP process: admit, send to workers, wait by one deadline.

Every front end (``POST /predict`` with one image or several, the Open Inference Protocol over HTTP
and gRPC) hands its images here. A client that leaves while they wait (its connection closes, its
gRPC call is cancelled) has them dropped wherever they are, unrun (service/request_scope.py).
Each image is its own batch item: the workers batch images, not requests, so a request of 64 images
fills two batches of 32 and shares them with other requests.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Sequence
from typing import NamedTuple

from preprocessing.errors import ImageDecodeError
from preprocessing.probe import check_image_header
from service._defaults import RETRY_AFTER_S
from service.errors import (
    ClientClosed,
    DeadlineExceeded,
    Overloaded,
    PayloadTooLarge,
    ServiceError,
    Unavailable,
    error_of_status,
)
from service.http.base.admission import AdmissionGate
from service.http.base.worker_watch import WorkerWatch
from service.http.cache.front import Lookup, keep, look_up
from service.http.cache.keys import model_fingerprint
from service.http.cache.response_cache import ResponseCache
from service.logs import REQUEST_ID
from service.metrics import metrics
from service.repository.table import VersionRoute
from service.request_scope import Departure
from service.tracing import current_traceparent, stage_span, wait_span
from service.transport.channels import ApiChannel
from service.wire import Answer, ImageRequest, answer_for


def check_header(image: bytes, max_image_pixels: int) -> None:
    """``ServiceError`` (4xx) for what no decoder should see: not an image, a corrupt header, too many
    pixels. Only the header is parsed, so a decompression bomb costs microseconds and never reaches a
    decoder or a queue slot; the worker probes again. The one place the HTTP processes turn the
    preprocessing library's ``ImageDecodeError`` into the service's error."""
    try:
        check_image_header(image, max_image_pixels)
    except ImageDecodeError as exc:
        raise error_of_status(exc.error.status_code, exc.error.detail) from None


def header_error(image: bytes, max_image_pixels: int) -> Answer | None:
    """``check_header`` for one image among several: its own 4xx ``Answer``, or ``None`` if it may run."""
    try:
        check_header(image, max_image_pixels)
    except ServiceError as exc:
        return answer_for(exc)
    return None


class Classified(NamedTuple):
    """What ``ImageDispatcher.classify`` gives back."""

    answers: list[Answer]  # in input order
    total_ms: float  # from the cache lookup or admission to the last answer
    route: VersionRoute | None  # the version that answered (None: any worker of a one-model server)


# The answer of an image whose client left before it was ready: nobody reads it, but the access log
# and vision_serve_requests_total count the request as 499.
CLIENT_LEFT = answer_for(ClientClosed("The client left before its answer was ready."))


class ImageDispatcher:
    """Admits images under the server-wide ``gate``, sends each to a ready worker, and waits for the
    answers until ``timeout_s``. Made before the HTTP processes fork; each one then ``attach``es
    its own channel and worker watch (service/http/process.py), and answers 503 until it has."""

    def __init__(self, gate: AdmissionGate, timeout_s: float) -> None:
        self.gate = gate
        self.timeout_s = timeout_s
        self.channel: ApiChannel | None = None
        self.watch: WorkerWatch | None = None
        self.cache: ResponseCache | None = None  # this HTTP process's (--response-cache-mb), while attached
        self._uids = itertools.count()

    def attach(self, channel: ApiChannel, watch: WorkerWatch, cache: ResponseCache | None = None) -> None:
        self.channel, self.watch, self.cache = channel, watch, cache

    def detach(self) -> None:
        self.channel = self.watch = self.cache = None

    def route(self, model: str | None, version: str | None = None) -> VersionRoute:
        """The served version a request names (``None``: the default model, its latest version);
        ``ServiceError`` 404 when it is not loaded, 503 before this process follows a table."""
        return self._watch_or_503().table.resolve(model, version)

    def _watch_or_503(self) -> WorkerWatch:
        if self.watch is None:
            raise Unavailable("The server is starting; retry shortly.")
        return self.watch

    async def classify(
        self,
        images: Sequence[bytes],
        top_k: int,
        route: VersionRoute | None = None,
        departure: Departure | None = None,
        *,
        pinned: bool = False,
    ) -> Classified:
        """Each image's ``Answer`` in input order, the milliseconds from admission to the last one, and
        the version that answered. The steps, each calling down: look the images up in the response
        cache (hits are answered before any admission or decode, service/http/cache/front.py); check
        ``route`` once more (the lookup may have waited on Redis while a load retired its version:
        ``pinned``, the request named that version, then gets 404, else the model's latest answers);
        admit and send the misses to that version's workers; keep their answers.

        ``route``: ``None`` for any ready worker of a one-model server. ``departure``: told when the client
        leaves; its images are then dropped by their workers, and this raises ``ClientClosed`` (499), as
        cancelling the call does. Raises ``ServiceError`` 503 when no worker is ready or the images do not
        fit under ``--max-queue`` now, 413 if they never could; an image without an answer by the deadline
        gets a 504 ``Answer``.
        """
        cache = self.cache
        if cache is None or route is None:
            answers, total_ms = await self._admit_and_run(images, top_k, route, departure)
            return Classified(answers, total_ms, route)
        lookup = await look_up(cache, images, top_k, route)
        missing = lookup.missing
        if not missing:
            metrics().observe_stages({"total": lookup.ms})
            return Classified(lookup.answers, lookup.ms, route)  # type: ignore[arg-type]  (no None left)
        # No await from here to the submit: the version the misses are sent to is the one served now.
        route = self._watch_or_503().table.current(route, pinned)
        if model_fingerprint(route) != model_fingerprint(lookup.route):
            # Another version answers: its own keys, and none of the old one's hits.
            lookup = Lookup(route, cache.keys(images, route, top_k), [None] * len(images), lookup.ms)
            missing = list(range(len(images)))
        ran, total_ms = await self._admit_and_run([images[index] for index in missing], top_k, route, departure)
        return Classified(keep(cache, lookup, missing, ran), lookup.ms + total_ms, route)

    async def _admit_and_run(
        self, images: Sequence[bytes], top_k: int, route: VersionRoute | None, departure: Departure | None
    ) -> tuple[list[Answer], float]:
        """``classify`` without the cache."""
        channel, watch = self.channel, self.watch
        if watch is None or channel is None:
            ready = ()
        else:
            ready = watch.ready_workers if route is None else watch.ready_in(route)
        if departure is not None and departure.gone:
            raise ClientClosed(CLIENT_LEFT.detail)
        if not ready:
            raise Unavailable(
                "No inference worker is ready (the server is starting, or restarting a worker); retry shortly."
            )
        if len(images) > self.gate.limit:  # could never be admitted: retrying would not help
            raise PayloadTooLarge(
                f"The request has {len(images)} images; the server admits at most {self.gate.limit} at once "
                "(--max-queue). Send fewer images per request.",
            )
        with stage_span("admission"):
            if not self.gate.try_admit(len(images)):
                raise Overloaded(
                    f"The server is at its limit of {self.gate.limit} queued images (--max-queue); retry after "
                    f"{RETRY_AFTER_S} s."
                )
        try:
            with wait_span():  # traced requests (service/tracing/): the workers' spans are its children
                answers, total_ms = await self._send_and_wait(channel, ready, images, top_k, departure)
        finally:
            self.gate.release(len(images))
        if route is not None:
            metrics().count_model_answers(route.name, route.version, (answer.status_code for answer in answers))
        if departure is not None and departure.gone:
            raise ClientClosed(CLIENT_LEFT.detail)  # its answer goes nowhere, but is counted 499
        return answers, total_ms

    async def _send_and_wait(
        self,
        channel: ApiChannel,
        ready: Sequence[int],
        images: Sequence[bytes],
        top_k: int,
        departure: Departure | None,
    ) -> tuple[list[Answer], float]:
        # The worker drops images older than the deadline instead of running them, so timed-out work
        # does not pile up; answers come back to this process only: a uid unique here is enough.
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
