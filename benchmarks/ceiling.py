"""The in-process ceiling: the served model's own throughput with no server around it.

    python -m benchmarks.ceiling --model resnet152 --weights random --batches 1,8
    python -m benchmarks.ceiling --artifact /tmp/r152-bf16 --batches 1,8

Loads the model exactly as a server worker does (``service.worker.engine``: eager or a compile-trt
artifact, channels_last, same thread count) and times what the worker's ``predict`` runs per batch
(model, softmax, top-5 to the host) on already-preprocessed benchmark photos. Preprocessing is
timed separately, per batch, with the backend the server would pick. Medians of ``repeats`` calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from compile import ModelRequest, restart_with_preload
from preprocessing import create_preprocessor
from service.testing import ServedModel, bind_worker_device, load_artifact, load_eager, set_worker_threads, usable_cores
from service.tune.images import read_images, write_benchmark_images

WARMUP_CALLS = 2


def load_served(model: str, weights: str, artifact: str | None, device: torch.device) -> ServedModel:
    return load_artifact(artifact, device) if artifact else load_eager(ModelRequest(model), weights, device)


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(WARMUP_CALLS):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def until_device_done(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """``fn``, returning only once the work it queued on ``device`` is done: a GPU runs kernels
    after the call that queued them returns, so a clock stopped at the return misses them."""

    def call() -> object:
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return result

    return call


def classify_call(served: ServedModel, images: torch.Tensor, device: torch.device) -> Callable[[], object]:
    """What ``Classifier.run`` runs on a prepared batch: model, softmax, top-5 to the host."""

    def call() -> object:
        with torch.inference_mode():
            probabilities, indices = served(images).float().softmax(dim=1).topk(5, dim=1)
            return probabilities.cpu().tolist(), indices.cpu().tolist()

    return until_device_done(call, device)


def measure_ceiling(
    served: ServedModel,
    photos: Sequence[bytes],
    batch_sizes: Sequence[int],
    device: torch.device,
    repeats: int,
    preprocess: str = "auto",
) -> dict:
    """Per batch size: model ms and img/s, preprocessing ms per batch (the same photos, cycled)."""
    preprocessor = create_preprocessor(preprocess, served.entry.preprocess, device, max_batch_size=max(batch_sizes))
    results = {}
    for size in batch_sizes:
        batch = [photos[i % len(photos)] for i in range(size)]
        prepared = preprocessor(batch)
        model_s = median_seconds(classify_call(served, prepared.images, device), repeats)
        preprocess_s = median_seconds(until_device_done(lambda batch=batch: preprocessor(batch), device), repeats)
        results[str(size)] = {
            "model_ms": model_s * 1e3,
            "model_img_per_s": size / model_s,
            "preprocess_ms": preprocess_s * 1e3,
        }
    return {"engine": served.engine_name, "threads": torch.get_num_threads(), "batches": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet152")
    parser.add_argument("--weights", default="random")
    parser.add_argument("--artifact", default=None, help="a compile-trt artifact directory instead of eager")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--images", type=Path, default=Path("/tmp/vision-serve-bench-images"))
    args = parser.parse_args()
    restart_with_preload(args.device)  # loads AOTInductor CUDA packages here (compile/libstdcxx.py)
    if not args.images.is_dir():
        write_benchmark_images(args.images)
    device = torch.device(args.device)
    bind_worker_device(device)
    set_worker_threads(device, usable_cores())
    served = load_served(args.model, args.weights, args.artifact, device)
    batches = [int(b) for b in args.batches.split(",")]
    print(json.dumps(measure_ceiling(served, read_images(args.images), batches, device, args.repeats), indent=1))


if __name__ == "__main__":
    main()
