"""Prometheus metrics for ``GET /metrics``, correct across every process of a server.

A running server is several processes: the main one, an HTTP process per API server (forked), the
inference workers (spawned) and LitServe's manager. Counters live where the events happen (status
codes in the HTTP processes, batches in the workers, restarts in the main process), so the server
uses prometheus_client's multiprocess mode: each process writes its values to files in one
directory and a scrape sums them. The mode is picked when prometheus_client is imported (from
``PROMETHEUS_MULTIPROC_DIR``), so this module imports it only inside functions, and the server
enters ``multiprocess_mode`` in the main process before any other process starts. Without it (the
in-process tests) each process counts for itself and ``/metrics`` shows the HTTP process's own.

Values that describe the server now (queue depth, requests in flight, worker states) are read at
scrape time from the shared state they already live in (``LiveStateCollector``), so any HTTP
process gives the same answer.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from compile.cli_flags import visible_device

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
PREFIX = "vision_serve_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds, 0.5 ms (a GPU batch stage) to 30 s (the default deadline): a 1-2-5 series.
DURATION_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# Why the main process found a worker hung (service/supervisor/pool/hangs.py): the workers_hung label.
HUNG_SILENT, HUNG_STUCK_BATCH = "silent", "stuck_batch"
HUNG_REASONS = (HUNG_SILENT, HUNG_STUCK_BATCH)

# Every metric the server exports (histograms add _bucket, _sum and _count series; counters _total).
METRIC_NAMES = tuple(
    PREFIX + name
    for name in (
        "requests_total",
        "stage_duration_seconds",
        "batch_size",
        "images_total",
        "queue_depth",
        "requests_in_flight",
        "requests_in_flight_limit",
        "requests_expired_total",
        "workers",
        "worker_restarts_total",
        "workers_hung_total",
        "gpu_memory_used_bytes",
        "gpu_memory_total_bytes",
        "build_info",
        "model_ready",
        "model_images_total",
        "response_cache_hits_total",
        "response_cache_misses_total",
        "response_cache_redis_errors_total",
        "response_cache_rejected_total",
        "requests_abandoned_total",
        "images_unclaimed_total",
    )
)


@contextlib.contextmanager
def multiprocess_mode() -> Iterator[str]:
    """Multiprocess mode for this process and every process it starts, while the block runs.

    Each server gets a private directory: inside ``PROMETHEUS_MULTIPROC_DIR`` when the operator
    set one (a tmpfs, say), else in the temp dir; so two servers never sum or delete each other's
    values. It is removed afterwards and the variable restored. (A server killed with SIGKILL leaves
    its directory behind: a few 64 KiB files, and nothing reads them again.)
    """
    previous = os.environ.get(MULTIPROC_ENV)
    if previous:
        os.makedirs(previous, exist_ok=True)
    path = tempfile.mkdtemp(prefix="vision-serve-metrics-", dir=previous or None)
    os.environ[MULTIPROC_ENV] = path
    _reload_value_class()
    try:
        # Made now, so the series exist from the start at 0: increase() of a counter whose first
        # sample is already 1 (a first worker restart) would be 0, and its alert would never fire.
        metrics()
        yield path
    finally:
        if previous is None:
            os.environ.pop(MULTIPROC_ENV, None)
        else:
            os.environ[MULTIPROC_ENV] = previous
        _reload_value_class()
        shutil.rmtree(path, ignore_errors=True)


def _reload_value_class() -> None:
    import prometheus_client.values as values

    # prometheus_client picks in-process or file-backed values when first imported; it may have been
    # imported before the variable changed (by a library, or a test). Metrics made after this call
    # use the right kind, and the cache makes the next metrics() call make new ones.
    values.ValueClass = values.get_value_class()
    metrics.cache_clear()


def multiprocess_directory() -> str | None:
    return os.environ.get(MULTIPROC_ENV)


@dataclass(frozen=True)
class Metrics:
    """The metric objects one process records into (each process makes its own: see ``metrics``)."""

    requests: Any
    stage_duration: Any
    batch_size: Any
    images: Any
    requests_expired: Any
    worker_restarts: Any
    workers_hung: Any
    model_images: Any
    gpu_memory_used: Any
    gpu_memory_total: Any
    cache_hits: Any
    cache_misses: Any
    cache_redis_errors: Any
    cache_rejected: Any
    requests_abandoned: Any
    images_unclaimed: Any
    model_loads_on_demand: Any
    model_evictions: Any
    registry: Any  # this process's own values: what /metrics shows without multiprocess mode

    def observe_stages(self, timings_ms: Mapping[str, float]) -> None:
        for stage, ms in timings_ms.items():
            self._stage(stage).observe(ms / 1e3)

    @functools.lru_cache(maxsize=16)  # noqa: B019 - one Metrics per process, kept for its life
    def _stage(self, stage: str) -> Any:
        # labels() takes a lock and builds a key on every call; the children never change.
        return self.stage_duration.labels(stage=stage)

    def count_model_answers(self, model: str, version: int, codes: Iterable[int]) -> None:
        for code in codes:  # most requests carry one image: one increment, no tally
            self._model_images(model, version, code).inc()

    @functools.lru_cache(maxsize=256)  # noqa: B019 - one Metrics per process, kept for its life
    def _model_images(self, model: str, version: int, code: int) -> Any:
        return self.model_images.labels(model=model, version=str(version), code=str(code))

    @functools.lru_cache(maxsize=4)  # noqa: B019 - one Metrics per process, kept for its life
    def cache_hits_in(self, tier: str) -> Any:
        """``cache_hits{tier}``'s child: looked up once, not on every cached request."""
        return self.cache_hits.labels(tier=tier)

    @functools.lru_cache(maxsize=4)  # noqa: B019 - one Metrics per process, kept for its life
    def cache_rejected_in(self, tier: str) -> Any:
        return self.cache_rejected.labels(tier=tier)

    def observe_batch(self, images: int) -> None:
        self.batch_size.observe(images)
        self.images.inc(images)


