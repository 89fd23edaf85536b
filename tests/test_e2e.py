"""End to end: `vision-serve` as a subprocess on a free loopback port, real HTTP, real model."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil
import pytest

from service.classify_cli import main as classify_main
from service.client import ClassifyError, VisionClient
from service.process import ServerProcess, free_port
from tests.conftest import CAT_LABELS, encode, sample_array

pytestmark = pytest.mark.slow

LITE = ["--model", "efficientnet-lite0", "--max-batch-size", "8"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(LITE, log_path=tmp_path_factory.mktemp("server") / "server.log") as running:
        yield running


@pytest.fixture(scope="module")
def sample_files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("images")
    paths = {}
    for name in ("chelsea", "coffee"):
        paths[name] = directory / f"{name}.jpg"
        paths[name].write_bytes(encode(sample_array(name), quality=92))
    return paths


def test_chelsea_is_a_cat_and_coffee_is_espresso(server, sample_files) -> None:
    with VisionClient(server.url) as client:
        cat = client.classify(sample_files["chelsea"])
        coffee = client.classify(sample_files["coffee"])
    assert cat.top1.label in CAT_LABELS
    assert coffee.top1.label == "espresso"
    assert len(cat.predictions) == 5 and cat.model == "efficientnet-lite0"


def test_client_raises_the_servers_explanation(server) -> None:
    with VisionClient(server.url) as client, pytest.raises(ClassifyError) as caught:
        client.classify(b"definitely not an image")
    assert caught.value.status_code == 415 and "not an image" in caught.value.detail


def test_vision_classify_prints_a_table_per_image(server, sample_files, capsys) -> None:
    code = classify_main([str(sample_files["chelsea"]), str(sample_files["coffee"]), "--url", server.url])
    out = capsys.readouterr().out
    assert code == 0
    assert "chelsea.jpg" in out and "coffee.jpg" in out
    assert "1. espresso" in out and out.count("%") == 10


def test_vision_classify_json_and_errors(server, sample_files, tmp_path, capsys) -> None:
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(sample_files["chelsea"].read_bytes()[:3000])
    code = classify_main([str(sample_files["coffee"]), str(broken), "--url", server.url, "--json", "--top-k", "2"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 1  # one image failed
    assert lines[0]["predictions"][0]["label"] == "espresso" and len(lines[0]["predictions"]) == 2
    assert lines[1]["error"].startswith("HTTP 400")


def test_vision_classify_explains_an_unreachable_server(sample_files, capsys) -> None:
    code = classify_main([str(sample_files["coffee"]), "--url", "http://127.0.0.1:9", "--timeout", "5"])
    assert code == 1 and "cannot reach the server" in capsys.readouterr().out


def descendants_of(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stop_signal_leaves_no_process_behind(tmp_path, sample_files, stop_signal) -> None:
    server = ServerProcess([*LITE, "--workers-per-device", "2"], log_path=tmp_path / "server.log").start()
    try:
        with VisionClient(server.url) as client:
            assert client.classify(sample_files["chelsea"]).top1.label in CAT_LABELS
        children = descendants_of(server.process.pid)
        # HTTP server, 2 inference workers, multiprocessing manager, resource tracker
        assert len(children) >= 4, [c.cmdline() for c in children]
        server.process.send_signal(stop_signal)
        code = server.process.wait(timeout=60)
    finally:
        server.stop()
    assert code == 0, server.log_tail()
    time.sleep(0.5)
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [f"{c.pid} {c.cmdline()}" for c in alive]


def test_worker_startup_failure_exits_nonzero_and_cleans_up(tmp_path) -> None:
    garbage = tmp_path / "weights.pt"
    garbage.write_bytes(b"this is not a state_dict")
    command = [sys.executable, "-m", "service.cli", "--model", "efficientnet-lite0", "--weights", str(garbage),
               "--port", str(free_port())]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            seen.update({c.pid: c for c in descendants_of(proc.pid)})
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1, output
    assert "Could not read" in output and "failed to start" in output
    assert seen, "the server never started its worker processes"
    alive = [c for c in seen.values() if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [f"{c.pid} {c.cmdline()}" for c in alive]
