"""vision-tune end to end: a tiny grid tuned on real servers, its answer served as it is, a precision
the accuracy gate drops, and a tune stopped by Ctrl-C and by kill -9 that leaves no server behind
and resumes where it stopped. EfficientNet-Lite0 with its real ImageNet weights; short load steps."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from service.client.launcher import ServerProcess
from service.client.vision_client import VisionClient
from service.settings import read_config_file, without_setting_variables
from tests.conftest import command_line
from tests.integration.test_quantized_compile import ONNX_INT8_ON_THIS_CPU

pytestmark = pytest.mark.slow

# Short steps: the tests check what a tune does, not how fast the model is; 400 ms is far above the
# p99 of Lite0 on two busy cores at a few requests in flight.
TUNE = [
    sys.executable, "-m", "service.tune.cli", "--model", "efficientnet-lite0", "--weights", "imagenet",
    "--p99-ms", "400", "--workers-per-device", "1", "--preprocess", "pil", "--step-seconds", "1",
    "--min-requests", "20", "--poisson-seconds", "2", "--max-concurrency", "8", "--search", "full",
]  # fmt: skip
WAIT_S = 240


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One compile-trt cache for the module: the second tune finds its engine there."""
    return tmp_path_factory.mktemp("tune-artifacts")


def tune(tmp_path: Path, artifacts: Path, *flags: str) -> list[str]:
    return [*TUNE, "--output", str(tmp_path / "tuned.toml"), "--artifacts", str(artifacts), *flags]


def journal_entries(work: Path) -> list[dict]:
    path = work / "journal.jsonl"
    if not path.exists():
        return []
    entries = []
    for line in path.read_text().splitlines()[1:]:
        with contextlib.suppress(ValueError):
            entries.append(json.loads(line))
    return entries


def measured(work: Path) -> list[tuple]:
    return [
        (e["measurement"]["phase"], e["measurement"]["candidate"]["max_batch_size"], e["measurement"]["round"])
        for e in journal_entries(work)
        if e["kind"] == "measurement"
    ]


def server_mains(folder: Path) -> list[psutil.Process]:
    """Running vision-serve main processes whose config file lies in ``folder``."""
    return [p for p in psutil.process_iter() if "service.cli" in command_line(p) and str(folder) in command_line(p)]


def ready_server(folder: Path) -> psutil.Process | None:
    """Such a server once it answers /ready: its workers are up, and it handles SIGTERM as it does when serving."""
    for process in server_mains(folder):
        try:
            # The main process leads its session; its forked HTTP processes share its command line, and
            # after the pids wrap one of them may be listed first.
            if os.getsid(process.pid) != process.pid:
                continue
            port = process.environ().get("VISION_SERVE_PORT")
            if port and httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return process
        except (OSError, psutil.Error, httpx.HTTPError):
            continue
    return None


def session(leader: int) -> list[psutil.Process]:
    """Every live process of the session a server leads (its workers and helpers; the tune starts each
    server in a session of its own), zombies not counted."""
    living = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == leader and process.status() != psutil.STATUS_ZOMBIE:
                living.append(process)
        except (OSError, psutil.Error):
            continue
    return living


