"""The main process: build the LitServer for a ``ServePlan`` and run it until SIGTERM/SIGINT, leaving
no orphans.

LitServe 0.2.19 leaves its uvicorn, inference-worker and manager processes running when the main
process gets SIGTERM. ``serve`` turns SIGTERM and SIGINT into LitServe's own graceful
shutdown (the path its ``/shutdown`` endpoint takes), and reaps any child left afterwards. Nothing
here imports torch: the HTTP processes fork from this one (service/supervisor/planning/planner.py).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from multiprocessing import resource_tracker
from multiprocessing.process import BaseProcess

from fastapi import FastAPI

from compile.unpacking import remove_every_unpacked, remove_unpacked_of, unpack_root
from compile.versions import PROJECT_DISTRIBUTION, package_version
from service.heap import freeze_startup_objects
from service.http.connection.guard import guarded_http_protocol
from service.http.connection.refusals import ConnectionLimits
from service.http.process import HttpFrontEnd
from service.http.routes import register_routes
from service.logs import adopt_library_loggers
from service.metrics import mark_process_dead, metrics, multiprocess_mode
from service.settings import ServeSettings
from service.supervisor.litserve_bridge import LitServerBridge
from service.supervisor.planning.layout import ServerLayout, server_layout
from service.supervisor.planning.plans import ServePlan, VersionPlan
from service.supervisor.pool.hangs import hang_watch
from service.supervisor.pool.hosts import WorkerHosts
from service.supervisor.pool.on_demand import attach_memory_budget
from service.supervisor.pool.repository_operations import RepositoryOperations
from service.supervisor.pool.restarts import WorkerRestarter
from service.supervisor.pool.states import WorkerStates
from service.supervisor.pool.table_publisher import TablePublisher
from service.supervisor.pool.workers import WorkerHooks, WorkerSet
from service.supervisor.startup import StartupInterrupted, WorkerStartupFailed
from service.transport.channels import ChannelConfig
from service.transport.control_channel import ERROR, READY, ControlServer
from service.transport.heartbeats import FIELDS as HEARTBEAT_FIELDS
from service.transport.heartbeats import HeartbeatBoard
from service.worker.entry import CLASSIFIER, WorkerEntry
from service.worker.host import HostResources, SlotSpec
from service.worker.loop import BatchPolicy, GreedyBatchedLoop

logger = logging.getLogger(__name__)

CHILD_STOP_TIMEOUT_S = 10.0
STARTUP_POLL_S = 0.05
# Slots of the shared array of running batch sizes; a worker writes slot id % RUNNING_SLOTS (ids grow
# with every load, and a slot is 0 whenever its worker is idle or gone).
RUNNING_SLOTS = 1024
# What the server reports as its version (OIP server metadata, build_info): "unknown" when it runs
# from a checkout that pip has not installed.
SERVER_VERSION = package_version(PROJECT_DISTRIBUTION) or "unknown"


def device_names(devices: list) -> list[str]:
    """LitServe's per-worker device groups (``[["cuda:0"]]`` for one GPU) as a flat list
    of device names, each once, in order."""
    flat = [d for group in devices for d in (group if isinstance(group, list | tuple) else [group])]
    return list(dict.fromkeys(str(d) for d in flat))


class VisionLitServer(LitServerBridge):
    """LitServer with vision-serve's request path, probes, auth, model pool and worker recovery.

    Made and run in the main process. The routes (service/http/routes.py) and the per-process
    front end (service/http/process.py) are set up here before the HTTP processes fork; requests
    and answers travel over service/transport/channels.py, not LitServe's manager queues. The
    inference workers are the model pool's (service/supervisor/pool/): the first versions' at
    launch, others at repository load calls, a dead one restarted. Stopping, also from a signal
    handler while workers start, takes LitServe's own graceful path: uvicorn stops accepting and
    finishes the requests it holds while the inference workers still answer them; the workers stop
    after that (tests/e2e/test_e2e.py checks in-flight requests get their answers).
    """

    exit_code = 0

    def __init__(
        self, plans: Sequence[VersionPlan], settings: ServeSettings, layout: ServerLayout, model: str = CLASSIFIER
    ) -> None:
        """``settings``: the server's own (its plans' carry each version's artifact and batching)."""
        self.settings = settings
        self.layout = layout
        self.api_servers = layout.api_servers
        self.model_path = model
        self.channels = ChannelConfig.create(layout.api_servers)
        # Per worker slot, the size of the batch it runs now: the queue depth is what is admitted and
        # not running. Shared memory, made before any worker spawns (they get it with the loop).
        self.running = multiprocessing.Array("i", RUNNING_SLOTS, lock=False)
        # Per worker slot, its last heartbeat and its batch's start, which the hang watch reads.
        self.heartbeats = multiprocessing.Array("d", RUNNING_SLOTS * HEARTBEAT_FIELDS, lock=False)
        self.heartbeat_board = HeartbeatBoard(self.heartbeats)
        # Per HTTP process, the routing table generation it follows (-1: not started yet).
        self.table_acks = multiprocessing.Array("q", [-1] * layout.api_servers, lock=False)
        self.initial_plans = list(plans)
        # The worker processes, each holding the engines of one model or of many (service/worker/host.py).
        self.hosts = WorkerHosts(
            lambda: HostResources(self.channels, self.running, self.heartbeats, os.getpid()),
            self.heartbeat_board.clear,  # nothing of a predecessor's is read as the new worker's
        )
        self.worker_hooks = WorkerHooks(
            spawn=self.hosts.place, make_entry=lambda plan: slot_spec(plan, model), device_slots=self.device_slots
        )
        self.pool_stopping = threading.Event()  # set on stop: a load's waits end at once
        # Every worker's state: changed by the pool and by the workers' reports over the control
        # channel, published to the HTTP processes in the routing table (docs/development.md).
        self.states = WorkerStates()
        self.worker_set = WorkerSet(settings, self.states, self.worker_hooks, self.pool_stopping)
        self.table_publisher = TablePublisher(
            self.channels.directory,
            self.table_acks,
            self.worker_set.routes,
            self.states.snapshot,
            settings.default_model,
            self.pool_stopping,
            parked=lambda: self.on_demand.routes() if self.on_demand is not None else {},
            filling=lambda: self.on_demand is not None and self.on_demand.filling,
            processes=self.hosts.worker_processes,
        )
        self.states.on_change = self.table_publisher.publish_soon
        self.repository = RepositoryOperations(settings, layout, self.worker_set, self.table_publisher)
        # A repository's memory budget: its models served on demand, or explicit loads checked.
        self.on_demand = attach_memory_budget(
            self.repository, layout.accelerator, plans[0].serve_plan.workers, self.states, self.heartbeat_board
        )
        reports = self.hosts.reports_to(self.states)
        self.control = ControlServer(self.channels.directory, self.repository.handle, reports)
        # Before LitServer.__init__, which registers the routes that use it.
        self.frontend = HttpFrontEnd(settings, self.channels, self.running, self.table_acks, SERVER_VERSION)
        first = plans[0].serve_plan
        # timeout: LitServe's own deadline, which its loop would apply (ours applies the same one).
        super().__init__(
            self.make_entry(plans[0]),
            timeout=settings.request_timeout_s,
            restart_workers=True,
            accelerator=first.accelerator,
            devices=first.devices,
            workers_per_device=first.settings.workers_per_device,
        )

    def make_entry(self, plan: VersionPlan) -> WorkerEntry:
        """The LitAPI LitServer is made with (its contract; our worker processes run ``slot_spec``'s)."""
        spec = slot_spec(plan, self.model_path)
        return WorkerEntry(spec.settings, GreedyBatchedLoop(self.channels, spec.policy), self.model_path)

    def launch_workers(self) -> list:
        # The control channel first: the workers report on it that they are ready.
        self.control.start()
        self.table_publisher.start()
        self.repository.start(self.initial_plans)
        # What LitServe stops at shutdown: the worker processes themselves, not the slots in them
        # (restarted ones are reaped after it: ``reap_children``).
        return self.hosts.processes()

    def wait_for_first_worker(self) -> None:
        while True:
            states = self.states.snapshot().values()
            if READY in states:
                return
            if self.stop_requested:
                raise StartupInterrupted()
            if ERROR in states or not any(process.is_alive() for process in self.worker_set.processes()):
                raise WorkerStartupFailed(
                    "An inference worker failed to start (its error is logged above): check --model, "
                    "--weights and --device."
                )
            time.sleep(STARTUP_POLL_S)

    def request_stop(self) -> None:
        self.pool_stopping.set()
        super().request_stop(start_stop_thread)

    def before_http_processes(self) -> None:
        # LitServer.run has just given the litserve logger a handler of its own, in its own format:
        # route it through ours, before the HTTP processes fork and inherit it.
        adopt_library_loggers()
        freeze_startup_objects()  # inherited by the HTTP processes

    def register_routes(self, app: FastAPI, api_path: str) -> None:
        register_routes(app, self.frontend, api_path, self.server_info())

    def server_info(self) -> dict:
        """``/info``'s ``server`` object; ``queued`` is filled in at each call."""
        return server_info(self.settings, self.initial_plans[0].serve_plan.settings, self.devices, self.api_servers)

    @asynccontextmanager
    async def http_process(self, app: FastAPI, api_server: int) -> AsyncIterator[None]:
        # Runs in each HTTP process (after the fork): its channel, watch and gRPC server are its own.
        async with self.frontend.running(api_server):
            yield

    def start_worker_monitor(self) -> None:
        hangs = hang_watch(self.settings, self.worker_set, self.heartbeat_board)
        restarter = WorkerRestarter(self.worker_set, self.worker_hooks, self._stop_with_error, hangs)
        thread = threading.Thread(
            target=restarter.watch,
            kwargs={"stopping": self._stopping, "metrics_restart": count_restart},
            name="vision-serve-worker-monitor",
            daemon=True,
        )
        thread.start()

    def stop_control(self) -> None:
        self.control.stop()

    def _stopping(self) -> bool:
        return self.stop_requested

    def _stop_with_error(self, message: str) -> None:
        logger.error("%s", message)
        self.exit_code = 1
        self.request_stop()