@functools.cache
def metrics() -> Metrics:
    """This process's metric objects, made on first use (inside ``multiprocess_mode``, in a server)."""
    import prometheus_client.values as values
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    # The kind of values the environment asks for now: file-backed only inside multiprocess_mode.
    # The environment may have changed since the last switch (a caller restoring it afterwards).
    values.ValueClass = values.get_value_class()
    registry = CollectorRegistry()
    common = {"registry": registry}
    made = Metrics(
        requests=Counter(
            PREFIX + "requests",
            "Inference responses (POST /predict, OIP infer over HTTP and gRPC) by HTTP status code.",
            ["code"],
            **common,
        ),
        stage_duration=Histogram(
            PREFIX + "stage_duration_seconds",
            "Seconds each request spent per stage: cache (a response-cache hit's lookup), queue (admission to batch "
            "start), preprocess, pipeline_wait "
            "(a pipelined worker's prepared batch waiting for the engine), inference, postprocess, and total "
            "(admission to answer, as Server-Timing's total).",
            ["stage"],
            buckets=DURATION_BUCKETS,
            **common,
        ),
        batch_size=Histogram(
            PREFIX + "batch_size", "Images per batch the model ran.", buckets=BATCH_SIZE_BUCKETS, **common
        ),
        images=Counter(PREFIX + "images", "Images classified; rate() gives images per second.", **common),
        requests_expired=Counter(
            PREFIX + "requests_expired",
            "Requests dropped unrun because their deadline passed while queued (their clients got 504).",
            **common,
        ),
        worker_restarts=Counter(PREFIX + "worker_restarts", "Inference workers restarted after they died.", **common),
        workers_hung=Counter(
            PREFIX + "workers_hung",
            "Inference workers found hung by the main process, by reason: silent (no heartbeat for "
            "--worker-heartbeat-timeout-s) or stuck_batch (one batch past --batch-hang-timeout-s).",
            ["reason"],
            **common,
        ),
        model_images=Counter(
            PREFIX + "model_images",
            "Images answered by each model version, by status code (a request of N images counts N).",
            ["model", "version", "code"],
            **common,
        ),
        # livemax: every worker on a GPU sees the same device-wide value; a dead worker's stops counting.
        gpu_memory_used=Gauge(
            PREFIX + "gpu_memory_used_bytes",
            "GPU memory in use on the device (total - free, as nvidia-smi shows).",
            ["device"],
            multiprocess_mode="livemax",
            **common,
        ),
        gpu_memory_total=Gauge(
            PREFIX + "gpu_memory_total_bytes",
            "GPU memory on the device.",
            ["device"],
            multiprocess_mode="livemax",
            **common,
        ),
        cache_hits=Counter(
            PREFIX + "response_cache_hits",
            "Images answered from the response cache, by where the answer was: memory (this HTTP process) or redis.",
            ["tier"],
            **common,
        ),
        cache_misses=Counter(
            PREFIX + "response_cache_misses", "Images looked up in the response cache and not found.", **common
        ),
        cache_redis_errors=Counter(
            PREFIX + "response_cache_redis_errors",
            "Redis calls of the response cache that failed (timeout or error); each lookup among them was a miss.",
            ["reason"],
            **common,
        ),
        cache_rejected=Counter(
            PREFIX + "response_cache_rejected",
            "Values read back from the response cache that were not a valid answer of the model to the request "
            "(malformed, another model's, planted in Redis), by tier: each was a miss.",
            ["tier"],
            **common,
        ),
        requests_abandoned=Counter(
            PREFIX + "requests_abandoned",
            "Images dropped unrun because their client left (disconnected, or cancelled its gRPC call), by where "
            "they were dropped: http (before they were sent to a worker) or worker (before their batch was prepared).",
            ["where"],
            **common,
        ),
        images_unclaimed=Counter(
            PREFIX + "images_unclaimed",
            "Images decoded and run for nobody: their answer came back after the client left or got its 504.",
            **common,
        ),
        model_loads_on_demand=Counter(
            PREFIX + "model_loads_on_demand",
            "Models of a repository served on demand that a request had loaded (they were not resident); the "
            "requests' waits are the model_load stage of vision_serve_stage_duration_seconds.",
            ["model"],
            **common,
        ),
        model_evictions=Counter(
            PREFIX + "model_evictions",
            "Models evicted, least recently used first, to make room under the memory budget for one a request "
            "asked for.",
            ["model"],
            **common,
        ),
        registry=registry,
    )
    # The labelled series whose labels are known, at 0 from the start (see multiprocess_mode).
    for tier in ("memory", "redis"):
        made.cache_hits_in(tier)
        made.cache_rejected_in(tier)
    for reason in ("timeout", "error"):
        made.cache_redis_errors.labels(reason=reason)
    for where in ("http", "worker"):
        made.requests_abandoned.labels(where=where)
    for reason in HUNG_REASONS:
        made.workers_hung.labels(reason=reason)
    return made


