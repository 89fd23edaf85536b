"""Build the LitServer for a ``ServeSettings`` and run it until SIGTERM/SIGINT, leaving no orphans.

LitServe 0.2.19 leaves its uvicorn, inference-worker and manager processes running when the main
process gets SIGTERM (measured). ``serve`` turns SIGTERM and SIGINT into LitServe's own graceful
shutdown (the path its ``/shutdown`` endpoint takes), and reaps any child left afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from multiprocessing import resource_tracker

import litserve as ls
import torch
from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse

from compile.catalog import get_model_entry
from compile.devices import ALL_GPUS, describe_device, parse_device
from compile.manifest import Manifest
from compile.versions import PROJECT_DISTRIBUTION, package_version
from preprocessing import resolve_preprocess_backend
from service import _defaults
from service.frontend.admission import AdmissionGate
from service.frontend.auth import ApiKeyAuth
from service.frontend.dispatch import ImageDispatcher
from service.frontend.observer import HttpObserver
from service.frontend.worker_watch import WorkerWatch, restart_dead_workers
from service.heap import freeze_startup_objects
from service.litserve_bridge import LitServerBridge, StartupInterrupted, WorkerStartupFailed, add_fast_route
from service.logs import adopt_library_loggers
from service.metrics import (
    CONTENT_TYPE as METRICS_CONTENT_TYPE,
)
from service.metrics import (
    LiveState,
    LiveStateCollector,
    exposition,
    mark_process_dead,
    metrics,
    multiprocess_mode,
)
from service.oip.rest import OipInferEndpoint, add_oip_routes, infer_paths
from service.rest.parsing import RequestLimits
from service.rest.predict import OPENAPI_EXTRA, PredictEndpoint
from service.rest.upload_page import upload_page
from service.settings import ServeSettings, resolve_api_servers, resolve_pipeline_depth
from service.transport.channels import ApiChannel, ChannelConfig
from service.worker.classifier import ClassifierAPI
from service.worker.engine import ENGINE_EAGER, ensure_servable
from service.worker.loop import GreedyBatchedLoop

logger = logging.getLogger(__name__)

CHILD_STOP_TIMEOUT_S = 10.0
GRPC_STOP_GRACE_S = 5.0
# What the server reports as its version (OIP server metadata, build_info): "unknown" when it runs
# from a checkout that pip has not installed.
SERVER_VERSION = package_version(PROJECT_DISTRIBUTION) or "unknown"


def resolve_device(
    device: str, cuda_count: int, visible_devices: str | None = None
) -> tuple[str, int | str, dict[str, str]]:
    """``--device`` -> (LitServer accelerator, devices, environment for the workers).

    ``visible_devices`` is the CUDA_VISIBLE_DEVICES already in force: torch numbers GPUs within it.
    """
    index = parse_device(device, cuda_count)
    if index is None:
        return "cpu", "auto", {}
    if index == ALL_GPUS:
        return "cuda", cuda_count, {}
    # One chosen GPU: show the worker only that one, and it becomes its cuda:0.
    visible = str(index)
    if visible_devices:
        visible = [d.strip() for d in visible_devices.split(",")][index]
    return "cuda", 1, {"CUDA_VISIBLE_DEVICES": visible}


def device_names(devices: list) -> list[str]:
    """LitServe's per-worker device groups (``[["cuda:0"]]``, measured on an H100) as a flat list
    of device names, each once, in order."""
    flat = [d for group in devices for d in (group if isinstance(group, list | tuple) else [group])]
    return list(dict.fromkeys(str(d) for d in flat))


class VisionLitServer(LitServerBridge):
    """LitServer with vision-serve's request path, probes, auth and worker recovery.

    - ``POST /predict`` (``PredictEndpoint``): limits checked in the HTTP process, a bounded queue
      (503 + Retry-After beyond it), a deadline that covers running work (504). Requests go to the
      workers and answers come back over service/transport/channels.py, not LitServe's manager queues.
    - ``/health`` (alive), ``/ready`` (every worker loaded and warmed) and ``/metrics`` (Prometheus,
      service/metrics.py) answer without a key; with ``--api-key``, ``/predict`` and ``/info`` need it.
    - Every response carries ``X-Request-ID``; the access log and ``vision_serve_requests_total``
      come from one middleware (service/frontend/observer.py).
    - A worker that dies is restarted; the requests it held get 503 at once (``WorkerWatch``).
    - Stopping, also from a signal handler while workers start, takes LitServe's own graceful path:
      uvicorn stops accepting and finishes the requests it holds while the inference workers still
      answer them; the workers stop after that. tests/test_e2e.py checks in-flight requests get
      their answers.
    """

    exit_code = 0
    api_channel: ApiChannel | None = None  # one per HTTP process, made in its lifespan
    worker_watch: WorkerWatch | None = None  # likewise

    def __init__(
        self, lit_api: ls.LitAPI, settings: ServeSettings, *, api_servers: int, workers: int, **kwargs: object
    ) -> None:
        # Set before LitServer.__init__, which registers the endpoints that use them.
        self.settings = settings
        self.inference_paths = [lit_api.api_path, *infer_paths(settings.model)]
        self.api_servers = api_servers
        self.limits = RequestLimits(settings.max_body_bytes, settings.max_image_pixels, settings.max_images_per_request)
        self.admission = AdmissionGate(settings.max_queue)
        self.dispatcher = ImageDispatcher(
            channel=lambda: self.api_channel,
            watch=lambda: self.worker_watch,
            gate=self.admission,
            timeout_s=settings.request_timeout_s,
        )
        self.auth_dependencies = [Depends(ApiKeyAuth(settings.api_key))] if settings.api_key else []
        self.channels = ChannelConfig.create(api_servers, workers)
        # Per worker, the size of the batch it runs now: the queue depth is what is admitted and
        # not running. Shared memory, made before the workers spawn (they get it with the loop).
        self.running = multiprocessing.Array("i", workers, lock=False)
        lit_api.loop = GreedyBatchedLoop(self.channels, self.running, settings.pipeline_depth)
        # timeout: the workers drop queued requests older than the deadline instead of running them.
        super().__init__(lit_api, timeout=settings.request_timeout_s, restart_workers=True, **kwargs)
        self.app.add_middleware(HttpObserver, counted_paths=self.inference_paths)

    def request_stop(self) -> None:
        super().request_stop(
            lambda target: threading.Thread(target=target, name="vision-serve-stop", daemon=True).start()
        )

    def before_http_processes(self) -> None:
        # LitServer.run has just given the litserve logger a handler of its own, in its own format:
        # route it through ours, before the HTTP processes fork and inherit it.
        adopt_library_loggers()
        freeze_startup_objects()  # inherited by the HTTP processes

    def register_routes(self, app: FastAPI, api_path: str) -> None:
        @app.get("/", include_in_schema=False)
        async def index() -> HTMLResponse:
            """A page to try the model from a browser: pick or drop an image, see the top 5 and the latency."""
            return upload_page()

        @app.get("/health")
        async def health() -> dict:
            """Liveness: the HTTP server answers. Never needs the API key."""
            return {"status": "alive"}

        @app.get("/ready", responses={503: {"description": "a worker is starting or restarting"}})
        async def ready() -> JSONResponse:
            """Readiness: every inference worker has loaded its model and finished warm-up."""
            watch = self.worker_watch
            is_ready = self.workers_ready()
            states = watch.named_states() if watch is not None else {}
            return JSONResponse({"ready": is_ready, "workers": states}, status_code=200 if is_ready else 503)

        @app.get("/metrics", include_in_schema=False)
        def prometheus_metrics() -> Response:
            """Prometheus text format; a plain def, so FastAPI runs the file reads in its thread pool."""
            return Response(exposition(self.live_metrics), media_type=METRICS_CONTENT_TYPE)

        @app.get("/info", dependencies=self.auth_dependencies)
        async def info() -> dict:
            settings = self.settings
            return {
                "model": self.model_metadata,
                "server": {
                    "devices": device_names(self.devices),
                    "workers_per_device": self.workers_per_device,
                    "api_servers": self.api_servers,
                    "pipeline_depth": settings.pipeline_depth,
                    "max_queue": settings.max_queue,
                    "queued": self.admission.admitted,
                    "request_timeout_s": settings.request_timeout_s,
                    "max_body_bytes": settings.max_body_bytes,
                    "max_image_pixels": settings.max_image_pixels,
                    "max_images_per_request": settings.max_images_per_request,
                    "grpc_port": settings.grpc_port,
                    "api_key_required": bool(settings.api_key),
                },
            }

        check_auth = ApiKeyAuth(self.settings.api_key) if self.settings.api_key else None
        endpoint = PredictEndpoint(self.dispatcher, self.limits, check_auth)
        # POST /predict skips FastAPI's stack: the observer (request id, access log, counts) wraps it
        # directly. The FastAPI route below is what /docs shows, and answers the same way.
        add_fast_route(app, "POST", api_path, HttpObserver(endpoint, self.inference_paths))

        async def predict(request: Request) -> Response:
            return await endpoint.handle(request)

        app.add_api_route(
            api_path,
            predict,
            methods=["POST"],
            dependencies=self.auth_dependencies,
            openapi_extra=OPENAPI_EXTRA,
            summary="Classify one image, or several: their top-k ImageNet labels",
        )
        self.register_oip_routes(app, check_auth)

    def register_oip_routes(self, app: FastAPI, check_auth: ApiKeyAuth | None) -> None:
        """The Open Inference Protocol (service/oip/rest.py); the served model's infer paths skip
        FastAPI's stack as /predict does."""
        oip_endpoint = OipInferEndpoint(self.dispatcher, self.limits, lambda: self.settings.model, check_auth)
        for path in infer_paths(self.settings.model):
            add_fast_route(app, "POST", path, HttpObserver(oip_endpoint, self.inference_paths))
        add_oip_routes(
            app,
            oip_endpoint,
            server_version=SERVER_VERSION,
            engine=self.engine_name,
            ready=self.workers_ready,
        )

    def workers_ready(self) -> bool:
        """Every inference worker has loaded its model and warmed up (this HTTP process's view)."""
        return self.worker_watch is not None and self.worker_watch.ready

    def engine_name(self) -> str:
        return str((self.model_metadata or {}).get("engine", ""))

    def queue_depth(self) -> int:
        """Images admitted and not yet in a running batch, across the server."""
        return max(0, self.admission.admitted - sum(self.running))

    @functools.cached_property
    def live_metrics(self) -> LiveStateCollector:
        """Made once per HTTP process, on its first scrape: its readers fetch the changing values."""
        metadata = self.model_metadata or {}
        return LiveStateCollector(
            LiveState(
                queue_depth=self.queue_depth,
                in_flight=lambda: self.admission.admitted,
                in_flight_limit=self.settings.max_queue,
                worker_states=lambda: self.worker_watch.named_states() if self.worker_watch is not None else {},
                build_info={
                    "version": SERVER_VERSION,
                    "model": str(metadata.get("model", "")),
                    "engine": str(metadata.get("engine", "")),
                    "preprocess": str(metadata.get("preprocess", "")),
                    "device": str(metadata.get("device", "")),
                },
            )
        )

    @asynccontextmanager
    async def http_process(self, app: FastAPI, api_server: int) -> AsyncIterator[None]:
        # Runs in each HTTP process (after the fork): its channel and watch are its own.
        channel = ApiChannel(self.channels, api_server)
        self.api_channel = channel
        self.worker_watch = WorkerWatch(self.worker_states, channel)
        self.worker_watch.refresh()
        loop = asyncio.get_running_loop()
        tasks = [
            loop.create_task(channel.receive_answers(), name="vision-serve-answers"),
            loop.create_task(self.worker_watch.run(), name="vision-serve-worker-watch"),
        ]
        grpc_server = await self.start_grpc() if self.settings.grpc_port else None
        try:
            yield
        finally:
            if grpc_server is not None:
                # Its calls in flight finish while the workers still answer (they stop after us).
                await grpc_server.stop(GRPC_STOP_GRACE_S)
            for task in tasks:
                task.cancel()
            channel.close()

    async def start_grpc(self) -> object:
        """The Open Inference Protocol's gRPC service in this HTTP process (service/oip/grpc_service.py)."""
        from service.oip.grpc_service import InferenceServicer, start_grpc_server  # grpc only where it is on

        settings = self.settings
        servicer = InferenceServicer(
            self.dispatcher,
            self.limits,
            model=settings.model,
            engine=self.engine_name,
            ready=self.workers_ready,
            server_version=SERVER_VERSION,
            api_key=settings.api_key,
        )
        return await start_grpc_server(servicer, settings.host, settings.grpc_port, settings.max_body_bytes)

    def start_worker_monitor(self) -> None:
        def stop_with_error(message: str) -> None:
            logger.error("%s", message)
            self.exit_code = 1
            self.request_stop()

        def relaunch(index: int) -> object:
            mark_process_dead(self.worker_processes[index].pid)  # its GPU-memory gauge no longer counts
            metrics().worker_restarts.inc()
            return self.relaunch_worker(index)

        thread = threading.Thread(
            target=restart_dead_workers,
            kwargs={
                "workers": self.worker_processes,
                "state_of": self.worker_state,
                "relaunch": relaunch,
                "stopping": lambda: self.stop_requested,
                "on_unrecoverable": stop_with_error,
            },
            name="vision-serve-worker-monitor",
            daemon=True,
        )
        thread.start()


