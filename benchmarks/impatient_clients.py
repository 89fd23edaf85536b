"""Goodput under overload with impatient clients: answers a waiting client received per second, and
the images the server decoded and ran for nobody, for one or more source trees of the server.

    python -m benchmarks.impatient_clients --trees before=/tmp/base,after=.      # 2 rounds, 30 s each
    python -m benchmarks.impatient_clients --trees after=. --rounds 1 --seconds 10 # smoke
    python -m benchmarks.impatient_clients --trees ignores=/tmp/base,honours=. --deadline-header

Each ``--trees`` entry is a checkout of vision-serve (``git worktree add /tmp/base <commit>``); its
server runs with that tree first on PYTHONPATH, on the same machine, model and flags as the others.
First the capacity is measured once (closed loop, twice the max batch in flight, on the last tree's
server); then, in each round and for each tree in turn (the order alternates from round to round),
a fresh server gets an open-loop Poisson stream of clients at ``--overload`` times that capacity.
Each client posts one photo and waits at most ``--client-timeout-s`` (then it closes its connection,
as an HTTP client's timeout does) and tries again at once, at most ``--attempts`` times in all; after a
503 it waits the Retry-After the server gave (1 s), as a polite client does. Goodput counts the
clients answered 200 in time.

With ``--deadline-header`` each attempt also says how long the client waits (``X-Request-Timeout-Ms``,
its timeout), and the client, trusting the server to answer by then, gives up only
``DEADLINE_GRACE_S`` later: a server that honours the header answers 504 at the deadline and drops the
image unrun; one that does not keeps it until the client leaves. A 200 after the deadline is late,
not goodput; after a 504 the client tries again at once.

After the stream stops, the server is left to finish what it holds; ``vision_serve_images_total``
then says how many images it ran, and those beyond the answers clients received were run for nobody.

Results: ``impatient-clients.json`` and ``impatient-clients.md`` in the results folder.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.harness.common import machine_record, results_dir, write_results
from service.client.launcher import ServerProcess
from service.tune.images import IMAGENET_SIZE, photo_jpegs
from service.tune.loadgen import LoadSpec, run_load

logger = logging.getLogger(__name__)

MODEL = "efficientnet-lite0"
# A batch of 8 takes a fraction of the 1 s client timeout on 2 cores (one of 32 takes about all of it).
MAX_BATCH = 8
DRAIN_TIMEOUT_S = 120.0
# How long after its deadline a client that sent one still waits for the server's answer (its 504).
DEADLINE_GRACE_S = 0.25


@dataclass
class Outcome:
    tree: str
    round: int
    seconds: float
    offered_clients_per_s: float
    clients: int = 0
    answered: int = 0  # clients that got a 200 within their timeout, on some attempt
    attempts: Counter = field(default_factory=Counter)  # by outcome: 200, timeout, 503, ...
    answered_latency_ms: list[float] = field(default_factory=list)  # of the attempt that was answered
    images_run: float = 0.0  # vision_serve_images_total during the run and the drain
    drain_s: float = 0.0
    server_counts: dict[str, float] = field(default_factory=dict)

    @property
    def goodput(self) -> float:
        return self.answered / self.seconds

    @property
    def run_for_nobody(self) -> float:
        return max(0.0, self.images_run - self.answered)

    def row(self) -> dict:
        record = asdict(self)
        record["attempts"] = dict(self.attempts)
        record.pop("answered_latency_ms")
        record["answered_p50_ms"] = statistics.median(self.answered_latency_ms) if self.answered_latency_ms else None
        record["goodput"] = self.goodput
        record["run_for_nobody"] = self.run_for_nobody
        return record


class ImpatientClients:
    """An open-loop stream of clients, each trying ``attempts`` times with a timeout per attempt.

    Each attempt is a new connection written and read with asyncio's streams: a general HTTP client
    costs about a core at these rates, taken from the server it measures on a small machine."""

    def __init__(self, port: int, photos: Sequence[bytes], args: argparse.Namespace, outcome: Outcome) -> None:
        self.port, self.args, self.outcome = port, args, outcome
        deadline = f"x-request-timeout-ms: {round(args.client_timeout_s * 1e3)}\r\n" if args.deadline_header else ""
        self.wait_s = args.client_timeout_s + (DEADLINE_GRACE_S if args.deadline_header else 0.0)
        self.requests = [
            b"POST /predict HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: image/jpeg\r\n"
            + f"content-length: {len(photo)}\r\n{deadline}connection: close\r\n\r\n".encode()
            + photo
            for photo in photos
        ]

    async def run(self, seed: int) -> None:
        rng = random.Random(seed)
        tasks = []
        started = time.perf_counter()
        due = 0.0
        while due < self.args.seconds:
            delay = started + due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.client(self.requests[len(tasks) % len(self.requests)])))
            due += rng.expovariate(self.outcome.offered_clients_per_s)
        self.outcome.clients = len(tasks)
        await asyncio.gather(*tasks)

    async def client(self, request: bytes) -> None:
        for _ in range(self.args.attempts):
            sent = time.perf_counter()
            try:
                status, retry_after = await asyncio.wait_for(self.post(request), self.wait_s)
            except TimeoutError:
                self.outcome.attempts["timeout"] += 1  # post's finally closed the connection: the client left
                continue
            except OSError as exc:
                self.outcome.attempts[type(exc).__name__] += 1
                continue
            waited = time.perf_counter() - sent
            if status == 200 and waited > self.args.client_timeout_s:
                self.outcome.attempts["200 late"] += 1  # past the deadline it sent: of no use to it
                continue
            self.outcome.attempts[str(status)] += 1
            if status == 200:
                self.outcome.answered += 1
                self.outcome.answered_latency_ms.append(waited * 1e3)
                return
            if status == 503:  # shed: wait as the server says (Retry-After), as clients do
                await asyncio.sleep(retry_after)

    async def post(self, request: bytes) -> tuple[int, float]:
        """The status of one POST on a new connection, and its Retry-After (1 s if none)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
            await reader.readexactly(int(headers.get("content-length", 0)))
            return int(lines[0].split()[1]), float(headers.get("retry-after", 1))
        finally:
            writer.transport.abort()


