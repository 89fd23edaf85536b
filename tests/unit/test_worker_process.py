"""Worker readiness and failure travel one way: the worker's report over the supervisor's control
channel, into the main process's ``WorkerStates``, out to the HTTP processes in the routing table.

Real processes and real sockets here (a spawned worker, the control channel's ZeroMQ socket), with a
trivial model instead of a real one; tests/e2e/test_e2e.py and tests/e2e/test_model_repository.py
check the same through a real server.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from service.settings import ServeSettings
from service.supervisor.pool.states import WorkerStates
from service.transport.control_channel import (
    ERROR,
    READY,
    STARTING,
    ControlReply,
    ControlRequest,
    ControlServer,
    WorkerReport,
    call_main_process,
    report_to_main_process,
)
from service.worker.entry import WorkerEntry
from service.worker.process import EXIT_SETUP_FAILED, run_worker


class TrivialModel:
    """What ``WorkerEntry.setup`` loads: a model that names its device, or fails on "broken"."""

    def __init__(self, device: str) -> None:
        self.device = device

    @classmethod
    def load(cls, settings: ServeSettings, device: str) -> TrivialModel:
        if device == "broken":
            raise RuntimeError("CUDA out of memory")
        return cls(device)


class RecordingLoop:
    """Writes what it was given to serve into a file, then returns (the worker then exits 0)."""

    def __init__(self, record: str) -> None:
        self.record = record

    def serve(self, model: TrivialModel, worker_id: int) -> None:
        Path(self.record).write_text(f"{worker_id} {os.getpid()} {model.device}")


def spawned_worker(tmp_path: Path, device: str, worker_id: int) -> multiprocessing.Process:
    entry = WorkerEntry(ServeSettings(), RecordingLoop(str(tmp_path / "record")), f"{__name__}:TrivialModel")
    process = multiprocessing.get_context("spawn").Process(
        target=run_worker, args=(entry, device, worker_id, str(tmp_path), os.getpid())
    )
    process.start()
    return process


@pytest.fixture
def main_process(tmp_path: Path):
    """The main process's end: the control server feeding a ``WorkerStates``, with workers 3 and 4 known."""
    states = WorkerStates()
    changes: list[dict[int, str]] = []
    states.on_change = lambda: changes.append(states.snapshot())
    states.set(3, STARTING)
    states.set(4, STARTING)
    server = ControlServer(
        str(tmp_path), lambda request: ControlReply(index=[{"name": request.model}]), states.take_report
    )
    server.start()
    yield states, changes
    server.stop()


def test_a_worker_reports_ready_then_serves_its_model(tmp_path: Path, main_process) -> None:
    states, changes = main_process
    process = spawned_worker(tmp_path, "cpu", 3)
    process.join(60)
    assert process.exitcode == 0
    worker_id, pid, device = (tmp_path / "record").read_text().split()
    assert (int(worker_id), int(pid), device) == (3, process.pid, "cpu")
    assert states.get(3) == READY and changes[-1] == {3: READY, 4: STARTING}, "READY is reported before serving"


def test_a_failed_setup_is_reported_with_its_reason_and_the_worker_exits(tmp_path: Path, main_process) -> None:
    states, _changes = main_process
    process = spawned_worker(tmp_path, "broken", 4)
    process.join(60)
    assert process.exitcode == EXIT_SETUP_FAILED
    assert states.get(4) == ERROR and states.detail(4) == "RuntimeError: CUDA out of memory"
    assert not (tmp_path / "record").exists(), "a worker whose setup failed never serves"


def test_repository_calls_share_the_channel_with_the_reports(tmp_path: Path, main_process) -> None:
    states, _changes = main_process
    reply = asyncio.run(call_main_process(str(tmp_path), ControlRequest("index", model="pets"), timeout_s=10))
    assert reply == ControlReply(index=[{"name": "pets"}])
    assert report_to_main_process(str(tmp_path), WorkerReport(3, READY)) and states.get(3) == READY


def test_states_ignore_reports_of_workers_the_pool_no_longer_has_and_states_no_worker_sends() -> None:
    states = WorkerStates()
    changes = []
    states.on_change = lambda: changes.append(states.snapshot())
    states.take_report(WorkerReport(9, READY))  # stopped before its report arrived
    states.set(1, STARTING)
    states.take_report(WorkerReport(1, STARTING))  # only the pool starts a worker over
    assert states.snapshot() == {1: STARTING} and changes == [{1: STARTING}]
    states.take_report(WorkerReport(1, ERROR, "ValueError: bad weights"))
    assert states.detail(1) == "ValueError: bad weights"
    states.set(1, STARTING)  # restarted: the old reason no longer holds
    assert states.detail(1) == "" and states.get(1) == STARTING
    states.set(1, None)
    assert states.snapshot() == {} and len(changes) == 4


def test_a_report_without_a_main_process_gives_up_instead_of_hanging(tmp_path: Path) -> None:
    started = time.monotonic()
    assert not report_to_main_process(str(tmp_path), WorkerReport(0, READY), timeout_ms=200)
    assert time.monotonic() - started < 5
