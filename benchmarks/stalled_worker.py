"""A stalled worker and clients with tiny deadlines: what the HTTP process buffers, for one or more
source trees of the server (issue 60).

    python -m benchmarks.stalled_worker --trees before=/tmp/base,after=.     # 10 s stall, 32 clients
    python -m benchmarks.stalled_worker --trees after=. --seconds 3           # smoke

Each ``--trees`` entry is a checkout of vision-serve (``git worktree add /tmp/base <commit>``), run
with that tree first on PYTHONPATH (benchmarks.impatient_clients.tree_env). For each tree in turn
(the order alternates from round to round) a fresh server with the no-op model
(benchmarks/frontend_server.py) and a small ``--max-queue`` answers one request, then its inference
worker is stopped (SIGSTOP: what a long batch or a hung engine looks like to the HTTP process) while
``--clients`` connections (``wrk``) post one photo after another with ``X-Request-Timeout-Ms: --deadline-ms``,
for ``--seconds``. Then the worker is resumed (SIGCONT) and left to drop what it was sent.

Recorded per run: the answers by status; the HTTP process's RSS before the stall, its peak during
it (sampled every 0.25 s), at its end, and after the worker has drained; and the images that reached
the worker: those it found past their deadline once resumed (``vision_serve_requests_expired_total``
after the resume, when no client is left). ``--max-queue`` should bound that count, and the growth.

Results: ``stalled-worker.json`` and ``stalled-worker.md`` in the results folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from benchmarks.harness.common import machine_record, results_dir, write_results
from benchmarks.impatient_clients import tree_env
from benchmarks.soak import rss_mb, server_processes
from service.client.launcher import ServerProcess
from service.tune.images import IMAGENET_SIZE, photo_jpegs

logger = logging.getLogger(__name__)

NOOP_SERVER = [sys.executable, "-m", "benchmarks.frontend_server"]
MODEL = "efficientnet-lite0"  # loaded for its labels; the no-op model runs
SAMPLE_EVERY_S = 0.25
SETTLE_S = 2.0  # after the resume, with the count of dropped images still: the worker has drained
DRAIN_TIMEOUT_S = 120.0


@dataclass
class Run:
    tree: str
    round: int
    seconds: float
    statuses: Counter = field(default_factory=Counter)
    rss_before_mb: float = 0.0
    rss_peak_mb: float = 0.0
    rss_end_of_stall_mb: float = 0.0
    rss_after_mb: float = 0.0
    reached_worker: float = 0.0  # images the worker dropped past their deadline after the resume
    in_flight_at_end_of_stall: int = 0

    @property
    def growth_mb(self) -> float:
        return self.rss_peak_mb - self.rss_before_mb


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


# wrk's Lua: the photo from a file, the deadline header, the answers counted by status per thread and
# summed at the end (one JSON line).
WRK_SCRIPT = r"""
local f = assert(io.open(os.getenv("STALLED_BODY"), "rb")); wrk.body = f:read("*a"); f:close()
wrk.method = "POST"
wrk.headers["Content-Type"] = "image/jpeg"
wrk.headers["X-Request-Timeout-Ms"] = os.getenv("STALLED_DEADLINE_MS")
local threads = {}
setup = function(thread) table.insert(threads, thread) end
init = function(args) c503 = 0; c504 = 0; other = 0 end
response = function(status, headers, body)
  if status == 503 then c503 = c503 + 1 elseif status == 504 then c504 = c504 + 1 else other = other + 1 end
end
done = function(summary, latency, requests)
  local a, b, o = 0, 0, 0
  for _, t in ipairs(threads) do a = a + t:get("c503"); b = b + t:get("c504"); o = o + t:get("other") end
  io.write(string.format('WRK_RESULT {"503": %d, "504": %d, "other": %d, "socket_errors": %d}\n', a, b, o,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout))