def apply_artifact(settings: ServeSettings, cuda_count: int | None = None) -> tuple[ServeSettings, Manifest]:
    """Settings adjusted to the artifact's manifest, which wins over flags; ``ValueError`` if they conflict."""
    from compile.manifest import read_manifest

    manifest = read_manifest(settings.artifact)
    cuda_count = torch.cuda.device_count() if cuda_count is None else cuda_count
    device = settings.device
    if device == "auto":
        device = manifest.device_type  # serve where it was compiled for
    if manifest.backend == "tensorrt" and device == "cuda" and cuda_count > 1:
        # A deserialized TensorRT engine is bound to one GPU; a worker per GPU would each need its own.
        logger.warning(
            "TensorRT artifacts are served on one GPU per server: using cuda:0 of %d. Run one vision-serve "
            "per GPU with --device cuda:N to use them all.",
            cuda_count,
        )
        device = "cuda:0"
    device_type = "cpu" if device == "cpu" else "cuda"
    # Describing the CPU is cheap; describing a GPU would create a CUDA context in this process.
    here = describe_device(torch.device("cpu")) if device_type == "cpu" else None
    ensure_servable(manifest, settings.artifact, device_type, here)
    if settings.model not in (_defaults.MODEL, manifest.model):
        raise ValueError(
            f"--model {settings.model} conflicts with --artifact {settings.artifact}, which holds {manifest.model}. "
            "Drop --model: the artifact decides the model."
        )
    if settings.weights != _defaults.WEIGHTS:
        raise ValueError(
            f"--weights has no effect with --artifact: the engine was compiled with {manifest.weights_source}. "
            "Drop --weights, or compile a new artifact with compile-trt --weights."
        )
    max_batch_size = settings.max_batch_size
    if max_batch_size > manifest.batch_max:
        logger.warning(
            "--max-batch-size %d is above the artifact's largest batch %d; using %d. Compile with "
            "compile-trt --batch MIN,OPT,%d to batch more.",
            max_batch_size,
            manifest.batch_max,
            manifest.batch_max,
            max_batch_size,
        )
        max_batch_size = manifest.batch_max
    adjusted = dataclasses.replace(settings, model=manifest.model, device=device, max_batch_size=max_batch_size)
    return adjusted, manifest