def mark_process_dead(pid: int | None) -> None:
    """Drop a dead process's live gauges (its counters stay: they already happened)."""
    directory = multiprocess_directory()
    if directory and pid is not None:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, directory)


def physical_gpu(index: int, visible_devices: str | None) -> str:
    """The GPU as nvidia-smi names it: a worker shown one GPU through CUDA_VISIBLE_DEVICES calls it cuda:0."""
    name = visible_device(index, visible_devices)
    return f"cuda:{name}" if name.isdigit() else name  # an index, or a GPU-... / MIG-... UUID


def record_gpu_memory(device: Any) -> None:
    """Sample the device's memory into the gauges (a cheap driver call; no-op off the GPU)."""
    if getattr(device, "type", None) != "cuda":
        return
    import torch

    free, total = torch.cuda.mem_get_info(device)
    label = physical_gpu(device.index or 0, os.environ.get("CUDA_VISIBLE_DEVICES"))
    m = metrics()
    m.gpu_memory_used.labels(device=label).set(total - free)
    m.gpu_memory_total.labels(device=label).set(total)


@dataclass
class LiveState:
    """Readers of the server's shared state, evaluated at scrape time."""

    queue_depth: Callable[[], int]
    in_flight: Callable[[], int]
    in_flight_limit: int
    worker_states: Callable[[], Mapping[str, str]]
    build_info: Callable[[], Mapping[str, str]]
    models: Callable[[], list[tuple[str, str, bool]]]  # (model, version, ready) of each served version


class LiveStateCollector:
    """Gauges read at scrape time: the same in every HTTP process, since the state is shared."""

    def __init__(self, state: LiveState) -> None:
        self.state = state

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        state = self.state
        yield _gauge(PREFIX + "queue_depth", "Images waiting for an inference worker.", _safe(state.queue_depth))
        yield _gauge(
            PREFIX + "requests_in_flight",
            "Images admitted and not yet answered (queued or running; a request of N images counts N); "
            "bounded by --max-queue.",
            state.in_flight(),
        )
        yield _gauge(
            PREFIX + "requests_in_flight_limit",
            "Most images in flight (--max-queue); more get 503.",
            state.in_flight_limit,
        )
        workers = GaugeMetricFamily(PREFIX + "workers", "Inference workers by state.", labels=["state"])
        counts: dict[str, int] = {"ready": 0}
        for worker_state in state.worker_states().values():
            counts[str(worker_state)] = counts.get(str(worker_state), 0) + 1
        for name, count in sorted(counts.items()):
            workers.add_metric([name], count)
        yield workers
        build_info = state.build_info()
        info = GaugeMetricFamily(
            PREFIX + "build_info", "What this server runs, its default model's (always 1).", labels=list(build_info)
        )
        info.add_metric(list(build_info.values()), 1)
        yield info
        models = GaugeMetricFamily(
            PREFIX + "model_ready",
            "Each served model version: 1 when all its workers are ready, else 0.",
            labels=["model", "version"],
        )
        for name, version, ready in state.models():
            models.add_metric([name, version], 1 if ready else 0)
        yield models


def _gauge(name: str, documentation: str, value: float) -> Any:
    from prometheus_client.core import GaugeMetricFamily

    return GaugeMetricFamily(name, documentation, value=value)


def _safe(read: Callable[[], int]) -> float:
    try:
        return read()
    except (OSError, EOFError, NotImplementedError):  # the manager is gone: shutting down
        return float("nan")


def exposition(live: LiveStateCollector | None) -> bytes:
    """The text a scrape gets: every process's values (or this process's own), plus the live gauges."""
    from prometheus_client import CollectorRegistry, generate_latest

    directory = multiprocess_directory()
    if directory:
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=directory)
    else:
        registry = metrics().registry
    text = generate_latest(registry)
    if live is not None:
        text += generate_latest(live)  # anything with collect() will do; a registry would call it twice
    return text
