"""One contract test per LitServe internal that service/supervisor/litserve_bridge.py and
service/http/fast_routes.py use.

If a LitServe upgrade moves one of them, the test named for it fails here, instead of a request
path failing somewhere else. The behavioural test runs LitServe's own in-process start helper with a
trivial LitAPI and a worker process of the subclass's own; no model is loaded. (The inference workers
are vision-serve's own since issue 54: tests/unit/test_worker_process.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import multiprocessing
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from multiprocessing.process import BaseProcess

import httpx
import litserve as ls
import pytest
from asgi_lifespan import LifespanManager
from fastapi import FastAPI
from litserve.utils import wrap_litserve_start

from service.http.fast_routes import add_fast_route
from service.supervisor import litserve_bridge
from service.supervisor.litserve_bridge import LitServerBridge


def parameters(function: object) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


class TrivialAPI(ls.LitAPI):
    def setup(self, device: str) -> None:
        self.model = f"model-on-{device}"  # what the loop gets to serve

    def predict(self, x: object) -> object:
        return x


class TrivialServer(LitServerBridge):
    """Records the hooks LitServe calls; its one "worker" is a process that sleeps."""

    def __init__(self, api: ls.LitAPI, **kwargs: object) -> None:
        self.routes: list[str] = []
        self.http_processes: list[int] = []
        self.calls: list[str] = []
        super().__init__(api, **kwargs)

    def launch_workers(self) -> list[BaseProcess]:
        self.calls.append("launch_workers")
        process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
        process.start()
        return [process]

    def wait_for_first_worker(self) -> None:
        self.calls.append("wait_for_first_worker")

    def before_http_processes(self) -> None:
        self.calls.append("before_http_processes")

    def register_routes(self, app: FastAPI, api_path: str) -> None:
        self.routes.append(api_path)

        @app.get("/ping")
        async def ping() -> dict:
            return {"pong": True}

    @contextlib.asynccontextmanager
    async def http_process(self, app: FastAPI, api_server: int) -> AsyncIterator[None]:
        self.http_processes.append(api_server)
        yield


def test_version_is_the_one_the_bridge_was_checked_against() -> None:
    assert ls.__version__ == litserve_bridge.SUPPORTED_LITSERVE


def test_hook_signatures_are_the_ones_the_bridge_overrides() -> None:
    server = ls.LitServer
    assert parameters(server._init_manager) == ["num_api_servers"]
    assert parameters(server.verify_worker_status) == []
    assert parameters(server._register_internal_endpoints) == []
    assert parameters(server._register_api_endpoints) == ["lit_api", "request_type", "response_type"]
    assert parameters(server.lifespan) == ["app"]
    assert parameters(server._start_worker_monitoring) == ["manager", "uvicorn_workers"]
    assert parameters(server._perform_graceful_shutdown) == ["manager", "uvicorn_workers", "shutdown_reason"]
    assert parameters(server.launch_inference_worker) == ["lit_api"]
    assert "num_api_servers" in parameters(server.run)


def test_init_manager_does_what_the_bridge_copies_of_it() -> None:
    """The bridge makes the manager itself (so that it ends with the main process): the same steps."""
    source = inspect.getsource(ls.LitServer._init_manager)
    for step in (
        "manager = mp.Manager()",
        "self.transport_config.manager = manager",
        "self.transport_config.num_consumers = num_api_servers",
        "self.workers_setup_status = manager.dict()",
        "self._shutdown_event = manager.Event()",
        "self.litapi_request_queues[lit_api.api_path] = manager.Queue()",
        "self.logger_queue = manager.Queue()",
        "self._logger_connector.run(self)",
        "self._transport = create_transport_from_config(self.transport_config)",
    ):
        assert step in source, step
    assert source.count("\n        ") <= 14, "LitServe's _init_manager grew: compare it with the bridge's"


def test_run_numbers_each_http_process_in_app_response_queue_id() -> None:
    source = inspect.getsource(ls.LitServer._start_server)
    assert "self.app.response_queue_id = response_queue_id" in source


def test_each_http_process_serves_a_shallow_copy_of_the_app_which_keeps_its_fast_routes() -> None:
    """add_fast_route turns the app's instance into a subclass: LitServe's shallow copy per HTTP
    process must keep that class and its routes (a deep copy or a new app would drop them)."""
    assert "app: FastAPI = copy.copy(self.app)" in inspect.getsource(ls.LitServer._start_server)
    app = FastAPI()

    async def fast(scope: dict, receive: object, send: Callable[[dict], Awaitable[None]]) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-route", b"fast")]})
        await send({"type": "http.response.body", "body": b"fast"})

    add_fast_route(app, "POST", "/predict", fast)

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=copy.copy(app))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/predict", content=b"x")

    response = asyncio.run(post())
    assert (response.status_code, response.headers.get("x-route"), response.content) == (200, "fast", b"fast")


def test_run_calls_init_manager_then_verify_then_monitoring_in_that_order() -> None:
    source = inspect.getsource(ls.LitServer.run)
    order = [source.index(name) for name in ("_init_manager(", "verify_worker_status()", "_start_worker_monitoring(")]
    assert order == sorted(order)


def test_graceful_shutdown_stops_uvicorn_before_the_workers() -> None:
    # The order that lets in-flight requests get answers: the bridge's request_stop relies on it.
    source = inspect.getsource(ls.LitServer._perform_graceful_shutdown)
    assert source.index("uvicorn_workers") < source.index("self.inference_workers")
    # The bridge stops the HTTP processes itself, then hands LitServe's method an empty set of them.
    assert "if len(uvicorn_workers) > 0:" in source
    assert "self.uvicorn_graceful_timeout" in source


def test_in_process_start_runs_the_hooks_and_launches_our_workers() -> None:
    server = TrivialServer(TrivialAPI(), accelerator="cpu", workers_per_device=1)
    assert server.routes == ["/predict"], "register_routes replaces every LitServe route"
    assert server.device_slots(2) == ["cpu", "cpu"]
    server.verify_worker_status()  # what LitServer.run calls after launching: the subclass's wait
    assert server.calls == ["wait_for_first_worker"]
    server.calls.clear()

    async def requests() -> list[int]:
        async with LifespanManager(server.app) as manager:
            transport = httpx.ASGITransport(app=manager.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                codes = [(await client.get("/ping")).status_code, (await client.get("/health")).status_code]
        return codes

    with wrap_litserve_start(server):
        assert server.calls == ["before_http_processes", "launch_workers"]
        assert len(server.inference_workers) == 1 and server.inference_workers[0].is_alive()
        assert asyncio.run(requests()) == [200, 404], "LitServe's own /health must be gone"
        assert server.http_processes == [0]

        started = []
        server.request_stop(lambda target: (started.append(target), target()))
        assert started and server._shutdown_event.is_set()
        server.request_stop(started.append)
        assert len(started) == 1, "a second stop request does nothing"
    assert not server.inference_workers[0].is_alive(), "LitServe stops the workers launch_workers returned"


def test_import_refuses_another_litserve_version() -> None:
    litserve_bridge.check_litserve_version(litserve_bridge.SUPPORTED_LITSERVE)
    with pytest.raises(ImportError, match=r"pip install litserve==0\.2\.19"):
        litserve_bridge.check_litserve_version("0.2.20")
