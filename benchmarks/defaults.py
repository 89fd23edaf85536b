"""Out of the box against the machine's bound: vision-serve with its defaults, other configurations,
and the same engine run with no server at all, alternating in one run.

    python -m benchmarks.defaults --artifact ART                  # a compile-trt artifact (Lite0 ONNX ...)
    python -m benchmarks.defaults --model resnet152 --weights random --connections 16 --duration 40
    python -m benchmarks.defaults --artifact ART --config "w1=--workers-per-device 1" \\
        --config "w2 b8=--workers-per-device 2 --max-batch-size 8"

Each round measures, in turn (the order alternates from round to round):

- every server configuration: ``defaults`` (the artifact or model and nothing else), ``one worker``
  (``--workers-per-device 1``: the layout vision-serve had before it chose one) and each ``--config``.
  Each is loaded by ``wrk`` (a C load generator that costs little CPU; the same photo in every request)
  at ``--connections``; its throughput is the server's own count of images answered over about
  ``--duration`` seconds, timed from one batch's answers to another's as the bound is
  (benchmarks/harness/answered.py; wrk's own count, short by up to a batch's time, is kept beside
  it). Then one connection, for the latency of a lone request;
- the bound: no server, no HTTP. ``P`` processes, each decoding the photo the servers get with Pillow
  on ``T`` threads and running the engine on ``T`` threads, a batch of ``--bound-batch`` at a time,
  for ``--duration`` seconds; every layout with ``P x T`` = the usable cores, the best one is the bound.

Prints and writes ``defaults-<label>.json`` and ``.md``: medians over the rounds, each configuration's
throughput as a share of the bound and of the best server configuration, and its one-connection p50
against ``one worker``'s.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import multiprocessing
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from benchmarks.frontend import image_request, run_wrk
from benchmarks.harness.answered import steady_rate
from benchmarks.harness.common import machine_record, results_dir, write_results
from benchmarks.harness.suite import markdown_table
from service.client.launcher import ServerProcess
from service.settings import without_setting_variables
from service.testing import usable_cores
from service.tune.images import IMAGENET_SIZE, photo_jpegs

logger = logging.getLogger(__name__)

DEFAULTS = "defaults"
ONE_WORKER = "one worker"
WARMUP_S = 5.0
SETTLE_S = 5.0  # seconds of load before the rate's clock starts
SERVER_FLAGS = ("--log-level", "warning", "--request-timeout-s", "120", "--max-queue", "4096")


@dataclass(frozen=True)
class ServerRun:
    label: str
    images_per_s: float  # the server's count, batch to batch (benchmarks/harness/answered.py)
    wrk_images_per_s: float  # wrk's count over its whole run, for comparison
    p50_ms: float
    p99_ms: float
    lone_p50_ms: float
    errors: int
    workers_per_device: int
    engine_threads: int


@dataclass(frozen=True)
class BoundRun:
    processes: int
    threads: int
    images_per_s: float


def source_args(args: argparse.Namespace) -> list[str]:
    if args.artifact:
        return ["--artifact", str(args.artifact)]
    return ["--model", args.model, "--weights", args.weights]


def measure_server(label: str, extra: Sequence[str], args: argparse.Namespace, work: Path) -> ServerRun:
    """One configuration: started with no VISION_SERVE_* settings inherited, loaded, stopped."""
    photo = photo_jpegs(*IMAGENET_SIZE)[0]
    request = image_request(photo)
    command = [*source_args(args), *SERVER_FLAGS, *extra]
    log = work / f"server-{label.replace(' ', '_')}.log"
    with ServerProcess(command, log_path=log, base_env=without_setting_variables(), with_parent=True) as server:
        info = httpx.get(f"{server.url}/info", timeout=10).json()["server"]
        run_wrk(server.url, request, args.connections, WARMUP_S, work)
        # The rate from the server's own count, from one batch's answers to another's, while wrk runs
        # on before and after (benchmarks/harness/answered.py: wrk's own count is short by a batch).
        load_s = SETTLE_S + args.duration + args.batch_slack_s
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            wrk = pool.submit(run_wrk, server.url, request, args.connections, load_s, work)
            time.sleep(SETTLE_S)
            steady = steady_rate(server.url, args.duration, timeout_s=args.batch_slack_s)
            loaded = wrk.result()
        time.sleep(args.batch_slack_s)  # the batches wrk left running end before the lone client starts
        lone = run_wrk(server.url, request, 1, args.lone_duration, work)
    seconds = loaded["duration_us"] / 1e6
    return ServerRun(
        label=label,
        images_per_s=round(steady.images_per_s, 2),
        wrk_images_per_s=round(loaded["requests"] / seconds, 2),
        p50_ms=round(loaded["p50_us"] / 1e3, 1),
        p99_ms=round(loaded["p99_us"] / 1e3, 1),
        lone_p50_ms=round(lone["p50_us"] / 1e3, 2),
        errors=loaded["non_2xx"] + loaded["socket_errors"] + lone["non_2xx"] + lone["socket_errors"],
        workers_per_device=info["workers_per_device"],
        engine_threads=info["engine_threads"],
    )


def _bound_process(source: dict, threads: int, batch: int, seconds: float, start, results) -> None:
    """One process of the bound: Pillow decode and the engine, ``threads`` each, no server."""
    import torch

    from benchmarks.ceiling import load_served
    from preprocessing import PilPreprocessor
    from service.testing import set_worker_threads

    device = torch.device("cpu")
    set_worker_threads(device, threads)
    served = load_served(source["model"], source["weights"], source["artifact"] or None, device)
    prepare = PilPreprocessor(served.entry.preprocess, device, num_threads=threads)
    images = [photo_jpegs(*IMAGENET_SIZE)[0]] * batch  # the photo wrk sends the servers

    def one_batch() -> None:
        tensor = prepare(images).images
        with torch.inference_mode():
            logits = served(tensor)
            torch.softmax(logits.float(), dim=1).topk(5)

    one_batch()  # warm
    start.wait()
    done, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        one_batch()
        done += batch
    results.put(done / (time.perf_counter() - began))


def measure_bound(processes: int, threads: int, args: argparse.Namespace) -> BoundRun:
    context = multiprocessing.get_context("spawn")
    start, results = context.Event(), context.Queue()
    source = {"artifact": str(args.artifact or ""), "model": args.model, "weights": args.weights}
    workers = [
        context.Process(target=_bound_process, args=(source, threads, args.bound_batch, args.duration, start, results))
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    time.sleep(args.bound_load_s)  # every process loaded and warm before the clock starts
    start.set()
    rates = [results.get(timeout=args.duration + 600) for _ in workers]
    for worker in workers:
        worker.join()
    return BoundRun(processes, threads, round(sum(rates), 2))


def bound_layouts(cores: int) -> list[tuple[int, int]]:
    """Every (processes, threads) with processes x threads = cores."""
    return [(p, cores // p) for p in range(1, cores + 1) if cores % p == 0]


def parse_configs(given: Sequence[str]) -> list[tuple[str, list[str]]]:
    configs = [(DEFAULTS, []), (ONE_WORKER, ["--workers-per-device", "1"])]
    for text in given:
        label, _, flags = text.partition("=")
        if not label or not flags:
            raise ValueError(
                f"--config {text!r}: write LABEL=FLAGS, e.g. 'w2 b8=--workers-per-device 2 --max-batch-size 8'"
            )
        configs.append((label.strip(), shlex.split(flags)))
    return configs


def summarize(rounds: list[dict]) -> dict:
    labels = [run["label"] for run in rounds[0]["servers"]]
    servers = {}
    for label in labels:
        runs = [next(r for r in one["servers"] if r["label"] == label) for one in rounds]
        servers[label] = {
            key: statistics.median(run[key] for run in runs)
            for key in ("images_per_s", "wrk_images_per_s", "p50_ms", "p99_ms", "lone_p50_ms")
        } | {
            "errors": sum(run["errors"] for run in runs),
            "layout": f"{runs[0]['workers_per_device']} x {runs[0]['engine_threads']}",
        }
    bound_by_layout: dict[str, list[float]] = {}
    for one in rounds:
        for run in one["bound"]:
            bound_by_layout.setdefault(f"{run['processes']} x {run['threads']}", []).append(run["images_per_s"])
    bounds = {layout: statistics.median(values) for layout, values in bound_by_layout.items()}
    bound = max(bounds.values())
    best = max(s["images_per_s"] for s in servers.values())
    before = servers[ONE_WORKER]
    for s in servers.values():
        s["of_bound"] = round(s["images_per_s"] / bound, 3)
        s["of_best"] = round(s["images_per_s"] / best, 3)
        s["lone_p50_vs_one_worker"] = round(s["lone_p50_ms"] / before["lone_p50_ms"], 3)
    for label in labels:  # each round's share of that round's bound too: the rounds drift with the machine
        ratios = []
        for one in rounds:
            run = next(r for r in one["servers"] if r["label"] == label)
            ratios.append(run["images_per_s"] / max(b["images_per_s"] for b in one["bound"]))
        servers[label]["of_bound_per_round"] = [round(r, 3) for r in ratios]
    return {"servers": servers, "bound": bounds, "bound_best": bound}


def rate_text(images_per_s: float) -> str:
    """Images per second to two significant digits at least: slow engines serve under 1 img/s."""
    return f"{images_per_s:.1f}" if images_per_s >= 10 else f"{images_per_s:.2f}"


def markdown(record: dict) -> str:
    summary = record["summary"]
    lines = [
        f"# Out of the box vs the bound: {record['source']}",
        "",
        f"`{record['command']}`",
        "",
        f"{record['cores']} usable cores; {len(record['rounds'])} alternating rounds, medians; wrk at "
        f"{record['connections']} connections for {record['duration_s']:g} s, then 1 connection for "
        f"{record['lone_duration_s']:g} s. Bound: no server, Pillow + the engine in P processes x T threads, "
        f"batch {record['bound_batch']}.",
        "",
    ]
    rows = [
        [
            label,
            s["layout"],
            rate_text(s["images_per_s"]),
            rate_text(s["wrk_images_per_s"]),
            f"{s['p99_ms']:.0f}",
            f"{s['of_bound']:.2f}",
            f"{s['of_best']:.2f}",
            f"{s['lone_p50_ms']:.1f}",
            f"{s['lone_p50_vs_one_worker']:.2f}",
            s["errors"],
        ]
        for label, s in summary["servers"].items()
    ]
    header = ["server", "workers x threads", "img/s", "wrk's img/s", "p99 ms", "of bound", "of best",
              "1-conn p50 ms", "p50 vs one worker", "errors"]  # fmt: skip
    lines += [markdown_table(header, rows), ""]
    bound_rows = [[layout, rate_text(rate)] for layout, rate in summary["bound"].items()]
    lines += [markdown_table(["bound: processes x threads", "img/s"], bound_rows), ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, help="a compile-trt artifact to serve")
    parser.add_argument("--model", default="resnet152", help="without --artifact: the eager model")
    parser.add_argument("--weights", default="random")
    parser.add_argument("--config", action="append", default=[], help="LABEL=FLAGS: another server configuration")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load per measurement")
    parser.add_argument("--lone-duration", type=float, default=10.0, help="seconds at one connection")
    parser.add_argument(
        "--batch-slack-s",
        type=float,
        default=10.0,
        help="the longest a batch takes: the load runs this much longer, then is let finish",
    )
    parser.add_argument("--bound-batch", type=int, default=16)
    parser.add_argument("--bound-load-s", type=float, default=20.0, help="seconds the bound's processes get to load")
    parser.add_argument("--label", default="", help="names the output files (default: the model)")
    parser.add_argument("--output-dir", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        configs = parse_configs(args.config)
    except ValueError as exc:
        parser.error(str(exc))
    cores = usable_cores()
    source = str(args.artifact) if args.artifact else f"{args.model} ({args.weights} weights, eager)"
    rounds = []
    with tempfile.TemporaryDirectory(prefix="defaults-bench-") as tmp:
        work = Path(tmp)
        for number in range(args.rounds):
            order = configs if number % 2 == 0 else configs[::-1]
            servers = []
            for label, flags in order:
                run = measure_server(label, flags, args, work)
                logger.info("round %d %s: %s", number + 1, label, run)
                servers.append(asdict(run))
            bound = []
            for processes, threads in bound_layouts(cores):
                run = measure_bound(processes, threads, args)
                logger.info("round %d bound: %s", number + 1, run)
                bound.append(asdict(run))
            rounds.append({"servers": servers, "bound": bound})
    label = args.label or (args.artifact.name if args.artifact else args.model)
    record = {
        "source": source,
        "command": "python -m benchmarks.defaults " + shlex.join(sys.argv[1:] if argv is None else argv),
        "cores": cores,
        "connections": args.connections,
        "duration_s": args.duration,
        "lone_duration_s": args.lone_duration,
        "bound_batch": args.bound_batch,
        "configs": {label: flags for label, flags in configs},
        "machine": machine_record(),
        "rounds": rounds,
    }
    record["summary"] = summarize(rounds)
    text = markdown(record)
    print(text)
    write_results(results_dir(args.output_dir), f"defaults-{label}", record, text, ".md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
