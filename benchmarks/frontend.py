"""Front-end benchmark: how many requests per second the path from socket to worker and back carries.

    python -m benchmarks.frontend                          # every target, 1/64/256 connections, 10 s each
    python -m benchmarks.frontend --targets vision-serve-1,triton --connections 64 --duration 5

The model and the decoder are no-ops (benchmarks.frontend_server), so what is left is the front end
a GPU would wait on. In the same run, the same load (``wrk``, a C load generator that costs little
CPU, each request the same ~60 kB JPEG) goes to:

- ``bare-N``: a raw ASGI endpoint on uvicorn with N processes that reads the body and returns fixed
  JSON (benchmarks.peers.noop_server): the Python bound, and the load generator's own ceiling;
- ``vision-serve-N``: the production server with ``--api-servers N``, no-op decoder and model;
- ``litserve``: plain LitServe with a no-op LitAPI, JSON base64 body (benchmarks.peers.litserve_noop);
- ``triton``: tritonserver through PyTriton, dynamic batcher, no-op Python model, KServe v2 binary
  request (benchmarks.peers.triton_noop, in its own Python 3.13 virtualenv: benchmarks.peers.triton_env).

Requires ``wrk`` (Debian package). Results: ``frontend.json``, ``frontend.md`` and
``frontend-throughput.png`` in the results folder.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from benchmarks.harness import plots
from benchmarks.harness.common import machine_record, results_dir, write_results
from service.client.launcher import free_port
from service.tune.images import IMAGENET_SIZE, photo_jpegs

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
CONNECTIONS = (1, 64, 256)
DURATION_S = 10.0
WARMUP_S = 2.0
STARTUP_TIMEOUT_S = 180.0
WRK_TIMEOUT_S = 30  # wrk counts slower answers as errors; the default 2 s would hide queueing
TARGETS = ("bare-1", "bare-2", "vision-serve-1", "vision-serve-2", "litserve", "triton")
MODEL = "efficientnet-lite0"  # loaded for its labels and warm-up; the no-op replaces it afterwards

# wrk's Lua: the body and headers come from files named in the environment; done() prints one JSON
# line that run_wrk parses (latency percentiles are in microseconds).
WRK_SCRIPT = r"""
local function slurp(path)
  local f = assert(io.open(path, "rb")); local data = f:read("*a"); f:close(); return data
end
wrk.method = "POST"
wrk.body = slurp(os.getenv("FRONTEND_BODY"))
for line in slurp(os.getenv("FRONTEND_HEADERS")):gmatch("[^\n]+") do
  local name, value = line:match("^([^:]+):%s*(.*)$")
  wrk.headers[name] = value
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_RESULT {"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, "non_2xx": %d, ' ..
    '"socket_errors": %d}\n', summary.requests, summary.duration, latency:percentile(50),
    latency:percentile(99), e.status, e.connect + e.read + e.write + e.timeout))
