"""The response cache on this machine: throughput and latency at 0 %, 50 % and 90 % repeated images,
with the cache off, in memory, and in memory in front of a shared Redis; and a hit's p50 vs a miss's.

    python -m benchmarks.response_cache                       # off/memory/redis x 0/50/90 %, 400 requests each
    python -m benchmarks.response_cache --requests 100 --configs memory --fractions 0.9   # smoke

A real model (EfficientNet-Lite0, eager, its ImageNet weights) on a real server on loopback, loaded by a
closed loop of ``--concurrency`` clients (service.tune.loadgen). Each request is, with probability
``fraction``, one of 8 "hot" photos (sent once before the run, so that a cache has them), else an image
never sent before (a benchmark photo with a counter appended after its end: other bytes, the same
decode and inference cost). With the cache on, a request is a hit when its Server-Timing has the
``cache`` stage. Each configuration runs on a fresh server; the Redis one on a fresh ``redis-server``
(Debian package) on loopback.

Results: ``response-cache.json`` and ``response-cache.md`` in the results folder.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
import shutil
import statistics
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from benchmarks.harness.common import machine_record, results_dir, write_results
from service.client.launcher import ServerProcess
from service.tune.images import IMAGENET_SIZE, photo_jpegs
from service.tune.loadgen import LoadSpec, Sample, percentile, run_load
from tests.redis_server import running_redis

logger = logging.getLogger(__name__)

MODEL = "efficientnet-lite0"
CONFIGS = ("off", "memory", "redis")
FRACTIONS = (0.0, 0.5, 0.9)
HOT_IMAGES = 8
CACHE_MB = 64


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A ``redis-server`` on a free loopback port, saving nothing (the tests' own: tests/redis_server.py);
    its URL."""
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed: apt-get install redis-server (or leave out --configs redis)")
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as directory, running_redis(Path(directory)) as server:
        yield server.url


def request_images(
    photos: Sequence[bytes], hot: Sequence[bytes], fraction: float, count: int, seed: int
) -> list[bytes]:
    """``count`` request bodies: a hot image with probability ``fraction``, else one never sent before."""
    rng = random.Random(seed)
    bodies = []
    for i in range(count):
        if rng.random() < fraction:
            bodies.append(hot[rng.randrange(len(hot))])
        else:
            bodies.append(photos[i % len(photos)] + f"unique-{seed}-{i}".encode())
    return bodies


def median_of(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def measure(url: str, photos: Sequence[bytes], fraction: float, args: argparse.Namespace, seed: int) -> dict:
    hot = [photo + f"hot-{seed}".encode() for photo in photos[:HOT_IMAGES]]
    run_load(url, hot, LoadSpec(len(hot), concurrency=1))  # into the cache, if there is one
    bodies = request_images(photos, hot, fraction, args.requests, seed)
    result = run_load(url, bodies, LoadSpec(args.requests, concurrency=args.concurrency, max_seconds=args.max_seconds))
    ok: list[Sample] = result.ok
    hits = sorted(s.latency_ms for s in ok if "cache" in s.timings_ms)
    misses = sorted(s.latency_ms for s in ok if "cache" not in s.timings_ms)
    latencies = sorted(s.latency_ms for s in ok)
    return {
        "fraction": fraction,
        "requests": len(result.samples),
        "ok": len(ok),
        "img_per_s": len(ok) / result.elapsed_s,
        "p50_ms": percentile(latencies, 0.5),
        "p99_ms": percentile(latencies, 0.99),
        "hits": len(hits),
        "hit_p50_ms": percentile(hits, 0.5) if hits else None,
        "miss_p50_ms": percentile(misses, 0.5) if misses else None,
        "hit_server_ms_median": median_of([s.timings_ms["total"] for s in ok if "cache" in s.timings_ms]),
    }


def server_args(config: str, redis_url: str | None) -> list[str]:
    args = ["--model", MODEL]
    if config != "off":
        args += ["--response-cache-mb", str(CACHE_MB)]
    if config == "redis":
        args += ["--response-cache-redis", redis_url]
    return args


def run_config(config: str, photos: Sequence[bytes], args: argparse.Namespace, work: Path) -> list[dict]:
    with contextlib.ExitStack() as stack:
        redis_url = stack.enter_context(redis_server()) if config == "redis" else None
        server = stack.enter_context(ServerProcess(server_args(config, redis_url), log_path=work / f"{config}.log"))
        rows = []
        for index, fraction in enumerate(args.fractions):
            row = {"config": config, **measure(f"{server.url}/predict", photos, fraction, args, seed=index)}
            logger.info("%s", json.dumps(row))
            rows.append(row)
        return rows


def format_table(rows: list[dict]) -> str:
    def ms(value: float | None) -> str:
        return "" if value is None else f"{value:.1f}"

    base = {row["fraction"]: row["img_per_s"] for row in rows if row["config"] == "off"}
    lines = [
        "| cache | repeats | img/s | vs off | p50 ms | p99 ms | hits | hit p50 ms | miss p50 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = row["img_per_s"] / base[row["fraction"]] if row["fraction"] in base else None
        lines.append(
            f"| {row['config']} | {row['fraction']:.0%} | {row['img_per_s']:.1f} | "
            f"{'' if ratio is None else f'{ratio:.2f}x'} | {ms(row['p50_ms'])} | {ms(row['p99_ms'])} | "
            f"{row['hits']}/{row['ok']} | {ms(row['hit_p50_ms'])} | {ms(row['miss_p50_ms'])} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="off, memory, redis (comma-separated)")
    parser.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS), help="shares of repeated images")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-seconds", type=float, default=120.0)
    parser.add_argument(
        "--out", type=Path, default=None, help="results folder (default: benchmarks/results/<machine>-<date>)"
    )
    args = parser.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown --configs {sorted(unknown)}: use {', '.join(CONFIGS)}")
    args.fractions = [float(f) for f in args.fractions.split(",")]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    photos = photo_jpegs(*IMAGENET_SIZE)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as work:
        for config in args.configs:
            rows += run_config(config, photos, args, Path(work))
    table = format_table(rows)
    print(table)
    record = {"machine": machine_record(), "model": MODEL, "concurrency": args.concurrency, "rows": rows}
    command = "python -m benchmarks.response_cache " + " ".join(argv or [])
    text = f"# Response cache ({MODEL}, closed loop of {args.concurrency})\n\n`{command.strip()}`\n\n{table}\n"
    write_results(results_dir(args.out), "response-cache", record, text, ".md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
