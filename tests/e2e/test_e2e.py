"""End to end: `vision-serve` as a subprocess on a free loopback port, real HTTP, real model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from service.client.cli import main as classify_main
from service.client.launcher import ServerProcess, free_port
from service.client.vision_client import ClassifyError, VisionClient
from tests.conftest import CAT_LABELS, encode, inference_workers, sample_array
from tests.worker_hold import in_flight as admitted
from tests.worker_hold import wait_until, worker_held

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


# Run as a fresh interpreter in which torch and the server's libraries cannot be imported: what a
# client-only install has (docs/http-api.md#clients: the client needs httpx alone).
CLIENT_ONLY = """
import sys
SERVER_SIDE = {"torch", "torchvision", "numpy", "PIL", "litserve", "fastapi", "starlette", "zmq", "prometheus_client"}
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in SERVER_SIDE:
            raise ImportError(f"{name} is not installed in a client-only environment")
sys.meta_path.insert(0, Blocked())
from service.client.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_vision_classify_runs_without_torch_or_the_server_stack(server, sample_files) -> None:
    command = [sys.executable, "-c", CLIENT_ONLY, str(sample_files["coffee"]), "--url", server.url, "--json"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["predictions"][0]["label"] == "espresso"


def test_vision_classify_explains_an_unreachable_server(sample_files, capsys) -> None:
    code = classify_main([str(sample_files["coffee"]), "--url", "http://127.0.0.1:9", "--timeout", "5"])
    assert code == 1 and "cannot reach the server" in capsys.readouterr().out


def descendants_of(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def still_running(processes: Iterable[psutil.Process]) -> list[str]:
    return [f"{p.pid} {p.cmdline()}" for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


STOP_CASES = {
    "SIGTERM-to-main": (signal.SIGTERM, False),  # what an orchestrator sends
    "SIGINT-to-group": (signal.SIGINT, True),  # Ctrl-C in a terminal reaches every process of the group
}
# Both stop the same way; a second ResNet-152 start of 20 s is the slow tier's.
STOP_MARKS = {"SIGINT-to-group": [pytest.mark.slow]}


@pytest.mark.parametrize(
    ("stop_signal", "to_group"),
    [pytest.param(*case, id=name, marks=STOP_MARKS.get(name, [])) for name, case in STOP_CASES.items()],
)
def test_stop_answers_in_flight_requests_and_leaves_no_process(tmp_path, sample_files, stop_signal, to_group) -> None:
    # ResNet-152 (random weights: only speed matters) keeps 8 requests busy for about a second.
    args = ["--model", "resnet152", "--weights", "random", "--max-batch-size", "4", "--workers-per-device", "2"]
    server = ServerProcess(args, log_path=tmp_path / "server.log").start()
    image = sample_files["chelsea"].read_bytes()
    try:
        children = descendants_of(server.process.pid)
        # HTTP servers, 2 inference workers, multiprocessing manager, resource tracker
        assert len(children) >= 4, [c.cmdline() for c in children]
        with VisionClient(server.url) as client, ThreadPoolExecutor(8) as pool:
            in_flight = [pool.submit(client.classify, image) for _ in range(8)]
            # Every request admitted (or already answered): the signal finds them in the server.
            wait_until(lambda: admitted(server.url) + sum(f.done() for f in in_flight) >= 8, "all are admitted")
            assert not all(f.done() for f in in_flight), "the requests finished before the signal"
            if to_group:
                os.killpg(server.process.pid, stop_signal)  # the server leads its own process group
            else:
                server.process.send_signal(stop_signal)
            answers = [f.result(timeout=60) for f in in_flight]
        code = server.process.wait(timeout=60)
    finally:
        server.stop()
    assert all(len(a.predictions) == 5 for a in answers)
    assert code == 0, server.log_tail()
    psutil.wait_procs(children, timeout=10)  # the main process reaped them; the last may still be exiting
    assert not still_running(children)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=2)


def accepts(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=2)
    except httpx.TransportError:
        return False
    return True


# A server of its own, 25 s; the container's stop test (slow tier too) fails without it as well.
@pytest.mark.slow
def test_sigterm_stops_every_http_process_at_once(tmp_path, sample_files) -> None:
    """With two HTTP processes on the one socket, SIGTERM closes it in both while requests are still
    held (the worker stopped), not in one after the other has drained; then every request is answered."""
    args = [*LITE, "--api-servers", "2", "--workers-per-device", "1"]
    server = ServerProcess(args, log_path=tmp_path / "server.log").start()
    image = sample_files["chelsea"].read_bytes()
    try:
        (worker,) = inference_workers(server)
        with httpx.Client(base_url=server.url, timeout=60) as client, ThreadPoolExecutor(8) as pool:
            with worker_held(worker.pid):
                held = [pool.submit(client.post, "/predict", content=image) for _ in range(8)]
                wait_until(lambda: admitted(server.url) >= 8, "all are admitted")
                server.process.send_signal(signal.SIGTERM)
                # Within seconds, and no connection then gets in (either process could have taken it).
                wait_until(lambda: not accepts(server.url), "the server stops accepting", timeout=10)
                assert not any(accepts(server.url) for _ in range(5))
            answers = [future.result(timeout=60) for future in held]
        code = server.process.wait(timeout=60)
    finally:
        server.stop()
    assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers]
    assert code == 0, server.log_tail()


def test_sigkill_of_the_main_process_leaves_no_process(tmp_path) -> None:
    """Killed without a chance to stop its children, the main process still leaves none behind: each
    ends itself once its parent is gone (service/parent_watch.py), the resource tracker with them."""
    server = ServerProcess(["--model", "efficientnet-lite0"], log_path=tmp_path / "server.log").start()
    try:
        children = descendants_of(server.process.pid)
        # HTTP server, inference worker, multiprocessing manager, resource tracker
        assert len(children) >= 4, [c.cmdline() for c in children]
        server.process.kill()
        server.process.wait(timeout=10)
        _gone, alive = psutil.wait_procs(children, timeout=15)
    finally:
        server.stop()
    assert not still_running(alive), [" ".join(c.cmdline())[:120] for c in alive]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=2)


