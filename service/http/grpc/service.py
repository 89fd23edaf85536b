"""The Open Inference Protocol over gRPC: ``inference.GRPCInferenceService`` (KServe v2, Triton).

ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata and ModelInfer, for every model
the routing table serves; with ``--model-control explicit`` also the repository extension
(RepositoryIndex, RepositoryModelLoad, RepositoryModelUnload) behind the admin key. The other RPCs
(streaming, shared memory, statistics, settings) answer UNIMPLEMENTED with their name. A
request that is not a valid protobuf message answers INVALID_ARGUMENT: neither is logged as a server
error. The protocol modules are the ones ``tritonclient`` ships, generated from Triton's own protos.

Runs in every HTTP process, on its event loop, on ``--grpc-port`` (each process binds the port with
SO_REUSEPORT, gRPC's default on Linux, and the kernel spreads connections over them). Limits,
shedding, deadline and API key (metadata ``x-api-key`` or ``authorization: Bearer``) are /predict's,
and so is tracing (service/tracing/): a ModelInfer whose metadata has a W3C ``traceparent`` joins its
caller's trace.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2, service_pb2_grpc

from service.errors import (
    ClientClosed,
    DeadlineExceeded,
    Internal,
    InvalidInput,
    NotFound,
    PayloadTooLarge,
    ServiceError,
    Unauthorized,
    Unavailable,
    UnprocessableContent,
    UnsupportedMediaType,
)
from service.http.base.auth import ApiKeyAuth
from service.http.base.deadlines import GRPC_DEADLINE, ClientDeadline
from service.http.base.observer import NO_ANSWER, client_request_id, log_access
from service.http.grpc.proto_request import parse_grpc_request
from service.http.oip.infer import run_infer
from service.http.oip.tensors import (
    SERVER_NAME,
    InferCall,
    build_outputs,
    model_metadata,
    server_extensions,
)
from service.http.pipeline.pipeline import RequestPipeline
from service.logs import REQUEST_ID
from service.metrics import metrics
from service.repository.http_calls import REPOSITORY_OFF, RepositoryCalls
from service.repository.table import VersionRoute
from service.tracing import TRACING, ServerSpan, stage_span, start_server_span

logger = logging.getLogger(__name__)

SERVICE = "inference.GRPCInferenceService"
# A response parameter: the milliseconds the call waited for its model to load on demand (HTTP: the
# ``model_load`` entry of Server-Timing); absent when the model was resident.
LOAD_MS_PARAMETER = "model_load_ms"
MODEL_INFER_PATH = f"/{SERVICE}/ModelInfer"  # the access log's path for ModelInfer
MODEL_INFER_SPAN = f"{SERVICE}/ModelInfer"  # a traced call's span name, as OpenTelemetry names RPCs
IMPLEMENTED = (
    "ServerLive",
    "ServerReady",
    "ModelReady",
    "ServerMetadata",
    "ModelMetadata",
    "ModelInfer",
    "RepositoryIndex",
    "RepositoryModelLoad",
    "RepositoryModelUnload",
)
# What a request deserializer returns for bytes that are not the RPC's message.
UNDECODABLE = object()
# The one mapping from a kind to this protocol's status. A kind it does not name (RequestTimeout: gRPC
# reads no body through read_body), or a status no kind names, answers UNKNOWN; a subclass answers as its
# base (Overloaded as Unavailable).
GRPC_STATUS: dict[type[ServiceError], grpc.StatusCode] = {
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    Unauthorized: grpc.StatusCode.UNAUTHENTICATED,
    NotFound: grpc.StatusCode.NOT_FOUND,
    PayloadTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,  # what gRPC itself answers for a message over its limit
    UnsupportedMediaType: grpc.StatusCode.INVALID_ARGUMENT,
    UnprocessableContent: grpc.StatusCode.INVALID_ARGUMENT,
    Internal: grpc.StatusCode.INTERNAL,
    ClientClosed: grpc.StatusCode.CANCELLED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def grpc_status(error: ServiceError) -> grpc.StatusCode:
    """The gRPC status of a ``ServiceError``: the one mapping of this protocol, by kind."""
    for kind in type(error).__mro__:
        if kind in GRPC_STATUS:
            return GRPC_STATUS[kind]
    return grpc.StatusCode.UNKNOWN


def response_parameters(load_ms: float) -> dict[str, service_pb2.InferParameter] | None:
    """How long the call waited for its model to load on demand, as HTTP's Server-Timing says it."""
    return {LOAD_MS_PARAMETER: service_pb2.InferParameter(double_param=load_ms)} if load_ms else None


def grpc_deadline(context: grpc.aio.ServicerContext) -> ClientDeadline:
    """The call's gRPC deadline, as the request pipeline takes a client's; none if it set none."""
    deadline = ClientDeadline()
    deadline.tighten(context.time_remaining(), GRPC_DEADLINE)
    return deadline


