"""Single-image latency and batch-8 throughput of the served model, next to the in-process model.

    python -m benchmarks.serve_latency --model resnet152 --weights random
    python -m benchmarks.serve_latency --model efficientnet-lite0

Phases run one after another (never overlapping: they share the same cores):
1. in process: Pillow preprocessing per image; model + softmax/top-k at batch 1 and batch 8;
2. served: `vision-serve --max-batch-size 8` on loopback; latency at concurrency 1 and throughput
   at concurrency 8 (so batches of up to 8 form), with the batch sizes the server reports.
Prints a table and writes JSON under benchmarks/results/<machine>-<date>/.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import torch
from PIL import Image

from benchmarks.common import machine_record, results_dir, write_results
from compile.catalog import get_model_entry
from compile.weights import load_model
from preprocessing.pil_backend import PilPreprocessor
from service._defaults import BATCH_TIMEOUT_MS
from service.process import ServerProcess


def sample_jpeg() -> bytes:
    from skimage import data

    buf = io.BytesIO()
    Image.fromarray(data.chelsea()).save(buf, format="JPEG", quality=92)  # 451x300, ImageNet-sized
    return buf.getvalue()


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def in_process(model_name: str, weights: str, image: bytes, repeats: int) -> dict:
    entry = get_model_entry(model_name)
    model = load_model(entry, weights).module.to(memory_format=torch.channels_last)
    preprocessor = PilPreprocessor(entry.preprocess)
    batches = {n: preprocessor([image] * n).images for n in (1, 8)}

    def classify(x: torch.Tensor) -> None:
        with torch.inference_mode():
            probabilities, indices = model(x).float().softmax(1).topk(5, dim=1)
            probabilities.tolist(), indices.tolist()

    result = {
        "preprocess_ms_per_image": median_ms(lambda: preprocessor([image]), repeats * 4),
        "model_ms_batch1": median_ms(lambda: classify(batches[1]), repeats),
        "model_ms_batch8": median_ms(lambda: classify(batches[8]), max(3, repeats // 4)),
    }
    result["model_img_per_s_batch8"] = 8e3 / result["model_ms_batch8"]
    result["end_to_end_ms_batch1"] = result["preprocess_ms_per_image"] + result["model_ms_batch1"]
    return result


async def served_run(url: str, image: bytes, requests: int, concurrency: int) -> dict:
    """Closed loop: ``concurrency`` clients each send the next request as soon as one returns."""
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def one() -> tuple[float, int, int]:
            started = time.perf_counter()
            response = await client.post("/predict", content=image, headers={"Content-Type": "image/jpeg"})
            latency = (time.perf_counter() - started) * 1e3
            return latency, response.status_code, int(response.headers.get("X-Batch-Size", 0))

        await asyncio.gather(*(one() for _ in range(concurrency)))  # warm-up round: connections, first batch
        pending = iter(range(requests))
        results: list[tuple[float, int, int]] = []

        async def client_loop() -> None:
            for _ in pending:
                results.append(await one())

        started = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    failed = [status for _, status, _ in results if status != 200]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} requests failed (statuses {sorted(set(failed))})")
    latencies = sorted(r[0] for r in results)
    statuses: dict[int, int] = {}
    for _, status, _ in results:
        statuses[status] = statuses.get(status, 0) + 1
    batch_sizes = [r[2] for r in results]
    return {
        "requests": len(results),
        "concurrency": concurrency,
        "statuses": statuses,
        "latency_ms_p50": statistics.median(latencies),
        "latency_ms_p90": latencies[int(0.9 * (len(latencies) - 1))],
        "img_per_s": len(results) / elapsed,
        "batch_size_median": statistics.median(batch_sizes),
        "batch_size_max": max(batch_sizes),
    }


def served(model_name: str, weights: str, image: bytes, repeats: int, batch_timeout_ms: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        args = ["--model", model_name, "--weights", weights, "--max-batch-size", "8", "--log-level", "warning",
                "--batch-timeout-ms", str(batch_timeout_ms)]  # fmt: skip
        with ServerProcess(args, log_path=Path(tmp) / "server.log") as server:
            return {
                "concurrency_1": asyncio.run(served_run(server.url, image, repeats, 1)),
                "concurrency_8": asyncio.run(served_run(server.url, image, repeats * 2, 8)),
            }


def report(model_name: str, weights: str, local: dict, remote: dict) -> str:
    c1, c8 = remote["concurrency_1"], remote["concurrency_8"]
    ms8, ips8 = local["model_ms_batch8"], local["model_img_per_s_batch8"]
    p50_1, p90_1, p50_8, p90_8 = c1["latency_ms_p50"], c1["latency_ms_p90"], c8["latency_ms_p50"], c8["latency_ms_p90"]
    rows = [
        ("in-process preprocess (Pillow), per image", f"{local['preprocess_ms_per_image']:.1f} ms"),
        ("in-process model + top-5, batch 1", f"{local['model_ms_batch1']:.1f} ms"),
        ("in-process preprocess + model, batch 1", f"{local['end_to_end_ms_batch1']:.1f} ms"),
        ("in-process model + top-5, batch 8", f"{ms8:.1f} ms = {ips8:.1f} img/s"),
        ("served, concurrency 1: latency p50 / p90", f"{p50_1:.1f} / {p90_1:.1f} ms"),
        (
            "served, concurrency 8: throughput",
            f"{c8['img_per_s']:.1f} img/s (median batch {c8['batch_size_median']:g})",
        ),
        ("served, concurrency 8: latency p50 / p90", f"{p50_8:.1f} / {p90_8:.1f} ms"),
        ("ratio: served c=1 latency / in-process batch 1", f"{p50_1 / local['end_to_end_ms_batch1']:.2f}x"),
        ("ratio: served c=8 throughput / in-process batch 8", f"{c8['img_per_s'] / ips8:.2f}x"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{model_name} (weights {weights}), {os.cpu_count()} CPU cores, torch {torch.__version__}"]
    return "\n".join(lines + [f"  {name:<{width}}  {value}" for name, value in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet152")
    parser.add_argument("--weights", default="random", help="random is fine for speed; imagenet if cached")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batch-timeout-ms", type=float, default=BATCH_TIMEOUT_MS, help="the server's batch window")
    parser.add_argument("--output-dir", type=Path, default=None)
    args = parser.parse_args()

    image = sample_jpeg()
    local = in_process(args.model, args.weights, image, args.repeats)
    remote = served(args.model, args.weights, image, args.repeats, args.batch_timeout_ms)
    text = report(args.model, args.weights, local, remote) + f"\n  (server batch window {args.batch_timeout_ms:g} ms)"
    print(text)

    record = {
        "model": args.model,
        "weights": args.weights,
        "batch_timeout_ms": args.batch_timeout_ms,
        "machine": machine_record(),
        "in_process": local,
        "served": remote,
    }
    stem = f"serve_latency-{args.model}" + (
        "" if args.batch_timeout_ms == BATCH_TIMEOUT_MS else f"-window{args.batch_timeout_ms:g}ms"
    )
    write_results(results_dir(args.output_dir), stem, record, text)


if __name__ == "__main__":
    main()
