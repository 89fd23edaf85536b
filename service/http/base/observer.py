"""ASGI middleware around every HTTP request: a request id, the access log, the request counter.

- Request id: the client's ``X-Request-ID`` if it is a sane token (so a trace can span a proxy and
  us), else a new one; set for the logs of this request and returned in the ``X-Request-ID`` header
  of every response, errors included.
- Access log: one line per request at INFO (probe and scrape paths at DEBUG, or they would drown
  the rest), with status, duration and request id. It replaces uvicorn's, which has no request id.
- ``vision_serve_requests_total{code}`` for the inference routes (``/predict``, OIP infer), counted
  as the response starts, so every answer is counted whichever layer produced it (auth, limits, shedding, the worker).
- An unhandled error becomes a 500 JSON answer sent from here, so that it too carries the id.
- Tracing (service/tracing/), when on: the inference routes' SERVER span, a child of the client's
  W3C ``traceparent`` if it sent one, current for the request's stages and ended with its answer.

Pure ASGI rather than Starlette's BaseHTTPMiddleware: that one adds a task and a stream per request.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Collection, MutableMapping
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse

from service.errors import CLIENT_CLOSED_REQUEST
from service.http.base.infer_paths import is_infer_path, model_in_path
from service.logs import REQUEST_ID
from service.metrics import metrics
from service.tracing import TRACING, ServerSpan, http_headers, start_server_span

access_logger = logging.getLogger("service.access")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# What we accept from a client as its request id: it goes into logs and a response header as is.
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
QUIET_PATHS = frozenset({"/health", "/ready", "/metrics"})
# nginx's code for "client closed request" (service/errors.py): here also any request that ended
# without an answer (it was cancelled). A client that disconnects while its answer is sent is counted
# with that answer's code: the server cannot tell.
NO_ANSWER = str(CLIENT_CLOSED_REQUEST)
# The Open Inference Protocol's infer routes, as a traced request's span names them (not the path:
# one name per route, whatever the model).
OIP_ROUTE = "/v2/models/{name}/infer"
OIP_VERSION_ROUTE = "/v2/models/{name}/versions/{version}/infer"


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name == b"x-request-id":
            return client_request_id(value.decode("latin-1"))
    return client_request_id(None)


def client_request_id(candidate: str | None) -> str:
    """The client's id if it is a sane token (it goes into logs and headers as is), else a new one."""
    if candidate and _CLIENT_REQUEST_ID.fullmatch(candidate):
        return candidate
    return os.urandom(16).hex()  # a random 128-bit id, as uuid4().hex but without the UUID object


class HttpObserver:
    def __init__(self, app: ASGIApp, counted_paths: Collection[str]) -> None:
        self.app = app
        self.counted_paths = frozenset(counted_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_from(scope.get("headers", []))
        # Not reset afterwards: uvicorn runs each request in a task of its own (its own context), and
        # its "Exception in ASGI application" line, written after we return, should carry the id too.
        REQUEST_ID.set(request_id)
        started = time.perf_counter()
        path = scope.get("path", "")
        code: str | None = None
        trace = self._start_trace(scope, path, request_id) if TRACING.on else None

        async def send_with_id(message: Message) -> None:
            nonlocal code
            if message["type"] == "http.response.start":
                code = str(message["status"])
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))]
                # Counted as the answer starts: a scrape made once a client has its answer includes it.
                self._count(path, code)
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except ClientDisconnect:
            # Starlette's own body readers raise it when the client leaves mid-request (ours answer
            # 499 themselves): the client's doing, so no 500 and no traceback. Counted 499 below.
            pass
        except Exception:
            if code is None:
                # Answer the 500 here rather than leave it to Starlette's outer error layer, which
                # would send it without the id a user needs to report it. That layer sees the
                # response started and only re-raises, so uvicorn still logs the traceback.
                await JSONResponse(
                    {"detail": f"Internal server error; quote request id {request_id} when reporting it."},
                    status_code=500,
                )(scope, receive, send_with_id)
            raise
        finally:
            if code is None:  # cancelled (the client left, or a shutdown's grace ran out): no answer
                code = NO_ANSWER
                self._count(path, code)
            if trace is not None:
                status = int(code)
                trace.end({"http.response.status_code": status}, failed=status >= 500)
            self._log(scope, path, code, started)

    def _start_trace(self, scope: Scope, path: str, request_id: str) -> ServerSpan | None:
        """The inference routes' SERVER span (None for other paths, or when the sampler drops it)."""
        if path in self.counted_paths:
            route, attributes = path, {}
        elif is_infer_path(path):
            model, version = model_in_path(path)
            route = OIP_VERSION_ROUTE if version is not None else OIP_ROUTE
            attributes = {"model": model}
        else:
            return None
        method = scope.get("method", "")
        attributes.update(
            {"http.request.method": method, "http.route": route, "url.path": path, "request.id": request_id}
        )
        return start_server_span(f"{method} {route}", http_headers(scope.get("headers", [])), attributes)

    def _count(self, path: str, code: str) -> None:
        if path in self.counted_paths or is_infer_path(path):
            metrics().requests.labels(code=code).inc()

    @staticmethod
    def _log(scope: Scope, path: str, code: str, started: float) -> None:
        client = scope.get("client")
        log_access(scope.get("method", ""), path, code, started, f"{client[0]}:{client[1]}" if client else None)


def log_access(method: str, path: str, code: str, started: float, client: str | None = None) -> None:
    """One access-log line for an answered request (HTTP, or a gRPC call with method ``GRPC``)."""
    level = logging.DEBUG if path in QUIET_PATHS else logging.INFO
    if not access_logger.isEnabledFor(level):
        return
    duration_ms = (time.perf_counter() - started) * 1e3
    access_logger.log(
        level,
        "%s %s %s %.1fms",
        method,
        path,
        code,
        duration_ms,
        extra={
            "method": method,
            "path": path,
            "status": int(code),
            "duration_ms": round(duration_ms, 2),
            "client": client,
        },
    )
