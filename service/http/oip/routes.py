"""The Open Inference Protocol over HTTP/REST (KServe v2, Triton): routes next to ``POST /predict``.

- ``GET /v2`` (server metadata), ``/v2/health/live``, ``/v2/health/ready``;
- ``GET /v2/models/{name}[/versions/1]`` (model metadata) and ``.../ready``;
- ``POST /v2/models/{name}[/versions/1]/infer``: JSON, or JSON plus binary tensors (the binary
  tensor extension: ``Inference-Header-Content-Length`` says where the JSON ends).
Errors answer ``{"error": "..."}``. The limits, shedding (503), deadline (504) and API key are
``/predict``'s; the health routes never need the key (orchestrators probe them).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from service.errors import InvalidInput, PayloadTooLarge, ServiceError, UnsupportedMediaType, http_headers
from service.http.base.deadlines import header_deadline
from service.http.base.infer_paths import model_in_path
from service.http.base.limits import read_body
from service.http.base.request_scope import departure_of
from service.http.base.server_timing import server_timing
from service.http.oip.infer import run_infer
from service.http.oip.json_request import parse_infer_body
from service.http.oip.tensors import (
    SERVER_NAME,
    InferCall,
    OutputTensor,
    build_outputs,
    model_metadata,
    server_extensions,
)
from service.http.pipeline.pipeline import RequestPipeline
from service.repository.table import RoutingTable, VersionRoute
from service.tracing import stage_span

HEADER_LENGTH = "inference-header-content-length"


def error_response(error: ServiceError) -> JSONResponse:
    """A ``ServiceError`` in the protocol's form: ``{"error": message}``."""
    return JSONResponse(
        {"error": error.message}, status_code=error.status, headers=http_headers(error.status, error.retry_after_s)
    )


def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """The body as sent with tritonclient's ``request_compression_algorithm`` (gzip or deflate),
    inflated to at most ``limit`` bytes: a small compressed body must not become gigabytes here."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise UnsupportedMediaType(f"Content-Encoding {encoding!r} is not supported; send gzip, deflate or none.")
    inflater = zlib.decompressobj(zlib.MAX_WBITS | 16 if encoding == "gzip" else zlib.MAX_WBITS)
    try:
        inflated = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise InvalidInput(f"The body is not valid {encoding} data: {exc}.") from None
    if len(inflated) > limit:
        raise PayloadTooLarge(f"The request body inflates to more than {limit:,} bytes (server flag --max-body-bytes).")
    return inflated


def encode_infer_response(
    model: str, version: int, call: InferCall, tensors: list[OutputTensor]
) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when binary tensors follow it."""
    outputs, blobs = [], []
    for tensor in tensors:
        entry: dict = {"name": tensor.name, "datatype": tensor.datatype, "shape": tensor.shape}
        if tensor.binary:
            blob = tensor.to_bytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        elif tensor.datatype == "BYTES":
            entry["data"] = [value.decode() for value in tensor.values]
        else:
            entry["data"] = tensor.values
        outputs.append(entry)
    response: dict = {"model_name": model, "model_version": str(version), "outputs": outputs}
    if call.request_id is not None:
        response["id"] = call.request_id
    header = json.dumps(response, separators=(",", ":")).encode()
    if not blobs:
        return header, None
    return header + b"".join(blobs), len(header)