def counters(url: str) -> dict[str, float]:
    """The server's counters this benchmark reads, summed over their labels (code kept apart)."""
    wanted = (
        "vision_serve_images_total",
        "vision_serve_requests_abandoned_total",
        "vision_serve_requests_expired_total",
        "vision_serve_images_unclaimed_total",
    )
    values: dict[str, float] = Counter()
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name in wanted:
                values[sample.name] += sample.value
            elif sample.name == "vision_serve_requests_total":
                values[f"requests_{sample.labels['code']}"] += sample.value
    return dict(values)


def drained(url: str, images_before: float) -> tuple[float, float]:
    """Wait until the server has answered all it holds (images_total steady, nothing in flight)."""
    started = last_change = time.monotonic()
    last = images_before
    while time.monotonic() - started < DRAIN_TIMEOUT_S:
        time.sleep(1.0)
        images = counters(url).get("vision_serve_images_total", 0.0)
        if images != last:
            last, last_change = images, time.monotonic()
        elif time.monotonic() - last_change >= 3.0:
            break
    return last, time.monotonic() - started


def server_args(extra: Sequence[str] = ()) -> list[str]:
    return ["--model", MODEL, "--max-batch-size", str(MAX_BATCH), *extra]


def tree_env(tree: Path) -> dict[str, str]:
    """The environment that makes ``python -m service.cli`` import ``tree``'s code: first on the path,
    and no current directory put before it (PYTHONSAFEPATH); checked, since a wrong tree compares nothing."""
    env = {
        "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "PYTHONSAFEPATH": "1",
    }
    found = subprocess.run(
        [sys.executable, "-c", "import service; print(service.__file__)"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(found).resolve().is_relative_to(tree):
        raise SystemExit(f"With PYTHONPATH={tree}, service is imported from {found}: not that tree.")
    return env


def measure_capacity(tree: Path, photos: Sequence[bytes], work: Path, seconds: float) -> float:
    with ServerProcess(server_args(), log_path=work / "capacity.log", env=tree_env(tree)) as server:
        spec = LoadSpec(100_000, concurrency=2 * MAX_BATCH, max_seconds=seconds, warmup_requests=2 * MAX_BATCH)
        result = run_load(f"{server.url}/predict", photos, spec)
        return result.summary()["throughput_rps"]


def run_once(name: str, tree: Path, round_: int, rate: float, photos: Sequence[bytes], args, work: Path) -> Outcome:
    log = work / f"{name}-{round_}.log"
    with ServerProcess(server_args(args.server_args), log_path=log, env=tree_env(tree)) as server:
        run_load(f"{server.url}/predict", photos, LoadSpec(4, concurrency=2))  # warm
        before = counters(server.url)
        outcome = Outcome(name, round_, args.seconds, rate)
        asyncio.run(ImpatientClients(server.port, photos, args, outcome).run(seed=round_))
        images_after, outcome.drain_s = drained(server.url, before.get("vision_serve_images_total", 0.0))
        after = counters(server.url)
        outcome.images_run = images_after - before.get("vision_serve_images_total", 0.0)
        outcome.server_counts = {key: after[key] - before.get(key, 0.0) for key in after}
    logger.info(
        "%s round %d: goodput %.1f/s, answered %d of %d clients, images run %d (for nobody %d), attempts %s",
        name, round_, outcome.goodput, outcome.answered, outcome.clients, outcome.images_run,
        outcome.run_for_nobody, dict(outcome.attempts),
    )  # fmt: skip
    return outcome


def format_table(outcomes: list[Outcome], capacity: float, names: list[str]) -> str:
    lines = [
        "| tree | runs | goodput img/s (median) | of capacity | clients answered | images run | run for nobody "
        "| dropped unrun | answered p50 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    goodputs = {}
    for name in names:
        mine = [o for o in outcomes if o.tree == name]
        goodput = statistics.median(o.goodput for o in mine)
        goodputs[name] = goodput
        answered = statistics.median(o.answered / o.clients for o in mine if o.clients)
        run = statistics.median(o.images_run for o in mine)
        nobody = statistics.median(o.run_for_nobody for o in mine)
        dropped = statistics.median(
            o.server_counts.get("vision_serve_requests_abandoned_total", 0.0)
            + o.server_counts.get("vision_serve_requests_expired_total", 0.0)
            for o in mine
        )
        latencies = [ms for o in mine for ms in o.answered_latency_ms]
        p50 = statistics.median(latencies) if latencies else float("nan")
        lines.append(
            f"| {name} | {len(mine)} | {goodput:.1f} | {goodput / capacity:.0%} | {answered:.0%} | {run:.0f} "
            f"| {nobody:.0f} | {dropped:.0f} | {p50:.0f} |"
        )
    if len(names) == 2 and goodputs[names[0]] > 0:
        lines.append(f"\n{names[1]} / {names[0]} goodput: {goodputs[names[1]] / goodputs[names[0]]:.2f}x")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", default="current=.", help="NAME=PATH,... checkouts of vision-serve to compare")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=30.0, help="how long clients keep arriving")
    parser.add_argument("--overload", type=float, default=2.0, help="client arrivals per second / capacity")
    parser.add_argument("--client-timeout-s", type=float, default=1.0)
    parser.add_argument("--attempts", type=int, default=3, help="tries per client, the first included")
    parser.add_argument(
        "--deadline-header",
        action="store_true",
        help="clients send X-Request-Timeout-Ms (their timeout) and wait for the server's answer a little longer",
    )
    parser.add_argument(
        "--server-args", default="", help='more flags for every server, e.g. "--max-queue 32 --request-timeout-s 0.8"'
    )
    parser.add_argument("--capacity-seconds", type=float, default=20.0)
    parser.add_argument("--capacity", type=float, default=0.0, help="img/s; 0: measure it first")
    parser.add_argument("--label", default="", help="suffix of the results' names (one per configuration)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: benchmarks/results/...)")
    args = parser.parse_args(argv)
    args.server_args = args.server_args.split()
    args.trees = [(name, Path(path).resolve()) for name, path in (item.split("=", 1) for item in args.trees.split(","))]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    photos = photo_jpegs(*IMAGENET_SIZE)
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="bench-impatient-") as directory:
        work = Path(directory)
        capacity = args.capacity or measure_capacity(args.trees[-1][1], photos, work, args.capacity_seconds)
        rate = args.overload * capacity
        logger.info("capacity %.1f img/s: clients arrive at %.1f/s", capacity, rate)
        for round_ in range(args.rounds):
            order = args.trees if round_ % 2 == 0 else list(reversed(args.trees))
            for name, tree in order:
                outcomes.append(run_once(name, tree, round_, rate, photos, args, work))
    names = [name for name, _ in args.trees]
    table = format_table(outcomes, capacity, names)
    print(table)
    command = "python -m benchmarks.impatient_clients " + " ".join(sys.argv[1:] if argv is None else argv)
    text = (
        f"# Impatient clients ({MODEL}, max batch {MAX_BATCH} {' '.join(args.server_args)}; "
        f"capacity {capacity:.1f} img/s; clients at "
        f"{args.overload:g}x, timeout {args.client_timeout_s:g} s, {args.attempts} attempts"
        f"{', deadline sent in X-Request-Timeout-Ms' if args.deadline_header else ''})\n\n"
        f"`{command}`\n\n{table}\n"
    )
    record = {
        "machine": machine_record(),
        "capacity_img_per_s": capacity,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "trees"},
        "trees": {name: str(path) for name, path in args.trees},
        "runs": [o.row() for o in outcomes],
    }
    stem = f"impatient-clients-{args.label}" if args.label else "impatient-clients"
    write_results(results_dir(args.out), stem, record, text, ".md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
