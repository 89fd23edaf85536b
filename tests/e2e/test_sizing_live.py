"""The defaults chosen from the engine and the machine, live: a server started with nothing said about
workers or threads serves EfficientNet-Lite0 with a worker per usable core (a small model), says so in
its startup log and /info, and answers right both a lone request (run on the cores of every idle
worker) and concurrent ones."""

from __future__ import annotations

import concurrent.futures
import os

import httpx
import psutil
import pytest

from service import _defaults
from service.client.launcher import ServerProcess
from service.supervisor.planning.cores import usable_cores
from tests.conftest import CAT_LABELS

WORKERS_ENV = "VISION_SERVE_WORKERS_PER_DEVICE"  # the suite pins it to 1 (tests/conftest.py)


def worker_processes(pid: int) -> list[psutil.Process]:
    """The server's inference workers: the processes LitServe spawns (its HTTP processes are forked)."""
    return [p for p in psutil.Process(pid).children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]


@pytest.mark.slow  # two Lite0 workers loaded on top of the suite: tests/unit/test_sizing.py is the fast check
def test_defaults_give_a_small_model_a_worker_per_core_and_say_why(tmp_path, chelsea_jpeg) -> None:
    environment = {k: v for k, v in os.environ.items() if k != WORKERS_ENV}
    cores = usable_cores()
    expected = min(cores, _defaults.MAX_CPU_WORKERS)  # the rule for a model under SMALL_MODEL_GMACS
    log = tmp_path / "server.log"
    args = ["--model", "efficientnet-lite0", "--weights", "imagenet", "--device", "cpu"]
    with ServerProcess(args, log_path=log, base_env=environment) as server:
        info = httpx.get(f"{server.url}/info", timeout=10).json()
        assert info["server"]["workers_per_device"] == expected
        assert info["server"]["engine_threads"] == cores // expected
        sizing = info["model"]["sizing"]
        assert sizing["workers_per_device"] == {"value": expected, "source": "auto"}
        assert sizing["engine_threads"] == {"value": cores // expected, "source": "auto"}
        assert sizing["usable_cores"] == cores and "small model" in sizing["why"], sizing
        assert len(worker_processes(server.process.pid)) == expected

        def classify(_: int) -> httpx.Response:
            return httpx.post(f"{server.url}/predict", files={"image": chelsea_jpeg}, timeout=60)

        # One at a time: each a lone image while the other workers idle, on all their threads.
        alone = [classify(n) for n in range(4)]
        assert [a.json()["predictions"][0]["label"] in CAT_LABELS for a in alone] == [True] * 4

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(classify, range(32)))
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
        assert all(a.json()["predictions"][0]["label"] in CAT_LABELS for a in answers)
    text = log.read_text()
    assert f"Serving efficientnet-lite0: {expected} worker(s) per device (auto) x {cores // expected}" in text
