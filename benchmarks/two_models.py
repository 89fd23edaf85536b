"""Two models in one vision-serve vs two vision-serve servers, one model each: same cores, same load.

    python -m benchmarks.two_models                 # 2 rounds, 30 s of load each
    python -m benchmarks.two_models --rounds 1 --seconds 10

Both models are the same compile-trt artifact (efficientnet-lite0, ``--backend onnx``, what ``auto``
picks on a CPU) served under two names, so only the serving layout differs:

- ``one-server``: ``vision-serve --model-repository DIR`` with ``DIR/a/1`` and ``DIR/b/1`` (one
  inference worker per model, as two servers would have; HTTP processes sized as by default);
- ``two-servers``: two ``vision-serve --artifact DIR/x/1`` on two ports.

The load is a closed loop of ``--concurrency`` connections per model, both models at once (one client
thread each), each request a photo POSTed to ``/predict`` (``/predict?model=<name>`` on the one
server). Layouts alternate round by round; each round reports throughput (answered 200 per second,
both models), p50/p99 and the memory of all server processes (RSS summed, which counts shared pages
in every process, and PSS, which splits them). The summary gives medians and the one-server / two-servers ratios.
Results: ``two-models.json`` and ``two-models.md`` in the results folder.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil

from benchmarks.harness.common import machine_record, results_dir, write_results
from service.client.launcher import ServerProcess
from service.tune.images import IMAGENET_SIZE, photo_jpegs
from service.tune.loadgen import CLOSED, LoadResult, LoadSpec, run_load

logger = logging.getLogger(__name__)

MODELS = ("a", "b")
LAYOUTS = ("one-server", "two-servers")
CONCURRENCY = 16
SECONDS = 30.0
WARMUP_REQUESTS = 32


def compile_artifact(output: Path) -> None:
    command = [sys.executable, "-m", "compile.cli", "--model", "efficientnet-lite0", "--backend", "onnx"]
    command += ["--device", "cpu", "--batch", "1,8,8", "--log-level", "warning", "--output", str(output)]
    subprocess.run(command, check=True)


def make_repository(root: Path, artifact: Path) -> Path:
    for name in MODELS:
        shutil.copytree(artifact, root / name / "1", dirs_exist_ok=True)
        (root / name / "config.toml").write_text("max_batch_size = 8\n")
    return root


@contextlib.contextmanager
def servers(layout: str, repository: Path, logs: Path) -> Iterator[tuple[dict[str, str], list[int]]]:
    """The running layout: model name -> its URL, and the servers' process ids."""
    with contextlib.ExitStack() as stack:
        if layout == "one-server":
            args = ["--model-repository", str(repository), "--log-level", "warning"]
            server = stack.enter_context(ServerProcess(args, log_path=logs / f"{layout}.log"))
            urls = {name: f"{server.url}/predict?model={name}" for name in MODELS}
            processes = [server.process.pid]
        else:
            urls, processes = {}, []
            for name in MODELS:
                args = ["--artifact", str(repository / name / "1"), "--name", name, "--max-batch-size", "8"]
                server = stack.enter_context(
                    ServerProcess([*args, "--log-level", "warning"], log_path=logs / f"{layout}-{name}.log")
                )
                urls[name] = f"{server.url}/predict"
                processes.append(server.process.pid)
        yield urls, processes


def memory_of(pids: Sequence[int]) -> dict[str, float]:
    """RSS and PSS (MiB) of the processes and all their children."""
    rss = pss = 0
    for pid in pids:
        root = psutil.Process(pid)
        for process in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                info = process.memory_full_info()
                rss += info.rss
                pss += info.pss
    return {"rss_mib": rss / 2**20, "pss_mib": pss / 2**20}


