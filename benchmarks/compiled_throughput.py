"""Model-only throughput of compiled artifacts next to the eager model, at several batch sizes.

    python -m benchmarks.compiled_throughput --model resnet152 --weights random \\
        --backends inductor,onnx --precisions fp32 --batches 1,8,32
    python -m benchmarks.compiled_throughput --model resnet152 --eager fp32,bf16 --artifacts /tmp/r152-bf16

``--backends`` x ``--precisions`` are compiled with compile-trt into the work folder (a cache hit
when they are there already; a precision a backend refuses, such as bf16 for onnx, is skipped),
with MIN,OPT,MAX = 1,8,<largest batch>, so every batch runs as one engine call; ``--artifacts``
adds artifacts compiled elsewhere.

Engines take turns within each batch size (round-robin over repeats), so slow drift of a shared
machine hits all of them alike; medians are reported, with ratios to eager fp32 from the same run.
No preprocessing, no HTTP: a fixed float32 channels_last batch already on the device.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.harness.common import machine_record, results_dir, write_results
from benchmarks.harness.suite import DEFAULT_WORK_DIR, prepare_inputs
from compile import PRECISION_DTYPES, PrecisionCast, get_model_entry, load_model, read_manifest, restart_with_preload
from service.testing import load_artifact


def eager_engine(model: torch.nn.Module, precision: str, device: torch.device) -> Callable:
    return PrecisionCast(model, PRECISION_DTYPES[precision]).eval().to(device).to(memory_format=torch.channels_last)


def timed(engine: Callable, images: torch.Tensor, device: torch.device) -> float:
    started = time.perf_counter()
    with torch.inference_mode():
        engine(images)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def measure(
    engines: dict[str, Callable], batches: list[int], input_size: tuple[int, int], device: torch.device, repeats: int
) -> dict:
    results: dict[str, dict[int, float]] = {name: {} for name in engines}
    for batch in batches:
        images = torch.randn(batch, 3, *input_size, device=device).contiguous(memory_format=torch.channels_last)
        times: dict[str, list[float]] = {name: [] for name in engines}
        for engine in engines.values():
            for _ in range(2):  # first calls at a new shape set up kernels
                timed(engine, images, device)
        for _ in range(repeats):
            for name, engine in engines.items():
                times[name].append(timed(engine, images, device))
        for name in engines:
            results[name][batch] = batch / statistics.median(times[name])
    return results


def report(title: str, results: dict[str, dict[int, float]], baseline: str) -> str:
    batches = sorted(next(iter(results.values())))
    width = max(len(name) for name in results)
    lines = [title, f"  {'engine':<{width}}  " + "  ".join(f"{'batch ' + str(b):>18}" for b in batches)]
    for name, per_batch in results.items():
        cells = []
        for b in batches:
            ratio = per_batch[b] / results[baseline][b] if baseline in results else float("nan")
            cells.append(f"{per_batch[b]:8.1f} img/s {ratio:4.2f}x")
        lines.append(f"  {name:<{width}}  " + "  ".join(f"{c:>18}" for c in cells))
    lines.append(f"  (img/s, median; ratio to {baseline} in the same run)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet152")
    parser.add_argument("--weights", default="random", help="random is fine for speed")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--eager", default="fp32", help="eager precisions to include, e.g. fp32,bf16")
    parser.add_argument("--artifacts", nargs="*", type=Path, default=[], help="compile-trt artifact directories")
    parser.add_argument("--backends", default="", help="compile these backends' artifacts too, e.g. inductor,onnx")
    parser.add_argument("--precisions", default="fp32", help="precisions of the --backends artifacts")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK_DIR, help="where --backends artifacts are kept")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output-dir", type=Path, default=None)
    args = parser.parse_args()
    restart_with_preload(args.device)  # loads AOTInductor CUDA packages here (compile/libstdcxx.py)

    device = torch.device(args.device)
    entry = get_model_entry(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    artifacts = list(args.artifacts)
    if args.backends:
        if device.type != "cpu":
            parser.error("--backends compiles CPU artifacts; compile GPU ones with compile-trt and pass --artifacts")
        backends, precisions = args.backends.split(","), args.precisions.split(",")
        batch = (1, min(8, max(batches)), max(batches))
        inputs = prepare_inputs(entry.name, args.work, args.weights, precisions, backends, batch)
        artifacts += list(inputs.artifacts.values())
        args.weights = str(inputs.weights_file)  # the eager engines load what was compiled
    model = load_model(entry, args.weights).module
    engines: dict[str, Callable] = {}
    for precision in filter(None, args.eager.split(",")):
        engines[f"eager-{precision}"] = eager_engine(
            model if precision == "fp32" else load_model(entry, args.weights).module, precision, device
        )
    manifests = {}
    for directory in artifacts:
        manifest = read_manifest(directory)
        if manifest.model != entry.name:
            parser.error(f"{directory} holds {manifest.model}, not {entry.name}")
        # The ServedModel, as the worker runs it: the batch in the engine's memory layout, then the engine.
        engines[manifest.engine_name] = load_artifact(directory, device)
        manifests[manifest.engine_name] = {
            "directory": str(directory),
            "compile_seconds": manifest.compile_seconds,
            "batch": [manifest.batch_min, manifest.batch_opt, manifest.batch_max],
            "validation": manifest.validation.get("metrics", {}),
        }
    results = measure(engines, batches, entry.preprocess.input_size, device, args.repeats)
    title = f"{entry.name} ({args.weights} weights), model only, on {device}"
    text = report(title, results, "eager-fp32")
    print(text)
    record = {
        "model": entry.name,
        "weights": args.weights,
        "device": str(device),
        "machine": machine_record(device),
        "repeats": args.repeats,
        "images_per_second": {name: {str(b): v for b, v in r.items()} for name, r in results.items()},
        "artifacts": manifests,
    }
    write_results(results_dir(args.output_dir, device), f"compiled_throughput-{entry.name}-{device.type}", record, text)


if __name__ == "__main__":
    main()
