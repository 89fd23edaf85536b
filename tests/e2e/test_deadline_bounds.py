"""Deadlines bound every wait, and ``--max-queue`` bounds every image buffered toward the workers,
whatever the deadlines (issue 60), on real servers (the front end's no-op model,
benchmarks/frontend_server.py: the production path with nothing to run).

- A stalled worker (SIGSTOP: what a long batch or a hung engine looks like to the HTTP process) and
  clients with 5 ms deadlines: each gets its 503 or 504, and the worker is sent no more images than
  ``--max-queue`` admits. Counted by the worker itself once resumed: each image it finds past its
  deadline it drops and counts in ``vision_serve_requests_expired_total``.
- A Redis whose replies are held (a proxy in this process): a request with a 100 ms deadline gets
  its 504 at the deadline, not at ``--response-cache-redis-timeout-ms``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from service.client.launcher import ServerProcess
from tests.conftest import inference_workers
from tests.redis_server import running_redis
from tests.worker_hold import in_flight, wait_until, worker_held

NOOP_SERVER = [sys.executable, "-m", "benchmarks.frontend_server"]
LITE = ["--model", "efficientnet-lite0"]  # loaded for its labels; the no-op runs
MAX_QUEUE = 16
MAX_BATCH = 8
CLIENTS = 32
FLOOD_S = 3.0
TINY_DEADLINE_MS = 5
REDIS_TIMEOUT_MS = 3000
REPLY_HOLD_S = 10.0
DEADLINE_MS = 100
JPEG = {"Content-Type": "image/jpeg"}


def expired_total(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(r"^vision_serve_requests_expired_total (\S+)$", text, re.M)
    assert match, "no vision_serve_requests_expired_total in /metrics"
    return float(match.group(1))


@pytest.fixture(scope="module")
def stalling_server(tmp_path_factory):
    args = [*LITE, "--api-servers", "1", "--max-queue", str(MAX_QUEUE), "--max-batch-size", str(MAX_BATCH)]
    log_path = tmp_path_factory.mktemp("stalling") / "server.log"
    with ServerProcess(args, log_path=log_path, command=NOOP_SERVER) as running:
        yield running


def flood(url: str, image: bytes, until: float) -> list[int]:
    """Requests with a 5 ms deadline, one after another until ``until``: their statuses."""
    statuses = []
    headers = {**JPEG, "X-Request-Timeout-Ms": str(TINY_DEADLINE_MS)}
    with httpx.Client(timeout=30) as client:
        while time.monotonic() < until:
            statuses.append(client.post(f"{url}/predict", content=image, headers=headers).status_code)
    return statuses


def test_tiny_deadlines_never_buffer_more_than_max_queue_toward_a_stalled_worker(stalling_server, chelsea_jpeg) -> None:
    url = stalling_server.url
    assert httpx.post(f"{url}/predict", content=chelsea_jpeg, headers=JPEG, timeout=60).status_code == 200
    workers = [worker.pid for worker in inference_workers(stalling_server)]  # the planning child too, if still there
    with worker_held(*workers):
        until = time.monotonic() + FLOOD_S
        with ThreadPoolExecutor(CLIENTS) as pool:
            statuses = [s for done in pool.map(lambda _: flood(url, chelsea_jpeg, until), range(CLIENTS)) for s in done]
        held = in_flight(url)
        expired_before = expired_total(url)
    assert statuses and set(statuses) <= {503, 504}, sorted(set(statuses))
    assert statuses.count(504) >= 1
    assert held <= MAX_QUEUE
    # Resumed: the worker reads what was sent to it, finds each image past its deadline, drops it and
    # counts it. Wait until that count stops moving.
    last, stable_since = expired_before, time.monotonic()
    while time.monotonic() - stable_since < 1.0:
        time.sleep(0.1)
        now = expired_total(url)
        if now != last:
            last, stable_since = now, time.monotonic()
    sent = last - expired_before
    assert sent <= MAX_QUEUE, (
        f"{sent:.0f} images reached the worker after {statuses.count(504)} x 504 and {statuses.count(503)} x 503: "
        f"more than the {MAX_QUEUE} that --max-queue admits"
    )
    wait_until(lambda: in_flight(url) == 0, "the dropped images' slots came back", timeout=30)
    assert httpx.post(f"{url}/predict", content=chelsea_jpeg, headers=JPEG, timeout=60).status_code == 200


class HeldRepliesProxy:
    """A TCP proxy on loopback in front of a real Redis that passes every command on at once and holds
    every reply for ``hold_s``: a slow Redis, as far as its clients can tell."""

    def __init__(self, upstream_port: int, hold_s: float) -> None:
        self.upstream_port = upstream_port
        self.hold_s = hold_s
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.port = 0

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hold_s: float) -> None:
        with contextlib.suppress(Exception):
            while chunk := await reader.read(65536):
                if hold_s:
                    await asyncio.sleep(hold_s)
                writer.write(chunk)
                await writer.drain()
        writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        await asyncio.gather(self._pipe(reader, upstream_writer, 0.0), self._pipe(upstream_reader, writer, self.hold_s))

    async def _start(self) -> asyncio.Server:
        return await asyncio.start_server(self._serve, "127.0.0.1", 0)

    @contextlib.contextmanager
    def running(self) -> Iterator[HeldRepliesProxy]:
        self.thread.start()
        server = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        self.port = server.sockets[0].getsockname()[1]
        try:
            yield self
        finally:
            server.close()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


@pytest.fixture(scope="module")
def slow_redis_server(tmp_path_factory):
    base = tmp_path_factory.mktemp("slow-redis")
    with running_redis(base) as redis_server:
        upstream = int(redis_server.url.rsplit(":", 1)[1].split("/")[0])
        with HeldRepliesProxy(upstream, REPLY_HOLD_S).running() as proxy:
            args = [*LITE, "--api-servers", "1", "--response-cache-mb", "4"]
            args += ["--response-cache-redis", f"redis://127.0.0.1:{proxy.port}"]
            args += ["--response-cache-redis-timeout-ms", str(REDIS_TIMEOUT_MS)]
            with ServerProcess(args, log_path=base / "server.log", command=NOOP_SERVER) as server:
                yield server


def test_a_deadline_ends_a_lookup_that_waits_on_a_slow_redis(slow_redis_server, chelsea_jpeg) -> None:
    url = slow_redis_server.url
    headers = {**JPEG, "X-Request-Timeout-Ms": str(DEADLINE_MS)}
    for _ in range(3):  # again and again: a lookup cut short leaves nothing behind that slows the next
        started = time.monotonic()
        response = httpx.post(f"{url}/predict", content=chelsea_jpeg, headers=headers, timeout=30)
        waited = time.monotonic() - started
        assert response.status_code == 504, response.text
        assert f"{DEADLINE_MS} ms deadline" in response.json()["detail"]
        assert waited < 0.5, f"the 504 came after {waited * 1e3:.0f} ms, for a {DEADLINE_MS} ms deadline"
    # Without a deadline the lookup waits out Redis's own timeout, then the worker answers.
    assert httpx.post(f"{url}/predict", content=chelsea_jpeg, headers=JPEG, timeout=60).status_code == 200
