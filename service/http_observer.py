"""ASGI middleware around every HTTP request: a request id, the access log, the request counter.

- Request id: the client's ``X-Request-ID`` if it is a sane token (so a trace can span a proxy and
  us), else a new one; set for the logs of this request and returned in the ``X-Request-ID`` header
  of every response, errors included.
- Access log: one line per request at INFO (probe and scrape paths at DEBUG, or they would drown
  the rest), with status, duration and request id. It replaces uvicorn's, which has no request id.
- ``vision_serve_requests_total{code}`` for the predict route, counted as the response starts, so
  every answer is counted whichever layer produced it (auth, limits, shedding, the worker).

Pure ASGI rather than Starlette's BaseHTTPMiddleware: that one adds a task and a stream per request.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from service.logs import REQUEST_ID
from service.metrics import metrics

access_logger = logging.getLogger("service.access")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

REQUEST_ID_HEADER = "X-Request-ID"
# What we accept from a client as its request id: it goes into logs and a response header as is.
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
QUIET_PATHS = frozenset({"/health", "/ready", "/metrics"})
CLIENT_CLOSED = "499"  # nginx's code for a client that left before its answer; no response was sent


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name == b"x-request-id":
            candidate = value.decode("latin-1")
            if _CLIENT_REQUEST_ID.fullmatch(candidate):
                return candidate
            break
    return uuid.uuid4().hex


class HttpObserver:
    def __init__(self, app: ASGIApp, counted_path: str) -> None:
        self.app = app
        self.counted_path = counted_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_from(scope.get("headers", []))
        token = REQUEST_ID.set(request_id)
        started = time.perf_counter()
        status: int | None = None

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        failed = False
        try:
            await self.app(scope, receive, send_with_id)
        except BaseException:
            failed = True  # Starlette's outermost layer turns it into a 500
            raise
        finally:
            code = str(status) if status is not None else ("500" if failed else CLIENT_CLOSED)
            path = scope.get("path", "")
            if path == self.counted_path:
                metrics().requests.labels(code=code).inc()
            level = logging.DEBUG if path in QUIET_PATHS else logging.INFO
            if access_logger.isEnabledFor(level):
                duration_ms = (time.perf_counter() - started) * 1e3
                client = scope.get("client")
                access_logger.log(
                    level,
                    "%s %s %s %.1fms",
                    scope.get("method", ""),
                    path,
                    code,
                    duration_ms,
                    extra={
                        "method": scope.get("method", ""),
                        "path": path,
                        "status": int(code),
                        "duration_ms": round(duration_ms, 2),
                        "client": f"{client[0]}:{client[1]}" if client else None,
                    },
                )
            REQUEST_ID.reset(token)
