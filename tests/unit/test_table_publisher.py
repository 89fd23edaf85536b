"""The routing table's publisher on its own (service/supervisor/pool/table_publisher.py): when a load
stops waiting for the HTTP processes' acks, and which model a table names the default.

The pool's tests (test_model_pool_units.py) drive it through loads and unloads, where a wait that runs
out its whole ack timeout still ends in the right table, only 10 s late: these pin the boundaries.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from service.repository.table import TableFile, VersionRoute
from service.supervisor.pool.table_publisher import TablePublisher

ACK_TIMEOUT_S = 2.0


def route(name: str) -> VersionRoute:
    return VersionRoute(name, 1, (0,), None)  # type: ignore[arg-type]  (the publisher never reads it)


def publisher(tmp_path: Path, acks: list[int], models: dict, default_model: str = "") -> TablePublisher:
    return TablePublisher(
        str(tmp_path),
        acks,
        routes=lambda: (models, ()),
        states=lambda: {0: "ready"},
        default_model=default_model,
        stopping=threading.Event(),
        ack_timeout_s=ACK_TIMEOUT_S,
    )


def seconds_waiting(table_publisher: TablePublisher, generation: int) -> float:
    started = time.monotonic()
    table_publisher.wait_acks(generation)
    return time.monotonic() - started


def test_a_wait_for_acks_ends_as_soon_as_every_process_follows_the_generation(tmp_path: Path) -> None:
    """Issue 64: compared with ``>`` instead of ``>=``, every load and unload waited out the timeout."""
    acks = [0, 0]
    table_publisher = publisher(tmp_path, acks, {"pets": {1: route("pets")}})
    generation = table_publisher.publish()
    acks[:] = [generation, generation]
    assert seconds_waiting(table_publisher, generation) < ACK_TIMEOUT_S / 4


def test_a_wait_for_acks_holds_while_one_process_is_a_generation_behind(tmp_path: Path) -> None:
    acks = [0, 0]
    table_publisher = publisher(tmp_path, acks, {"pets": {1: route("pets")}})
    generation = table_publisher.publish()
    acks[:] = [generation, generation - 1]
    assert seconds_waiting(table_publisher, generation) >= ACK_TIMEOUT_S


def test_a_process_not_started_yet_is_not_waited_for(tmp_path: Path) -> None:
    acks = [-1, 0]
    table_publisher = publisher(tmp_path, acks, {"pets": {1: route("pets")}})
    generation = table_publisher.publish()
    acks[1] = generation
    assert seconds_waiting(table_publisher, generation) < ACK_TIMEOUT_S / 4


@pytest.mark.parametrize(
    ("names", "default_model", "expected"),
    [
        (["pets"], "", "pets"),  # one model: it is the default
        (["pets", "cars"], "", ""),  # several and no --default-model: none, requests must name one
        (["pets", "cars"], "cars", "cars"),
    ],
)
def test_the_default_model_is_the_only_one_or_the_one_named(tmp_path: Path, names, default_model, expected) -> None:
    """Issue 64: a repository of several models without --default-model silently made the first one
    the default (the e2e servers always pass --default-model)."""
    models = {name: {1: route(name)} for name in names}
    publisher(tmp_path, [0], models, default_model).publish()
    assert TableFile(tmp_path).read_if_changed().default_model == expected


def test_the_table_says_which_process_each_worker_runs_in(tmp_path: Path) -> None:
    """What the HTTP processes spread requests by (service/transport/channels.py, ``pick_worker``)."""
    table_publisher = TablePublisher(
        str(tmp_path),
        [0],
        routes=lambda: ({"pets": {1: route("pets")}}, ()),
        states=lambda: {0: "ready", 1: "ready"},
        default_model="",
        stopping=threading.Event(),
        processes=lambda: {0: 4321, 1: 4321},
    )
    table_publisher.publish()
    table = TableFile(tmp_path).read_if_changed()
    assert table is not None and table.worker_processes == {0: 4321, 1: 4321}
