"""Pipelined worker: does preparing batch N+1 while batch N runs pay off, and where?

    python -m benchmarks.pipeline                   # stand-in stages, then the real models on this CPU

The real worker loop's pieces (service/worker/loop.py) read a real request channel in this process, with
``pipeline_depth`` 1 (prepare, then predict, then the next batch) and 2 (a thread prepares the next
batch while this one runs). Requests are all queued up front, so every batch is full.

1. Stand-in stages of known duration that release the GIL (``time.sleep``), as GPU work does:
   throughput should reach 1 / max(prepare, predict) with the pipeline and 1 / (prepare + predict)
   without it.
2. The real Classifier on this machine's CPU (Pillow decode, eager model), which decides whether
   the pipeline is on for CPU serving: on a CPU both stages want the same cores.

Results: ``pipeline.json`` and ``pipeline.md`` in the results folder.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import zmq

from benchmarks.harness.common import machine_record, results_dir, write_results
from service.testing import (
    BatchCollector,
    BatchedModel,
    BatchPolicy,
    BatchRunner,
    ChannelConfig,
    PipelinedRunner,
    WorkerChannel,
)
from service.tune.images import IMAGENET_SIZE, photo_jpegs
from service.wire import Answer, ImageRequest, RequestBatch

BATCH = 8
STAND_IN_CASES_MS = ((20.0, 20.0), (10.0, 30.0), (30.0, 10.0))
STAND_IN_BATCHES = 40
REPEATS = 3


@dataclass
class StandInModel:
    """Prepare and run take fixed times and release the GIL, like GPU work behind a sync."""

    prepare_s: float
    run_s: float

    def prepare(self, requests: list[ImageRequest]) -> list[ImageRequest]:
        time.sleep(self.prepare_s)
        return requests

    def run(self, prepared: list[ImageRequest]) -> list[Answer]:
        time.sleep(self.run_s)
        return [Answer(batch_size=len(prepared))] * len(prepared)

    def unusable_device(self) -> str | None:
        return None


def images_per_second(model: BatchedModel, requests: list[ImageRequest], depth: int) -> float:
    """All ``requests`` queued, the loop started; the rate at which their answers come back."""
    with tempfile.TemporaryDirectory(prefix="pipeline-") as tmp:
        config = ChannelConfig(tmp, api_servers=1)
        context = zmq.Context()
        answers = context.socket(zmq.PULL)
        answers.bind(config.answer_address(0))
        sender = context.socket(zmq.PUSH)
        sender.connect(config.request_address(0))
        worker = WorkerChannel(config, 0)
        for uid, request in enumerate(requests):
            sender.send(pickle.dumps(RequestBatch(0, [uid], [request])))
        time.sleep(0.2)  # let the local socket deliver them all before the clock starts
        collector = BatchCollector(worker, BatchPolicy(BATCH, 0.0, pipeline_depth=depth))
        runner = BatchRunner(model, worker, 0)
        stop = threading.Event()
        if depth > 1:
            thread = threading.Thread(
                target=PipelinedRunner(collector, runner, depth - 1).serve, args=(stop,), daemon=True
            )
        else:

            def sequential() -> None:
                while not stop.is_set():
                    batch = collector.get_batch()
                    if batch:
                        runner.run_batch(batch)

            thread = threading.Thread(target=sequential, daemon=True)
        started = time.perf_counter()
        thread.start()
        received = 0
        while received < len(requests):
            received += len(pickle.loads(answers.recv()).uids)
        elapsed = time.perf_counter() - started
        stop.set()
        thread.join()
        worker.close()
        context.destroy(linger=0)
    return len(requests) / elapsed


def stand_in_results() -> list[dict]:
    rows = []
    requests = [ImageRequest(b"x")] * (BATCH * STAND_IN_BATCHES)
    for prepare_ms, predict_ms in STAND_IN_CASES_MS:
        model = StandInModel(prepare_ms / 1e3, predict_ms / 1e3)
        rates = {d: statistics.median(images_per_second(model, requests, d) for _ in range(REPEATS)) for d in (1, 2)}
        bound = BATCH / (max(prepare_ms, predict_ms) / 1e3)
        rows.append(
            {
                "prepare_ms": prepare_ms,
                "predict_ms": predict_ms,
                "sequential_img_s": round(rates[1], 1),
                "pipelined_img_s": round(rates[2], 1),
                "bound_img_s": round(bound, 1),
                "pipelined_of_bound": round(rates[2] / bound, 3),
                "sequential_of_sum_bound": round(rates[1] / (BATCH / ((prepare_ms + predict_ms) / 1e3)), 3),
            }
        )
        print(
            f"stand-in prepare {prepare_ms:g} ms, predict {predict_ms:g} ms: sequential {rates[1]:.0f} img/s, "
            f"pipelined {rates[2]:.0f} img/s = {rates[2] / bound:.2f} x 1/max"
        )
    return rows


def real_model_results(models: Sequence[str], images: int) -> list[dict]:
    from service.settings import ServeSettings
    from service.testing import Classifier

    width, height = IMAGENET_SIZE
    jpegs = photo_jpegs(width, height)
    requests = [ImageRequest(jpegs[i % len(jpegs)]) for i in range(images)]
    rows = []
    for model in models:
        weights = "imagenet" if model == "efficientnet-lite0" else "random"
        classifier = Classifier.load(
            ServeSettings(model=model, weights=weights, device="cpu", max_batch_size=BATCH), "cpu"
        )
        rates = {
            d: statistics.median(images_per_second(classifier, requests, d) for _ in range(REPEATS)) for d in (1, 2)
        }
        rows.append(
            {
                "model": model,
                "sequential_img_s": round(rates[1], 2),
                "pipelined_img_s": round(rates[2], 2),
                "ratio": round(rates[2] / rates[1], 3),
            }
        )
        print(f"{model} on this CPU: sequential {rates[1]:.1f} img/s, pipelined {rates[2]:.1f} img/s")
    return rows


def render(stand_in: list[dict], real: list[dict]) -> str:
    lines = [
        f"# Pipelined worker: batches of {BATCH}, all requests queued, median of {REPEATS}",
        "",
        "| prepare ms | predict ms | sequential img/s | pipelined img/s | 1/max bound | pipelined / bound |",
        "|---|---|---|---|---|---|",
    ]
    for r in stand_in:
        lines.append(
            f"| {r['prepare_ms']:g} | {r['predict_ms']:g} | {r['sequential_img_s']:.0f} | {r['pipelined_img_s']:.0f} "
            f"| {r['bound_img_s']:.0f} | {r['pipelined_of_bound']:.2f} |"
        )
    if real:
        lines += ["", "| model (this CPU, eager fp32, Pillow) | sequential img/s | pipelined img/s | ratio |"]
        lines.append("|---|---|---|---|")
        for r in real:
            lines.append(f"| {r['model']} | {r['sequential_img_s']} | {r['pipelined_img_s']} | {r['ratio']:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="efficientnet-lite0,resnet152", help="comma-separated; empty: none")
    parser.add_argument("--images", type=int, default=64, help="images per real-model run")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    stand_in = stand_in_results()
    real = real_model_results([m for m in args.models.split(",") if m], args.images)
    record = {"machine": machine_record(), "batch": BATCH, "repeats": REPEATS, "stand_in": stand_in, "real": real}
    write_results(results_dir(args.out), "pipeline", record, render(stand_in, real), ".md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
