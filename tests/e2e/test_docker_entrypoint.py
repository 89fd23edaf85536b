"""The image's entrypoint (deploy/docker/entrypoint.sh), run for real outside Docker: it compiles a small
CPU artifact, serves it, stops on SIGTERM, hits its cache on the second start, and fails clearly. The
deploy files themselves are checked in tests/unit/test_deploy_files.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from service.client.launcher import ServerProcess, free_port
from service.client.vision_client import VisionClient
from tests.conftest import CAT_LABELS, command_line
from tests.unit.test_deploy_files import (
    ENTRYPOINT,
    alert_rules,
    compose_healthcheck,
    dashboard_queries,
    dockerfile_healthcheck,
    metric_names_in,
)

# The console scripts (vision-serve, compile-trt) of the environment running the tests.
VENV_BIN = Path(sys.executable).parent
# A cheap artifact: EfficientNet-Lite0 ships its weights (offline), eager on the CPU compiles in seconds.
LITE0_COMPILE_ARGS = "--model efficientnet-lite0 --backend eager --device cpu --batch 1,2,4"
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0


def run_healthcheck(command: list[str], port: int) -> int:
    # The image's `python` is this interpreter here.
    command = [sys.executable if part == "python" else part for part in command]
    env = {**os.environ, "VISION_SERVE_PORT": str(port)}
    return subprocess.run(command, env=env, capture_output=True, timeout=30).returncode


def entrypoint(args: list[str], log_path: Path, **env: str) -> ServerProcess:
    """deploy/docker/entrypoint.sh launched as a server process, with the venv's console scripts on PATH
    and none of this shell's VISION_SERVE_* settings."""
    base = {
        k: v for k, v in os.environ.items() if not k.startswith("VISION_SERVE_") and k != "PROMETHEUS_MULTIPROC_DIR"
    }
    env = {"PATH": f"{VENV_BIN}{os.pathsep}{base.get('PATH', '')}", "VISION_SERVE_HOST": "127.0.0.1", **env}
    return ServerProcess(args, log_path=log_path, env=env, base_env=base, command=[str(ENTRYPOINT)]).launch()


def alive_in_session(run: ServerProcess) -> list[psutil.Process]:
    """Every process still alive of this run (its session)."""
    alive = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == run.process.pid and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except (ProcessLookupError, psutil.Error):
            pass
    return alive


def manifest_of(artifact: Path) -> dict:
    return json.loads((artifact / "manifest.json").read_text())


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """``launch(args, VISION_SERVE_X=...)`` starts the script; whatever a failed test leaves running is killed."""
    runs: list[ServerProcess] = []

    def start(args: list[str], **env: str) -> ServerProcess:
        runs.append(entrypoint(args, tmp_path / f"entrypoint-{len(runs)}.log", **env))
        return runs[-1]

    yield start
    for run in runs:
        run.kill_group()


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Two levels down: the script creates the artifact's parent folder on a fresh volume.
    return tmp_path_factory.mktemp("volume") / "artifacts" / "lite0"