def artifact_metadata(directory: str, manifest: Manifest) -> dict:
    return {
        "directory": directory,
        "backend": manifest.backend,
        "precision": manifest.precision,
        "batch": {"min": manifest.batch_min, "opt": manifest.batch_opt, "max": manifest.batch_max},
        "device": {
            "type": manifest.device_type,
            "name": manifest.device_name,
            "capability": manifest.device_capability,
        },
        "weights_sha256": manifest.weights_sha256,
        "compiled_at": manifest.compiled_at,
        "versions": manifest.versions,
        "validation": manifest.validation.get("metrics", {}),
        "cache_key": manifest.cache_key,
        "backend_config": manifest.backend_config,
    }


def build_server(settings: ServeSettings, lit_api: ls.LitAPI | None = None) -> VisionLitServer:
    """The server for ``settings``; ``lit_api`` replaces ``ClassifierAPI(settings)`` (the front-end
    benchmark serves a no-op model through everything else)."""
    manifest = None
    if settings.artifact:
        settings, manifest = apply_artifact(settings)
    accelerator, devices, worker_env = resolve_device(
        settings.device, torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES")
    )
    os.environ.update(worker_env)  # spawned workers inherit it
    worker_device = "cpu" if accelerator == "cpu" else "cuda:0"
    preprocess, reason = resolve_preprocess_backend(settings.preprocess, worker_device)
    logger.info("Preprocessing: %s (%s)", preprocess, reason)
    if manifest is not None:
        spec, labels_source = manifest.preprocess, manifest.labels_source
        weights, engine = manifest.weights_source, manifest.engine_name
    else:
        entry = get_model_entry(settings.model)  # fail fast on a bad name, before spawning workers
        spec, labels_source = entry.preprocess, entry.labels_source
        weights, engine = settings.weights, ENGINE_EAGER
    metadata = {
        "model": settings.model,
        "weights": weights,
        "engine": engine,
        "preprocess": preprocess,
        "preprocess_reason": reason,
        "preprocess_spec": spec.to_dict(),
        "labels_source": labels_source,
        # What --device resolved to: cpu, cuda (every GPU) or cuda:N.
        "device": "cpu" if accelerator == "cpu" else ("cuda" if settings.device == "auto" else settings.device),
        "max_batch_size": settings.max_batch_size,
        "batch_timeout_ms": settings.batch_timeout_ms,
    }
    if manifest is not None:
        metadata["artifact"] = artifact_metadata(settings.artifact, manifest)
    workers = (1 if accelerator == "cpu" else devices) * settings.workers_per_device
    settings = dataclasses.replace(
        settings, pipeline_depth=resolve_pipeline_depth(settings.pipeline_depth, accelerator)
    )
    return VisionLitServer(
        lit_api or ClassifierAPI(settings),
        settings,
        api_servers=resolve_api_servers(settings.api_servers, accelerator, workers, os.cpu_count() or 1),
        workers=workers,
        accelerator=accelerator,
        devices=devices,
        workers_per_device=settings.workers_per_device,
        model_metadata=metadata,
    )


