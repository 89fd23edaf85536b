"""The load generator's closed or open loop over several URLs in turn: request i goes to ``urls[i % n]``.

``service.tune.loadgen.run_load`` drives one URL. A server with many models is driven by spreading
the same load (same concurrency, same images, same spec) evenly over its models' URLs
(``/predict?model=NAME``), so that "one model" and "20 models" differ only in where each request
goes. It reuses loadgen's sender and loops (its Sample, Server-Timing parsing, coordinated-omission
rule and LoadResult summary), so the numbers mean the same as every other benchmark's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import httpx

from service.tune.loadgen import (
    CLIENT_TIMEOUT_S,
    CLOSED,
    LoadResult,
    LoadSpec,
    Sample,
    _closed_loop,
    _open_loop,
    _Sender,
    check_loopback,
)


class RoundRobinSender:
    """Request ``index`` to URL ``index % n``; each URL cycles through all the images in turn
    (``index // n``), so no model sees only a fixed subset of them."""

    def __init__(self, senders: Sequence[_Sender]) -> None:
        self.senders = list(senders)

    @property
    def started(self) -> float:
        return self.senders[0].started

    @started.setter
    def started(self, value: float) -> None:
        for sender in self.senders:  # Sample.sent_s counts from here, for every URL alike
            sender.started = value

    async def send(self, index: int, scheduled: float | None = None) -> Sample:
        count = len(self.senders)
        return await self.senders[index % count].send(index // count, scheduled)


async def run_spread_async(urls: Sequence[str], images: Sequence[bytes], spec: LoadSpec) -> tuple[list[Sample], float]:
    """``spec``'s load over ``urls`` in turn (warm-up requests included, so every URL is warmed);
    the samples and the wall time of the measured part, as ``loadgen.run_load_async``."""
    if not urls:
        raise ValueError("No URLs to send to.")
    if not images:
        raise ValueError("No images to send.")
    for url in urls:
        check_loopback(url)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, limits=limits) as client:
        now = time.perf_counter()
        sender = RoundRobinSender([_Sender(client, url, images, now) for url in urls])
        if spec.warmup_requests:
            warmup = LoadSpec(spec.warmup_requests, concurrency=max(1, spec.concurrency), max_seconds=spec.max_seconds)
            await _closed_loop(sender, warmup, 0, time.perf_counter() + spec.max_seconds)
        sender.started = time.perf_counter()
        deadline = sender.started + spec.max_seconds
        loop = _closed_loop if spec.mode == CLOSED else _open_loop
        samples = await loop(sender, spec, spec.warmup_requests, deadline)
        elapsed = time.perf_counter() - sender.started
    return samples, elapsed


def run_spread(urls: Sequence[str], images: Sequence[bytes], spec: LoadSpec) -> LoadResult:
    """Blocking :func:`run_spread_async`, in this process."""
    samples, elapsed = asyncio.run(run_spread_async(urls, images, spec))
    return LoadResult(spec, samples, elapsed)