@pytest.fixture(scope="module")
def first_start(artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The container's first start: compile into the empty volume, then serve. Shared by the tests below,
    which leave it running (the SIGTERM test stops a server of its own)."""
    run = entrypoint(
        ["--max-queue", "7"],  # flags go to vision-serve
        tmp_path_factory.mktemp("first") / "entrypoint.log",
        VISION_SERVE_ARTIFACT=str(artifact),
        VISION_SERVE_COMPILE_ARGS=LITE0_COMPILE_ARGS,
        VISION_SERVE_LOG_FORMAT="json",  # as the images set it
    )
    try:
        run.wait_ready(READY_TIMEOUT_S)
        yield run
    finally:
        run.kill_group()


def test_first_start_compiles_the_artifact_then_serves_it(
    first_start: ServerProcess, artifact: Path, chelsea_jpeg: bytes
) -> None:
    manifest = manifest_of(artifact)
    assert (manifest["model"], manifest["backend"], manifest["device_type"]) == ("efficientnet-lite0", "eager", "cpu")
    assert "compiled in" in first_start.log_text()
    # exec: the server is the very process the script started as (so SIGTERM reaches it), no bash left.
    command = " ".join(psutil.Process(first_start.process.pid).cmdline())
    assert "vision-serve" in command and "entrypoint" not in command, command
    with VisionClient(first_start.url, timeout=30.0) as client:
        assert client.classify(chelsea_jpeg).top1.label in CAT_LABELS
    info = httpx.get(f"{first_start.url}/info", timeout=10).json()
    assert artifact.name in json.dumps(info), "the server serves VISION_SERVE_ARTIFACT"
    # The script's own arguments reached vision-serve.
    scrape = httpx.get(f"{first_start.url}/metrics", timeout=10).text
    assert re.search(r"^vision_serve_requests_in_flight_limit 7(\.0)?$", scrape, re.M), scrape


def test_json_log_format_makes_the_whole_start_one_json_stream(first_start: ServerProcess) -> None:
    """The script's lines, compile-trt's (progress, gate report) and the server's: one JSON object each."""
    lines = [line for line in first_start.log_text().splitlines() if line.strip()]
    entries = []
    for line in lines:
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"not a JSON line in a json-format start: {line!r}")
    loggers = {entry["logger"] for entry in entries}
    assert {"entrypoint", "compile.cli", "compile.progress"} <= loggers, loggers
    assert any(name.startswith("service.") for name in loggers), loggers
    assert all({"time", "level", "message"} <= entry.keys() for entry in entries)
    assert any("accuracy gate passed" in entry["message"] for entry in entries)


def test_dashboard_and_alert_metrics_are_in_a_real_scrape(first_start: ServerProcess, chelsea_jpeg: bytes) -> None:
    with VisionClient(first_start.url, timeout=30.0) as client:
        client.classify(chelsea_jpeg)  # so that every labelled series has a sample
    scrape = httpx.get(f"{first_start.url}/metrics", timeout=10).text
    scraped = set(re.findall(r"^(vision_serve_\w+)", scrape, re.M))
    used = {name for _, e in dashboard_queries() for name in metric_names_in(e)}
    used |= {name for rule in alert_rules() for name in metric_names_in(rule["expr"])}
    gpu_only = {name for name in used if "_gpu_" in name}  # exported only where a GPU exists
    assert not used - gpu_only - scraped, f"queried but not in the scrape: {sorted(used - gpu_only - scraped)}"


def test_healthchecks_pass_against_the_live_server(first_start: ServerProcess) -> None:
    assert run_healthcheck(dockerfile_healthcheck(), first_start.port) == 0
    compose_probe = [part.replace(":8000/", f":{first_start.port}/") for part in compose_healthcheck()]
    assert run_healthcheck(compose_probe, first_start.port) == 0
    # Docker reads exit code 1 as unhealthy (2 is reserved): nothing listening must give exactly 1.
    assert run_healthcheck(dockerfile_healthcheck(), free_port()) == 1


@pytest.mark.slow  # a second start, 20 s (the stop tests of test_e2e.py check SIGTERM in make test)
def test_second_start_is_a_cache_hit_and_sigterm_leaves_no_process(
    first_start: ServerProcess, artifact: Path, launch: Callable[..., ServerProcess]
) -> None:
    before = manifest_of(artifact)
    engine_mtime = (artifact / before["engine_file"]).stat().st_mtime_ns
    run = launch([], VISION_SERVE_ARTIFACT=str(artifact), VISION_SERVE_COMPILE_ARGS=LITE0_COMPILE_ARGS)
    run.wait_ready(READY_TIMEOUT_S)
    started = time.monotonic()
    assert run.stop() == 0, run.log_text()[-3000:]
    assert time.monotonic() - started < STOP_TIMEOUT_S
    assert not alive_in_session(run), [command_line(p) for p in alive_in_session(run)]
    assert "up to date (cache hit)" in run.log_text()
    assert manifest_of(artifact)["compiled_at"] == before["compiled_at"]
    assert (artifact / before["engine_file"]).stat().st_mtime_ns == engine_mtime