end
"""


@dataclass
class Request:
    path: str
    body: bytes
    headers: dict[str, str]


@dataclass
class Target:
    name: str
    port: int
    command: list[str]
    ready_path: str
    request: Request
    env: dict[str, str] = field(default_factory=dict)
    notes: str = ""


@dataclass
class Point:
    target: str
    connections: int
    requests: int
    seconds: float
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    non_2xx: int
    socket_errors: int


def image_request(image: bytes) -> Request:
    return Request("/predict", image, {"Content-Type": "image/jpeg"})


def litserve_request(image: bytes) -> Request:
    import base64

    body = json.dumps({"image": base64.b64encode(image).decode()}).encode()
    return Request("/predict", body, {"Content-Type": "application/json"})


def triton_request(image: bytes, model: str = "noop") -> Request:
    """KServe v2 binary tensor extension: a JSON header, then the image as a UINT8 [1, N] tensor."""
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "shape": [1, len(image)],
                    "datatype": "UINT8",
                    "parameters": {"binary_data_size": len(image)},
                }
            ],
            "outputs": [{"name": "scores", "parameters": {"binary_data": False}}],
        }
    ).encode()
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))}
    return Request(f"/v2/models/{model}/infer", header + image, headers)


def make_target(name: str, image: bytes, port: int, triton_python: Callable[[], Path]) -> Target:
    python = sys.executable
    if match := re.fullmatch(r"bare-(\d+)", name):
        command = [python, "-m", "benchmarks.peers.noop_server", "--port", str(port), "--workers", match[1]]
        return Target(
            name, port, command, "/", image_request(image), notes=f"raw ASGI, uvicorn, {match[1]} process(es)"
        )
    if match := re.fullmatch(r"vision-serve-(\d+)", name):
        command = [
            *(python, "-m", "benchmarks.frontend_server", "--model", MODEL, "--port", str(port)),
            *("--api-servers", match[1]),
            # The no-op stands in for a GPU, which the server gives one worker; on this CPU it would
            # give Lite0 a worker per core, and the second no-op worker would take the front end's cores.
            *("--workers-per-device", "1"),
        ]
        notes = (
            f"production path, --api-servers {match[1]}, one worker (as on a GPU), default settings otherwise "
            "(info log), no-op decode and model"
        )
        return Target(name, port, command, "/ready", image_request(image), notes=notes)
    if name == "litserve":
        command = [python, "-m", "benchmarks.peers.litserve_noop", "--port", str(port)]
        return Target(name, port, command, "/health", litserve_request(image), notes="LitServe defaults, JSON base64")
    if name == "triton":
        command = [
            *(str(triton_python()), str(REPO / "benchmarks" / "peers" / "triton_noop.py"), "--port", str(port)),
            *("--grpc-port", str(free_port()), "--metrics-port", str(free_port())),
        ]
        notes = "tritonserver via PyTriton 0.7, dynamic batcher (max 64), KServe v2 binary request"
        return Target(name, port, command, "/v2/models/noop/ready", triton_request(image), notes=notes)
    raise ValueError(f"unknown target {name!r}: use bare-N, vision-serve-N, litserve or triton")


@contextlib.contextmanager
def running(target: Target, url: str, log_path: Path) -> Iterator[None]:
    """The target's server as a child process group, ready to answer; stopped (and reaped) after."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            target.command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **target.env},
            cwd=REPO,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while not _answers(url + target.ready_path):
                if process.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{target.name} did not become ready; its log ends:\n{tail}")
                time.sleep(0.5)
            yield
        finally:
            _stop_group(process)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.TransportError:
        return False


def _stop_group(process: subprocess.Popen, timeout: float = 30.0) -> None:
    # SIGTERM to the main process only, as an orchestrator sends it: a server forks helpers (a
    # multiprocessing manager) that must outlive its HTTP processes while they finish.
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    # Children that outlived their parent (a tritonserver, a uvicorn worker) share its group.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def check_answer(url: str, request: Request) -> None:
    """One request before the load: a target that answers errors would measure nothing."""
    response = httpx.post(url + request.path, content=request.body, headers=request.headers, timeout=30.0)
    if response.status_code != 200:
        raise RuntimeError(f"{url}{request.path} answered {response.status_code}: {response.text[:500]}")


def run_wrk(url: str, request: Request, connections: int, duration_s: float, workdir: Path) -> dict:
    body, headers = workdir / "body", workdir / "headers"
    body.write_bytes(request.body)
    headers.write_text("".join(f"{k}: {v}\n" for k, v in request.headers.items()))
    script = workdir / "post.lua"
    script.write_text(WRK_SCRIPT)
    threads = min(2, connections)
    command = [
        *("wrk", "-t", str(threads), "-c", str(connections), "-d", f"{duration_s:g}s"),
        *("--timeout", f"{WRK_TIMEOUT_S}s", "-s", str(script), url + request.path),
    ]
    env = {**os.environ, "FRONTEND_BODY": str(body), "FRONTEND_HEADERS": str(headers)}
    output = subprocess.run(command, capture_output=True, text=True, env=env, check=True).stdout
    return parse_wrk(output)


def parse_wrk(output: str) -> dict:
    match = re.search(r"^WRK_RESULT (\{.*\})$", output, re.M)
    if match is None:
        raise RuntimeError(f"wrk printed no result line:\n{output[-2000:]}")
    return json.loads(match[1])


