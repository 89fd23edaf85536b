"""Load generator: closed loop (N requests, C in flight) or open loop (constant or Poisson arrivals).

    python -m service.tune.images /tmp/bench-images
    python -m service.tune.loadgen --url http://127.0.0.1:8000/predict --images /tmp/bench-images \\
        --requests 400 --concurrency 32
    python -m service.tune.loadgen --url http://127.0.0.1:8000/predict --images /tmp/bench-images \\
        --requests 400 --rate 8 --arrivals poisson

Each request POSTs the next image of the folder (raw bytes, so any server that takes an image body
works: vision-serve's /predict, TorchServe's /predictions/NAME; an ``encode`` function wraps the image
for a server that wants another body, as Triton's KServe v2 request). Per request it keeps the client
latency, the status, and what the server says about it: ``X-Batch-Size`` and ``Server-Timing``
(queue, preprocess, inference, postprocess, total). The summary has p50/p95/p99, throughput,
errors by status and the median server-side breakdown.

Bounded: at most ``requests`` requests and ``max_seconds`` of sending; loopback URLs only.
Open-loop latencies count from the *scheduled* send time, so a lagging client or a full connection
pool shows up as latency instead of silently lowering the offered load (no coordinated omission).

The pieces are every benchmark's, so that a latency, a lost request and a closed loop mean the same
in all of them: :func:`exchange` (one timed POST), :func:`closed_loop` (C clients, each sends the
next request when its last answer came; the soak and the swap benchmark drive theirs with it, each
with its own requests and records) and :func:`oip_images` (every OIP binary request).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import ipaddress
import json
import logging
import math
import multiprocessing
import os
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import httpx

from preprocessing.probe import sniff_format
from service.tune.images import read_images

logger = logging.getLogger(__name__)
T = TypeVar("T")

CLOSED, OPEN = "closed", "open"
CONSTANT, POISSON = "constant", "poisson"
CLIENT_TIMEOUT_S = 300.0  # longer than any server deadline: a request that times out here was lost
DEFAULT_MAX_SECONDS = 600.0
TIMING_PARTS = ("queue", "preprocess", "pipeline_wait", "inference", "postprocess", "total")
# An image -> the request body and headers that carry it. Module-level functions (or partials of them)
# only: run_load pickles it for its client processes.
Encoder = Callable[[bytes], tuple[bytes, dict[str, str]]]


@dataclass(frozen=True)
class LoadSpec:
    """What load to offer. Closed loop: ``concurrency`` clients, each sends when its last answer came.
    Open loop: ``rate`` arrivals per second, constant spacing or Poisson, however many are in flight."""

    requests: int
    mode: str = CLOSED
    concurrency: int = 1
    rate: float = 0.0
    arrivals: str = POISSON
    max_seconds: float = DEFAULT_MAX_SECONDS
    seed: int = 0
    warmup_requests: int = 0  # sent first (closed loop at ``concurrency``, or 1), not counted
    first_arrival_s: float = 0.0  # open loop: when the first arrival is due (splits a constant stream)

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}.")
        if self.mode not in (CLOSED, OPEN):
            raise ValueError(f"mode must be {CLOSED!r} or {OPEN!r}, got {self.mode!r}.")
        if self.mode == CLOSED and self.concurrency < 1:
            raise ValueError(f"a closed loop needs concurrency >= 1, got {self.concurrency}.")
        if self.mode == OPEN and not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"an open loop needs a rate > 0 requests/s (--rate), got {self.rate}.")
        if self.arrivals not in (CONSTANT, POISSON):
            raise ValueError(f"arrivals must be {CONSTANT!r} or {POISSON!r}, got {self.arrivals!r}.")
        if not self.max_seconds > 0:
            raise ValueError(f"max_seconds must be > 0, got {self.max_seconds}.")

    @property
    def label(self) -> str:
        if self.mode == CLOSED:
            return f"closed loop, concurrency {self.concurrency}"
        return f"open loop, {self.arrivals} arrivals at {self.rate:g} req/s"


@dataclass(frozen=True)
class Sample:
    """One request as the client saw it, plus what the server reported about it."""

    sent_s: float  # when it was (scheduled to be) sent, seconds from the start of the run
    latency_ms: float
    status: int | None  # None: lost (connection error or client timeout)
    batch_size: int | None = None
    timings_ms: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    lag_ms: float = 0.0  # open loop: how long after its scheduled time the client actually sent it


def parse_server_timing(header: str | None) -> dict[str, float]:
    """``"queue;dur=1.5, inference;dur=30"`` -> ``{"queue": 1.5, "inference": 30.0}``; other metrics
    and parameters are ignored."""
    timings: dict[str, float] = {}
    for entry in (header or "").split(","):
        name, *params = (part.strip() for part in entry.split(";"))
        for param in params:
            key, _, value = param.partition("=")
            if name and key.strip() == "dur":
                with contextlib.suppress(ValueError):  # a malformed entry is skipped, not fatal
                    timings[name] = float(value.strip().strip('"'))
    return timings


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: always a value that was actually observed (NaN for none)."""
    if not sorted_values:
        return math.nan
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def arrival_times(count: int, rate: float, arrivals: str, rng: random.Random) -> list[float]:
    """Send times in seconds from the start: evenly spaced, or a Poisson process (exponential gaps)."""
    if arrivals == CONSTANT:
        return [i / rate for i in range(count)]
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def check_loopback(url: str) -> None:
    host = urlsplit(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"The load generator only targets loopback servers (127.0.0.1, ::1, localhost), not {url}.")


