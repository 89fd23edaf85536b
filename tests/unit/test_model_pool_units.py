"""The model pool's load and unload with fake workers and fake HTTP processes, in well under a second.

The real pieces (``WorkerSet``, ``WorkerStates``, ``TablePublisher``, ``RepositoryOperations``, the
table file) run as they do in the main process; the worker processes (which report over the control
channel), the planner child and the HTTP processes are fakes with a schedule. The HTTP processes
follow the table file with a lag each, as their worker watches do (service/http/base/worker_watch.py),
and a draining worker exits only once every one of them has told it that it sends nothing more. So a
load that does not wait for every HTTP process, an unload that returns before the old workers are
gone, or a table published while a new worker still loads, each fail here;
tests/e2e/test_model_repository.py checks the same on a real server.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from service.model_info import ModelInfo
from service.repository.table import RoutingTable, TableFile
from service.settings import ServeSettings
from service.supervisor.planning.layout import server_layout
from service.supervisor.planning.plans import ServePlan, VersionPlan
from service.supervisor.pool import workers as workers_module
from service.supervisor.pool.repository_operations import LoadFailed, RepositoryOperations
from service.supervisor.pool.states import WorkerStates
from service.supervisor.pool.table_publisher import TablePublisher
from service.supervisor.pool.workers import WorkerHooks, WorkerSet
from service.transport.control_channel import ERROR, READY, WorkerReport

# The HTTP processes' lags: one quick, one slow (a GC pause, a busy event loop).
ACK_LAGS_S = (0.01, 0.08)
# How long a told draining worker takes to answer what it still holds and exit.
DRAIN_EXIT_S = 0.04
FOLLOW_POLL_S = 0.002


class FakeProcess:
    """A worker process: alive until it exits (drained) or is terminated."""

    def __init__(self, pid: int) -> None:
        self.pid, self.exitcode = pid, None
        self._exited = threading.Event()

    def is_alive(self) -> bool:
        return not self._exited.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._exited.wait(timeout)

    def exit(self, code: int = 0) -> None:
        if not self._exited.is_set():
            self.exitcode = code
            self._exited.set()

    def terminate(self) -> None:
        self.exit(-15)

    kill = terminate


def later(delay_s: float, action) -> None:
    timer = threading.Timer(delay_s, action)
    timer.daemon = True
    timer.start()


@dataclass
class FakeLitServe:
    """The server's worker hooks: each version's workers report ready after their scheduled delay,
    or that their setup failed ("error"), in spawn order, as real ones do over the control channel."""

    directory: Path
    schedule: dict[int, list[float | str]]  # version -> per worker: seconds to READY, or "error"
    states: WorkerStates = field(default_factory=WorkerStates)
    processes: dict[int, FakeProcess] = field(default_factory=dict)
    spawned: dict[int, int] = field(default_factory=dict)  # version -> workers spawned so far

    def spawn(self, plan: VersionPlan, worker_id: int, device: object, ordinal: int = 0) -> FakeProcess:
        index = self.spawned.get(plan.version, 0)
        self.spawned[plan.version] = index + 1
        outcome = self.schedule[plan.version][index]
        process = self.processes[worker_id] = FakeProcess(pid=1000 + worker_id)
        ready = WorkerReport(worker_id, READY)
        if outcome == "error":
            later(0.01, lambda: self.fail(worker_id, process))
        elif outcome == 0:
            self.states.take_report(ready)
        else:
            later(outcome, lambda: self.states.take_report(ready))
        return process

    def fail(self, worker_id: int, process: FakeProcess) -> None:
        self.states.take_report(WorkerReport(worker_id, ERROR, "RuntimeError: CUDA out of memory"))
        process.exit(1)

    def hooks(self) -> WorkerHooks:
        return WorkerHooks(spawn=self.spawn, make_entry=lambda plan: plan, device_slots=lambda count: ["cpu"] * count)


class FakeHttpProcesses:
    """Each follows the table file after its own lag, acknowledges the generation, and tells each
    draining worker it sends nothing more; a worker told by all exits ``DRAIN_EXIT_S`` later."""

    def __init__(self, directory: Path, litserve: FakeLitServe) -> None:
        self.directory, self.litserve = directory, litserve
        self.acks = [0] * len(ACK_LAGS_S)  # started, following no table yet
        self.told: dict[int, set[int]] = {}
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self.follow, args=(i, lag), daemon=True) for i, lag in enumerate(ACK_LAGS_S)
        ]

    def follow(self, index: int, lag_s: float) -> None:
        table_file = TableFile(self.directory)
        while not self.stop.is_set():
            table = table_file.read_if_changed()
            if table is not None:
                time.sleep(lag_s)
                self.acks[index] = table.generation
                for worker_id in table.draining:
                    told = self.told.setdefault(worker_id, set())
                    if index not in told:
                        told.add(index)
                        if len(told) == len(ACK_LAGS_S):
                            later(DRAIN_EXIT_S, self.litserve.processes[worker_id].exit)
            time.sleep(FOLLOW_POLL_S)


@dataclass
class FakePlanning:
    plans: list[VersionPlan]

    def result(self, timeout_s: float | None = None) -> list[VersionPlan]:
        return self.plans


def version_plan(version: int, workers: int = 2, isolation: str = "shared") -> VersionPlan:
    settings = ServeSettings(workers_per_device=workers, worker_isolation=isolation)
    model = ModelInfo("pets", "w", "engine", "pil", "", {}, "", "cpu", 8, 0.0)
    return VersionPlan("pets", version, ServePlan(settings, "cpu", "auto", {}, workers, model))


@dataclass
class Pool:
    operations: RepositoryOperations
    workers: WorkerSet
    litserve: FakeLitServe
    http: FakeHttpProcesses
    published: list[RoutingTable]  # every table written after the start, as written
    unready_routes: list[str]  # routed workers that were not ready when their table was written

    def table(self) -> RoutingTable:
        return self.published[-1]

    def first_generation_serving(self, version: int) -> int:
        return next(t.generation for t in self.published if version in t.models.get("pets", {}))


@pytest.fixture
def pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pool]:
    """A pool serving pets version 1 (two workers), whose HTTP processes follow it; a load of
    version 2 gets ready as ``pool.litserve.schedule[2]`` says."""
    monkeypatch.setattr(workers_module, "POLL_INTERVAL_S", 0.002)
    repository, channels = tmp_path / "models", tmp_path / "channels"
    (repository / "pets").mkdir(parents=True)
    channels.mkdir()
    settings = ServeSettings(model_repository=str(repository), load_timeout_s=5.0)
    litserve = FakeLitServe(channels, {1: [0, 0], 2: [0.01, 0.06]})
    http = FakeHttpProcesses(channels, litserve)
    stopping = threading.Event()
    worker_set = WorkerSet(settings, litserve.states, litserve.hooks(), stopping)
    publisher = TablePublisher(str(channels), http.acks, worker_set.routes, litserve.states.snapshot, "", stopping)
    operations = RepositoryOperations(
        settings, None, worker_set, publisher, plan=lambda settings, load: FakePlanning([version_plan(2)])
    )
    operations.start([version_plan(1)])
    pool = Pool(operations, worker_set, litserve, http, [], [])
    write = publisher.table_file.write

    def checked_write(table: RoutingTable) -> None:
        states = table.worker_states  # what the HTTP processes see with the routes
        pool.unready_routes += [f"{r.version}:{w}" for r in table.routes() for w in r.workers if states.get(w) != READY]
        pool.published.append(table)
        write(table)

    publisher.table_file.write = checked_write
    for thread in http.threads:
        thread.start()
    yield pool
    stopping.set()
    http.stop.set()
    for thread in http.threads:
        thread.join(1.0)


def test_a_load_returns_only_once_every_http_process_follows_the_new_table(pool: Pool) -> None:
    pool.operations.load("pets")
    acks = list(pool.http.acks)  # as the load call returns
    generation = pool.first_generation_serving(2)
    assert all(ack >= generation for ack in acks), f"acks {acks} when the load returned; the new table is {generation}"
    assert list(pool.table().models["pets"]) == [2]


def test_a_new_version_is_published_only_when_every_one_of_its_workers_is_ready(pool: Pool) -> None:
    pool.operations.load("pets")  # version 2's second worker gets ready later than its first
    assert pool.unready_routes == [], f"published routes to workers still loading: {pool.unready_routes}"
    assert pool.table().models["pets"][2].workers == (2, 3)


def test_the_old_workers_drain_after_a_load_and_are_forgotten(pool: Pool) -> None:
    old = [pool.litserve.processes[0], pool.litserve.processes[1]]
    pool.operations.load("pets")
    deadline = time.monotonic() + 2.0
    while (pool.workers.draining or pool.table().draining) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not any(process.is_alive() for process in old)
    assert all(process.exitcode == 0 for process in old)  # each exited once told, none was stopped
    assert pool.table().draining == () and 0 not in pool.litserve.states.snapshot()


def test_an_unload_returns_only_once_the_old_workers_are_gone(pool: Pool) -> None:
    old = [pool.litserve.processes[0], pool.litserve.processes[1]]
    pool.operations.unload("pets")
    alive = [process.pid for process in old if process.is_alive()]
    assert alive == [], f"workers {alive} still ran when the unload returned"
    assert pool.workers.draining == {} and pool.table().models == {} and pool.table().draining == ()
    assert all(ack >= pool.table().generation - 1 for ack in pool.http.acks)  # every one saw the model go
    assert [e["state"] for e in pool.operations.index()] == ["UNAVAILABLE"]


def test_an_unload_lets_the_old_workers_drain_instead_of_stopping_them(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gone is not enough: an unloaded model's workers must answer what they hold, so each exits of itself
    once every HTTP process told it that it sends nothing more (exit code 0), and none is terminated.
    Here they take 0.3 s to answer, far longer than the unload needs to reach them."""
    monkeypatch.setitem(globals(), "DRAIN_EXIT_S", 0.3)  # read by FakeHttpProcesses.follow
    old = [pool.litserve.processes[0], pool.litserve.processes[1]]
    pool.operations.unload("pets")
    assert [process.exitcode for process in old] == [0, 0], "exit code -15: terminated instead of drained"


