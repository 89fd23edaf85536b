"""The reliability parts on their own: admission gate, API-key check, worker watch and restarter.

The end-to-end behaviour (real server, real kill -9, real overload) is in tests/e2e/test_reliability.py;
these pin the rules that are hard to provoke there (a restarted worker failing its setup, requests
of one worker among several).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import multiprocessing
import threading
from pathlib import Path

import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient

from service.errors import ServiceError
from service.http.base.admission import AdmissionGate
from service.http.base.auth import ApiKeyAuth
from service.http.base.worker_watch import WorkerWatch
from service.http.predict.render import handle_service_error
from service.model_info import ModelInfo
from service.repository.table import RoutingTable, TableFile, VersionRoute
from service.settings import ServeSettings
from service.supervisor.pool.restarts import WorkerRestarter
from service.supervisor.pool.states import WorkerStates
from service.supervisor.pool.workers import ServedVersion, Worker, WorkerHooks, WorkerSet
from service.transport.channels import ApiChannel, ChannelConfig
from service.transport.control_channel import ERROR, READY, STARTING, WorkerReport
from service.wire import ImageRequest


def test_admission_gate_bounds_and_recovers() -> None:
    gate = AdmissionGate(2)
    assert gate.try_admit() and gate.try_admit()
    assert not gate.try_admit() and gate.admitted == 2
    gate.release()
    assert gate.try_admit()  # a finished request frees its slot


def _admit_in_child(gate: AdmissionGate, results: multiprocessing.Queue) -> None:
    results.put(gate.try_admit())


def test_admission_gate_is_shared_by_forked_http_processes() -> None:
    gate = AdmissionGate(1)
    assert gate.try_admit()  # the parent holds the only slot
    results = multiprocessing.get_context("fork").Queue()
    child = multiprocessing.get_context("fork").Process(target=_admit_in_child, args=(gate, results))
    child.start()
    child.join(30)
    assert results.get(timeout=5) is False
    gate.release()


@pytest.fixture(scope="module")
def locked_app() -> TestClient:
    app = FastAPI()
    app.add_exception_handler(ServiceError, handle_service_error)  # as service/http/routes.py does

    @app.get("/secret", dependencies=[Depends(ApiKeyAuth("k3y-with-some-length"))])
    async def secret() -> dict:
        return {"ok": True}

    return TestClient(app)


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"X-API-Key": "wrong"}, 401),
        ({"X-API-Key": "k3y-with-some-lengt"}, 401),  # a prefix is not the key
        ({"Authorization": "Basic k3y-with-some-length"}, 401),
        ({"Authorization": "Bearer wrong"}, 401),
        ({"X-API-Key": "k3y-with-some-length"}, 200),
        ({"Authorization": "Bearer k3y-with-some-length"}, 200),
        ({"Authorization": "bearer  k3y-with-some-length "}, 200),
    ],
)
def test_api_key_header_forms(locked_app, headers, status) -> None:
    r = locked_app.get("/secret", headers=headers)
    assert r.status_code == status
    if status == 401:
        assert "X-API-Key" in r.json()["detail"] and r.headers["WWW-Authenticate"] == "Bearer"


def test_api_key_is_compared_in_constant_time(locked_app, monkeypatch) -> None:
    compared = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    locked_app.get("/secret", headers={"X-API-Key": "guess"})
    assert compared == [(b"guess", b"k3y-with-some-length")]


def test_empty_api_key_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        ApiKeyAuth("")


def publish(directory: Path, generation: int, states: dict[int, str]) -> None:
    """A routing table with these worker states, as the main process publishes one at each change."""
    TableFile(directory).write(RoutingTable(generation, worker_states=dict(states)))


def test_watch_fails_only_the_dead_workers_requests(tmp_path: Path) -> None:
    async def scenario() -> None:
        channel = ApiChannel(ChannelConfig(str(tmp_path), api_servers=1), 0)
        publish(tmp_path, 1, {0: READY, 1: READY})
        watch = WorkerWatch(channel, TableFile(tmp_path))
        watch.refresh()
        assert watch.ready_workers == [0, 1]
        held_by_0 = channel.submit(0, 1, ImageRequest(b"jpeg"))
        held_by_1 = channel.submit(1, 2, ImageRequest(b"jpeg"))
        publish(tmp_path, 2, {0: STARTING, 1: READY})  # the monitor restarts worker 0 after it died
        watch.refresh()
        assert watch.ready_workers == [1]
        answer = held_by_0.result()
        assert answer.status_code == 503 and answer.retry_after_s == 1
        assert not held_by_1.done()  # worker 1 is fine
        # Sent to worker 0 by a request that picked it just before this process saw the state.
        late = channel.submit(0, "late", ImageRequest(b"jpeg"))
        watch.refresh()  # the same table: failed again at the next poll
        assert late.result().status_code == 503
        publish(tmp_path, 3, {0: READY, 1: READY})
        watch.refresh()
        assert watch.ready_workers == [0, 1] and watch.named_states() == {"worker_0": READY, "worker_1": READY}
        channel.close()

    asyncio.run(scenario())


def test_watch_is_ready_only_when_every_served_worker_is(tmp_path: Path) -> None:
    async def scenario() -> None:
        channel = ApiChannel(ChannelConfig(str(tmp_path), api_servers=1), 0)
        watch = WorkerWatch(channel, TableFile(tmp_path))
        watch.refresh()  # no table published yet
        assert not watch.ready and watch.ready_workers == []
        model = ModelInfo("pets", "w", "engine", "pil", "", {}, "", "cpu", 8, 0.0)
        route = VersionRoute("pets", 1, (0, 1), model)
        table = RoutingTable(1, {"pets": {1: route}}, worker_states={0: READY, 1: STARTING})
        TableFile(tmp_path).write(table)
        watch.refresh()
        assert not watch.ready and watch.ready_in(route) == [0]
        TableFile(tmp_path).write(dataclasses.replace(table, generation=2, worker_states={0: READY, 1: READY}))
        watch.refresh()
        assert watch.ready and watch.ready_in(route) == [0, 1]
        channel.close()

    asyncio.run(scenario())


class FakeProcess:
    """Stands in for a worker process: the restart rules, not process handling, are under test."""

    def __init__(self, alive: bool = True, pid: int = 1) -> None:
        self.alive, self.pid, self.exitcode = alive, pid, None if alive else -9

    def is_alive(self) -> bool:
        return self.alive


def pool_serving(processes: list, states: dict, spawn) -> WorkerRestarter:
    """A restarter watching one served version whose workers are ``processes`` (ids 0, 1, ...)."""
    hooks = WorkerHooks(spawn=spawn, make_entry=lambda plan: None, device_slots=lambda count: ["cpu"] * count)
    worker_states = WorkerStates()
    for worker_id, state in states.items():
        worker_states.set(worker_id, state)
    worker_set = WorkerSet(ServeSettings(), worker_states, hooks, threading.Event())
    workers = [Worker(i, "m", 1, "cpu", process, None) for i, process in enumerate(processes)]
    worker_set.served = {"m": {1: ServedVersion(plan=None, workers=workers)}}
    return WorkerRestarter(worker_set, hooks, on_unrecoverable=lambda message: None)


def watch(pool: WorkerRestarter, stopped: list, rounds: list | None = None) -> None:
    pool.on_unrecoverable = stopped.append
    rounds = [] if rounds is None else rounds
    pool.watch(
        stopping=lambda: bool(stopped) or len(rounds) > 5, metrics_restart=lambda process: None, sleep=rounds.append
    )


def test_restarter_replaces_a_dead_worker_and_stops_on_a_failed_setup() -> None:
    relaunched, stopped = [], []

    def spawn(entry, worker_id: int, device, ordinal: int = 0) -> FakeProcess:
        relaunched.append(worker_id)
        assert pool.workers.states.get(worker_id) == STARTING, "restarted workers start over"
        # The new worker's setup fails (say, the GPU is gone): it reports so, and exits.
        pool.workers.states.take_report(WorkerReport(worker_id, ERROR, "RuntimeError: no GPU"))
        return FakeProcess(alive=False, pid=3)

    pool = pool_serving([FakeProcess(), FakeProcess(alive=False, pid=2)], {0: READY, 1: READY}, spawn)
    watch(pool, stopped)
    assert relaunched == [1]  # restarted once, not in a loop
    assert pool.workers.served["m"][1].workers[1].process.pid == 3
    assert len(stopped) == 1 and "died during its setup" in stopped[0]


@pytest.mark.parametrize("state", [STARTING, ERROR])
def test_restarter_stops_when_a_worker_dies_before_it_was_ready(state) -> None:
    stopped = []
    spawn = lambda *args: pytest.fail("must not restart a worker that never became ready")  # noqa: E731
    pool = pool_serving([FakeProcess(alive=False)], {0: state}, spawn)  # killed while loading (OOM), or setup raised
    watch(pool, stopped)
    assert len(stopped) == 1 and "died during its setup" in stopped[0]


def test_restarter_stops_when_relaunching_fails() -> None:
    stopped = []

    def spawn(*args) -> FakeProcess:
        raise OSError("fork failed")

    pool = pool_serving([FakeProcess(alive=False)], {0: READY}, spawn)
    watch(pool, stopped)
    assert len(stopped) == 1 and "could not be restarted" in stopped[0]