def content_type(image: bytes) -> str:
    fmt = sniff_format(image)
    return f"image/{fmt.lower()}" if fmt else "application/octet-stream"


def raw_image(image: bytes) -> tuple[bytes, dict[str, str]]:
    """The default request: the image bytes as the body, with their media type."""
    return image, {"Content-Type": content_type(image)}


def oip_images(
    image: bytes,
    count: int = 1,
    *,
    input_name: str = "IMAGE",
    output_names: Sequence[str] = ("LABELS",),
    shape: Sequence[int] | None = None,
    binary_outputs: bool = True,
) -> tuple[bytes, dict[str, str]]:
    """An Open Inference Protocol infer request of ``count`` copies of ``image``, in the binary tensor
    extension as tritonclient sends it: the JSON header, then ``input_name`` as a BYTES tensor (each
    element a 4-byte little-endian length, then its bytes); ``Inference-Header-Content-Length`` says
    where the JSON ends. For ``/v2/models/NAME/infer``; ``functools.partial(oip_images, count=32)``
    is an ``Encoder``.

    The one builder of every benchmark's OIP requests; what differs between servers is a parameter:
    the tensor names (vision-serve's ``IMAGE``, the Triton peers' ``image``), the shape (default
    ``[count]``; ``(1, 1)`` for a model whose input has dims [1]) and whether the outputs come back
    binary (less work in the answer) or as JSON (an answer read like vision-serve's).
    """
    from service.http.oip.tensors import serialize_bytes  # only the client processes of OIP runs need it

    shape = [count] if shape is None else list(shape)
    if math.prod(shape) != count:
        raise ValueError(f"a BYTES tensor of shape {shape} holds {math.prod(shape)} elements, not {count}.")
    data = serialize_bytes([image] * count)
    header = json.dumps(
        {
            "inputs": [
                {"name": input_name, "shape": shape, "datatype": "BYTES", "parameters": {"binary_data_size": len(data)}}
            ],
            "outputs": [{"name": name, "parameters": {"binary_data": binary_outputs}} for name in output_names],
        }
    ).encode()
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))}
    return header + data, headers


@dataclass(frozen=True)
class Exchange:
    """One POST as the driver timed it: the whole response, or the transport error that took its place."""

    sent: float  # time.perf_counter() when it was (scheduled to be) sent
    latency_ms: float  # from ``sent`` to the whole response read (or the error)
    response: httpx.Response | None  # None: lost (connection error or client timeout)
    error: httpx.HTTPError | None = None
    lag_ms: float = 0.0  # how long after ``scheduled`` it actually went (open loop)


async def exchange(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    params: dict[str, str] | None = None,
    scheduled: float | None = None,
) -> Exchange:
    """POST one prepared request and time it. Every load of the project goes through here, so that
    latency (send, or the scheduled send, to the whole response) and a lost request (any
    ``httpx.HTTPError``: connection refused or reset, the client's timeout) mean one thing in every
    benchmark; what an answer is worth (a status, a label, a version) is the caller's to judge."""
    actual = time.perf_counter()
    sent = actual if scheduled is None else scheduled
    lag_ms = (actual - sent) * 1e3
    try:
        response = await client.post(url, content=body, headers=headers, params=params)
    except httpx.HTTPError as exc:
        return Exchange(sent, (time.perf_counter() - sent) * 1e3, None, exc, lag_ms)
    return Exchange(sent, (time.perf_counter() - sent) * 1e3, response, None, lag_ms)