def test_a_failing_load_keeps_the_old_version_serving(pool: Pool) -> None:
    pool.litserve.schedule[2] = [0.01, "error"]
    with pytest.raises(
        LoadFailed, match=r"version 2 could not be loaded: RuntimeError: CUDA out of memory\..*still serve"
    ):
        pool.operations.load("pets")
    table = pool.table()
    assert list(table.models["pets"]) == [1] and table.models["pets"][1].workers == (0, 1)
    assert pool.litserve.processes[0].is_alive() and pool.litserve.processes[1].is_alive()
    assert not pool.litserve.processes[2].is_alive() and not pool.litserve.processes[3].is_alive()
    assert 2 not in pool.litserve.states.snapshot() and pool.litserve.states.detail(3) == "", "forgotten when stopped"
    assert [e["version"] for e in pool.operations.index()] == ["1"]


def test_auto_http_processes_follow_the_worker_processes_not_the_model_slots() -> None:
    """``--api-servers 0``: one HTTP process per worker process. A model alone keeps one per worker
    (the front end's throughput depends on it); twenty shared models of two workers each live in
    two processes, so they get two, not forty; an isolated model's workers add a process each."""
    assert server_layout([version_plan(1, workers=2)], ServeSettings(), cpu_count=2).api_servers == 2
    assert server_layout([version_plan(1, workers=1)], ServeSettings(), cpu_count=2).api_servers == 1
    twenty = [version_plan(v, workers=2) for v in range(1, 21)]
    assert server_layout(twenty, ServeSettings(), cpu_count=2).api_servers == 2
    isolated = [version_plan(21, workers=2, isolation="process"), version_plan(22, workers=1, isolation="process")]
    assert server_layout([*twenty, *isolated], ServeSettings(), cpu_count=2).api_servers == 2 + 3
    assert server_layout(isolated, ServeSettings(), cpu_count=2).api_servers == 3
    assert server_layout(twenty, ServeSettings(api_servers=7), cpu_count=2).api_servers == 7  # asked for: as asked


def test_the_server_layout_is_what_every_starting_version_shares() -> None:
    """One server, one device layout: the HTTP processes are sized from every starting version's
    worker processes, and a version for another accelerator is refused with what to do."""
    cpu = [version_plan(1, workers=2), version_plan(2, workers=3)]
    layout = server_layout(cpu, ServeSettings(), cpu_count=8)
    assert (layout.accelerator, layout.devices, layout.worker_env) == ("cpu", "auto", {})
    assert layout.api_servers == 3  # on a CPU, one HTTP process per worker process: both share 3
    gpu = VersionPlan("pets", 3, dataclasses.replace(cpu[0].serve_plan, accelerator="cuda", devices=1))
    assert not layout.fits(gpu.serve_plan)
    with pytest.raises(ValueError, match=r"one server serves one device layout\. Recompile one, or pass --device"):
        server_layout([*cpu, gpu], ServeSettings(), cpu_count=8)