PLANNER_GONE_WITHIN_S = 2.0
# The main process's part of planning, as at launch: start the planner, hand it the settings, wait.
PLANS = """
from service.settings import ServeSettings
from service.supervisor.planning.launch import start_planning
start_planning(ServeSettings(model="efficientnet-lite0")).result()
"""


def test_a_planner_whose_main_process_is_killed_ends_too() -> None:
    """The planner child (service/supervisor/planning/) imports torch and plans for seconds once it has
    its settings: a main process killed meanwhile (SIGKILL, the OOM killer) must not leave it running.
    It watches its parent from its first line (service/parent_watch.py)."""
    main = subprocess.Popen([sys.executable, "-c", PLANS])
    planner = None
    try:
        deadline = time.monotonic() + 60
        while planner is None and time.monotonic() < deadline and main.poll() is None:
            found = [c for c in descendants_of(main.pid) if "service.supervisor.planning" in " ".join(c.cmdline())]
            planner = found[0] if found else None
            time.sleep(0.02)
        assert planner is not None, "the main process never started its planner"
        time.sleep(0.5)  # its settings are in its stdin by now, and it is importing torch
        assert still_running([planner]), "the planner ended before the main process was killed"
        main.kill()
        killed_at = time.monotonic()
        while still_running([planner]) and time.monotonic() - killed_at < 60:
            time.sleep(0.02)
        outlived_s = time.monotonic() - killed_at
    finally:
        main.kill()
        main.wait(timeout=10)
        if planner is not None and still_running([planner]):
            planner.kill()
    assert outlived_s < PLANNER_GONE_WITHIN_S, f"the planner outlived the main process by {outlived_s:.1f} s"


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
    assert not still_running(seen.values())
