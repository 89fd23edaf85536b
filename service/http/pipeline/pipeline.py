"""The request pipeline: one request's way through an HTTP process, the same for ``POST /predict``, the
Open Inference Protocol over HTTP and over gRPC. ``RequestPipeline.run`` calls each step in order;
each step calls down and never back.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

from service.errors import ClientClosed, DeadlineExceeded, Unavailable
from service.http.base.admission import AdmissionGate
from service.http.base.deadlines import within
from service.http.base.limits import RequestLimits
from service.http.base.worker_watch import WorkerWatch
from service.http.cache.front import for_route, keep, look_up
from service.http.cache.response_cache import ResponseCache
from service.http.pipeline.ask import Ask, Outcome, P
from service.http.pipeline.checks import refusals
from service.http.pipeline.on_demand import ModelLoads
from service.http.pipeline.submit import CLIENT_LEFT, Submission
from service.metrics import metrics
from service.repository.table import RoutingTable, VersionRoute
from service.tracing import stage_span
from service.transport.channels import ApiChannel
from service.wire import Answer, answer_for

STARTING = "The server is starting; retry shortly."
# How many times a request asks for its model to be loaded before it gives up (503).
LOAD_ATTEMPTS = 2
NO_WORKER_READY = "No inference worker is ready (the server is starting, or restarting a worker); retry shortly."


class RequestPipeline:
    """Made before the HTTP processes fork, with what they share (the limits, the admission gate in
    shared memory, the deadline); each process then ``attach``es its own channel, worker watch and
    cache (service/http/process.py), and answers 503 until it has. The channel it attaches releases
    the slots of the images it held to ``gate``: the submit hands them over.

    Every wait is bounded by the client's deadline (``Ask.deadline``): the parse (the upload), the cache
    lookup (Redis), then the queue and the batch (submit.py); each ends in a 504 when it passes."""

    def __init__(self, limits: RequestLimits, gate: AdmissionGate, timeout_s: float) -> None:
        self.limits = limits
        self.gate = gate
        self.submission = Submission(timeout_s, gate.release)
        self.channel: ApiChannel | None = None
        self.watch: WorkerWatch | None = None
        self.cache: ResponseCache | None = None  # this HTTP process's (--response-cache-mb), while attached
        self.loads: ModelLoads | None = None  # this HTTP process's calls for models not resident, while attached

    def attach(
        self,
        channel: ApiChannel,
        watch: WorkerWatch,
        cache: ResponseCache | None = None,
        loads: ModelLoads | None = None,
    ) -> None:
        channel.held.release = self.gate.release  # each image's slot comes back when its worker answers or drops it
        self.channel, self.watch, self.cache, self.loads = channel, watch, cache, loads

    def detach(self) -> None:
        self.channel = self.watch = self.cache = self.loads = None

    def route(self, model: str | None, version: str | None = None) -> VersionRoute:
        """The served version a request names (``None``: the default model, its latest version);
        ``ServiceError`` 404 when it is not loaded, 503 before this process follows a table."""
        return self._table().resolve(model, version)

    async def run(self, ask: Ask, parse: Callable[[], Awaitable[P]]) -> Outcome[P]:
        """One request, top to bottom: route, parse (the protocol's), route again, check, then for the
        images that pass: look up the cache, admit, submit, keep. The protocol renders the ``Outcome``.

        Raises ``ServiceError``: 404 for a version not served, the parse's 4xx, ``ask.on_refused``'s,
        503 when no worker is ready or the images do not fit under ``--max-queue`` now, 413 if they
        never could, 499 (``ClientClosed``) when the client left. An image without an answer by the
        deadline (the client's, ``ask.deadline``, else ``--request-timeout-s``) gets a 504 ``Answer``;
        a client's deadline that passes during the parse (a slow upload) raises ``DeadlineExceeded``.
        """
        first = self.route(ask.model, ask.version)  # a model not served is a 404 before the upload
        loads = self.loads
        if not first.resident and loads is not None:
            loads.start(first.name)  # its load runs while the body comes in
        with stage_span("parse"):  # traced requests (service/tracing/)
            deadline = ask.deadline  # the headers' cuts a slow upload short
            parsed = await parse() if deadline is None else await within(deadline, parse())
        # Again once the body is in: a swap during a slow upload may have retired the version's workers.
        route = self.route(ask.model, ask.version)
        load_ms = 0.0
        if not route.resident:
            route, load_ms = await self._bring_in(route, ask)
        images = parsed.images
        refused = refusals(images, self.limits.max_image_pixels)
        top_k, cache_on, logits = parsed.worker_top_k, self.cache is not None, parsed.wants_logits
        if refused.count(None) == len(images):  # the usual case, every image may run: nothing to pick out
            answers, total_ms, route = await self._from_cache_or_workers(images, top_k, route, ask, logits)
            return Outcome(parsed, answers, range(len(images)), total_ms, route, cache_on, load_ms)
        if ask.on_refused is not None:
            ask.on_refused(parsed, refused)  # the protocol's rule: it raises to fail the whole request
        # Else the others run, and each answer goes back to its image's place.
        ran = [index for index, refusal in enumerate(refused) if refusal is None]
        answers, total_ms = refused, 0.0
        if ran:
            picked = [images[index] for index in ran]
            ran_answers, total_ms, route = await self._from_cache_or_workers(picked, top_k, route, ask, logits)
            for index, answer in zip(ran, ran_answers, strict=True):
                answers[index] = answer
        return Outcome(parsed, answers, ran, total_ms, route, cache_on, load_ms)

    async def _bring_in(self, route: VersionRoute, ask: Ask) -> tuple[VersionRoute, float]:
        """A version not resident, loaded by the main process (making room under its memory budget):
        the route that serves it now, and the milliseconds this request waited for it (the answer's
        ``model_load`` timing, and the stage metric of that name)."""
        loads = self.loads
        if loads is None:
            raise Unavailable(STARTING)
        waited = 0.0
        for _ in range(LOAD_ATTEMPTS):
            waited += await loads.wait(route.name, ask.deadline)
            route = self.route(route.name, route.version if ask.pinned else None)
            if route.resident:
                metrics().observe_stages({"model_load": waited})
                return route, waited
        # Evicted again before this request reached it: the memory budget holds fewer models than
        # the clients use at once.
        raise Unavailable(
            f"Model '{route.name}' was loaded and evicted again before this request could run: the memory "
            "budget holds fewer models than are in use at once. Raise --memory-budget-mib, or retry."
        )

    async def _from_cache_or_workers(
        self, images: Sequence[bytes], top_k: int, route: VersionRoute, ask: Ask, logits: bool = False
    ) -> tuple[list[Answer], float, VersionRoute]:
        """The checked images' answers from the cache, then the workers for the misses; the
        milliseconds from the lookup to the last answer, and the version that answered. A request for
        the logits (``logits``) bypasses the cache both ways: it keeps top-k answers, never a whole output."""
        cache = self.cache
        if cache is None or logits:
            answers, total_ms = await self._admit_and_submit(images, top_k, route, ask, logits)
            return answers, total_ms, route
        started = time.monotonic()
        try:  # hits answered before any admission or decode; a slow Redis waited on until the deadline only
            lookup = await within(ask.deadline, look_up(cache, images, top_k, route))
        except DeadlineExceeded as passed:  # as the submit answers the images its deadline leaves unanswered
            metrics().requests_expired.inc(len(images))
            return [answer_for(passed)] * len(images), (time.monotonic() - started) * 1e3, route
        if not lookup.missing:  # every image a hit
            metrics().observe_stages({"total": lookup.ms})
            return lookup.answers, lookup.ms, route  # type: ignore[return-value]  (no None left)
        # The lookup may have waited on Redis while a load retired the version: checked once more, with
        # no await from here to the submit, so the misses go to the version served now.
        route = self._table().current(route, ask.pinned)
        lookup = for_route(cache, lookup, images, top_k, route)
        missing = lookup.missing
        ran, total_ms = await self._admit_and_submit([images[i] for i in missing], top_k, route, ask)
        return keep(cache, lookup, missing, ran), lookup.ms + total_ms, route

    async def _admit_and_submit(
        self, images: Sequence[bytes], top_k: int, route: VersionRoute, ask: Ask, logits: bool = False
    ) -> tuple[list[Answer], float]:
        """Admit the images under the server-wide gate and submit them to ``route``'s ready workers
        (their slots come back as their workers answer or drop them: service/transport/channels.py)."""
        channel, watch, departure = self.channel, self.watch, ask.departure
        ready = watch.ready_in(route) if watch is not None and channel is not None else ()
        if departure is not None and departure.gone:
            raise ClientClosed(CLIENT_LEFT.detail)
        if not ready or channel is None:
            raise Unavailable(NO_WORKER_READY)
        self.gate.admit(len(images))
        # The slots are the submit's from here: each comes back once its image is answered or dropped
        # by its worker (or was never sent), not when the client stops waiting.
        answers, total_ms = await self.submission.submit(channel, ready, images, top_k, departure, ask.deadline, logits)
        metrics().count_model_answers(route.name, route.version, (answer.status_code for answer in answers))
        if departure is not None and departure.gone:
            raise ClientClosed(CLIENT_LEFT.detail)  # its answers go nowhere, but the request is counted 499
        return answers, total_ms

    def _table(self) -> RoutingTable:
        """The routing table this process follows; 503 before it follows one (or once detached)."""
        watch = self.watch
        if watch is None:
            raise Unavailable(STARTING)
        return watch.table
