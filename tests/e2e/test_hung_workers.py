"""A worker that stops answering, on a real server (service/supervisor/pool/hangs.py): one stopped with
SIGSTOP, and one whose engine hangs while its heartbeat beats, are marked unresponsive (/ready 503),
have their requests answered 503 long before --request-timeout-s, and are restarted; one that is only
slow, its batches longer than the heartbeat timeout, is left alone and answers 200.

The workers serve tests/sleepy_model.py (the no-op model, its batches as long as the test writes into
a file), with short bounds: no heartbeat for 2 s marks a worker unresponsive, 4 s kills it, and one
batch of 8 s while it beats counts as hung.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from service.client.launcher import ServerProcess
from tests.conftest import inference_workers
from tests.worker_hold import wait_until

HEARTBEAT_TIMEOUT_S = 2.0
BATCH_HANG_TIMEOUT_S = 8.0
REQUEST_TIMEOUT_S = 30.0
# What the bounds may be late by on a busy 2-core machine: the beat interval, the polls of the main
# and HTTP processes, a table write; generous, and still far below --request-timeout-s.
SLACK_S = 3.0
ARGS = ["--model", "efficientnet-lite0", "--max-batch-size", "8", "--workers-per-device", "1", "--api-servers", "1",
        "--worker-heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S), "--batch-hang-timeout-s", str(BATCH_HANG_TIMEOUT_S),
        "--request-timeout-s", str(REQUEST_TIMEOUT_S)]  # fmt: skip
JPEG = {"Content-Type": "image/jpeg"}


class Sleepy:
    """The running server and the file that sets how long its batches take."""

    def __init__(self, server: ServerProcess, sleep_file: Path) -> None:
        self.server, self.sleep_file = server, sleep_file
        self.url = server.url

    def batches_take(self, seconds: float) -> None:
        self.sleep_file.write_text(str(seconds))

    def batches_run_at_once(self) -> None:
        self.sleep_file.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def sleepy(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hung")
    sleep_file = directory / "sleep"
    command = (sys.executable, "-m", "tests.sleepy_server")
    env = {"SLEEPY_FILE": str(sleep_file)}
    with ServerProcess(ARGS, log_path=directory / "server.log", env=env, command=command) as running:
        yield Sleepy(running, sleep_file)


def post(url: str, image: bytes) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = httpx.post(f"{url}/predict", content=image, headers=JPEG, timeout=120)
    return response, time.monotonic() - started


def counter(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M)
    assert match, f"no {name}{labels} in /metrics"
    return float(match.group(1))


def hung(url: str, reason: str) -> float:
    return counter(url, "vision_serve_workers_hung_total", f'{{reason="{reason}"}}')


def restarts(url: str) -> float:
    return counter(url, "vision_serve_worker_restarts_total")


def ready(url: str) -> httpx.Response:
    return httpx.get(f"{url}/ready", timeout=10)


def wait_for_a_new_worker(sleepy: Sleepy, old: psutil.Process) -> psutil.Process:
    """The restarted worker, once it serves: another pid, and /ready 200."""

    def replaced() -> bool:
        workers = inference_workers(sleepy.server)
        return bool(workers) and workers[0].pid != old.pid and ready(sleepy.url).status_code == 200

    wait_until(replaced, "the worker was restarted and ready", timeout=180)
    return inference_workers(sleepy.server)[0]


def gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_stopped_worker_is_marked_unresponsive_its_requests_get_503_and_it_is_restarted(sleepy, chelsea_jpeg):
    sleepy.batches_run_at_once()
    assert post(sleepy.url, chelsea_jpeg)[0].status_code == 200
    (worker,) = inference_workers(sleepy.server)
    silent_before, restarts_before = hung(sleepy.url, "silent"), restarts(sleepy.url)
    os.kill(worker.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        with ThreadPoolExecutor(3) as pool:
            held = [pool.submit(post, sleepy.url, chelsea_jpeg) for _ in range(3)]
            wait_until(lambda: ready(sleepy.url).status_code == 503, "/ready said 503", timeout=30)
            not_ready_after = time.monotonic() - stopped_at
            shown = ready(sleepy.url).json()["workers"]
            answers = [future.result(timeout=60) for future in held]
        new = wait_for_a_new_worker(sleepy, worker)  # stopped until then: resumed, it would serve again
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.pid, signal.SIGCONT)
    assert not_ready_after < HEARTBEAT_TIMEOUT_S + SLACK_S, not_ready_after
    assert set(shown.values()) <= {"unresponsive", "starting"}, shown  # starting: already restarted
    for response, seconds in answers:
        assert response.status_code == 503 and response.headers["Retry-After"] == "1", response.text
        assert "stopped answering" in response.json()["detail"]
        assert seconds < HEARTBEAT_TIMEOUT_S + SLACK_S, seconds  # not at --request-timeout-s
    assert gone(worker), "the stopped worker was not killed"
    assert post(sleepy.url, chelsea_jpeg)[0].status_code == 200
    assert new.pid != worker.pid
    assert hung(sleepy.url, "silent") == silent_before + 1
    assert restarts(sleepy.url) == restarts_before + 1
    assert "stopped answering (no heartbeat" in sleepy.server.log_text()


def test_a_slow_worker_that_beats_is_left_alone_and_answers(sleepy, chelsea_jpeg):
    """Batches of 5 s: past the heartbeat timeout (2 s) and the kill (4 s) had its heartbeat hung on
    its loop, and under --batch-hang-timeout-s (8 s)."""
    sleepy.batches_run_at_once()
    assert post(sleepy.url, chelsea_jpeg)[0].status_code == 200
    (worker,) = inference_workers(sleepy.server)
    hung_before = hung(sleepy.url, "silent") + hung(sleepy.url, "stuck_batch")
    restarts_before = restarts(sleepy.url)
    sleepy.batches_take(5.0)
    try:
        with ThreadPoolExecutor(2) as pool:
            slow = [pool.submit(post, sleepy.url, chelsea_jpeg) for _ in range(2)]
            probes = []
            while not all(future.done() for future in slow):
                probes.append(ready(sleepy.url).status_code)
                time.sleep(0.2)
            answers = [future.result() for future in slow]
    finally:
        sleepy.batches_run_at_once()
    assert [response.status_code for response, _ in answers] == [200, 200], [r.text for r, _ in answers]
    assert min(seconds for _, seconds in answers) >= 5.0  # each waited for a batch longer than the bound
    assert set(probes) == {200}, probes  # never shown unresponsive
    assert inference_workers(sleepy.server)[0].pid == worker.pid
    assert hung(sleepy.url, "silent") + hung(sleepy.url, "stuck_batch") == hung_before
    assert restarts(sleepy.url) == restarts_before


def test_a_batch_that_never_ends_while_the_worker_beats_gets_it_restarted(sleepy, chelsea_jpeg):
    """An engine that never returns (a batch of 2 minutes here) with the heartbeat alive: after
    --batch-hang-timeout-s the worker is unresponsive, its request is answered 503, and it restarts."""
    sleepy.batches_run_at_once()
    assert post(sleepy.url, chelsea_jpeg)[0].status_code == 200
    (worker,) = inference_workers(sleepy.server)
    stuck_before, restarts_before = hung(sleepy.url, "stuck_batch"), restarts(sleepy.url)
    sleepy.batches_take(120.0)
    try:
        response, seconds = post(sleepy.url, chelsea_jpeg)
    finally:
        sleepy.batches_run_at_once()  # the restarted worker's batches run at once
    assert response.status_code == 503 and "stopped answering" in response.json()["detail"], response.text
    assert BATCH_HANG_TIMEOUT_S <= seconds < BATCH_HANG_TIMEOUT_S + SLACK_S, seconds
    wait_for_a_new_worker(sleepy, worker)
    assert gone(worker)
    assert post(sleepy.url, chelsea_jpeg)[0].status_code == 200
    assert hung(sleepy.url, "stuck_batch") == stuck_before + 1
    assert restarts(sleepy.url) == restarts_before + 1
    assert "one batch running for" in sleepy.server.log_text()
