"""One HTTP process's front end: everything it runs besides the route handlers themselves.

``HttpFrontEnd`` is made in the main process, before the HTTP processes fork, with what they all
share: the settings, the request limits, the admission gate (shared memory), the request pipeline,
the channels' configuration. In each HTTP process, ``running(api_server)`` then opens that process's
own request/answer channel, its view of the workers (``WorkerWatch``), its response cache and its gRPC
server, attaches the first three to the pipeline, turns tracing on when it is (service/tracing/), and
closes all of them when the process ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, MutableSequence, Sequence

from service.errors import ServiceError
from service.http.base.admission import AdmissionGate
from service.http.base.limits import RequestLimits
from service.http.base.worker_watch import WorkerWatch
from service.http.cache import ResponseCache
from service.http.pipeline.on_demand import ModelLoads
from service.http.pipeline.pipeline import RequestPipeline
from service.metrics import LiveState, LiveStateCollector
from service.model_info import ModelInfo
from service.repository.http_calls import RepositoryCalls
from service.repository.table import RoutingTable, TableFile, VersionRoute
from service.settings import ServeSettings
from service.tracing import configure_tracing, shutdown_tracing
from service.transport.channels import ApiChannel, ChannelConfig

logger = logging.getLogger(__name__)

GRPC_STOP_GRACE_S = 5.0


class HttpFrontEnd:
    """``running_batches``: per worker, the size of the batch it runs now (shared memory)."""

    def __init__(
        self,
        settings: ServeSettings,
        channels: ChannelConfig,
        running_batches: Sequence[int],
        table_acks: MutableSequence[int],
        server_version: str,
    ) -> None:
        """``table_acks``: per HTTP process, the routing table generation it follows."""
        self.settings = settings
        self.table_acks = table_acks
        self.channels = channels
        self.running_batches = running_batches
        self.server_version = server_version
        self.limits = RequestLimits(settings.max_body_bytes, settings.max_image_pixels, settings.max_images_per_request)
        self.gate = AdmissionGate(settings.max_queue)
        self.pipeline = RequestPipeline(self.limits, self.gate, settings.request_timeout_s)
        self.watch: WorkerWatch | None = None  # this HTTP process's, while ``running``
        self._live_metrics: LiveStateCollector | None = None

    @contextlib.asynccontextmanager
    async def running(self, api_server: int) -> AsyncIterator[None]:
        """This HTTP process's channel, worker watch and gRPC server, for the life of the process."""
        # Here, after the fork: an exporter's thread made in the main process would not survive it.
        configure_tracing(self.settings.trace_sample_rate, self.settings.otlp_endpoint, f"http-{api_server}")
        channel = ApiChannel(self.channels, api_server)
        watch = WorkerWatch(channel, TableFile(self.channels.directory), acks=self.table_acks)
        watch.refresh()
        self.watch = watch
        # Each process its own cache, and its own Redis client made in its own loop (after the fork).
        cache = ResponseCache.from_settings(self.settings)
        loads = ModelLoads(self.channels.directory, self.settings.request_timeout_s)  # models loaded on demand
        self.pipeline.attach(channel, watch, cache, loads)
        loop = asyncio.get_running_loop()
        tasks = [
            loop.create_task(channel.receive_answers(), name="vision-serve-answers"),
            loop.create_task(watch.run(), name="vision-serve-worker-watch"),
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
            self.pipeline.detach()
            self.watch = None
            channel.close()
            if cache is not None:
                await cache.close()
            shutdown_tracing()  # this process's last spans, before it exits (a forked process runs no atexit)

    async def start_grpc(self) -> object:
        """The Open Inference Protocol's gRPC service in this HTTP process (service/http/grpc/service.py)."""
        from service.http.grpc.service import InferenceServicer, start_grpc_server  # grpc only where it is on

        settings = self.settings
        servicer = InferenceServicer(
            self.pipeline,
            ready=self.ready,
            model_ready=self.model_ready,
            server_version=self.server_version,
            api_key=settings.api_key,
            admin_api_key=settings.admin_api_key,
            repository=self.repository_calls(),
        )
        return await start_grpc_server(servicer, settings.host, settings.grpc_port, settings.max_body_bytes)

    def ready(self) -> bool:
        """Every served model version's workers have loaded and warmed up (this HTTP process's view)."""
        return self.watch is not None and self.watch.ready

    def model_ready(self, route: VersionRoute) -> bool:
        """Every worker of one model version is ready."""
        return route.resident and self.watch is not None and len(self.watch.ready_in(route)) == len(route.workers)

    def table(self) -> RoutingTable:
        return self.watch.table if self.watch is not None else RoutingTable()

    def default_model(self) -> ModelInfo | None:
        """What ``/info``'s ``model`` shows: the default model's latest version, if there is one."""
        table = self.table()
        try:
            return table.resolve(None).model
        except ServiceError:
            return None

    def repository_calls(self) -> RepositoryCalls | None:
        """The repository API's calls to the main process; ``None`` unless --model-control explicit."""
        if self.settings.model_control != "explicit":
            return None
        settings = self.settings
        return RepositoryCalls(self.channels.directory, settings.load_timeout_s, settings.request_timeout_s)

    def worker_states(self) -> dict[str, str]:
        """``{"worker_0": "ready", ...}``: for /ready and the workers gauge."""
        return self.watch.named_states() if self.watch is not None else {}

    def queue_depth(self) -> int:
        """Images admitted and not yet in a running batch, across the server."""
        return max(0, self.gate.admitted - sum(self.running_batches))

    def response_cache(self) -> dict | None:
        """``/info``'s ``response_cache``: this HTTP process's cache, or ``None`` when it is off."""
        cache = self.pipeline.cache
        return cache.stats() if cache is not None else None

    def in_flight(self) -> int:
        return self.gate.admitted

    def live_metrics(self) -> LiveStateCollector:
        """Made once per HTTP process, on its first scrape: its readers fetch the changing values."""
        if self._live_metrics is None:
            self._live_metrics = LiveStateCollector(
                LiveState(
                    queue_depth=self.queue_depth,
                    in_flight=self.in_flight,
                    in_flight_limit=self.settings.max_queue,
                    worker_states=self.worker_states,
                    build_info=self.build_info,
                    models=self.model_states,
                )
            )
        return self._live_metrics

    def build_info(self) -> dict[str, str]:
        model = self.default_model()
        return {
            "version": self.server_version,
            "model": model.model if model else "",
            "engine": model.engine if model else "",
            "preprocess": model.preprocess if model else "",
            "device": model.device if model else "",
        }

    def model_states(self) -> list[tuple[str, str, bool]]:
        """(model, version, ready) of every served version: the model_ready gauge."""
        return [(r.name, str(r.version), self.model_ready(r)) for r in self.table().routes()]
