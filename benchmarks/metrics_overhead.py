"""What observability costs per request: metric recording, the HTTP middleware, the access log, a scrape.

    python -m benchmarks.metrics_overhead [--out DIR]

Each figure is the median of several rounds of many calls, in the mode the server runs in
(prometheus_client's multiprocess mode, values in files). For scale: a GPU serving 3,000 img/s
spends ~330 us per image in all.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.harness.common import machine_record, results_dir, write_results
from service.testing import HttpObserver, configure_logging, exposition, metrics, multiprocess_mode

ROUNDS = 7
STAGES = {"queue": 1.2, "preprocess": 3.4, "inference": 20.0, "postprocess": 0.1, "total": 25.0}


def median_us(run: Callable[[], None], calls: int) -> float:
    """Median over ROUNDS of the mean time per call, in microseconds."""
    per_call = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        for _ in range(calls):
            run()
        per_call.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(per_call)


def record_one_request() -> None:
    """What the server records per request: its status code and five stage durations."""
    m = metrics()
    m.requests.labels(code="200").inc()
    m.observe_stages(STAGES)


async def _bare_app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def asgi_call_us(app, calls: int) -> float:
    scope = {"type": "http", "method": "POST", "path": "/predict", "headers": [], "client": ("127.0.0.1", 1)}

    async def send(message) -> None:
        pass

    async def rounds() -> list[float]:
        per_call = []
        for _ in range(ROUNDS):
            started = time.perf_counter()
            for _ in range(calls):
                await app(dict(scope), None, send)
            per_call.append((time.perf_counter() - started) / calls * 1e6)
        return per_call

    return statistics.median(asyncio.run(rounds()))


def _worker_records(batches: int) -> None:
    for _ in range(batches):
        metrics().observe_batch(8)
        for _ in range(8):
            metrics().observe_stages(STAGES)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: benchmarks/results/...)")
    parser.add_argument("--calls", type=int, default=20_000, help="calls per round")
    args = parser.parse_args(argv)

    with multiprocess_mode():
        record_us = median_us(record_one_request, args.calls)
        batch_us = median_us(lambda: metrics().observe_batch(8), args.calls)
        bare_us = asgi_call_us(_bare_app, args.calls)
        observed = HttpObserver(_bare_app, ["/predict"])
        configure_logging("warning", "json", io.StringIO())  # access log off
        no_log_us = asgi_call_us(observed, args.calls)
        configure_logging("info", "json", io.StringIO())  # access log on, JSON, to memory
        json_log_us = asgi_call_us(observed, args.calls)
        configure_logging("info", "text", io.StringIO())
        text_log_us = asgi_call_us(observed, args.calls)
        configure_logging("info", "text")
        # A scrape of a busy server: 2 HTTP processes and 4 workers have written their files.
        context = mp.get_context("spawn")
        children = [context.Process(target=_worker_records, args=(50,)) for _ in range(6)]
        for child in children:
            child.start()
        for child in children:
            child.join()
        scrape_ms = median_us(lambda: exposition(None), 50) / 1e3
        scrape_bytes = len(exposition(None))

    record = {
        "machine": machine_record(),
        "calls_per_round": args.calls,
        "rounds": ROUNDS,
        "record_per_request_us": round(record_us, 2),
        "record_per_batch_us": round(batch_us, 2),
        "middleware_no_access_log_us": round(no_log_us - bare_us, 2),
        "middleware_json_access_log_us": round(json_log_us - bare_us, 2),
        "middleware_text_access_log_us": round(text_log_us - bare_us, 2),
        "scrape_ms_7_processes": round(scrape_ms, 2),
        "scrape_bytes": scrape_bytes,
    }
    text = "\n".join(
        [
            "Observability cost (medians of 7 rounds; multiprocess mode, values in files):",
            f"  metrics recorded per request (status + 5 stages)   {record_us:7.1f} us",
            f"  metrics recorded per batch (size + images)         {batch_us:7.1f} us",
            f"  middleware, access log off (--log-level warning)   {no_log_us - bare_us:7.1f} us",
            f"  middleware, JSON access log                        {json_log_us - bare_us:7.1f} us",
            f"  middleware, text access log                        {text_log_us - bare_us:7.1f} us",
            f"  one scrape, files of 7 processes                   {scrape_ms:7.2f} ms ({scrape_bytes} bytes)",
        ]
    )
    print(text)
    write_results(results_dir(args.out), "metrics_overhead", record, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