def count_restart(process: BaseProcess) -> None:
    """A worker process restarted: what it left behind goes."""
    mark_process_dead(process.pid)  # its GPU-memory gauge no longer counts
    remove_unpacked_of(process.pid)  # its copy of the engine (it may have ended with os._exit)
    metrics().worker_restarts.inc()


def slot_spec(plan: VersionPlan, model_path: str) -> SlotSpec:
    """What a version's workers run: its settings and batch policy, and the model class."""
    settings = plan.serve_plan.settings
    policy = BatchPolicy(
        max_batch_size=settings.max_batch_size,
        batch_timeout_s=settings.batch_timeout_ms / 1000,
        pipeline_depth=settings.pipeline_depth,
    )
    return SlotSpec(settings, policy, model_path)


def server_info(settings: ServeSettings, first: ServeSettings, devices: list, api_servers: int) -> dict:
    """``/info``'s ``server`` object: the server's ``settings``, and the sizing of the first model's
    (``first``: each model's own is in /info's models)."""
    return {
        "devices": device_names(devices),
        "workers_per_device": first.workers_per_device,
        "engine_threads": first.engine_threads,
        "api_servers": api_servers,
        "pipeline_depth": first.pipeline_depth,
        "max_queue": settings.max_queue,
        "queued": 0,
        "request_timeout_s": settings.request_timeout_s,
        "max_body_bytes": settings.max_body_bytes,
        "max_image_pixels": settings.max_image_pixels,
        "max_images_per_request": settings.max_images_per_request,
        "grpc_port": settings.grpc_port,
        "api_key_required": bool(settings.api_key),
        "model_repository": settings.model_repository or None,
        "model_control": settings.model_control,
    }


