"""Worker processes and their model slots (service/worker/host.py, service/supervisor/pool/hosts.py):
readiness, failure and a slot's end travel one way, the slot's report over the supervisor's control
channel, into the main process's ``WorkerStates`` (and ``WorkerHosts`` for a slot's end), out to the
HTTP processes in the routing table.

Real processes and real sockets here (spawned worker processes, the control channel's ZeroMQ socket,
each slot's request channel), with a trivial model instead of a real one; tests/e2e/test_e2e.py,
tests/e2e/test_model_repository.py and tests/e2e/test_shared_workers.py check the same through a real
server.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from service.settings import ServeSettings
from service.supervisor.pool.states import WorkerStates
from service.transport.channels import ApiChannel, ChannelConfig
from service.transport.control_channel import (
    ERROR,
    READY,
    STARTING,
    ControlReply,
    ControlRequest,
    WorkerReport,
    call_main_process,
    report_to_main_process,
)
from service.wire import Answer, ImageRequest
from service.worker.contract import BatchPolicy
from service.worker.host import EXIT_SETUP_FAILED, SlotSpec
from tests.worker_hold import wait_until
from tests.worker_hosts import main_process_end, place


class TrivialModel:
    """What a slot loads: a model that answers each image with its bytes and its own name; it fails to
    load when named "broken", and fails every batch when named "failing"."""

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def load(cls, settings: ServeSettings, device: str) -> TrivialModel:
        if settings.name == "broken":
            raise RuntimeError("CUDA out of memory")
        return cls(settings.name)

    def prepare(self, requests: list) -> list:
        return requests

    def run(self, prepared: list) -> list[Answer]:
        if self.name == "failing":
            raise RuntimeError("the engine failed")
        return [Answer(predictions=((0, request.image.decode(), 1.0),), model=self.name) for request in prepared]

    def unusable_device(self) -> str | None:
        return None


def spec(name: str = "lite", isolation: str = "shared") -> SlotSpec:
    settings = ServeSettings(name=name, worker_isolation=isolation)
    return SlotSpec(settings, BatchPolicy(max_batch_size=4), f"{__name__}:TrivialModel")


@pytest.fixture
def main_process(tmp_path: Path):
    with main_process_end(tmp_path) as ends:
        yield ends


def test_shared_slots_load_in_one_process_and_a_failing_model_fails_alone(main_process) -> None:
    states, hosts = main_process
    first = place(states, hosts, 0, spec("lite"))
    second = place(states, hosts, 1, spec("pets"))
    broken = place(states, hosts, 2, spec("broken"))
    wait_until(
        lambda: states.get(0) == READY and states.get(1) == READY and states.get(2) == ERROR,
        "workers 0, 1 ready and 2 failed",
    )
    assert first.pid == second.pid == broken.pid, "one worker process holds every shared model"
    assert states.detail(2) == "RuntimeError: CUDA out of memory"
    wait_until(lambda: not broken.is_alive(), "the broken slot ended")
    assert broken.exitcode == EXIT_SETUP_FAILED, "its slot ended, with the load's failure"
    assert first.is_alive() and second.is_alive() and first.host.alive(), "the others serve on"
    other_device = place(states, hosts, 3, spec("lite"), ordinal=1)
    wait_until(lambda: states.get(3) == READY, "worker 3 is ready")
    assert other_device.pid != first.pid, "a version's second worker goes to the second process"
    # What the routing table tells the HTTP processes, which spread requests by process.
    assert hosts.worker_processes() == {0: first.pid, 1: first.pid, 3: other_device.pid}


def test_a_model_whose_engine_fails_fails_only_its_own_requests(tmp_path: Path, main_process) -> None:
    states, hosts = main_process
    healthy = place(states, hosts, 0, spec("lite"))
    failing = place(states, hosts, 1, spec("failing"))
    wait_until(lambda: states.get(0) == READY and states.get(1) == READY, "workers 0 and 1 ready")
    assert healthy.pid == failing.pid

    async def scenario() -> list[Answer]:
        api = ApiChannel(ChannelConfig(str(tmp_path), api_servers=1), 0)
        receiving = asyncio.create_task(api.receive_answers())
        try:
            requests = [api.submit(worker, uid, ImageRequest(b"cat")) for uid, worker in enumerate((0, 1, 0, 1, 0))]
            return await asyncio.wait_for(asyncio.gather(*requests), 30)
        finally:
            receiving.cancel()
            api.close()

    answers = asyncio.run(scenario())
    assert [answer.status_code for answer in answers] == [200, 500, 200, 500, 200]
    assert {(answer.model, answer.predictions[0][1]) for answer in answers[::2]} == {("lite", "cat")}
    assert healthy.is_alive() and failing.is_alive(), "a failing batch ends neither slot"


def test_a_stopped_slot_ends_and_its_process_serves_on(main_process) -> None:
    states, hosts = main_process
    kept = place(states, hosts, 0, spec("lite"))
    stopped = place(states, hosts, 1, spec("pets"))
    wait_until(lambda: states.get(0) == READY and states.get(1) == READY, "workers 0 and 1 ready")
    stopped.terminate()
    stopped.join(10)
    assert not stopped.is_alive() and stopped.exitcode == 0
    assert kept.is_alive() and kept.host.alive()
    again = place(states, hosts, 2, spec("pets"))  # a load into the process that is still there
    wait_until(lambda: states.get(2) == READY, "worker 2 is ready")
    assert again.pid == kept.pid


def test_killing_a_slot_ends_its_process_and_so_its_neighbours(main_process) -> None:
    states, hosts = main_process
    hung = place(states, hosts, 0, spec("lite"))
    neighbour = place(states, hosts, 1, spec("pets"))
    wait_until(lambda: states.get(0) == READY and states.get(1) == READY, "workers 0 and 1 ready")
    hung.kill()
    hung.join(10)
    assert not hung.is_alive() and not neighbour.is_alive(), "a thread cannot be killed: its process is"
    restarted = place(states, hosts, 1, spec("pets"))
    wait_until(lambda: states.get(1) == READY, "worker 1 is ready")
    assert restarted.pid != neighbour.pid and restarted.is_alive(), "a restart starts a new process"


def test_an_isolated_model_gets_a_process_of_its_own_that_ends_with_it(main_process) -> None:
    states, hosts = main_process
    shared = place(states, hosts, 0, spec("lite"))
    own = place(states, hosts, 1, spec("big", isolation="process"))
    failed = place(states, hosts, 2, spec("broken", isolation="process"))
    wait_until(
        lambda: states.get(0) == READY and states.get(1) == READY and states.get(2) == ERROR,
        "workers 0, 1 ready and 2 failed",
    )
    assert len({shared.pid, own.pid, failed.pid}) == 3
    failed.host.process.join(30)
    assert failed.host.process.exitcode == EXIT_SETUP_FAILED, "its state and its process's exit agree"
    own.terminate()
    own.host.process.join(30)
    assert own.host.process.exitcode == 0 and shared.is_alive()


def test_a_ready_report_carries_what_the_load_took(tmp_path: Path, main_process) -> None:
    states, hosts = main_process
    place(states, hosts, 0, spec("lite"))
    wait_until(lambda: states.get(0) == READY, "worker 0 is ready")
    assert report_to_main_process(str(tmp_path), WorkerReport(0, READY, memory_bytes=123 << 20))
    assert states.memory(0) == 123 << 20
    states.set(0, STARTING)  # restarted: the old measure no longer holds
    assert states.memory(0) == 0


def test_repository_calls_share_the_channel_with_the_reports(tmp_path: Path, main_process) -> None:
    states, _hosts = main_process
    states.set(3, STARTING)
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