def _never() -> bool:
    return False


async def closed_loop(
    send: Callable[[int], Awaitable[T]],
    concurrency: int,
    indices: Iterable[int],
    stop: Callable[[], bool] = _never,
    into: list[T] | None = None,
) -> list[T]:
    """The closed loop of every load: ``concurrency`` clients, each takes the next index (shared: each
    is sent by exactly one client), awaits ``send(index)`` and takes the next, until the indices run
    out or ``stop()`` says so before a send; a request in flight is always finished.

    ``send`` is the caller's: its request encoding and what it records of the answer (usually an
    :func:`exchange` and a record of it). Results are appended to ``into`` (a new list by default) as
    they come, so a caller that cancels the loop keeps what was answered. If one client raises, the
    others are cancelled and the error is raised: no client outlives the loop."""
    results: list[T] = [] if into is None else into
    next_index = iter(indices)

    async def client_loop() -> None:
        for index in next_index:
            if stop():
                return
            results.append(await send(index))

    clients = [asyncio.create_task(client_loop()) for _ in range(concurrency)]
    try:
        await asyncio.gather(*clients)
    finally:
        for client in clients:  # after an error in one (gather cancels them all when it is cancelled)
            client.cancel()
    return results


class _Sender:
    """Request ``index``: the ``index % n``-th image, encoded once; answered as a :class:`Sample`."""

    def __init__(
        self, client: httpx.AsyncClient, url: str, images: Sequence[bytes], started: float, encode: Encoder = raw_image
    ) -> None:
        self.client, self.url, self.started = client, url, started
        # Encoded once per image before the clock starts: every server's client does the same work per request.
        self.bodies = [encode(image) for image in images]

    async def send(self, index: int, scheduled: float | None = None) -> Sample:
        body, headers = self.bodies[index % len(self.bodies)]
        done = await exchange(self.client, self.url, body, headers, scheduled=scheduled)
        sent_s, response = done.sent - self.started, done.response
        if response is None:
            return Sample(sent_s, done.latency_ms, None, error=repr(done.error), lag_ms=done.lag_ms)
        batch = response.headers.get("X-Batch-Size")
        return Sample(
            sent_s,
            done.latency_ms,
            response.status_code,
            int(batch) if batch and batch.isdigit() else None,
            parse_server_timing(response.headers.get("Server-Timing")),
            None if response.status_code == 200 else response.text[:200],
            done.lag_ms,
        )


async def _closed_loop(sender: _Sender, spec: LoadSpec, first: int, deadline: float) -> list[Sample]:
    indices = range(first, first + spec.requests)
    return await closed_loop(sender.send, spec.concurrency, indices, lambda: time.perf_counter() >= deadline)


async def _open_loop(sender: _Sender, spec: LoadSpec, first: int, deadline: float) -> list[Sample]:
    times = arrival_times(spec.requests, spec.rate, spec.arrivals, random.Random(spec.seed))
    offsets = [spec.first_arrival_s + t for t in times]
    start = time.perf_counter()
    tasks = []
    for i, offset in enumerate(offsets):
        scheduled = start + offset
        if scheduled >= deadline:
            break
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(sender.send(first + i, scheduled)))
    return list(await asyncio.gather(*tasks))


async def run_load_async(
    url: str, images: Sequence[bytes], spec: LoadSpec, encode: Encoder = raw_image
) -> tuple[list[Sample], float]:
    """Offer ``spec``'s load to ``url``; returns the samples and the wall time of the measured part."""
    check_loopback(url)
    if not images:
        raise ValueError("No images to send.")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, limits=limits) as client:
        sender = _Sender(client, url, images, time.perf_counter(), encode)
        if spec.warmup_requests:
            warmup = LoadSpec(spec.warmup_requests, concurrency=max(1, spec.concurrency), max_seconds=spec.max_seconds)
            await _closed_loop(sender, warmup, 0, time.perf_counter() + spec.max_seconds)
        sender.started = time.perf_counter()
        deadline = sender.started + spec.max_seconds
        loop = _closed_loop if spec.mode == CLOSED else _open_loop
        samples = await loop(sender, spec, spec.warmup_requests, deadline)
        elapsed = time.perf_counter() - sender.started
    return samples, elapsed


