"""Every use of LitServe's internals, in one place, checked against the one version it was written for.

vision-serve keeps ``ls.LitAPI`` as its model contract and LitServe's process management (the
spawned inference workers, the forked uvicorn processes, graceful shutdown), and replaces its
request path: routes, request and answer transport (service/transport/channels.py), batching loop, worker
recovery. That needs hooks LitServe does not make public. ``LitServerBridge`` turns them into
plain methods for service/supervisor/server.py; ``WorkerLoop`` does the same for the worker's loop.
tests/unit/test_litserve_bridge.py holds one contract test per internal used here, so an upgrade that
moves one fails there, by name, instead of somewhere in the request path.
"""

from __future__ import annotations

import abc
import contextlib
import multiprocessing as mp
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.process import BaseProcess
from typing import Any

import litserve as ls
from fastapi import FastAPI
from litserve.loops import inference_worker
from litserve.loops.base import DefaultLoop
from litserve.utils import WorkerSetupStatus

SUPPORTED_LITSERVE = "0.2.19"


def check_litserve_version(installed: str) -> None:
    if installed != SUPPORTED_LITSERVE:
        raise ImportError(
            f"vision-serve uses LitServe internals checked against litserve=={SUPPORTED_LITSERVE}, but "
            f"{installed} is installed: pip install litserve=={SUPPORTED_LITSERVE}. To move to a new "
            "version, run tests/unit/test_litserve_bridge.py against it and fix service/litserve_bridge.py."
        )


check_litserve_version(ls.__version__)

# Worker setup states, as LitServe's workers write them into the shared status dict.
STARTING = WorkerSetupStatus.STARTING
READY = WorkerSetupStatus.READY
ERROR = WorkerSetupStatus.ERROR


class StartupInterrupted(Exception):
    """A stop signal arrived before any worker was ready."""


class WorkerStartupFailed(RuntimeError):
    """An inference worker's setup raised; its traceback is in the log above."""


def worker_id_of(status_key: str) -> int:
    """LitServe names setup states ``<endpoint>_<worker id>``."""
    return int(status_key.rsplit("_", 1)[1])


class WorkerLoop(DefaultLoop):
    """A worker's loop: LitServe calls it once, after ``setup`` and after marking the worker ready.

    Subclasses implement ``serve(model, worker_id)``, which runs until the process is stopped;
    ``model`` is what the LitAPI's ``setup`` loaded (``lit_api.model``: service/worker/entry.py).
    LitServe also hands over its request queue and response transport; they are not used.
    """

    def __call__(
        self,
        lit_api: ls.LitAPI,
        device: str,
        worker_id: int,
        request_queue: object,
        transport: object,
        workers_setup_status: object,
        callback_runner: object,
    ) -> None:
        self.serve(lit_api.model, worker_id)

    @abc.abstractmethod
    def serve(self, model: object, worker_id: int) -> None: ...


