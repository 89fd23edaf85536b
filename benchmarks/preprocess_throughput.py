"""Preprocessing-only throughput of each backend, for ImageNet-sized and 12 MP JPEGs, at several batch sizes.

    python -m benchmarks.preprocess_throughput --device cpu
    python -m benchmarks.preprocess_throughput --device cuda
    python -m benchmarks.preprocess_throughput --device cpu --backends pil,dali --batches 1,8,32 --repeats-12mp 3

Defaults: every backend that runs on the device, batches 1,32, 5 repeats. Run it on an otherwise
idle machine: when another process holds a core, torch's OpenMP threads wait on each other and the
torch backend (and whatever runs after it) slows down several-fold.

Each timed call is ``preprocessor(list_of_jpeg_bytes)`` -> a normalized batch on the device (on cuda
the clock stops after ``torch.cuda.synchronize``). Per backend x image size x batch size it reports
images/s (median over repeats), the CPU cores the process kept busy during the timed calls (process
CPU time, all threads, over wall time) and how the items were decoded (a device backend's counts: on
its device path or by Pillow), with ratios to pil from the same run. Backends take turns within each
cell (round-robin over repeats), so slow drift of a shared machine hits all of them alike; each
backend is warmed up with 2 calls per cell first. Backends that cannot run on the device are skipped
and the reason recorded.

The inputs are scikit-image sample photos cropped to 4:3, resized with Lanczos to 500x375
("imagenet") and 4000x3000 ("12mp"), with mild fixed noise so the 12 MP files carry a camera's
entropy (about 2 MB each) rather than compressing like a smooth upscale; JPEG quality 90. A batch
cycles through the 4 distinct photos. No model, no HTTP.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.harness.common import machine_record, results_dir, write_results
from compile import get_model_entry
from preprocessing import BACKENDS, DALI_MAX_THREADS, Preprocessor, backend_problem, create_preprocessor
from service.tune.images import JPEG_QUALITY, NOISE_SIGMA, photo_jpegs

SIZES = {"imagenet": (500, 375), "12mp": (4000, 3000)}  # width x height
SOURCES = ("chelsea", "coffee", "astronaut", "rocket")  # skimage.data photos
WARMUP_CALLS = 2
# Linux folds a running thread's CPU time into the process total only at scheduler ticks and context
# switches, so process CPU time over a few milliseconds is off by up to a tick per thread (it showed
# more "cores" busy than the machine has); below this much timed wall time, cores come from one block
# of back-to-back calls at least this long instead.
CPU_WINDOW_SECONDS = 1.0


def decode_counts(preprocessor: Preprocessor) -> dict[str, int] | None:
    """A device backend's cumulative ``DecodeCounts`` as a dict; ``None`` for pil (all Pillow)."""
    counts = getattr(preprocessor, "counts", None)
    return dataclasses.asdict(counts) if counts is not None else None


def timed(preprocessor: Preprocessor, images: list[bytes], device: torch.device) -> tuple[float, float]:
    """``(wall seconds, process CPU seconds)`` of one call; raises if any benchmark image failed."""
    cpu_started = time.process_time()  # user + sys of every thread of this process
    started = time.perf_counter()
    batch = preprocessor(images)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    failed = [error for error in batch.errors if error is not None]
    if failed:
        raise RuntimeError(f"{preprocessor.name} failed on {len(failed)} benchmark image(s): {failed[0].detail}")
    return wall, cpu