def drive(urls: dict[str, str], images: list[bytes], concurrency: int, seconds: float) -> dict[str, LoadResult]:
    """Both models loaded at once, one client thread each."""
    spec = LoadSpec(
        requests=1_000_000, mode=CLOSED, concurrency=concurrency, max_seconds=seconds, warmup_requests=WARMUP_REQUESTS
    )
    results: dict[str, LoadResult] = {}

    def one(name: str) -> None:
        results[name] = run_load(urls[name], images, spec)

    threads = [threading.Thread(target=one, args=(name,)) for name in urls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def measure(layout: str, repository: Path, logs: Path, images: list[bytes], concurrency: int, seconds: float) -> dict:
    with servers(layout, repository, logs) as (urls, pids):
        results = drive(urls, images, concurrency, seconds)
        memory = memory_of(pids)
    summaries = {name: result.summary() for name, result in results.items()}
    latencies = sorted(s.latency_ms for result in results.values() for s in result.ok)
    errors = sum(summary["errors"] for summary in summaries.values())
    record = {
        "layout": layout,
        "throughput_rps": sum(summary["throughput_rps"] for summary in summaries.values()),
        "p50_ms": statistics.median(latencies) if latencies else None,
        "p99_ms": latencies[int(0.99 * (len(latencies) - 1))] if latencies else None,
        "errors": errors,
        **memory,
        "per_model": summaries,
    }
    logger.info(
        "%s: %.1f img/s, p50 %.0f ms, p99 %.0f ms, %d errors, RSS %.0f MiB, PSS %.0f MiB",
        layout,
        record["throughput_rps"],
        record["p50_ms"] or 0,
        record["p99_ms"] or 0,
        errors,
        record["rss_mib"],
        record["pss_mib"],
    )
    return record


def summarize(rounds: list[dict]) -> dict:
    by_layout = {layout: [r for r in rounds if r["layout"] == layout] for layout in LAYOUTS}
    medians = {
        layout: {
            key: statistics.median(r[key] for r in runs) for key in ("throughput_rps", "p99_ms", "rss_mib", "pss_mib")
        }
        for layout, runs in by_layout.items()
    }
    one, two = medians["one-server"], medians["two-servers"]
    ratios = {key: one[key] / two[key] for key in one}
    return {"medians": medians, "one_over_two": ratios}


def render(summary: dict, concurrency: int, seconds: float) -> str:
    lines = [
        f"# Two models: one server vs two servers ({concurrency} connections per model, {seconds:g} s per round)",
        "",
        "| layout | images/s (both models) | p99 ms | RSS MiB | PSS MiB |",
        "|---|---|---|---|---|",
    ]
    for layout, values in summary["medians"].items():
        lines.append(
            f"| {layout} | {values['throughput_rps']:.1f} | {values['p99_ms']:.0f} | {values['rss_mib']:.0f} | "
            f"{values['pss_mib']:.0f} |"
        )
    ratios = summary["one_over_two"]
    lines += [
        "",
        f"one server / two servers: throughput {ratios['throughput_rps']:.2f}x, p99 {ratios['p99_ms']:.2f}x, "
        f"RSS {ratios['rss_mib']:.2f}x, PSS {ratios['pss_mib']:.2f}x (medians of alternating rounds).",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.two_models", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds per layout, alternating")
    parser.add_argument("--seconds", type=float, default=SECONDS, help="seconds of load per round")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY, help="connections per model")
    parser.add_argument("--output-dir", type=Path, help="results folder (default: benchmarks/results/<machine>-<date>)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    images = photo_jpegs(*IMAGENET_SIZE)
    with tempfile.TemporaryDirectory(prefix="two-models-") as tmp:
        work = Path(tmp)
        compile_artifact(work / "artifact")
        repository = make_repository(work / "repository", work / "artifact")
        rounds = [
            measure(layout, repository, work, images, args.concurrency, args.seconds)
            for _ in range(args.rounds)
            for layout in LAYOUTS
        ]
    summary = summarize(rounds)
    text = render(summary, args.concurrency, args.seconds)
    record = {"machine": machine_record(), "concurrency": args.concurrency, "seconds": args.seconds}
    write_results(
        results_dir(args.output_dir), "two-models", {**record, "summary": summary, "rounds": rounds}, text, ".md"
    )
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