class OipInferEndpoint:
    """``POST /v2/models/{name}[/versions/{v}]/infer``. Also a plain ASGI app for every model's infer
    paths, mounted ahead of FastAPI's stack like ``/predict`` (``add_fast_prefix_route``)."""

    def __init__(self, pipeline: RequestPipeline, check_auth: Callable[[Request], None] | None = None) -> None:
        self.pipeline = pipeline
        self.check_auth = check_auth

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        name, version = model_in_path(scope["path"])
        response = await self.answer(Request(scope, receive), name, version)
        await response(scope, receive, send)

    async def answer(self, request: Request, name: str, version: str | None) -> Response:
        return await self.guarded(request, lambda: self.handle(request, name, version))

    async def guarded(self, request: Request, respond: Callable[[], Awaitable[Response]]) -> Response:
        """``respond()`` behind the API key, its errors in OIP's form; for every route that needs the key."""
        try:
            if self.check_auth is not None:
                self.check_auth(request)
            return await respond()
        except ServiceError as exc:
            return error_response(exc)

    async def handle(self, request: Request, name: str, version: str | None) -> Response:
        limits = self.pipeline.limits

        async def parse() -> InferCall:
            body = decompress(
                await read_body(request, limits.max_body_bytes),
                request.headers.get("content-encoding", ""),
                limits.max_body_bytes,
            )
            return parse_infer_body(body, request.headers.get(HEADER_LENGTH), limits.max_images_per_request)

        deadline = header_deadline(request.scope["headers"])
        outcome = await run_infer(self.pipeline, name, version, parse, departure_of(request.scope), deadline)
        call, route = outcome.parsed, outcome.route
        with stage_span("answer"):  # traced requests (service/tracing/)
            content, header_length = encode_infer_response(
                route.name, route.version, call, build_outputs(call, outcome.answers, route.model.labels)
            )
        headers = {"Server-Timing": server_timing(outcome.timings_ms())}
        if header_length is None:
            return Response(content, media_type="application/json", headers=headers)
        headers["Inference-Header-Content-Length"] = str(header_length)
        return Response(content, media_type="application/octet-stream", headers=headers)


def add_oip_routes(
    app: FastAPI,
    endpoint: OipInferEndpoint,
    *,
    server_version: str,
    ready: Callable[[], bool],
    model_ready: Callable[[VersionRoute], bool],
    table: Callable[[], RoutingTable],
    repository: bool = False,
) -> None:
    """``repository``: the repository extension's calls are on (the server metadata lists it)."""
    """The metadata and health routes, and the infer route for any model name (404 for those not loaded)."""

    @app.get("/v2", tags=["Open Inference Protocol"])
    async def server_metadata(request: Request) -> Response:
        """Server metadata: name, version, protocol extensions."""

        async def describe() -> Response:
            extensions = server_extensions(repository)
            return JSONResponse({"name": SERVER_NAME, "version": server_version, "extensions": extensions})

        return await endpoint.guarded(request, describe)

    @app.get("/v2/health/live", tags=["Open Inference Protocol"])
    async def server_live() -> Response:
        """The server answers (liveness); no key needed."""
        return JSONResponse({"live": True})

    @app.get("/v2/health/ready", tags=["Open Inference Protocol"])
    async def server_ready() -> Response:
        """Every served model version is loaded and warm: 200, else 400 (as Triton); no key needed."""
        is_ready = ready()
        return JSONResponse({"ready": is_ready}, status_code=200 if is_ready else 400)

    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):

        @app.get(prefix, tags=["Open Inference Protocol"])
        async def metadata(request: Request, name: str, version: str | None = None) -> Response:
            """Model metadata: its input and outputs, and its loaded versions."""

            async def describe() -> Response:
                route = table().resolve(name, version)
                versions = sorted(table().models[route.name]) if version is None else [route.version]
                model = route.model
                return JSONResponse(model_metadata(route.name, versions, model.engine, len(model.labels)))

            return await endpoint.guarded(request, describe)

        @app.get(prefix + "/ready", tags=["Open Inference Protocol"])
        async def model_is_ready(name: str, version: str | None = None) -> Response:
            """The model version (default: its latest loaded) is warm in every worker: 200, else 400; no key needed."""
            try:
                route = table().resolve(name, version)
            except ServiceError as exc:
                return error_response(exc)
            is_ready = model_ready(route)
            return JSONResponse({"name": name, "ready": is_ready}, status_code=200 if is_ready else 400)

        @app.post(prefix + "/infer", tags=["Open Inference Protocol"])
        async def infer(request: Request, name: str, version: str | None = None) -> Response:
            """Classify a batch of image files (input IMAGE); see docs/open-inference-protocol.md for the tensors."""
            return await endpoint.answer(request, name, version)
