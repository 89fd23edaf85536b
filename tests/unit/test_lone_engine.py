"""A lone image on the cores of every idle worker (service/worker/engine.py ``with_lone_engine``,
service/worker/runner.py ``others_idle``): several single-threaded workers serve a small model, and a
single image while the others are idle runs on all their threads."""

from __future__ import annotations

import pytest
import torch

from compile.catalog import get_model_entry
from service.worker.engine import ServedModel, with_lone_engine
from service.worker.runner import BatchRunner


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def recording_model(engine_name: str, seen: list[int]) -> ServedModel:
    def run(images: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return torch.zeros(len(images), 3)

    return ServedModel(get_model_entry("efficientnet-lite0"), engine_name, run)


def test_a_torch_engine_runs_a_lone_image_on_every_workers_threads(one_thread) -> None:
    seen: list[int] = []

    def never() -> ServedModel:
        raise AssertionError("a torch engine switches threads; it is not loaded again")

    served = with_lone_engine(recording_model("torch-eager-fp32", seen), 1, 2, never)
    image, two = torch.zeros(1, 3, 8, 8), torch.zeros(2, 3, 8, 8)
    served(image, alone=True)
    served(image)  # another worker is busy
    served(two, alone=True)  # a batch of several: the worker's own share
    assert seen == [2, 1, 1]
    assert torch.get_num_threads() == 1, "the worker's own count is back after the lone call"


def test_a_lone_call_that_fails_still_gives_the_threads_back(one_thread) -> None:
    def fails(images: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("engine failed")

    served = with_lone_engine(
        ServedModel(get_model_entry("efficientnet-lite0"), "torch-eager-fp32", fails), 1, 2, lambda: None
    )
    with pytest.raises(RuntimeError, match="engine failed"):
        served(torch.zeros(1, 3, 8, 8), alone=True)
    assert torch.get_num_threads() == 1


def test_an_onnx_runtime_engine_gets_a_second_session_on_every_workers_threads(one_thread) -> None:
    """An ONNX Runtime session's threads are fixed when it opens, from torch's count at load: the lone
    session is loaded again with torch set to the lone count."""
    shared_seen: list[int] = []
    lone_seen: list[int] = []
    threads_at_load: list[int] = []

    def load_again() -> ServedModel:
        threads_at_load.append(torch.get_num_threads())
        return recording_model("onnxruntime-fp32", lone_seen)

    served = with_lone_engine(recording_model("onnxruntime-fp32", shared_seen), 1, 2, load_again)
    assert threads_at_load == [2] and torch.get_num_threads() == 1
    served(torch.zeros(1, 3, 8, 8), alone=True)
    served(torch.zeros(1, 3, 8, 8))
    assert (len(lone_seen), len(shared_seen)) == (1, 1)
    assert lone_seen == [1], "the session does not switch torch's threads: it has its own"


def test_one_worker_or_no_spare_cores_keep_a_single_engine(one_thread) -> None:
    served = recording_model("torch-eager-fp32", [])
    assert with_lone_engine(served, 2, 2, lambda: None) is served
    assert served.lone_run is None


@pytest.mark.parametrize(
    ("running", "slot", "idle"),
    [
        ([0, 0, 0], 0, True),
        ([5, 0, 0], 0, True),  # only this worker's own batch
        ([5, 3, 0], 0, False),
        ([0, 0, 1], 1, False),
        (None, 0, False),  # no shared array: never assumed alone
    ],
)
def test_a_runner_tells_whether_every_other_worker_is_idle(running, slot, idle) -> None:
    runner = BatchRunner(model=None, channel=None, worker_id=slot, running=running)
    assert runner.others_idle() is idle