def cancelled_status(deadline: ClientDeadline) -> tuple[int, grpc.StatusCode]:
    """How a cancelled call is counted: ended by its deadline (grpc cancels it then too), or its client
    cancelled or left, as HTTP counts one that left."""
    if deadline.passed():
        return DeadlineExceeded.status, grpc.StatusCode.DEADLINE_EXCEEDED
    return int(NO_ANSWER), grpc.StatusCode.CANCELLED


def start_model_infer_span(
    request: service_pb2.ModelInferRequest, context: grpc.aio.ServicerContext, request_id: str
) -> ServerSpan | None:
    """ModelInfer's SERVER span (tracing on), a child of the caller's ``traceparent`` metadata if it sent one."""
    attributes = {
        "rpc.system": "grpc",
        "rpc.service": SERVICE,
        "rpc.method": "ModelInfer",
        "model": request.model_name,
        "request.id": request_id,
    }
    return start_server_span(MODEL_INFER_SPAN, context.invocation_metadata() or (), attributes)


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self,
        pipeline: RequestPipeline,
        *,
        ready: Callable[[], bool],
        model_ready: Callable[[VersionRoute], bool],
        server_version: str,
        api_key: str = "",
        admin_api_key: str = "",
        repository: RepositoryCalls | None = None,
    ) -> None:
        """``repository``: the repository extension's calls; ``None`` answers them INVALID_ARGUMENT
        with how to turn them on."""
        self.pipeline = pipeline
        self.ready = ready
        self.model_ready = model_ready
        self.server_version = server_version
        self.repository = repository
        self._auth = ApiKeyAuth(api_key) if api_key else None
        self._admin_auth = ApiKeyAuth(admin_api_key) if admin_api_key else None

    async def ServerLive(self, request, context) -> service_pb2.ServerLiveResponse:
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context) -> service_pb2.ServerReadyResponse:
        return service_pb2.ServerReadyResponse(ready=self.ready())

    async def ModelReady(self, request, context) -> service_pb2.ModelReadyResponse:
        route = await self._run(context, lambda: self.pipeline.route(request.name, request.version))
        return service_pb2.ModelReadyResponse(ready=self.model_ready(route))

    async def ServerMetadata(self, request, context) -> service_pb2.ServerMetadataResponse:
        await self._run(context, lambda: self._check_key(context))
        return service_pb2.ServerMetadataResponse(
            name=SERVER_NAME, version=self.server_version, extensions=server_extensions(self.repository is not None)
        )

    async def ModelMetadata(self, request, context) -> service_pb2.ModelMetadataResponse:
        def describe() -> dict:
            self._check_key(context)
            route = self.pipeline.route(request.name, request.version)
            table = self.pipeline.watch.table
            versions = sorted(table.models[route.name]) if not request.version else [route.version]
            return model_metadata(route.name, versions, route.model.engine, len(route.model.labels))

        metadata = await self._run(context, describe)
        tensor = service_pb2.ModelMetadataResponse.TensorMetadata
        return service_pb2.ModelMetadataResponse(
            name=metadata["name"],
            versions=metadata["versions"],
            platform=metadata["platform"],
            inputs=[tensor(**t) for t in metadata["inputs"]],
            outputs=[tensor(**t) for t in metadata["outputs"]],
        )

    async def ModelInfer(self, request, context) -> service_pb2.ModelInferResponse:
        request_id = client_request_id(request.id)  # the HTTP rules: a sane token, else a new id
        REQUEST_ID.set(request_id)
        started = time.perf_counter()
        status, code = 200, grpc.StatusCode.OK
        trace = start_model_infer_span(request, context, request_id) if TRACING.on else None
        deadline = grpc_deadline(context)
        try:
            self._check_key(context)

            async def parse() -> InferCall:
                return parse_grpc_request(request, self.pipeline.limits.max_images_per_request)

            outcome = await run_infer(self.pipeline, request.model_name, request.model_version, parse, None, deadline)
            route = outcome.route
            with stage_span("answer"):
                tensors = build_outputs(outcome.parsed, outcome.answers, route.model.labels)
        except ServiceError as exc:
            status, code = exc.status, grpc_status(exc)
            await context.abort(code, exc.message)
        except asyncio.CancelledError:
            status, code = cancelled_status(deadline)
            raise
        except Exception:
            status, code = 500, grpc.StatusCode.UNKNOWN  # the traceback is logged by grpc
            raise
        finally:
            # Counted with /predict's answers, by the HTTP status the same outcome would have had.
            metrics().requests.labels(code=str(status)).inc()
            log_access("GRPC", MODEL_INFER_PATH, str(status), started)
            if trace is not None:
                trace.end({"rpc.grpc.status_code": code.value[0]}, failed=status >= 500)
        return service_pb2.ModelInferResponse(
            model_name=route.name,
            model_version=str(route.version),
            id=request.id,
            outputs=[
                service_pb2.ModelInferResponse.InferOutputTensor(name=t.name, datatype=t.datatype, shape=t.shape)
                for t in tensors
            ],
            raw_output_contents=[t.to_bytes() for t in tensors],
            parameters=response_parameters(outcome.load_ms),
        )

    async def RepositoryIndex(self, request, context) -> service_pb2.RepositoryIndexResponse:
        repository = await self._run(context, lambda: self._check_admin(context))
        try:
            entries = await repository.index(request.ready)
        except ServiceError as exc:
            await context.abort(grpc_status(exc), exc.message)
        model = service_pb2.RepositoryIndexResponse.ModelIndex
        return service_pb2.RepositoryIndexResponse(models=[model(**entry) for entry in entries])

    async def RepositoryModelLoad(self, request, context) -> service_pb2.RepositoryModelLoadResponse:
        repository = await self._run(context, lambda: self._check_admin(context))
        config = request.parameters.get("config")
        files = [name for name in request.parameters if name.startswith("file:")]
        try:
            await repository.load(request.model_name, config.string_param if config is not None else "", files)
        except ServiceError as exc:
            await context.abort(grpc_status(exc), exc.message)
        return service_pb2.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context) -> service_pb2.RepositoryModelUnloadResponse:
        repository = await self._run(context, lambda: self._check_admin(context))
        try:
            await repository.unload(request.model_name)
        except ServiceError as exc:
            await context.abort(grpc_status(exc), exc.message)
        return service_pb2.RepositoryModelUnloadResponse()

    def _check_admin(self, context: grpc.aio.ServicerContext) -> RepositoryCalls:
        """The repository calls, if this server takes them and the caller has the admin key."""
        if self.repository is None or self._admin_auth is None:
            raise InvalidInput(REPOSITORY_OFF)
        supplied = ApiKeyAuth.supplied_key(dict(context.invocation_metadata() or ()))
        if not self._admin_auth.matches(supplied):
            raise Unauthorized("Missing or wrong admin key. Send --admin-api-key as metadata 'x-api-key: <key>'.")
        return self.repository

    def _check_key(self, context: grpc.aio.ServicerContext) -> None:
        if self._auth is None:
            return
        supplied = ApiKeyAuth.supplied_key(dict(context.invocation_metadata() or ()))
        if not self._auth.matches(supplied):
            raise Unauthorized("Missing or wrong API key. Send it as metadata 'x-api-key: <key>'.")

    @staticmethod
    async def _run(context: grpc.aio.ServicerContext, check: Callable[[], object]) -> object:
        try:
            return check()
        except ServiceError as exc:
            await context.abort(grpc_status(exc), exc.message)


