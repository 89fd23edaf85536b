"""The model a worker serves: encoded images in, each request's top-k labels out, per-item errors.

Nothing here raises for one bad item: decode failures travel through the batch as ``ImageError``
values and become that request's own 4xx ``Answer``. Only a failure of the model itself (a real
server error) fails the batch. The worker's loop (service/worker/loop.py) calls ``prepare`` and
``run``, the ``BatchedModel`` contract; service/worker/entry.py builds this object in the worker.
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from compile.model_request import ModelRequest
from preprocessing import ImageError, PreparedBatch, Preprocessor, create_preprocessor
from preprocessing.device_health import unusable_device
from service.heap import HeapTrimmer, process_heap_trimmer
from service.metrics import metrics, record_gpu_memory
from service.model_info import resolve_activation
from service.settings import ServeSettings
from service.tracing import ENGINE, PIPELINE_WAIT, PREPROCESS, BatchTrace, record_batch, trace_batch
from service.wire import Answer, ImageRequest
from service.worker.engine import (
    ENGINE_EAGER,
    ServedModel,
    bind_worker_device,
    decode_threads,
    load_artifact,
    load_eager,
    set_worker_threads,
    with_lone_engine,
)
from service.worker.outputs import activation_function, logits_rows, top_scores

logger = logging.getLogger(__name__)

GPU_MEMORY_SAMPLE_INTERVAL_S = 1.0


@dataclass
class ClassifyBatch:
    """What ``prepare`` hands to ``run``: the device tensor plus what each request asked for."""

    prepared: PreparedBatch
    top_k: list[int]
    preprocess_ms: float
    queue_ms: list[float | None]  # per request: from queueing in the HTTP process to this batch's start
    request_ids: list[str | None] = field(default_factory=list)
    prepared_at: float = 0.0  # time.perf_counter() when preparing ended
    trace: BatchTrace | None = None  # its traced requests (service/tracing/); None: none, or tracing off
    logits: list[bool] = field(default_factory=list)  # per request: it asked for its whole logits row


@dataclass
class ItemResult:
    """One request's outcome inside ``run``, before it becomes an ``Answer``."""

    batch_size: int
    timings_ms: dict[str, float] = field(default_factory=dict)
    predictions: list[tuple[int, float]] | None = None
    error: ImageError | None = None
    logits: bytes | None = None  # the whole row, float32, for a request that asked for it


