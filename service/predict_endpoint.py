"""``POST /predict``: parse and check in the HTTP process, admit or shed, send to a worker, answer by
the deadline.

Requests go straight to a ready inference worker over service/channels.py and its compact answer
becomes JSON here (service/answers.py). The deadline covers running work: a request in a batch
that runs for minutes still gets its 504 on time.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

from fastapi import HTTPException, Request, Response
from fastapi.responses import JSONResponse

from service._defaults import RETRY_AFTER_S
from service.admission import AdmissionGate
from service.answers import RETRY_HEADERS, render
from service.channels import ApiChannel
from service.logs import REQUEST_ID
from service.metrics import metrics
from service.request_parsing import ImageRequest, RequestLimits, check_image_header, read_image_request
from service.worker_watch import WorkerWatch

# For /docs: the endpoint reads the body itself (to bound it), so FastAPI cannot infer this.
OPENAPI_EXTRA = {
    "parameters": [
        {"name": "top_k", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1, "default": 5}}
    ],
    "requestBody": {
        "required": True,
        "content": {
            "image/*": {"schema": {"type": "string", "format": "binary"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {"image": {"type": "string", "format": "binary"}, "top_k": {"type": "integer"}},
                    "required": ["image"],
                }
            },
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "image": {"type": "string", "description": "base64 of the file, or a data: URL"},
                        "top_k": {"type": "integer"},
                    },
                    "required": ["image"],
                }
            },
        },
    },
}


class PredictEndpoint:
    """``channel`` and ``watch`` return the HTTP process's own (made in its lifespan; ``None`` before).

    Also a plain ASGI app (``__call__``), which the server mounts ahead of FastAPI's stack
    (service/litserve_bridge.py ``add_fast_route``); ``check_auth`` then does what the route's
    dependency would.
    """

    def __init__(
        self,
        channel: Callable[[], ApiChannel | None],
        watch: Callable[[], WorkerWatch | None],
        limits: RequestLimits,
        gate: AdmissionGate,
        timeout_s: float,
        check_auth: Callable[[Request], None] | None = None,
    ) -> None:
        self.channel = channel
        self.watch = watch
        self.limits = limits
        self.gate = gate
        self.timeout_s = timeout_s
        self.check_auth = check_auth
        self._uids = itertools.count()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        request = Request(scope, receive)
        try:
            if self.check_auth is not None:
                self.check_auth(request)
            response = await self.handle(request)
        except HTTPException as exc:  # what FastAPI's own handler of it answers
            response = JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)
        await response(scope, receive, send)

    async def handle(self, request: Request) -> Response:
        image_request = await read_image_request(request, self.limits)
        check_image_header(image_request.image, self.limits.max_image_pixels)
        watch, channel = self.watch(), self.channel()
        worker_id = None if watch is None or channel is None else channel.pick_worker(watch.ready_workers)
        if worker_id is None:
            raise HTTPException(
                503,
                "No inference worker is ready (the server is starting, or restarting a worker); retry shortly.",
                headers=RETRY_HEADERS,
            )
        if not self.gate.try_admit():
            raise HTTPException(
                503,
                f"The server is at its limit of {self.gate.limit} queued requests (--max-queue); retry after "
                f"{RETRY_AFTER_S} s.",
                headers=RETRY_HEADERS,
            )
        try:
            return await self._send_and_wait(channel, worker_id, image_request)
        finally:
            self.gate.release()

    async def _send_and_wait(self, channel: ApiChannel, worker_id: int, image_request: ImageRequest) -> Response:
        uid = next(self._uids)  # answers come back to this process only: unique here is enough
        # The worker drops requests older than the deadline instead of running them, so timed-out
        # work does not pile up.
        queued_at = time.monotonic()
        try:
            queued = ImageRequest(image_request.image, image_request.top_k, queued_at, REQUEST_ID.get())
            answer_future = channel.submit(worker_id, uid, queued_at, queued)
            # A timer on the future itself: asyncio.wait_for adds a second future and callbacks per request.
            expiry = asyncio.get_running_loop().call_later(self.timeout_s, _expire, answer_future)
            try:
                answer = await answer_future
            except asyncio.TimeoutError:
                raise HTTPException(
                    504,
                    f"No answer within the {self.timeout_s:g} s deadline (--request-timeout-s): the server is "
                    "overloaded or its batches are too slow.",
                ) from None
            finally:
                expiry.cancel()
        finally:
            channel.forget(uid)  # a late answer then finds no one waiting and is dropped
            # Every admitted request, answered or not: the stage a dashboard's p99 is read from.
            total_ms = (time.monotonic() - queued_at) * 1e3
            metrics().observe_stages({"total": total_ms})
        response = render(answer, total_ms)
        # The worker's stages and the rendering, recorded here to keep that work off its loop.
        metrics().observe_stages(answer.timings_ms)
        return response


def _expire(answer: asyncio.Future) -> None:
    if not answer.done():
        answer.set_exception(asyncio.TimeoutError())