def wait_for(condition, what: str, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


def test_a_tiny_grid_is_tuned_on_real_servers_and_its_answer_serves_as_written(tmp_path, artifacts, coffee_jpeg):
    # eager-bf16 computes the real model in bf16 (cosine ~0.998 to fp32): a gate asking 0.99999 drops it.
    command = tune(
        tmp_path, artifacts, "--engines", "onnx-fp32,eager-bf16", "--gate-min-cosine", "0.99999",
        "--max-batch-sizes", "1,4", "--confirm-rounds", "1",
    )  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    toml = tmp_path / "tuned.toml"
    assert f"Serve it: vision-serve --config {toml}" in done.stdout

    builds = {
        e["build"]["engine"]: e["build"] for e in journal_entries(tmp_path / "tuned.work") if e["kind"] == "engine"
    }
    assert builds["onnx-fp32"]["status"] == "ok"
    assert builds["eager-bf16"]["status"] == "gate failed" and "cosine" in builds["eager-bf16"]["message"]
    report = (tmp_path / "tuned.md").read_text()
    assert "| eager-bf16 | gate failed |" in report and "Tuned vs defaults, alternating rounds" in report

    with (tmp_path / "tuned.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {row["engine"] for row in rows} == {"onnx-fp32"}  # the dropped precision was never served
    assert {row["phase"] for row in rows} == {"search", "confirm-defaults", "confirm-tuned"}
    assert {row["max_batch_size"] for row in rows if row["phase"] == "search"} == {"1", "4", "32"}  # + the defaults
    judged = [row for row in rows if row["phase"] == "search" and row["load"] == "poisson" and row["chosen"] == "True"]
    assert judged and all(float(row["p99_ms"]) <= 400 for row in judged)  # each configuration's judged run
    assert (tmp_path / "tuned.png").read_bytes()[:4] == b"\x89PNG"

    # The answer, served as it is.
    values = read_config_file(toml)
    assert Path(values["artifact"]).is_dir() and values["max_batch_size"] in (1, 4, 32)
    served = ServerProcess(
        ["--config", str(toml)], log_path=tmp_path / "serve.log", base_env=without_setting_variables()
    )
    with served as server:
        info = httpx.get(f"{server.url}/info", timeout=10).json()
        assert info["model"]["engine"] == "onnxruntime-fp32"
        assert info["model"]["max_batch_size"] == values["max_batch_size"]
        sizing = info["model"]["sizing"]["workers_per_device"]
        assert sizing["source"] == ("auto" if values["workers_per_device"] == 0 else "set")
        assert info["server"]["workers_per_device"] == (values["workers_per_device"] or sizing["value"])
        with VisionClient(server.url) as client:
            assert client.classify(coffee_jpeg).top1.label == "espresso"


def test_a_tune_stopped_by_kill_and_by_ctrl_c_leaves_no_server_and_resumes(tmp_path, artifacts):
    command = tune(tmp_path, artifacts, "--engines", "onnx-fp32", "--max-batch-sizes", "1,4", "--confirm-rounds", "1")
    work = tmp_path / "tuned.work"

    # 1. kill -9 while a server is measured, after one measurement is in the journal
    with (tmp_path / "run1.log").open("w") as log:
        first = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    wait_for(lambda: measured(work), "a first measurement")
    server = wait_for(lambda: ready_server(tmp_path), "the second server to be ready")
    assert len(session(server.pid)) >= 3  # the server, its HTTP process and its worker at least
    first.send_signal(signal.SIGKILL)
    first.wait()
    wait_for(lambda: not session(server.pid), "the server of a killed tune to stop, workers and all", timeout=60)
    before = measured(work)
    assert before

    # 2. Ctrl-C (SIGINT to its process group, as a terminal sends it) while a server is measured
    with (tmp_path / "run2.log").open("w") as log:
        second = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = wait_for(lambda: ready_server(tmp_path), "a server of the resumed tune to be ready")
    assert len(session(server.pid)) >= 3
    os.killpg(second.pid, signal.SIGINT)
    assert second.wait(timeout=120) == 130
    assert session(server.pid) == []  # stopped by the tune before it exited
    text = (tmp_path / "run2.log").read_text()
    assert "Resuming the tune" in text and "run the same command again to resume" in text
    read_back = measured(work)

    # 3. resumed to the end: nothing measured twice, the answer written
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Resuming the tune" in done.stderr
    final = measured(work)
    assert len(final) == len(set(final))  # every (phase, configuration, round) measured once
    assert set(before) <= set(final)
    assert ("confirm-tuned", read_config_file(tmp_path / "tuned.toml")["max_batch_size"], 0) in final
    assert done.stderr.count("-m service.cli --config") == len(final) - len(read_back)  # the rest only
    assert server_mains(tmp_path) == []


def test_calibration_adds_an_int8_engine_that_is_gated_measured_and_served(tmp_path, artifacts, coffee_jpeg):
    """Issue 43: with --calibration, an int8 engine is compiled by compile-trt with the calibration
    flags, passes int8's gate, is measured like any engine, and its artifact serves."""
    from compile.sample_photos import write_sample_calibration_set

    calibration = tmp_path / "calibration"
    write_sample_calibration_set(calibration)
    command = tune(
        tmp_path, artifacts, "--engines", "onnx-int8", "--calibration", str(calibration),
        "--max-batch-sizes", "4", "--confirm-rounds", "1",
        *ONNX_INT8_ON_THIS_CPU,  # lower thresholds on a CPU without VNNI (test_quantized_compile.py says why)
    )  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    builds = {
        e["build"]["engine"]: e["build"] for e in journal_entries(tmp_path / "tuned.work") if e["kind"] == "engine"
    }
    int8 = builds["onnx-int8"]
    assert int8["status"] == "ok", int8["message"]
    assert int8["command"][int8["command"].index("--calibration") + 1] == str(calibration)
    assert "mean_prob_drop" in int8["message"]  # the int8 gate's figures
    with (tmp_path / "tuned.csv").open() as f:
        assert "onnx-int8" in {row["engine"] for row in csv.DictReader(f)}
    with ServerProcess(["--artifact", int8["artifact"]], log_path=tmp_path / "serve.log") as server:
        assert httpx.get(f"{server.url}/info", timeout=10).json()["model"]["engine"] == "onnxruntime-int8"
        with VisionClient(server.url) as client:
            assert client.classify(coffee_jpeg).top1.label == "espresso"