def warmup_jpeg(width: int = 640, height: int = 480) -> bytes:
    """A small synthetic photo-sized JPEG, to run the whole decode path once before serving."""
    gradient = np.linspace(0, 255, width * height * 3, dtype=np.float32).reshape(height, width, 3)
    buf = io.BytesIO()
    Image.fromarray(gradient.astype(np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


def warmup_batch_sizes(served: ServedModel, max_batch_size: int) -> list[int]:
    """Batch sizes to run once before serving.

    Eager: 1 and the largest. A compiled engine: also every power of two in between, because its
    first call at a new shape still sets up kernels (oneDNN primitives on CPU, TensorRT contexts).
    """
    if served.engine_name == ENGINE_EAGER:
        return sorted({1, max_batch_size})
    sizes = {1, max_batch_size}
    size = 2
    while size < max_batch_size:
        sizes.add(size)
        size *= 2
    return sorted(sizes)


def load_served_model(settings: ServeSettings, device: torch.device) -> ServedModel:
    """The artifact ``settings`` names, or the model of ``--model`` uncompiled; on a CPU with several
    workers, with an engine on all their cores for a lone image (``with_lone_engine``)."""
    served = load_engine(settings, device)
    if device.type == "cpu" and settings.workers_per_device > 1:
        threads = settings.engine_threads
        lone_threads = threads * settings.workers_per_device
        served = with_lone_engine(served, threads, lone_threads, lambda: load_engine(settings, device))
        if served.lone_run is not None:  # warm it too: its own session, or its thread count's kernels
            height, width = served.entry.preprocess.input_size
            with torch.inference_mode():
                served(torch.zeros(1, 3, height, width), alone=True)
    return served


def make_preprocessor(settings: ServeSettings, served: ServedModel, device: torch.device) -> Preprocessor:
    """The preprocessing backend the settings name, for the served model's input, on ``device``."""
    return create_preprocessor(
        settings.preprocess,
        served.entry.preprocess,
        device,
        max_batch_size=settings.max_batch_size,
        max_image_pixels=settings.max_image_pixels,
        decode_threads=decode_threads(settings.engine_threads, device),
    )


def load_engine(settings: ServeSettings, device: torch.device) -> ServedModel:
    if settings.artifact:
        return load_artifact(settings.artifact, device, settings.served_name)
    return load_eager(ModelRequest.from_settings(settings), settings.weights, device)


def record_batch_trace(
    batch: ClassifyBatch, results: list[ItemResult], served: ServedModel, run: tuple[float, float], pipelined: bool
) -> None:
    """The traced requests' worker spans (service/tracing/): preprocess, pipeline_wait when pipelined,
    engine (``run``: its perf_counter start and end); an image that did not decode ends at preprocess."""
    prepare_started = batch.prepared_at - batch.preprocess_ms / 1e3
    stages = [(PREPROCESS, prepare_started, batch.prepared_at)]
    if pipelined:
        stages.append((PIPELINE_WAIT, batch.prepared_at, run[0]))
    if batch.prepared.ok_indices:  # else the engine did not run
        stages.append((ENGINE, *run))
    attributes = {"batch.size": len(results), "model": served.entry.name, "engine": served.engine_name}
    failed = {i: result.error.detail for i, result in enumerate(results) if result.error is not None}
    record_batch(batch.trace, stages, attributes, failed)


def to_answer(result: ItemResult, served: ServedModel) -> Answer:
    """The compact answer the loop sends to the HTTP process."""
    if result.error is not None:
        return Answer(
            status_code=result.error.status_code,
            detail=result.error.detail,
            batch_size=result.batch_size,
            timings_ms=result.timings_ms,
        )
    labels = served.entry.labels
    return Answer(
        predictions=tuple((index, labels[index], score) for index, score in result.predictions),
        model=served.entry.name,
        engine=served.engine_name,
        batch_size=result.batch_size,
        timings_ms=result.timings_ms,
        logits=result.logits,
    )


def never_idle() -> bool:
    """What a classifier knows of the other workers before its loop tells it: never idle."""
    return False


class Classifier:
    """``prepare`` (decode, resize, upload; on a GPU on a CUDA stream of its own when pipelined) and
    ``run`` (engine, activation and top-k on the device, answers). Built by ``load`` in the worker."""

    def __init__(
        self, settings: ServeSettings, served: ServedModel, preprocessor: Preprocessor, device: torch.device
    ) -> None:
        self.settings = settings
        self.served = served
        self.preprocessor = preprocessor
        self.device = device
        self.activation = resolve_activation(settings.activation, served.entry.activation)
        self._activate = activation_function(self.activation)
        # A pipelined worker prepares the next batch in another thread while this one runs: on a GPU
        # that work goes on a stream of its own, so it overlaps the engine's (service/worker/loop.py).
        self.pipelined = settings.pipeline_depth > 1  # the plan resolved it (service/supervisor/planning/)
        on_gpu = device.type == "cuda"
        self.prepare_stream = torch.cuda.Stream(device) if self.pipelined and on_gpu else None
        self.heap_trimmer = HeapTrimmer()  # not started: ``load`` gives a worker's classifier the process's
        # Whether every other worker is idle (the loop's runner tells: service/worker/runner.py);
        # until then never, and a lone image runs on this worker's own threads.
        self.others_idle: Callable[[], bool] = never_idle
        self._gpu_memory_sampled_at = 0.0

    @classmethod
    def load(cls, settings: ServeSettings, device: str) -> Classifier:
        """Bind the device, load the model, make the preprocessor, warm up: ready to serve."""
        torch_device = torch.device(device)
        bind_worker_device(torch_device)  # the pool hands each worker its GPU as "cuda:N"
        set_worker_threads(torch_device, settings.engine_threads)
        served = load_served_model(settings, torch_device)
        preprocessor = make_preprocessor(settings, served, torch_device)
        logger.info(
            "Model loaded: model=%s engine=%s device=%s, %s; warming up",
            served.entry.name,
            served.engine_name,
            torch_device,
            served.description,
        )
        classifier = cls(settings, served, preprocessor, torch_device)
        classifier.warm_up()
        classifier.heap_trimmer = process_heap_trimmer()  # shared with the process's other models
        record_gpu_memory(torch_device)
        return classifier

    def release(self) -> None:
        """Drop the engine and the preprocessor now: the slot's loop ended, and its process may hold
        other models for weeks (service/worker/host.py). Not left to the collector: the loop's runner
        and this object reference each other (``watch_other_workers``), and the load froze this object
        out of the collector's passes (service/heap.py), so that cycle, and the engine, would never go."""
        self.others_idle = never_idle
        self.prepare_stream = None
        del self.served, self.preprocessor

    def watch_other_workers(self, others_idle: Callable[[], bool]) -> None:
        """The loop's hook: how to tell that no other worker is running a batch."""
        self.others_idle = others_idle

    def warm_up(self) -> None:
        """Run the full path at the batch sizes requests will form, so first requests are not slow."""
        started = time.perf_counter()
        sample = warmup_jpeg()
        for size in warmup_batch_sizes(self.served, self.settings.max_batch_size):
            results = self._classify(self.prepare([ImageRequest(sample)] * size))
            if any(r.error for r in results):
                raise RuntimeError(f"Warm-up failed: {results[0].error}")
        logger.info("Warm-up done in %.1f s", time.perf_counter() - started)

    def prepare(self, requests: list[ImageRequest]) -> ClassifyBatch:
        now = time.monotonic()
        queue_ms = [None if item.queued_at is None else (now - item.queued_at) * 1e3 for item in requests]
        started = time.perf_counter()
        stream = self.prepare_stream
        with self.heap_trimmer.busy(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            prepared = self.preprocessor([item.image for item in requests])
            if stream is not None:
                # Handed over finished: the engine's stream then never waits on this one, and the
                # memory is not reused before the engine is done with it (run syncs on .cpu()).
                stream.synchronize()
        prepared_at = time.perf_counter()
        request_ids = [item.request_id for item in requests]
        top_k = [item.top_k for item in requests]
        preprocess_ms = (prepared_at - started) * 1e3
        trace = trace_batch(requests, now)
        logits = [item.logits for item in requests]
        return ClassifyBatch(prepared, top_k, preprocess_ms, queue_ms, request_ids, prepared_at, trace, logits)

    def run(self, batch: ClassifyBatch) -> list[Answer]:
        # A pipelined worker's prepared batch waits while the engine runs the one before it: its
        # own stage, or the breakdown would not add up to the time the request spent.
        run_started = time.perf_counter()
        pipeline_wait_ms = (run_started - batch.prepared_at) * 1e3 if self.pipelined else None
        results = self._classify(batch, pipeline_wait_ms)
        if batch.trace is not None:
            record_batch_trace(batch, results, self.served, (run_started, time.perf_counter()), self.pipelined)
        # Counted here, not in _classify, which warm-up also runs.
        classified = sum(r.predictions is not None for r in results)
        if classified:
            metrics().observe_batch(classified)
        now = time.monotonic()
        if now - self._gpu_memory_sampled_at >= GPU_MEMORY_SAMPLE_INTERVAL_S:
            self._gpu_memory_sampled_at = now
            record_gpu_memory(self.device)
        if logger.isEnabledFor(logging.DEBUG):
            timings = results[0].timings_ms if results else {}
            logger.debug(
                "Batch of %d (%d classified): %s",
                len(results),
                classified,
                ", ".join(f"{k} {v:.1f} ms" for k, v in timings.items() if k != "queue"),
                extra={"request_ids": batch.request_ids},
            )
        return [to_answer(result, self.served) for result in results]

    def unusable_device(self) -> str | None:
        """After a failure: why this worker's device no longer runs work, or None (service/worker/loop.py)."""
        return unusable_device(self.device)

    def _classify(self, batch: ClassifyBatch, pipeline_wait_ms: float | None = None) -> list[ItemResult]:
        prepared = batch.prepared
        results = []
        for error, queue_ms in zip(prepared.errors, batch.queue_ms, strict=True):
            timings = {} if queue_ms is None else {"queue": queue_ms}
            timings["preprocess"] = batch.preprocess_ms
            if pipeline_wait_ms is not None:
                timings["pipeline_wait"] = pipeline_wait_ms
            results.append(ItemResult(len(prepared), timings, error=error))
        ok = prepared.ok_indices
        if not ok:
            return results
        started = time.perf_counter()
        k = min(max(batch.top_k[i] for i in ok), self.served.entry.num_classes)
        with self.heap_trimmer.busy(), torch.inference_mode():
            # Only a worker with a lone engine asks the others: the shared array is read for nothing else.
            alone = self.served.lone_run is not None and len(ok) == 1 and self.others_idle()
            logits = self.served(prepared.images, alone=alone).float()
            # The activation and top-k on the device: only k values per image cross back to the host,
            # and a whole row only for a request that asked for it.
            scores, indices = top_scores(logits, self._activate, k)
            asked = [row for row, i in enumerate(ok) if batch.logits[i]] if any(batch.logits) else []
            rows = logits_rows(logits, asked)
        inference_ms = (time.perf_counter() - started) * 1e3
        for row, i in enumerate(ok):
            results[i].predictions = list(zip(indices[row], scores[row], strict=True))[: batch.top_k[i]]
            results[i].timings_ms["inference"] = inference_ms
            results[i].logits = rows.get(row)
        return results