def run_load(
    url: str,
    images: Sequence[bytes],
    spec: LoadSpec,
    processes: int = 1,
    encode: Encoder = raw_image,
    clients: LoadClients | None = None,
) -> LoadResult:
    """Blocking :func:`run_load_async`. ``processes`` > 1 splits the load over that many client
    processes (concurrency and rate divided; Poisson streams merge into a Poisson stream), for
    servers fast enough that one Python client process would be the bottleneck. ``clients``: client
    processes started once for many runs (a sweep), instead of a new pool per run."""
    if processes <= 1:
        samples, elapsed = asyncio.run(run_load_async(url, images, spec, encode))
        return LoadResult(spec, samples, elapsed)
    processes = min(processes, spec.requests)  # a client process with nothing to send is no client
    if spec.mode == CLOSED and spec.concurrency < processes:
        raise ValueError(f"concurrency {spec.concurrency} cannot be split over {processes} client processes.")
    if clients is not None and processes > clients.processes:
        raise ValueError(f"{processes} client processes asked of a pool of {clients.processes}.")

    def share(total: int, i: int) -> int:
        return total // processes + (i < total % processes)

    shares = [
        LoadSpec(
            requests=share(spec.requests, i),
            mode=spec.mode,
            concurrency=share(spec.concurrency, i),
            rate=spec.rate / processes,
            arrivals=spec.arrivals,
            max_seconds=spec.max_seconds,
            seed=spec.seed * 1000 + i,
            warmup_requests=share(spec.warmup_requests, i),
            # Constant spacing: process i takes arrivals i, i+P, i+2P... of the whole stream.
            first_arrival_s=i / spec.rate if spec.mode == OPEN and spec.arrivals == CONSTANT else 0.0,
        )
        for i in range(processes)
    ]
    arguments = ([url] * processes, [list(images)] * processes, shares, [encode] * processes)
    if clients is not None:
        parts = clients.map(_run_share, *arguments)
    else:
        with LoadClients(processes) as pool:
            parts = pool.map(_run_share, *arguments)
    samples = [s for part, _ in parts for s in part]
    return LoadResult(spec, samples, max(elapsed for _, elapsed in parts))


def _run_share(url: str, images: list[bytes], spec: LoadSpec, encode: Encoder) -> tuple[list[Sample], float]:
    return asyncio.run(run_load_async(url, images, spec, encode))


def _pid() -> int:
    return os.getpid()


@contextlib.contextmanager
def _without_main_module() -> Iterator[None]:
    """Processes spawned in this block do not import the caller's ``__main__``.

    multiprocessing's spawn runs the parent's main module again in every child (to find what it
    pickled by reference there). A client process needs only this module, but a benchmark's main
    imports torch and matplotlib: ~8 s of imports per client process and run, measured on 2 cores.
    multiprocessing reads the main module's ``__spec__`` and ``__file__`` to decide, so they are
    hidden while the children start. The price: what a child unpickles (the ``encode`` function)
    must live in an importable module, not in ``__main__``.
    """
    main = sys.modules["__main__"]
    saved = {name: main.__dict__[name] for name in ("__spec__", "__file__") if name in main.__dict__}
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.update(saved)