def test_other_commands_run_in_place_of_the_script(tmp_path: Path, launch: Callable[..., ServerProcess]) -> None:
    artifact = tmp_path / "artifacts" / "never"
    run = launch(["compile-trt", "--help"], VISION_SERVE_ARTIFACT=str(artifact))
    assert run.wait() == 0
    assert "usage: compile-trt" in run.log_text()
    assert not artifact.parent.exists(), "no compile for a command other than the server"
    # exec, not a child: the command has the script's process id.
    run = launch(["python", "-c", "import os; print(os.getpid())"])
    assert run.wait() == 0
    assert run.log_text().strip() == str(run.process.pid)


@pytest.mark.parametrize(
    ("compile_args", "code", "message"),
    [
        ("--model no-such-model --backend eager --device cpu", 2, "compile-trt rejected its arguments"),
        pytest.param(
            LITE0_COMPILE_ARGS + " --precision bf16 --gate-max-rel-error 0",
            3,
            "the accuracy gate failed",
            marks=pytest.mark.slow,  # a bf16 AOTInductor compile
        ),
        ("--model efficientnet-lite0 --backend tensorrt --device cpu", 4, "compile backend is not available"),
    ],
    ids=["bad-arguments", "gate-failed", "backend-unavailable"],
)
def test_compile_failure_exits_with_compile_trts_code_and_does_not_serve(
    tmp_path: Path, launch: Callable[..., ServerProcess], compile_args: str, code: int, message: str
) -> None:
    artifact = tmp_path / "artifacts" / "lite0"
    run = launch([], VISION_SERVE_ARTIFACT=str(artifact), VISION_SERVE_COMPILE_ARGS=compile_args)
    assert run.wait() == code, run.log_text()[-3000:]
    log = run.log_text()
    assert message in log and "not starting vision-serve" in log, log[-3000:]
    assert not artifact.exists()


def test_compile_step_can_be_turned_off(tmp_path: Path, launch: Callable[..., ServerProcess]) -> None:
    # No compile: vision-serve itself is told to serve a folder that does not exist, and says so.
    artifact = tmp_path / "artifacts" / "prebuilt"
    run = launch(
        [],
        VISION_SERVE_ARTIFACT=str(artifact),
        VISION_SERVE_COMPILE="0",
        VISION_SERVE_COMPILE_ARGS=LITE0_COMPILE_ARGS,
    )
    assert run.wait() != 0
    log = run.log_text()
    assert "entrypoint: compile-trt" not in log and "manifest.json not found" in log, log[-3000:]
    assert not artifact.parent.exists()


def test_unwritable_volume_fails_with_a_plain_message(tmp_path: Path, launch: Callable[..., ServerProcess]) -> None:
    # A file where the volume's folder should be: like a root-owned bind mount, the folder cannot be made.
    (tmp_path / "volume").write_text("not a folder")
    run = launch([], VISION_SERVE_ARTIFACT=str(tmp_path / "volume" / "artifacts" / "x"))
    assert run.wait() == 1
    assert "cannot create or write" in run.log_text()


def test_sigterm_during_the_compile_stops_it_at_once(tmp_path: Path, launch: Callable[..., ServerProcess]) -> None:
    artifact = tmp_path / "artifacts" / "lite0"
    run = launch([], VISION_SERVE_ARTIFACT=str(artifact), VISION_SERVE_COMPILE_ARGS=LITE0_COMPILE_ARGS)
    deadline = time.monotonic() + 30
    while not any("compile-trt" in command_line(p) for p in psutil.Process(run.process.pid).children()):
        assert time.monotonic() < deadline and run.process.poll() is None, run.log_text()
        time.sleep(0.05)
    time.sleep(0.5)  # inside compile-trt's imports
    started = time.monotonic()
    run.process.send_signal(signal.SIGTERM)
    assert run.wait(15) == 128 + signal.SIGTERM
    assert time.monotonic() - started < 10
    assert "interrupted" in run.log_text()
    assert not alive_in_session(run), "compile-trt outlived the script"
    assert not artifact.exists()