def to_point(target: str, connections: int, raw: dict) -> Point:
    seconds = raw["duration_us"] / 1e6
    return Point(
        target=target,
        connections=connections,
        requests=raw["requests"],
        seconds=round(seconds, 3),
        requests_per_s=round(raw["requests"] / seconds, 1),
        p50_ms=round(raw["p50_us"] / 1e3, 2),
        p99_ms=round(raw["p99_us"] / 1e3, 2),
        non_2xx=raw["non_2xx"],
        socket_errors=raw["socket_errors"],
    )


def measure_target(
    target: Target, connections: Sequence[int], duration_s: float, workdir: Path
) -> tuple[list[Point], dict]:
    url = f"http://127.0.0.1:{target.port}"
    points = []
    with running(target, url, workdir / f"{target.name}.log"):
        check_answer(url, target.request)
        run_wrk(url, target.request, max(connections), WARMUP_S, workdir)  # caches, pools, lazy imports
        for count in connections:
            point = to_point(target.name, count, run_wrk(url, target.request, count, duration_s, workdir))
            logger.info(
                "%-16s %4d conn: %8.1f req/s  p50 %7.2f ms  p99 %7.2f ms  errors %d",
                target.name,
                count,
                point.requests_per_s,
                point.p50_ms,
                point.p99_ms,
                point.non_2xx + point.socket_errors,
            )
            points.append(point)
    return points, {"command": " ".join(target.command[1:]), "notes": target.notes}


def render(points: list[Point], configs: dict[str, dict], duration_s: float) -> str:
    lines = [
        f"# Front end: no-op decoder and model, wrk, {duration_s:g} s per point, one run",
        "",
        "| target | connections | req/s | p50 ms | p99 ms | errors |",
        "|---|---|---|---|---|---|",
    ]
    for p in points:
        errors = p.non_2xx + p.socket_errors
        lines.append(
            f"| {p.target} | {p.connections} | {p.requests_per_s:,.0f} | {p.p50_ms:.2f} | {p.p99_ms:.2f} | {errors} |"
        )
    lines += ["", "| target | what ran |", "|---|---|"]
    lines += [f"| {name} | {config['notes']} |" for name, config in configs.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated (default: {','.join(TARGETS)})")
    parser.add_argument("--connections", default=",".join(map(str, CONNECTIONS)), help="comma-separated")
    parser.add_argument("--duration", type=float, default=DURATION_S, help="seconds per point")
    parser.add_argument("--triton-venv", type=Path, default=None, help="PyTriton virtualenv (made if missing)")
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per readiness probe otherwise
    if shutil.which("wrk") is None:
        parser.error("wrk is not installed: apt-get install wrk")
    connections = [int(c) for c in args.connections.split(",")]
    names = [t.strip() for t in args.targets.split(",") if t.strip()]

    def triton_python() -> Path:
        from benchmarks.peers.triton_env import ensure_venv

        return ensure_venv(args.triton_venv)

    width, height = IMAGENET_SIZE
    image = photo_jpegs(width, height, ("chelsea",))[0]
    points: list[Point] = []
    configs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="frontend-") as tmp:
        workdir = Path(tmp)
        for name in names:
            target = make_target(name, image, free_port(), triton_python)
            target_points, configs[name] = measure_target(target, connections, args.duration, workdir)
            points += target_points
    record = {
        "machine": machine_record(),
        "image_bytes": len(image),
        "duration_s": args.duration,
        "connections": connections,
        "load_generator": subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout.splitlines()[0],
        "targets": configs,
        "points": [asdict(p) for p in points],
    }
    directory = results_dir(args.out)
    write_results(directory, "frontend", record, render(points, configs, args.duration), ".md")
    series: dict[str, list[tuple[int, float]]] = {}
    for p in points:
        series.setdefault(p.target, []).append((p.connections, p.requests_per_s))
    plots.throughput_vs_concurrency(
        series, "No-op front ends on this machine (req/s = img/s)", directory / "frontend-throughput.png"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