def reap_children(timeout: float = CHILD_STOP_TIMEOUT_S) -> None:
    """Terminate, then kill, any multiprocessing child still alive; then stop the resource tracker."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    deadline = time.monotonic() + timeout
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            logger.warning("Child %s (pid %s) ignored SIGTERM; killing it.", child.name, child.pid)
            child.kill()
            child.join()
    # The tracker that spawn-started workers use would otherwise outlive us by a moment.
    stop_tracker = getattr(resource_tracker._resource_tracker, "_stop", None)
    if stop_tracker is not None:
        stop_tracker()


def check_port_free(host: str, port: int) -> None:
    """``OSError`` if something listens on ``host:port``.

    The gRPC servers of the HTTP processes share their port (SO_REUSEPORT), so they would also share
    it, silently, with a stale server still bound there; a plain bind first makes that an error.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # connections in TIME_WAIT are no owner
        probe.bind((host, port))


def serve(settings: ServeSettings, server: VisionLitServer | None = None) -> int:
    """Run until SIGTERM or SIGINT; returns the process exit code."""
    if settings.grpc_port:
        try:
            check_port_free(settings.host, settings.grpc_port)
        except OSError as exc:
            logger.error(
                "--grpc-port %d cannot be used (%s): another process listens there. Stop it, or choose another port.",
                settings.grpc_port,
                exc.strerror or exc,
            )
            return 1
    server = server or build_server(settings)

    main_pid = os.getpid()

    def on_signal(signum: int, _frame: object) -> None:
        if os.getpid() != main_pid:
            # A forked child (the multiprocessing manager, a uvicorn server before it installs its
            # own handlers) inherited this handler: behave as the default and end.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if not server.stop_requested:
            logger.info("%s received: shutting down.", signal.Signals(signum).name)
        server.request_stop()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    # Entered before any other process starts: they all record into its directory (service/metrics.py).
    # Left after every child is reaped: their files are no longer written.
    with multiprocess_mode():
        try:
            return _run(server, settings)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            reap_children()
            server.channels.remove()


def _run(server: VisionLitServer, settings: ServeSettings) -> int:
    """LitServer.run until it stops; the exit code, with startup failures explained."""
    try:
        server.run(
            host=settings.host,
            port=settings.port,
            num_api_servers=server.api_servers,
            log_level=settings.log_level,
            generate_client_file=False,  # LitServe would otherwise write client.py into the cwd
            # uvicorn: no handlers of its own (its records reach ours, service/logs.py), and no access
            # log (ours has the request id, service/frontend/observer.py).
            log_config=None,
            access_log=False,
        )
        return server.exit_code
    except StartupInterrupted:
        logger.info("Stopped before the workers were ready.")
        return 0
    except WorkerStartupFailed as exc:
        logger.error("%s", exc)
        return 1
    except (EOFError, ConnectionError) as exc:
        # The manager connection the main thread waits on broke (the manager process died):
        # nothing can be served any more.
        logger.error("The server stopped: its multiprocessing manager is gone (%r); see the log above.", exc)
        return 1
