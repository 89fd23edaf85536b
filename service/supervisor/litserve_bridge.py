"""Every use of LitServe's internals, in one place, checked against the one version it was written for.

vision-serve keeps ``ls.LitAPI`` as its model contract and LitServe's start of the HTTP processes
(the forked uvicorn processes on one socket, graceful shutdown), and replaces the rest: routes,
request and answer transport (service/transport/channels.py), the inference workers (spawned by the
model pool, service/supervisor/pool/, which keeps their states: LitServe's manager dict is not used),
batching loop, worker recovery. That needs hooks LitServe does not make public. ``LitServerBridge``
turns them into plain methods for server.py beside it. (The HTTP processes' fast routes, which
rely on how LitServe hands each of them its app, are service/http/fast_routes.py.)
tests/unit/test_litserve_bridge.py holds one contract test per internal used here, so an upgrade that
moves one fails there, by name, instead of somewhere in the request path.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.managers import SyncManager
from multiprocessing.process import BaseProcess
from typing import Any

import litserve as ls
from fastapi import FastAPI
from litserve.transport.factory import create_transport_from_config

from service.parent_watch import exit_with_parent

logger = logging.getLogger(__name__)

SUPPORTED_LITSERVE = "0.2.19"


def check_litserve_version(installed: str) -> None:
    if installed != SUPPORTED_LITSERVE:
        raise ImportError(
            f"vision-serve uses LitServe internals checked against litserve=={SUPPORTED_LITSERVE}, but "
            f"{installed} is installed: pip install litserve=={SUPPORTED_LITSERVE}. To move to a new "
            "version, run tests/unit/test_litserve_bridge.py against it and fix service/supervisor/litserve_bridge.py."
        )


check_litserve_version(ls.__version__)


class LitServerBridge(ls.LitServer):
    """``ls.LitServer`` with its internal hooks turned into the methods below.

    Subclasses implement ``register_routes`` (every route of the app), ``http_process`` (an async
    context around each HTTP process's life, with its index), ``before_http_processes``,
    ``launch_workers``, ``wait_for_first_worker`` and ``start_worker_monitor``; they may call
    ``request_stop`` and ``device_slots`` and read ``lit_api`` (LitServer's own attribute) and
    ``stop_requested``.
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

    def launch_workers(self) -> list[BaseProcess]:
        """In the main process, when LitServe would start its workers: start them, return them (LitServe
        terminates them at shutdown)."""
        raise NotImplementedError

    def wait_for_first_worker(self) -> None:
        """In the main process, after ``launch_workers``: return once a worker is ready to serve;
        raise ``StartupInterrupted`` on a stop request, ``WorkerStartupFailed`` when none can be."""
        raise NotImplementedError

    # -- what subclasses use ---------------------------------------------------------------------
    def device_slots(self, workers_per_device: int) -> list[object]:
        """One device per worker, as LitServe lays them out: each device, ``workers_per_device`` times."""
        return [group[0] if len(group) == 1 else group for group in self.devices] * workers_per_device

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
        # LitServer._init_manager, but its manager process ends with this one (service/parent_watch.py):
        # ``mp.Manager()`` cannot be given that. What the manager still carries: LitServe's stop event.
        self.main_pid = os.getpid()
        manager = SyncManager(ctx=mp.get_context())
        manager.start(initializer=exit_with_parent, initargs=(self.main_pid,))
        self.transport_config.manager = manager
        self.transport_config.num_consumers = num_api_servers
        self.workers_setup_status = manager.dict()
        self._shutdown_event = manager.Event()
        for lit_api in self.litapi_connector:
            self.litapi_request_queues[lit_api.api_path] = manager.Queue()
        if self._logger_connector._loggers:
            self.logger_queue = manager.Queue()
        self._logger_connector.run(self)
        self._transport = create_transport_from_config(self.transport_config)
        self.before_http_processes()
        return manager

    def verify_worker_status(self) -> None:
        # LitServer.run waits here for the first ready worker (in LitServe's manager dict, which our
        # workers do not write): the subclass's wait, which also ends on a stop or a failed setup.
        self.wait_for_first_worker()

    def _register_internal_endpoints(self) -> None:
        pass  # every route, LitServe's /health and /info included, comes from register_routes

    def _register_api_endpoints(self, lit_api: ls.LitAPI, request_type: Any, response_type: Any) -> None:
        self.register_routes(self.app, lit_api.api_path)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        # Not LitServer.lifespan: that starts the reader of LitServe's response queues, which
        # carry nothing here (answers come over service/transport/channels.py).
        main_pid = getattr(self, "main_pid", None)
        if main_pid is not None and main_pid != os.getpid():  # a forked HTTP process, not an in-process test
            exit_with_parent(main_pid)
        async with self.http_process(app, app.response_queue_id):
            yield

    def _perform_graceful_shutdown(
        self, manager: object, uvicorn_workers: dict[str, Any], shutdown_reason: str = "normal"
    ) -> None:
        # LitServe sends SIGTERM to its HTTP processes one at a time, each once the one before has
        # drained: the others keep accepting on the shared socket meanwhile, and the drains add up.
        # Here all are told at once, then joined against one deadline; LitServe's own method then
        # does the rest (its transport, the workers, the manager) with no HTTP process left to stop.
        http_processes = [p for p in uvicorn_workers.values() if isinstance(p, BaseProcess) and p.is_alive()]
        for process in http_processes:
            process.terminate()
        deadline = time.monotonic() + self.uvicorn_graceful_timeout
        for process in http_processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                logger.warning(
                    "%s did not finish its requests within %g s: killed.", process.name, self.uvicorn_graceful_timeout
                )
                process.kill()
        others = {name: worker for name, worker in uvicorn_workers.items() if not isinstance(worker, BaseProcess)}
        super()._perform_graceful_shutdown(manager, others, shutdown_reason)

    def _start_worker_monitoring(self, manager: object, uvicorn_workers: object) -> None:
        self.start_worker_monitor()

    def launch_inference_worker(self, lit_api: ls.LitAPI) -> list[BaseProcess]:
        return self.launch_workers()