end
"""


def flood(url: str, photo: bytes, clients: int, seconds: float, deadline_ms: int, work: Path) -> Counter:
    """``clients`` connections (wrk) posting ``photo`` one after another for ``seconds``: the answers by status."""
    body, script = work / "photo.jpg", work / "stalled.lua"
    body.write_bytes(photo)
    script.write_text(WRK_SCRIPT)
    command = ["wrk", "-t", "2", "-c", str(clients), "-d", f"{seconds:g}s", "--timeout", "30s", "-s", str(script)]
    env = {**os.environ, "STALLED_BODY": str(body), "STALLED_DEADLINE_MS": str(deadline_ms)}
    output = subprocess.run([*command, f"{url}/predict"], capture_output=True, text=True, env=env, check=True).stdout
    match = re.search(r"^WRK_RESULT (\{.*\})$", output, re.M)
    if match is None:
        raise RuntimeError(f"wrk printed no result line:\n{output[-2000:]}")
    counts = json.loads(match[1])
    return Counter({int(k) if k.isdigit() else k: v for k, v in counts.items() if v})


def one_run(tree_name: str, tree: Path, round_: int, args: argparse.Namespace, photo: bytes, work: Path) -> Run:
    server_args = ["--model", MODEL, "--api-servers", "1", "--max-queue", str(args.max_queue)]
    server_args += ["--max-batch-size", str(args.max_batch)]
    log = work / f"{tree_name}-{round_}.log"
    run = Run(tree_name, round_, args.seconds)
    # The hang watch (service/supervisor/pool/hangs.py) would take a worker stopped this long out of
    # service at 5 s and restart it: what is measured here is what piles up while a worker does not
    # read, so it is off (trees without it ignore the variable).
    env = {**tree_env(tree), "VISION_SERVE_WORKER_HEARTBEAT_TIMEOUT_S": "0"}
    with ServerProcess(server_args, log_path=log, env=env, command=NOOP_SERVER) as server:
        url = server.url
        httpx.post(f"{url}/predict", content=photo, headers={"Content-Type": "image/jpeg"}, timeout=60)
        processes = server_processes(server.process.pid)
        (http_pid,) = [pid for pid, (role, _) in processes.items() if role == "http"]
        # Every spawned child (the planning child may not have exited yet): stopping it too costs nothing.
        worker_pids = [pid for pid, (role, _) in processes.items() if role == "worker"]
        http = {http_pid: processes[http_pid]}
        time.sleep(1.0)
        run.rss_before_mb = rss_mb(http)[http_pid]
        peak = [run.rss_before_mb]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(SAMPLE_EVERY_S):
                peak.append(rss_mb(http).get(http_pid, 0.0))

        sampler = threading.Thread(target=sample, daemon=True)
        for pid in worker_pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            sampler.start()
            run.statuses = flood(url, photo, args.clients, args.seconds, args.deadline_ms, work)
            run.rss_end_of_stall_mb = rss_mb(http)[http_pid]
            run.in_flight_at_end_of_stall = int(metric(url, "vision_serve_requests_in_flight"))
            expired_before = metric(url, "vision_serve_requests_expired_total")
        finally:
            for pid in worker_pids:
                os.kill(pid, signal.SIGCONT)
        last, still_since, started = expired_before, time.monotonic(), time.monotonic()
        while time.monotonic() - still_since < SETTLE_S and time.monotonic() - started < DRAIN_TIMEOUT_S:
            time.sleep(0.2)
            now = metric(url, "vision_serve_requests_expired_total")
            if now != last:
                last, still_since = now, time.monotonic()
        run.reached_worker = last - expired_before
        stop.set()
        sampler.join()
        run.rss_peak_mb = max(peak)
        run.rss_after_mb = rss_mb(http)[http_pid]
    logger.info(
        "%s round %d: %s; HTTP RSS %.0f -> peak %.0f (after %.0f) MiB; %d images reached the worker",
        tree_name, round_, dict(run.statuses), run.rss_before_mb, run.rss_peak_mb, run.rss_after_mb,
        run.reached_worker,
    )  # fmt: skip
    return run


def report(runs: Sequence[Run], args: argparse.Namespace) -> str:
    md = [
        "# A stalled worker and 5 ms deadlines: what the HTTP process buffers",
        "",
        f"`python -m benchmarks.stalled_worker {' '.join(sys.argv[1:])}`: no-op model, `--api-servers 1`, "
        f"`--max-queue {args.max_queue}`, `--max-batch-size {args.max_batch}`; the worker stopped (SIGSTOP) for "
        f"{args.seconds:g} s while {args.clients} connections post with `X-Request-Timeout-Ms: {args.deadline_ms}`, "
        "then resumed. RSS of the HTTP process in MiB; *reached worker*: images it dropped past their deadline "
        "once resumed.",
        "",
        "| tree | round | 503 | 504 | other | RSS before | peak | end of stall | after drain | growth (peak) "
        "| reached worker | in flight at end |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        other = sum(n for status, n in run.statuses.items() if status not in (503, 504))
        md.append(
            f"| {run.tree} | {run.round} | {run.statuses.get(503, 0):,} | {run.statuses.get(504, 0):,} | {other:,} "
            f"| {run.rss_before_mb:.0f} | {run.rss_peak_mb:.0f} | {run.rss_end_of_stall_mb:.0f} "
            f"| {run.rss_after_mb:.0f} | {run.growth_mb:.0f} | {run.reached_worker:,.0f} "
            f"| {run.in_flight_at_end_of_stall} |"
        )
    md += ["", "Medians:", ""]
    for tree in dict.fromkeys(run.tree for run in runs):
        mine = [run for run in runs if run.tree == tree]
        md.append(
            f"- {tree}: growth {statistics.median(r.growth_mb for r in mine):.0f} MiB, "
            f"{statistics.median(r.reached_worker for r in mine):,.0f} images reached the worker"
        )
    return "\n".join(md) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stalled_worker", description=__doc__.split("\n")[0])
    parser.add_argument("--trees", default="after=.", help="name=path,... (default: after=.)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=10.0, help="how long the worker is stopped")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--deadline-ms", type=int, default=5)
    parser.add_argument("--max-queue", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    trees = [(name, Path(path).resolve()) for name, path in (item.split("=", 1) for item in args.trees.split(","))]
    directory = results_dir(args.out)
    work = Path(tempfile.mkdtemp(prefix="stalled-worker-"))  # the servers' logs, wrk's script
    logger.info("Server logs in %s", work)
    photo = photo_jpegs(*IMAGENET_SIZE)[0]
    runs = []
    for round_ in range(1, args.rounds + 1):
        order = trees if round_ % 2 else trees[::-1]
        runs += [one_run(name, tree, round_, args, photo, work) for name, tree in order]
    records = [{**asdict(run), "statuses": {str(k): v for k, v in run.statuses.items()}} for run in runs]
    record = {"machine": machine_record(), "args": {**vars(args), "out": None}, "runs": records}
    text = report(runs, args)
    write_results(directory, "stalled-worker", record, text, text_suffix=".md")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
