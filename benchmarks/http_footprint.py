"""What an HTTP process of vision-serve costs: memory, start time, the libraries it carries, and
what the server prints when it stops.

    python -m benchmarks.http_footprint                    # EfficientNet-Lite0 on the CPU, 3 starts
    python -m benchmarks.http_footprint --repeats 5 --out /tmp/footprint

Per start of ``vision-serve --model efficientnet-lite0 --api-servers 2``: seconds from launch until
``/health`` answers (HTTP up) and until ``/ready`` (the worker loaded and warm); for each HTTP process
(the processes listening on the port) its RSS and USS (memory only it holds: forked processes share
the rest with the main process until they write to it) and whether it has torch and OpenAI Triton
mapped (``/proc/PID/maps``); the main process's RSS; and the lines printed after SIGTERM that are
not log records (library noise at exit). Also the wall time of ``import service.cli`` in a fresh
interpreter, the main process's import cost. Medians over ``--repeats``; results in
``http_footprint.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from benchmarks.harness.common import machine_record, results_dir, write_results
from service.client.launcher import ServerProcess

logger = logging.getLogger(__name__)

ARGS = ["--model", "efficientnet-lite0", "--device", "cpu", "--api-servers", "2", "--log-level", "warning"]
LIBRARIES = {"torch": "libtorch_cpu.so", "triton": "libtriton.so"}
IMPORT_REPEATS = 3


def wait_for(url: str, started: float, timeout: float = 300.0) -> float:
    while time.monotonic() - started < timeout:
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return time.monotonic() - started
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(url)


def mapped(pid: int) -> dict[str, bool]:
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return {name: False for name in LIBRARIES}
    return {name: library in maps for name, library in LIBRARIES.items()}


def http_processes(main: psutil.Process, port: int) -> list[psutil.Process]:
    """The children listening on ``port``, less the multiprocessing manager: forked after the socket
    was opened, it holds it too, but it serves its own Unix socket (``.../listener-...``)."""
    found = []
    for child in main.children(recursive=True):
        try:
            listens = any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in child.net_connections("tcp"))
            manager = any("listener-" in (c.laddr or "") for c in child.net_connections("unix"))
        except psutil.Error:
            continue
        if listens and not manager:
            found.append(child)
    return found


def one_start(workdir: Path, number: int) -> dict:
    log = workdir / f"server-{number}.log"
    server = ServerProcess(ARGS, log_path=log)
    started = time.monotonic()
    server.launch()
    try:
        health_s = wait_for(f"{server.url}/health", started)
        ready_s = wait_for(f"{server.url}/ready", started)
        time.sleep(1.0)  # the HTTP processes settle (first scrape, caches)
        main = psutil.Process(server.process.pid)
        processes = []
        for process in http_processes(main, server.port):
            memory = process.memory_full_info()
            processes.append({"rss_mb": memory.rss / 2**20, "uss_mb": memory.uss / 2**20, **mapped(process.pid)})
        main_rss = main.memory_info().rss / 2**20
        before_stop = len(server.log_text().splitlines())
    finally:
        code = server.stop()
    after = server.log_text().splitlines()[before_stop:]
    noise = [line for line in after if line.strip() and not line.startswith("20")]  # log records start with the date
    return {"health_s": health_s, "ready_s": ready_s, "http_processes": processes, "main_rss_mb": main_rss,
            "exit_code": code, "stop_noise_lines": len(noise), "stop_noise_sample": noise[:5]}  # fmt: skip


def import_seconds() -> float:
    times = []
    for _ in range(IMPORT_REPEATS):
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", "import service.cli"], check=True)
        times.append(time.monotonic() - started)
    return statistics.median(times)


def summarize(starts: list[dict], import_s: float) -> dict:
    http = [p for start in starts for p in start["http_processes"]]
    return {
        "starts": len(starts),
        "health_s": statistics.median(s["health_s"] for s in starts),
        "ready_s": statistics.median(s["ready_s"] for s in starts),
        "http_rss_mb": statistics.median(p["rss_mb"] for p in http),
        "http_uss_mb": statistics.median(p["uss_mb"] for p in http),
        "http_with_torch": sum(p["torch"] for p in http),
        "http_with_triton": sum(p["triton"] for p in http),
        "http_processes": len(http),
        "main_rss_mb": statistics.median(s["main_rss_mb"] for s in starts),
        "stop_noise_lines": max(s["stop_noise_lines"] for s in starts),
        "import_service_cli_s": import_s,
    }


def report(summary: dict, label: str) -> str:
    s = summary
    return (
        f"# HTTP process footprint: {label}\n\n"
        f"`vision-serve {' '.join(ARGS)}`, median of {s['starts']} starts.\n\n"
        "| measure | value |\n|---|---|\n"
        f"| launch to /health | {s['health_s']:.2f} s |\n"
        f"| launch to /ready | {s['ready_s']:.2f} s |\n"
        f"| HTTP process RSS | {s['http_rss_mb']:.0f} MB |\n"
        f"| HTTP process USS (its own) | {s['http_uss_mb']:.0f} MB |\n"
        f"| HTTP processes with torch / OpenAI Triton mapped | {s['http_with_torch']} / {s['http_with_triton']} "
        f"of {s['http_processes']} |\n"
        f"| main process RSS | {s['main_rss_mb']:.0f} MB |\n"
        f"| lines printed at stop that are not log records | {s['stop_noise_lines']} |\n"
        f"| `import service.cli` in a fresh interpreter | {s['import_service_cli_s']:.2f} s |\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--label", default="", help="a name for this run in the report (e.g. a commit)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="footprint-") as tmp:
        starts = [one_start(Path(tmp), n) for n in range(args.repeats)]
    summary = summarize(starts, import_seconds())
    record = {"machine": machine_record(), "label": args.label, "summary": summary, "starts": starts}
    out = results_dir(args.out)
    stem = f"http_footprint-{args.label}" if args.label else "http_footprint"
    write_results(out, stem, record, report(summary, args.label or "this checkout"), text_suffix=".md")
    print(report(summary, args.label or "this checkout"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