class LoadClients:
    """``processes`` client processes, started once and reused by every run given them.

    ``with LoadClients(8) as clients: run_load(url, images, spec, processes=8, clients=clients)``
    """

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def __enter__(self) -> LoadClients:
        # spawn, not fork: the caller may hold CUDA or DALI threads, and a forked child inherits their locks.
        context = multiprocessing.get_context("spawn")
        self._pool = concurrent.futures.ProcessPoolExecutor(self.processes, mp_context=context)
        with _without_main_module():  # the pool starts its processes on the first submits: all of them, now
            started = [self._pool.submit(_pid) for _ in range(self.processes)]
            concurrent.futures.wait(started)
        return self

    def map(self, fn: Callable[..., T], *iterables: Sequence[object]) -> list[T]:
        if self._pool is None:
            raise RuntimeError("LoadClients used outside its with block.")
        try:
            with _without_main_module():
                return list(self._pool.map(fn, *iterables))
        except concurrent.futures.process.BrokenProcessPool:
            # A client process died (killed, out of memory): the pool takes no more work. Once, a new
            # pool and the same run again; a second death is the caller's to see.
            logger.warning("A load client process died; starting them again and repeating the run.")
            self.__exit__()
            self.__enter__()
            with _without_main_module():
                return list(self._pool.map(fn, *iterables))

    def __exit__(self, *exc_info: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None


@dataclass
class LoadResult:
    spec: LoadSpec
    samples: list[Sample]
    elapsed_s: float

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.status == 200]

    def summary(self) -> dict:
        """Counts, throughput (answered 200 per second), latency percentiles of the 200s, errors by
        status, batch sizes, and the median server-side breakdown (``other`` = client latency minus
        the server's own total: HTTP, the client, the network stack)."""
        ok = self.ok
        latencies = sorted(s.latency_ms for s in ok)
        statuses = Counter("lost" if s.status is None else str(s.status) for s in self.samples)
        breakdown = {}
        for part in TIMING_PARTS:
            values = [s.timings_ms[part] for s in ok if part in s.timings_ms]
            if values:
                breakdown[part] = statistics.median(values)
        with_total = [s for s in ok if "total" in s.timings_ms]
        if with_total:
            breakdown["other"] = statistics.median(s.latency_ms - s.timings_ms["total"] for s in with_total)
        batches = Counter(s.batch_size for s in ok if s.batch_size is not None)
        return {
            "load": self.spec.label,
            "requests": len(self.samples),
            "ok": len(ok),
            "statuses": dict(sorted(statuses.items())),
            "errors": len(self.samples) - len(ok),
            "elapsed_s": self.elapsed_s,
            "throughput_rps": len(ok) / self.elapsed_s if self.elapsed_s else 0.0,
            "offered_rps": self.spec.rate if self.spec.mode == OPEN else None,
            "latency_ms": {
                "p50": percentile(latencies, 0.50),
                "p95": percentile(latencies, 0.95),
                "p99": percentile(latencies, 0.99),
                "mean": statistics.fmean(latencies) if latencies else math.nan,
                "max": latencies[-1] if latencies else math.nan,
            },
            "server_ms_median": breakdown,
            # Open loop: a client that sends late hides queueing; latency counts from the schedule anyway.
            "send_lag_ms_max": max((s.lag_ms for s in self.samples), default=0.0),
            "batch_sizes": {str(size): n for size, n in sorted(batches.items())},
            "batch_size_mean": (sum(size * n for size, n in batches.items()) / sum(batches.values()))
            if batches
            else None,
        }

    def to_dict(self) -> dict:
        return {"spec": asdict(self.spec), "summary": self.summary(), "samples": [asdict(s) for s in self.samples]}


def format_summary(summary: dict) -> str:
    latency = summary["latency_ms"]
    lines = [
        f"{summary['load']}: {summary['ok']}/{summary['requests']} ok in {summary['elapsed_s']:.1f} s, "
        f"{summary['throughput_rps']:.2f} req/s",
        f"  latency ms p50 {latency['p50']:.1f}  p95 {latency['p95']:.1f}  p99 {latency['p99']:.1f}  "
        f"max {latency['max']:.1f}",
        f"  statuses {summary['statuses']}",
    ]
    if summary["server_ms_median"]:
        parts = "  ".join(f"{name} {ms:.1f}" for name, ms in summary["server_ms_median"].items())
        lines.append(f"  server-side median ms: {parts}")
    if summary["batch_sizes"]:
        lines.append(f"  batch sizes {summary['batch_sizes']} (mean {summary['batch_size_mean']:.1f})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the full predict URL, e.g. http://127.0.0.1:8000/predict")
    parser.add_argument("--images", type=Path, required=True, help="a folder of images, cycled in name order")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=1, help="closed loop: requests in flight")
    parser.add_argument("--rate", type=float, default=0.0, help="open loop: arrivals per second (sets --mode open)")
    parser.add_argument("--arrivals", choices=(CONSTANT, POISSON), default=POISSON)
    parser.add_argument("--max-seconds", type=float, default=DEFAULT_MAX_SECONDS)
    parser.add_argument("--warmup-requests", type=int, default=0)
    parser.add_argument("--processes", type=int, default=1, help="client processes to split the load over")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="write the summary and every sample as JSON here")
    args = parser.parse_args(argv)
    try:
        spec = LoadSpec(
            requests=args.requests,
            mode=OPEN if args.rate else CLOSED,
            concurrency=args.concurrency,
            rate=args.rate,
            arrivals=args.arrivals,
            max_seconds=args.max_seconds,
            seed=args.seed,
            warmup_requests=args.warmup_requests,
        )
        check_loopback(args.url)
        images = read_images(args.images)
    except ValueError as exc:
        parser.error(str(exc))
    result = run_load(args.url, images, spec, processes=args.processes)
    print(format_summary(result.summary()))
    if args.output:
        args.output.write_text(json.dumps(result.to_dict(), indent=1) + "\n")
        print(f"wrote {args.output}")
    return 0 if result.summary()["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