def measure(
    preprocessors: dict[str, Preprocessor],
    images: list[bytes],
    batches: list[int],
    device: torch.device,
    repeats: int,
    label: str,
) -> dict[int, dict[str, dict]]:
    """``{batch: {backend: cell}}`` for one image size."""
    results: dict[int, dict[str, dict]] = {}
    for batch in batches:
        inputs = [images[i % len(images)] for i in range(batch)]
        print(f"  {label} batch {batch}: warm-up + {repeats} repeats ...", flush=True)
        for preprocessor in preprocessors.values():
            for _ in range(WARMUP_CALLS):
                timed(preprocessor, inputs, device)
        walls: dict[str, list[float]] = {name: [] for name in preprocessors}
        cpus: dict[str, list[float]] = {name: [] for name in preprocessors}
        before = {name: decode_counts(p) for name, p in preprocessors.items()}
        for _ in range(repeats):
            for name, preprocessor in preprocessors.items():
                wall, cpu = timed(preprocessor, inputs, device)
                walls[name].append(wall)
                cpus[name].append(cpu)
        results[batch] = {}
        for name, preprocessor in preprocessors.items():
            after = decode_counts(preprocessor)
            decoded = {key: after[key] - before[name][key] for key in after} if after is not None else None
            cores, block_calls = sum(cpus[name]) / sum(walls[name]), 0
            if sum(walls[name]) < CPU_WINDOW_SECONDS:
                cores, block_calls = cpu_cores_block(preprocessor, inputs, device)
            results[batch][name] = {
                "images_per_second": batch / statistics.median(walls[name]),
                "cpu_cores": cores,
                "cpu_cores_block_calls": block_calls,  # 0: cores are from the timed calls
                "wall_seconds": walls[name],
                "cpu_seconds": cpus[name],
                "decoded": decoded,  # timed calls only; None: pil, every item by Pillow
            }
    return results


def cpu_cores_block(preprocessor: Preprocessor, images: list[bytes], device: torch.device) -> tuple[float, int]:
    """``(cores, calls)``: process CPU time / wall time over back-to-back calls lasting ``CPU_WINDOW_SECONDS``."""
    cpu_started = time.process_time()
    started = time.perf_counter()
    calls = 0
    while time.perf_counter() - started < CPU_WINDOW_SECONDS:
        preprocessor(images)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        calls += 1
    return (time.process_time() - cpu_started) / (time.perf_counter() - started), calls


def decoded_text(decoded: dict[str, int] | None) -> str:
    if decoded is None:
        return "all by Pillow"
    parts = [f"{decoded['device']} device", f"{decoded['pillow']} pillow"]
    if decoded["device_failed"] or decoded["split_retries"]:
        parts += [f"{decoded['device_failed']} device-failed", f"{decoded['split_retries']} split retries"]
    return ", ".join(parts)


