"""One contract test per LitServe internal that service/litserve_bridge.py uses.

If a LitServe upgrade moves one of them, the test named for it fails here, instead of a request
path failing somewhere else. The behavioural tests run LitServe's own code (its worker entry
point, its in-process start helper) with a trivial LitAPI; no model is loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import multiprocessing
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import litserve as ls
import pytest
from asgi_lifespan import LifespanManager
from fastapi import FastAPI
from litserve.callbacks.base import CallbackRunner
from litserve.loops.loops import inference_worker
from litserve.utils import wrap_litserve_start

from service import litserve_bridge
from service.litserve_bridge import READY, STARTING, LitServerBridge, WorkerLoop, worker_id_of


def parameters(function: object) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


class RecordingLoop(WorkerLoop):
    """Writes what it was called with into a file, then returns (the worker then exits)."""

    def __init__(self, record: str) -> None:
        super().__init__()
        self.record = record

    def serve(self, model: object, worker_id: int) -> None:
        Path(self.record).write_text(f"{worker_id} {os.getpid()} {model}")
        while True:  # like a real loop: runs until the process is stopped
            time.sleep(0.05)


class TrivialAPI(ls.LitAPI):
    def setup(self, device: str) -> None:
        self.model = f"model-on-{device}"  # what the loop gets to serve

    def predict(self, x: object) -> object:
        return x


class TrivialServer(LitServerBridge):
    def __init__(self, api: ls.LitAPI, **kwargs: object) -> None:
        self.routes: list[str] = []
        self.http_processes: list[int] = []
        super().__init__(api, **kwargs)

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


def test_worker_states_are_the_strings_workers_write() -> None:
    assert (STARTING, READY) == ("starting", "ready")
    assert litserve_bridge.ERROR == "error"


def test_setup_status_keys_name_endpoint_and_worker_id() -> None:
    assert worker_id_of("predict_0") == 0 and worker_id_of("my_api_12") == 12
    source = inspect.getsource(ls.LitServer.launch_single_inference_worker)
    assert 'f"{endpoint}_{worker_id}"' in source and "WorkerSetupStatus.STARTING" in source


def test_inference_worker_marks_ready_then_calls_the_loop_with_the_worker_id(tmp_path: Path) -> None:
    # LitServe's own worker entry point, in a process of its own as LitServe runs it.
    record = tmp_path / "record"
    api = TrivialAPI()
    api.loop = RecordingLoop(str(record))
    status = multiprocessing.Manager().dict({"predict_3": STARTING})  # as launch_single_inference_worker leaves it
    args = (api, "cpu", 3, None, None, status, CallbackRunner(), True)
    assert parameters(inference_worker) == [
        "lit_api",
        "device",
        "worker_id",
        "request_queue",
        "transport",
        "workers_setup_status",
        "callback_runner",
        "restart_workers",
    ]
    process = multiprocessing.get_context("spawn").Process(target=inference_worker, args=args)
    process.start()
    try:
        deadline = time.monotonic() + 60
        while not record.exists():
            assert process.is_alive() and time.monotonic() < deadline
            time.sleep(0.05)
        worker_id, pid, model = record.read_text().split()
        assert (int(worker_id), int(pid), model) == (3, process.pid, "model-on-cpu")
        assert dict(status) == {"predict_3": READY}, "READY must be written before the loop runs"
    finally:
        process.kill()
        process.join()


def test_hook_signatures_are_the_ones_the_bridge_overrides() -> None:
    server = ls.LitServer
    assert parameters(server._init_manager) == ["num_api_servers"]
    assert parameters(server.verify_worker_status) == []
    assert parameters(server._register_internal_endpoints) == []
    assert parameters(server._register_api_endpoints) == ["lit_api", "request_type", "response_type"]
    assert parameters(server.lifespan) == ["app"]
    assert parameters(server._start_worker_monitoring) == ["manager", "uvicorn_workers"]
    assert parameters(server._inference_workers_config_for_api) == ["api_path"]
    assert parameters(server.launch_single_inference_worker) == ["lit_api", "worker_id"]
    assert "num_api_servers" in parameters(server.run)


def test_run_numbers_each_http_process_in_app_response_queue_id() -> None:
    source = inspect.getsource(ls.LitServer._start_server)
    assert "self.app.response_queue_id = response_queue_id" in source


def test_run_calls_init_manager_then_verify_then_monitoring_in_that_order() -> None:
    source = inspect.getsource(ls.LitServer.run)
    order = [source.index(name) for name in ("_init_manager(", "verify_worker_status()", "_start_worker_monitoring(")]
    assert order == sorted(order)


def test_graceful_shutdown_stops_uvicorn_before_the_workers() -> None:
    # The order that lets in-flight requests get answers: the bridge's request_stop relies on it.
    source = inspect.getsource(ls.LitServer._perform_graceful_shutdown)
    assert source.index("uvicorn_workers") < source.index("self.inference_workers")


def test_in_process_start_runs_the_hooks_and_reports_worker_states(tmp_path: Path) -> None:
    record = tmp_path / "record"
    api = TrivialAPI()
    api.loop = RecordingLoop(str(record))
    server = TrivialServer(api, accelerator="cpu", workers_per_device=1)
    assert server.routes == ["/predict"], "register_routes replaces every LitServe route"
    assert server.device_slots(1) == ["cpu"]

    async def requests() -> list[int]:
        async with LifespanManager(server.app) as manager:
            transport = httpx.ASGITransport(app=manager.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                codes = [(await client.get("/ping")).status_code, (await client.get("/health")).status_code]
        return codes

    with wrap_litserve_start(server):
        deadline = time.monotonic() + 60
        while server.worker_states() != {0: READY}:
            assert time.monotonic() < deadline, server.worker_states()
            time.sleep(0.05)
        assert asyncio.run(requests()) == [200, 404], "LitServe's own /health must be gone"
        assert server.http_processes == [0]

        # A worker of our own, with an id and a LitAPI of our choice (a model loaded later).
        old = server.inference_workers[0]
        old.kill()
        old.join()
        other = TrivialAPI()
        other.loop = RecordingLoop(str(record))
        spawned = server.spawn_worker(other, 7, "cpu")
        assert server.worker_states()[7] == STARTING
        while server.worker_states().get(7) != READY:
            assert time.monotonic() < deadline + 60
            time.sleep(0.05)
        server.set_worker_state(0, None)
        assert server.worker_states() == {7: READY}
        server.inference_workers.append(spawned)

        started = []
        server.request_stop(lambda target: (started.append(target), target()))
        assert started and server._shutdown_event.is_set()
        server.request_stop(started.append)
        assert len(started) == 1, "a second stop request does nothing"


def test_import_refuses_another_litserve_version() -> None:
    litserve_bridge.check_litserve_version(litserve_bridge.SUPPORTED_LITSERVE)
    with pytest.raises(ImportError, match=r"pip install litserve==0\.2\.19"):
        litserve_bridge.check_litserve_version("0.2.20")
