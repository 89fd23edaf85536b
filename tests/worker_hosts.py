"""The main process's end of worker processes, without a server: the control server feeding
``WorkerStates`` and ``WorkerHosts``, which place model slots in real spawned worker processes
(tests/unit/test_worker_process.py with a trivial model, tests/integration/test_onnx_compile.py with
a real one)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from service.supervisor.pool.hosts import WorkerHosts
from service.supervisor.pool.states import WorkerStates
from service.transport.channels import ChannelConfig
from service.transport.control_channel import STARTING, ControlReply, ControlServer
from service.worker.host import HostResources, SlotSpec


@contextlib.contextmanager
def main_process_end(directory: Path) -> Iterator[tuple[WorkerStates, WorkerHosts]]:
    """The states and hosts of worker processes whose channels live in ``directory``; every process
    placed is killed at the end."""
    states = WorkerStates()
    channels = ChannelConfig(str(directory), api_servers=1)
    hosts = WorkerHosts(lambda: HostResources(channels, None, None, os.getpid()))
    server = ControlServer(
        str(directory), lambda request: ControlReply(index=[{"name": request.model}]), hosts.reports_to(states)
    )
    server.start()
    try:
        yield states, hosts
    finally:
        for process in hosts.processes():
            process.kill()
            process.join()
        server.stop()


def place(states: WorkerStates, hosts: WorkerHosts, worker_id: int, slot: SlotSpec, ordinal: int = 0):
    """Load ``slot`` as worker ``worker_id`` in the ``ordinal``-th shared worker process (made if none)."""
    states.set(worker_id, STARTING)
    return hosts.place(slot, worker_id, "cpu", ordinal)