def report(title: str, sizes: dict[str, dict], results: dict[str, dict[int, dict[str, dict]]]) -> str:
    lines = [title]
    for size, per_batch in results.items():
        info = sizes[size]
        lines.append("")
        lines.append(
            f"{size}: {info['width']}x{info['height']} JPEG q{JPEG_QUALITY}, {len(info['bytes'])} files of "
            + ", ".join(f"{b / 1e3:.0f}" for b in info["bytes"])
            + " kB"
        )
        batches = list(per_batch)
        backends = list(per_batch[batches[0]])
        width = max(len("backend"), *(len(name) for name in backends))
        lines.append(f"  {'backend':<{width}}  " + "  ".join(f"{'batch ' + str(b):>34}" for b in batches))
        for name in backends:
            cells = []
            for b in batches:
                cell = per_batch[b][name]
                pil = per_batch[b].get("pil")
                ratio = f"{cell['images_per_second'] / pil['images_per_second']:5.2f}x" if pil else "     -"
                cells.append(f"{cell['images_per_second']:8.1f} img/s {cell['cpu_cores']:4.2f} cores {ratio}")
            lines.append(f"  {name:<{width}}  " + "  ".join(f"{c:>34}" for c in cells))
        for name in backends:
            decoded = "; ".join(f"batch {b}: {decoded_text(per_batch[b][name]['decoded'])}" for b in batches)
            lines.append(f"  {name:<{width}}  decoded {decoded}")
    lines.append("")
    lines.append(
        "  (img/s: median; cores: process CPU time / wall time over the timed calls, or over"
        f" {CPU_WINDOW_SECONDS:g} s of back-to-back calls where those are shorter; ratio to pil, same run)"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet152", help="whose PreprocessSpec to use")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated; default: all that run here")
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated of {', '.join(SIZES)}")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--repeats-12mp",
        type=int,
        default=None,
        help="repeats for 12mp (default: --repeats); its calls are slow on a CPU",
    )
    parser.add_argument("--output", type=Path, default=None, help="results folder (default: benchmarks/results/...)")
    args = parser.parse_args()

    device = torch.device(args.device)
    spec = get_model_entry(args.model).preprocess
    batches = [int(b) for b in args.batches.split(",")]
    sizes = list(filter(None, args.sizes.split(",")))
    requested = list(filter(None, args.backends.split(",")))
    for name in requested:
        if name not in BACKENDS:
            parser.error(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
    for size in sizes:
        if size not in SIZES:
            parser.error(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    if args.repeats_12mp is None:
        args.repeats_12mp = args.repeats
    if min(batches) < 1 or args.repeats < 1 or args.repeats_12mp < 1:
        parser.error("batches and repeats must be >= 1")

    preprocessors: dict[str, Preprocessor] = {}
    skipped: dict[str, str] = {}
    for name in requested:
        problem = backend_problem(name, device)
        if problem:
            skipped[name] = problem
            print(f"skipping {name}: {problem}")
            continue
        preprocessors[name] = create_preprocessor(name, spec, device, max_batch_size=max(batches))
    if not preprocessors:
        parser.error(f"no requested backend can run on {device}")

    size_info: dict[str, dict] = {}
    samples: dict[str, list[bytes]] = {}
    for size in sizes:
        width, height = SIZES[size]
        samples[size] = photo_jpegs(width, height, SOURCES)
        size_info[size] = {"width": width, "height": height, "pixels": width * height}
        size_info[size]["bytes"] = [len(jpeg) for jpeg in samples[size]]
        print(f"{size}: {width}x{height}, JPEG bytes {size_info[size]['bytes']}", flush=True)

    started = time.perf_counter()
    results: dict[str, dict[int, dict[str, dict]]] = {}
    repeats = {size: args.repeats_12mp if size == "12mp" else args.repeats for size in sizes}
    for size in sizes:
        results[size] = measure(preprocessors, samples[size], batches, device, repeats[size], size)
    elapsed = time.perf_counter() - started

    title = (
        f"{args.model} preprocessing ({spec.describe()}) "
        f"on {device}, {machine_record(device)['cpus']} CPUs; "
        + ", ".join(f"{size}: median of {n}" for size, n in repeats.items())
    )
    if skipped:
        title += "\n" + "\n".join(f"skipped {name}: {problem}" for name, problem in skipped.items())
    text = report(title, size_info, results)
    print(text)
    record = {
        "model": args.model,
        "spec": spec.to_dict(),
        "device": str(device),
        "machine": machine_record(device),
        "repeats": repeats,
        "warmup_calls": WARMUP_CALLS,
        # Thread counts matter here: torch's OpenMP pool (the torch backend, and normalization in all
        # of them), Pillow's decode pool and DALI's workers share the same cores.
        "threads": {
            "torch_intra_op": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "pil": getattr(preprocessors.get("pil"), "num_threads", None),
            "dali_max": DALI_MAX_THREADS,
        },
        "measure_seconds": elapsed,
        "sizes": {
            size: {**info, "jpeg_quality": JPEG_QUALITY, "noise_sigma": NOISE_SIGMA, "sources": list(SOURCES)}
            for size, info in size_info.items()
        },
        "skipped": skipped,
        "results": {size: {str(b): cells for b, cells in per_batch.items()} for size, per_batch in results.items()},
    }
    write_results(results_dir(args.output, device), f"preprocess_throughput-{device.type}", record, text)


if __name__ == "__main__":
    main()