class LitServerBridge(ls.LitServer):
    """``ls.LitServer`` with its internal hooks turned into the methods below.

    Subclasses implement ``register_routes`` (every route of the app), ``http_process`` (an async
    context around each HTTP process's life, with its index), ``before_http_processes``,
    ``launch_workers`` and ``start_worker_monitor``; they may call ``request_stop``,
    ``worker_states``, ``spawn_worker``, ``set_worker_state``, ``device_slots`` and read
    ``lit_api`` (LitServer's own attribute) and ``stop_requested``.
    """

    stop_requested = False

    # -- what subclasses implement ---------------------------------------------------------------
    def register_routes(self, app: FastAPI, api_path: str) -> None:
        raise NotImplementedError

    @contextlib.asynccontextmanager
    async def http_process(self, app: FastAPI, api_server: int) -> AsyncIterator[None]:
        yield

    def before_http_processes(self) -> None:
        """In the main process, after the workers started and before the HTTP processes fork."""

    def start_worker_monitor(self) -> None:
        """In the main process, once a worker is ready; should watch the workers it launched."""

    # -- what subclasses use ---------------------------------------------------------------------
    def worker_states(self) -> dict[int, str]:
        """Worker id -> ``STARTING``, ``READY`` or ``ERROR`` (one round trip to the manager)."""
        return {worker_id_of(key): state for key, state in self.workers_setup_status.copy().items()}

    def spawn_worker(self, lit_api: ls.LitAPI, worker_id: int, device: object) -> BaseProcess:
        """Start an inference worker for ``lit_api`` on ``device`` (``"cpu"``, ``"cuda:0"``) as
        LitServe starts its own (``launch_single_inference_worker``), with a worker id and a LitAPI
        of the caller's choice: models loaded after launch get workers of their own. Its state is
        STARTING until its ``setup`` returns."""
        self.set_worker_state(worker_id, STARTING)
        process = mp.get_context("spawn").Process(
            target=inference_worker,
            args=(
                lit_api,
                device,
                worker_id,
                self._get_request_queue(self.lit_api.api_path),
                self._transport,
                self.workers_setup_status,
                self._callback_runner,
                self.restart_workers,
            ),
            name="inference-worker",
        )
        process.start()
        return process

    def set_worker_state(self, worker_id: int, state: str | None) -> None:
        """Set a worker's setup state; ``None`` removes it (the worker is gone for good)."""
        key = f"{self.lit_api.api_path.split('/')[-1]}_{worker_id}"
        if state is None:
            self.workers_setup_status.pop(key, None)
        else:
            self.workers_setup_status[key] = state

    def device_slots(self, workers_per_device: int) -> list[object]:
        """One device per worker, as LitServe lays them out: each device, ``workers_per_device`` times."""
        return [group[0] if len(group) == 1 else group for group in self.devices] * workers_per_device

    def launch_workers(self) -> list[BaseProcess]:
        """In the main process, when LitServe would start its workers: start them, return them.
        By default, LitServe's own workers for ``lit_api``."""
        return ls.LitServer.launch_inference_worker(self, self.lit_api)

    def request_stop(self, start_thread: Callable[[Callable[[], None]], None]) -> None:
        """Take LitServe's graceful shutdown path (its /shutdown endpoint's): uvicorn stops accepting
        and finishes what it holds while the workers still answer; the workers stop after that.

        ``start_thread`` runs the event's ``set`` in a new thread: the event is a manager proxy that
        the main thread may be blocked on, and a proxy connection must not be re-entered.
        """
        if self.stop_requested:
            return
        self.stop_requested = True
        event = self._shutdown_event
        if event is not None:
            start_thread(event.set)

    # -- LitServe's internal hooks, overridden ----------------------------------------------------
    def _init_manager(self, num_api_servers: int) -> object:
        manager = super()._init_manager(num_api_servers)
        self.before_http_processes()
        return manager

    def verify_worker_status(self) -> None:
        # LitServer.run waits here for the first ready worker; this wait also ends on a stop
        # request or a worker whose setup failed, instead of forever.
        while True:
            states = self.worker_states().values()
            if READY in states:
                return
            if self.stop_requested:
                raise StartupInterrupted()
            if ERROR in states or not any(worker.is_alive() for worker in self.inference_workers):
                raise WorkerStartupFailed(
                    "An inference worker failed to start (its error is logged above): check --model, "
                    "--weights and --device."
                )
            time.sleep(0.05)

    def _register_internal_endpoints(self) -> None:
        pass  # every route, LitServe's /health and /info included, comes from register_routes

    def _register_api_endpoints(self, lit_api: ls.LitAPI, request_type: Any, response_type: Any) -> None:
        self.register_routes(self.app, lit_api.api_path)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        # Not LitServer.lifespan: that starts the reader of LitServe's response queues, which
        # carry nothing here (answers come over service/transport/channels.py).
        async with self.http_process(app, app.response_queue_id):
            yield

    def _start_worker_monitoring(self, manager: object, uvicorn_workers: object) -> None:
        self.start_worker_monitor()

    def launch_inference_worker(self, lit_api: ls.LitAPI) -> list[BaseProcess]:
        return self.launch_workers()


class _AppWithFastRoutes(FastAPI):
    """A FastAPI app that answers a few (method, path) pairs with plain ASGI handlers, ahead of its
    own middleware, routing and dependency stack, the largest cost of a request in the HTTP process.
    Every other request takes FastAPI's path."""

    fast_routes: dict[tuple[str, str], Callable[..., Any]]
    fast_patterns: list[tuple[str, Callable[[str], bool], Callable[..., Any]]]

    async def __call__(self, scope: dict, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] == "http":
            method, path = scope["method"], scope["path"]
            handler = self.fast_routes.get((method, path))
            if handler is None:
                handler = next((h for m, matches, h in self.fast_patterns if m == method and matches(path)), None)
            if handler is not None:
                await handler(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def add_fast_route(app: FastAPI, method: str, path: str, handler: Callable[..., Any]) -> None:
    """Answer ``method path`` with the ASGI ``handler`` before FastAPI sees the request.

    LitServe builds the app (``LitServer.app``) and hands each HTTP process a shallow copy of it
    (``_start_server``); turning the instance into a subclass keeps both its routes and that copy.
    """
    _with_fast_routes(app).fast_routes[(method, path)] = handler


def add_fast_pattern_route(
    app: FastAPI, method: str, matches: Callable[[str], bool], handler: Callable[..., Any]
) -> None:
    """``add_fast_route`` for every path ``matches`` accepts (the OIP infer path of any model name)."""
    _with_fast_routes(app).fast_patterns.append((method, matches, handler))


def _with_fast_routes(app: FastAPI) -> _AppWithFastRoutes:
    if not isinstance(app, _AppWithFastRoutes):
        app.__class__ = _AppWithFastRoutes
        app.fast_routes = {}
        app.fast_patterns = []
    return app