async def start_grpc_server(
    servicer: InferenceServicer, host: str, port: int, max_message_bytes: int
) -> grpc.aio.Server:
    """The gRPC server on ``host:port``, started on the running event loop."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 1),  # one server per HTTP process on the same port
        ]
    )
    add_servicer(servicer, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    server.add_insecure_port(address)
    await server.start()
    logger.info("gRPC (Open Inference Protocol) listening on %s", address)
    return server


class _HandlerCapture:
    """Stands in for a server to take the generated method handlers (name -> handler) as they are."""

    handlers: dict[str, grpc.RpcMethodHandler]

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.handlers = handlers


def add_servicer(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` as the generated code would, with two changes that keep client faults out
    of the server's error log: a request that does not parse answers INVALID_ARGUMENT (grpc would
    answer UNKNOWN with the parser's exception and log a traceback), and the RPCs we do not implement
    answer UNIMPLEMENTED with their name (the generated defaults raise, and grpc logs each one)."""
    capture = _HandlerCapture()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, capture)
    handlers = {}
    for name, handler in capture.handlers.items():
        if name in IMPLEMENTED:
            handlers[name] = handler._replace(
                request_deserializer=_tolerant(handler.request_deserializer),
                unary_unary=_refusing_undecodable(handler.unary_unary, name),
            )
        elif handler.request_streaming:
            handlers[name] = grpc.stream_stream_rpc_method_handler(_unimplemented_stream(name))
        else:
            handlers[name] = grpc.unary_unary_rpc_method_handler(_unimplemented(name))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


def _tolerant(parse: Callable[[bytes], object]) -> Callable[[bytes], object]:
    def deserialize(data: bytes) -> object:
        try:
            return parse(data)
        except DecodeError:  # truncated, random bytes, bad varints, invalid UTF-8, nesting too deep
            return UNDECODABLE

    return deserialize


def _refusing_undecodable(method: Callable, name: str) -> Callable:
    async def handle(request: object, context: grpc.aio.ServicerContext) -> object:
        if request is UNDECODABLE:
            if name == "ModelInfer":  # counted and logged as every other infer answer
                metrics().requests.labels(code="400").inc()
                log_access("GRPC", MODEL_INFER_PATH, "400", time.perf_counter())
            message = f"The {name} request is not a valid protobuf message."
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        return await method(request, context)

    return handle


def _unimplemented(name: str) -> Callable:
    async def refuse(request: bytes, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"vision-serve does not implement {name}.")

    return refuse


def _unimplemented_stream(name: str) -> Callable:
    async def refuse(requests: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"vision-serve does not implement {name}.")

    return refuse