def start_stop_thread(target: Callable[[], None]) -> None:
    """Run ``target`` (the stop event's ``set``) in a thread of its own (see ``request_stop``)."""
    threading.Thread(target=target, name="vision-serve-stop", daemon=True).start()


def build_server(
    plans: ServePlan | Sequence[VersionPlan], settings: ServeSettings | None = None, model: str = CLASSIFIER
) -> VisionLitServer:
    """The server for ``plans`` (one ``ServePlan``: a one-model server); ``settings``: the server's
    own, by default the first plan's; ``model`` names the model the workers load (service/worker/
    entry.py; service/testing/: the front-end benchmark serves a no-op one through everything else)."""
    if isinstance(plans, ServePlan):
        plans = [VersionPlan(plans.settings.served_name, 1, plans)]
    settings = settings or plans[0].serve_plan.settings
    layout = server_layout(plans, settings)
    os.environ.update(layout.worker_env)  # spawned workers inherit it (CUDA_VISIBLE_DEVICES for one GPU)
    for plan in plans:
        logger.info(
            "Model %s version %d: preprocessing %s (%s): %s",
            plan.name,
            plan.version,
            plan.serve_plan.model.preprocess,
            plan.serve_plan.model.preprocess_reason,
            plan.serve_plan.model.preprocess_summary,
        )
    return VisionLitServer(plans, settings, layout, model)


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


def serve(server: VisionLitServer) -> int:
    """Run until SIGTERM or SIGINT; returns the process exit code."""
    settings = server.settings
    if settings.grpc_port:
        try:
            check_port_free(settings.host, settings.grpc_port)
        except OSError as exc:
            logger.error(
                "--grpc-port %d cannot be used (%s): another process listens there. Stop it, or choose another port.",
                settings.grpc_port,
                exc.strerror or exc,
            )
            server.channels.remove()
            return 1

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
    # Entered before any other process starts: they all record into its directory (service/metrics.py),
    # and unpack their engines into the run folder (compile/unpacking.py), whatever way they end.
    # Left after every child is reaped: their files are no longer written.
    with multiprocess_mode(), unpack_root(os.path.join(server.channels.directory, "unpacked")):
        try:
            return _run(server)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            server.stop_control()
            reap_children()
            remove_every_unpacked()  # the run folder holds them, but older torch unpacks into /tmp
            server.channels.remove()


def _run(server: VisionLitServer) -> int:
    """LitServer.run until it stops; the exit code, with startup failures explained."""
    settings = server.settings
    try:
        server.run(
            host=settings.host,
            port=settings.port,
            num_api_servers=server.api_servers,
            log_level=settings.log_level,
            generate_client_file=False,  # LitServe would otherwise write client.py into the cwd
            # uvicorn: no handlers of its own (its records reach ours, service/logs.py), and no access
            # log (ours has the request id, service/http/base/observer.py).
            log_config=None,
            access_log=False,
            http=guarded_http_protocol(
                ConnectionLimits(settings.max_header_bytes, settings.header_timeout_s, settings.body_timeout_s)
            ),
            timeout_keep_alive=settings.keep_alive_timeout_s,
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
