"""``POST /predict``: parse and check in the HTTP process, admit or shed, queue, answer by the deadline.

Replaces LitServe's request handler, which waits for the worker without a bound (its ``timeout``
only drops requests that are still queued: one already in a batch that runs for minutes holds its
client for minutes) and accepts work while no worker can take it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import TYPE_CHECKING

from fastapi import HTTPException, Request, Response
from litserve.server import RegularRequestHandler
from litserve.utils import LitAPIStatus, ResponseBufferItem

from service._defaults import RETRY_AFTER_S
from service.admission import AdmissionGate
from service.logs import REQUEST_ID
from service.metrics import metrics
from service.request_parsing import ImageRequest, RequestLimits, check_image_header, read_image_request
from service.server_timing import add_server_timing

if TYPE_CHECKING:
    from service.server import VisionLitServer

RETRY_HEADERS = {"Retry-After": str(RETRY_AFTER_S)}

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
    def __init__(
        self,
        server: VisionLitServer,
        api_path: str,
        limits: RequestLimits,
        gate: AdmissionGate,
        timeout_s: float,
    ) -> None:
        self.server = server
        self.api_path = api_path
        self.limits = limits
        self.gate = gate
        self.timeout_s = timeout_s

    async def handle(self, request: Request) -> Response:
        image_request = await read_image_request(request, self.limits)
        check_image_header(image_request.image, self.limits.max_image_pixels)
        watch = self.server.worker_watch
        if watch is None or not watch.any_ready:
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
            return await self._queue_and_wait(image_request)
        finally:
            self.gate.release()

    async def _queue_and_wait(self, image_request: ImageRequest) -> Response:
        uid = uuid.uuid4().hex
        item = ResponseBufferItem(asyncio.Event())
        buffer = self.server.response_buffer
        buffer[uid] = item  # before queueing: the answer can only be matched to a buffered request
        # The worker drops requests older than the deadline instead of running them (LitServe's own
        # queue timeout, set to the same value), so timed-out work does not pile up.
        queued_at = time.monotonic()
        try:
            queue = self.server._get_request_queue(self.api_path)
            try:
                queued = dataclasses.replace(image_request, queued_at=queued_at, request_id=REQUEST_ID.get())
                queue.put((self.server.app.response_queue_id, uid, queued_at, queued))
            except (OSError, EOFError) as exc:  # the manager is gone: the server is shutting down
                raise HTTPException(
                    503, f"The server is shutting down ({exc!r}); retry.", headers=RETRY_HEADERS
                ) from exc
            try:
                await asyncio.wait_for(item.event.wait(), self.timeout_s)
            except asyncio.TimeoutError:
                raise HTTPException(
                    504,
                    f"No answer within the {self.timeout_s:g} s deadline (--request-timeout-s): the server is "
                    "overloaded or its batches are too slow.",
                ) from None
        finally:
            buffer.pop(uid, None)  # a late answer then finds no one waiting and is dropped
            # Every admitted request, answered or not: the stage a dashboard's p99 is read from.
            total_ms = (time.monotonic() - queued_at) * 1e3
            metrics().observe_stages({"total": total_ms})
        response, status = item.response
        if status == LitAPIStatus.ERROR:
            RegularRequestHandler._handle_error_response(response)  # raises the HTTPException or a 500
        # The worker's stages (service/api.py), recorded here to keep that work off its loop.
        metrics().observe_stages(getattr(response, "stage_timings_ms", {}))
        add_server_timing(response, "total", total_ms)
        return response
