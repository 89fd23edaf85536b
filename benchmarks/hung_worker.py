"""A worker that stops answering, with the server's defaults: how soon it is seen, what the requests it
held get, and how soon the server serves again (issue 60; service/supervisor/pool/hangs.py).

    python -m benchmarks.hung_worker                 # EfficientNet-Lite0, one worker, 3 rounds
    python -m benchmarks.hung_worker --rounds 1 --held 2

One server (``--workers-per-device 1``, so that /ready follows the one worker; every other setting its
default: --worker-heartbeat-timeout-s 5, --request-timeout-s 30). Each round answers one photo, then
stops the worker (SIGSTOP: what a frozen process or a native call that holds the GIL looks like),
sends ``--held`` photos to it at once, and times from the stop: /ready's first 503, each held
request's answer and status, and the restarted worker's first 200. Before the hang watch a stopped
worker went unnoticed: /ready stayed 200 and its requests waited out --request-timeout-s.

Results: ``hung-worker.json`` and ``hung-worker.md`` in the results folder.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

from benchmarks.harness.common import machine_record, results_dir, write_results
from benchmarks.soak import server_processes
from compile import sample_photo_file
from service.client.launcher import ServerProcess

logger = logging.getLogger(__name__)

MODEL = "efficientnet-lite0"
POLL_S = 0.05
GIVE_UP_S = 120.0
JPEG = {"Content-Type": "image/jpeg"}


def worker_pid(server: ServerProcess) -> int | None:
    """The one inference worker's pid; None while there is not exactly one alive (a killed one is a
    zombie until its parent reaps it)."""
    try:
        processes = server_processes(server.process.pid)
    except psutil.Error:
        return None
    workers = [pid for pid, (role, _) in processes.items() if role == "worker"]
    return workers[0] if len(workers) == 1 else None


def counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(value) for value in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def post(url: str, photo: bytes, stopped_at: float) -> tuple[int, float]:
    response = httpx.post(f"{url}/predict", content=photo, headers=JPEG, timeout=GIVE_UP_S)
    return response.status_code, time.monotonic() - stopped_at


def wait_for(condition, what: str) -> float:
    """Seconds until ``condition()``; ``GIVE_UP_S`` at most."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > GIVE_UP_S:
            raise TimeoutError(f"no {what} within {GIVE_UP_S:.0f} s")
        time.sleep(POLL_S)
    return time.monotonic() - started


def one_round(server: ServerProcess, photo: bytes, held: int) -> dict:
    url = server.url
    assert httpx.post(f"{url}/predict", content=photo, headers=JPEG, timeout=60).status_code == 200
    wait_for(lambda: worker_pid(server) is not None, "worker")
    old = worker_pid(server)
    hung_before = counter(url, "vision_serve_workers_hung_total")
    restarts_before = counter(url, "vision_serve_worker_restarts_total")
    os.kill(old, signal.SIGSTOP)
    stopped_at = time.monotonic()
    with ThreadPoolExecutor(held) as pool:
        answers = [pool.submit(post, url, photo, stopped_at) for _ in range(held)]
        not_ready_s = wait_for(lambda: httpx.get(f"{url}/ready", timeout=10).status_code == 503, "/ready 503")
        results = [answer.result() for answer in answers]

    def serving_again() -> bool:
        pid = worker_pid(server)
        return pid not in (None, old) and httpx.get(f"{url}/ready", timeout=10).status_code == 200

    wait_for(serving_again, "restarted worker")
    status, _ = post(url, photo, stopped_at)
    serving_s = time.monotonic() - stopped_at
    return {
        "ready_503_after_s": round(not_ready_s, 2),
        "held_answers": [{"status": code, "after_s": round(seconds, 2)} for code, seconds in results],
        "first_answer_after_restart": status,
        "serving_again_after_s": round(serving_s, 2),
        "hung_counted": counter(url, "vision_serve_workers_hung_total") - hung_before,
        "restarts_counted": counter(url, "vision_serve_worker_restarts_total") - restarts_before,
    }


def summarize(rounds: list[dict], args: argparse.Namespace) -> str:
    held_s = [answer["after_s"] for entry in rounds for answer in entry["held_answers"]]
    statuses = sorted({answer["status"] for entry in rounds for answer in entry["held_answers"]})
    lines = [
        "# A stopped worker with the server's defaults",
        "",
        f"`python -m benchmarks.hung_worker --rounds {args.rounds} --held {args.held}`: {MODEL}, one worker, "
        "--worker-heartbeat-timeout-s 5 and --request-timeout-s 30 (the defaults); seconds from the SIGSTOP.",
        "",
        "| round | /ready 503 | held requests answered (status) | restarted worker's first 200 "
        "| hung / restarts counted |",
        "|---|---|---|---|---|",
    ]
    for number, entry in enumerate(rounds, 1):
        answered = ", ".join(f"{a['after_s']:.1f} ({a['status']})" for a in entry["held_answers"])
        lines.append(
            f"| {number} | {entry['ready_503_after_s']:.1f} | {answered} | {entry['serving_again_after_s']:.1f} "
            f"({entry['first_answer_after_restart']}) | {entry['hung_counted']:g} / {entry['restarts_counted']:g} |"
        )
    lines += [
        "",
        f"Median: /ready 503 after {statistics.median(e['ready_503_after_s'] for e in rounds):.1f} s; held requests "
        f"answered after {statistics.median(held_s):.1f} s (statuses {statuses}); serving again after "
        f"{statistics.median(e['serving_again_after_s'] for e in rounds):.1f} s.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--held", type=int, default=4, help="requests sent to the stopped worker")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    photo = sample_photo_file("chelsea")
    flags = ["--model", MODEL, "--workers-per-device", "1", "--api-servers", "1", "--log-level", "warning"]
    # The test suite's pin (tests/worker_hold.py) must not reach this server: the defaults are measured.
    environment = {k: v for k, v in os.environ.items() if k != "VISION_SERVE_WORKER_HEARTBEAT_TIMEOUT_S"}
    with (
        tempfile.TemporaryDirectory() as workdir,
        ServerProcess(flags, log_path=Path(workdir) / "server.log", base_env=environment) as server,
    ):
        rounds = []
        for number in range(1, args.rounds + 1):
            rounds.append(one_round(server, photo, args.held))
            logger.info("round %d: %s", number, rounds[-1])
    text = summarize(rounds, args)
    write_results(results_dir(args.out), "hung-worker", {"machine": machine_record(), "rounds": rounds}, text, ".md")
    print(text)
    failed = any(a["status"] != 503 for e in rounds for a in e["held_answers"]) or any(
        e["first_answer_after_restart"] != 200 for e in rounds
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
