"""Bounded soak test: thousands of mixed good and bad requests; nothing lost, no 5xx, flat memory.

    python -m benchmarks.soak                                # starts efficientnet-lite0 itself
    python -m benchmarks.soak --requests 600 --concurrency 32 --warmup-requests 200
    python -m benchmarks.soak --url http://127.0.0.1:8000    # a running server: no memory figures

A closed-loop load (asyncio + one shared httpx.AsyncClient, ``concurrency`` requests in flight)
sends real photos (raw, multipart and JSON base64) and, with probability ``bad_fraction``, a bad
request: every body of ``tests/bad_inputs.py`` plus request-level mistakes (bad base64, top_k=0,
empty body). A warm-up of the same mix runs first and is not counted, so the RSS of every server
process is compared between an idle, warmed-up server and the same server after the load.
Prints a table, writes JSON and TXT under benchmarks/results/<machine>-<date>/ (stem ``soak``),
and exits 1 with the reasons when the soak fails (see ``SoakReport.failures``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import io
import json
import logging
import math
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil
from PIL import Image

from benchmarks.harness.common import machine_record, results_dir, write_results
from compile import CAT_LABELS, sample_photo
from service.client.launcher import ServerProcess
from service.tune.loadgen import Exchange, closed_loop, exchange, percentile
from tests.bad_inputs import bad_inputs

logger = logging.getLogger(__name__)

DEFAULT_MAX_RSS_GROWTH_PCT = 10.0
# Growth below this many MiB is never a failure: the HTTP processes start near 65 MiB, where the
# allocator keeping the arenas of the last large bodies moves RSS by several MiB (11.6 % once).
MIN_RSS_GROWTH_MB = 8.0
CLIENT_TIMEOUT_S = 120.0  # generous: a lost request must mean a broken server, not a slow 2-core box
READY_TIMEOUT_S = 120.0
MEMORY_SAMPLE_INTERVAL_S = 1.0
SETTLE_S = 1.0  # idle pause before each RSS snapshot, so both are taken on an idle server
MAX_BAD_ITEM_BYTES = 2 * 1024 * 1024  # keep the soak light: larger corpus items are left out
TOP_K = 5
ESPRESSO = frozenset({"espresso"})


@dataclass(frozen=True)
class RequestSpec:
    """One prepared request: its bytes are built once, so the load generator only sends."""

    kind: str
    good: bool
    content: bytes
    headers: dict[str, str]
    params: dict[str, str]
    statuses: frozenset[int]  # what a correct server answers
    top1: frozenset[str] | None = None  # for good requests of known photos: acceptable top-1 labels


@dataclass(frozen=True)
class Outcome:
    kind: str
    good: bool
    status: int | None  # None: lost (connection error or timeout)
    latency_ms: float
    problem: str | None  # why this answer is wrong; None when it is right


@dataclass
class ProcessMemory:
    role: str
    pid: int
    rss_before_mb: float
    rss_after_mb: float | None  # None: the process was gone at the end
    rss_peak_mb: float

    @property
    def growth_pct(self) -> float | None:
        if self.rss_after_mb is None:
            return None
        return (self.rss_after_mb / self.rss_before_mb - 1) * 100


@dataclass
class SoakReport:
    url: str
    requests: int
    concurrency: int
    bad_fraction: float
    warmup_requests: int
    seed: int
    duration_s: float
    outcomes: list[Outcome] = field(repr=False)
    memory: list[ProcessMemory] = field(default_factory=list)
    process_changes: list[str] = field(default_factory=list)  # server processes that appeared or vanished
    ready_after: bool = True  # GET /ready answered 200 after the load
    rss_timeline: dict = field(default_factory=dict, repr=False)
    cpu_cores: dict[str, float] = field(default_factory=dict)  # mean busy cores during the load, by whom

    @property
    def lost(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status is None]

    @property
    def good(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.good]

    @property
    def bad(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.good]

    @property
    def server_errors(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status is not None and o.status >= 500]

    @property
    def throughput(self) -> float:
        return len(self.outcomes) / self.duration_s if self.duration_s else 0.0

    def status_counts(self, outcomes: Sequence[Outcome] | None = None) -> dict[str, int]:
        chosen = self.outcomes if outcomes is None else outcomes
        counts = Counter("lost" if o.status is None else str(o.status) for o in chosen)
        return dict(sorted(counts.items()))

    def wrong(self, good: bool) -> list[Outcome]:
        return [o for o in self.outcomes if o.good == good and o.problem is not None]

    def failures(self, max_rss_growth_pct: float = DEFAULT_MAX_RSS_GROWTH_PCT) -> list[str]:
        """Why this soak fails, in words; empty when the server held up."""
        reasons = []
        if self.lost:
            reasons.append(f"{len(self.lost)} requests lost (connection error or timeout): {_examples(self.lost)}")
        if self.server_errors:
            reasons.append(f"{len(self.server_errors)} answers were 5xx: {_examples(self.server_errors)}")
        if bad_good := [o for o in self.wrong(good=True) if o.status is not None and o.status < 500]:
            reasons.append(f"{len(bad_good)} good requests got a wrong answer: {_examples(bad_good)}")
        if bad_bad := [o for o in self.wrong(good=False) if o.status is not None and o.status < 500]:
            reasons.append(f"{len(bad_bad)} bad requests got an unexpected status: {_examples(bad_bad)}")
        reasons += [f"server process {change}" for change in self.process_changes]
        if not self.ready_after:
            reasons.append("GET /ready was not 200 after the load: a worker is down or restarting")
        for proc in self.memory:
            growth = proc.growth_pct
            grown_mb = (proc.rss_after_mb or 0.0) - proc.rss_before_mb
            if growth is not None and growth >= max_rss_growth_pct and grown_mb >= MIN_RSS_GROWTH_MB:
                reasons.append(
                    f"{proc.role} (pid {proc.pid}) RSS grew {growth:.1f} % "
                    f"({proc.rss_before_mb:.1f} -> {proc.rss_after_mb:.1f} MB), limits {max_rss_growth_pct:g} % "
                    f"and {MIN_RSS_GROWTH_MB:g} MB"
                )
        return reasons

    def to_dict(self, max_rss_growth_pct: float = DEFAULT_MAX_RSS_GROWTH_PCT) -> dict:
        """The figures for the JSON record; individual outcomes only where something went wrong."""
        by_kind: dict[str, list[Outcome]] = {}
        for o in self.outcomes:
            by_kind.setdefault(o.kind, []).append(o)
        return {
            "config": {
                "url": self.url,
                "requests": self.requests,
                "concurrency": self.concurrency,
                "bad_fraction": self.bad_fraction,
                "warmup_requests": self.warmup_requests,
                "seed": self.seed,
            },
            "duration_s": self.duration_s,
            "throughput_req_per_s": self.throughput,
            "lost": len(self.lost),
            "statuses": self.status_counts(),
            "server_errors_5xx": len(self.server_errors),
            "good": {
                "count": len(self.good),
                "ok": sum(o.problem is None for o in self.good),
                "wrong_label": sum(o.problem is not None and "top-1" in o.problem for o in self.good),
                "statuses": self.status_counts(self.good),
                "latency_ms": latency_summary(self.good),
            },
            "bad": {
                "count": len(self.bad),
                "statuses": self.status_counts(self.bad),
                "unexpected": [asdict(o) for o in self.wrong(good=False)],
                "latency_ms": latency_summary(self.bad),
            },
            "wrong_good": [asdict(o) for o in self.wrong(good=True)][:100],
            "by_kind": {
                kind: {"statuses": self.status_counts(group), "latency_ms": latency_summary(group)}
                for kind, group in sorted(by_kind.items())
            },
            "memory": [{**asdict(p), "growth_pct": p.growth_pct} for p in self.memory],
            "process_changes": self.process_changes,
            "ready_after": self.ready_after,
            "cpu_cores_during_load": self.cpu_cores,
            "rss_timeline": self.rss_timeline,
            "max_rss_growth_pct": max_rss_growth_pct,
            "failures": self.failures(max_rss_growth_pct),
        }


def _examples(outcomes: Sequence[Outcome], limit: int = 5) -> str:
    """A few distinct problems, so a failure message names what went wrong without 5,000 lines."""
    seen = Counter(f"{o.kind}: {o.problem}" for o in outcomes)
    shown = [f"{text} (x{n})" for text, n in seen.most_common(limit)]
    return "; ".join(shown) + (f"; and {len(seen) - limit} more kinds" if len(seen) > limit else "")


def latency_summary(outcomes: Sequence[Outcome]) -> dict[str, float]:
    values = sorted(o.latency_ms for o in outcomes if o.status is not None)
    return {
        "p50": percentile(values, 0.50),
        "p90": percentile(values, 0.90),
        "p99": percentile(values, 0.99),
        "max": values[-1] if values else math.nan,
    }


# --- what is sent ---------------------------------------------------------------------------------


def _photo(name: str, fmt: str = "JPEG", size: tuple[int, int] | None = None, **save_kwargs: object) -> bytes:
    img = Image.fromarray(sample_photo(name))
    if size is not None:
        img = img.resize(size, Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save_kwargs)
    return buf.getvalue()


def _raw(kind: str, image: bytes, content_type: str, top1: frozenset[str] | None) -> RequestSpec:
    headers = {"Content-Type": content_type}
    return RequestSpec(kind, True, image, headers, {"top_k": str(TOP_K)}, frozenset({200}), top1)


def _multipart(kind: str, image: bytes, content_type: str, top1: frozenset[str] | None) -> RequestSpec:
    """Encoded once by httpx itself, so the body and its boundary header are what a client sends."""
    request = httpx.Request(
        "POST", "http://soak/predict", files={"image": ("photo", image, content_type)}, data={"top_k": str(TOP_K)}
    )
    headers = {"Content-Type": request.headers["Content-Type"]}
    return RequestSpec(kind, True, request.read(), headers, {}, frozenset({200}), top1)


def _json_body(image: bytes, top_k: int) -> bytes:
    return json.dumps({"image": base64.b64encode(image).decode("ascii"), "top_k": top_k}).encode()


def _json(kind: str, image: bytes, top1: frozenset[str] | None) -> RequestSpec:
    headers = {"Content-Type": "application/json"}
    return RequestSpec(kind, True, _json_body(image, TOP_K), headers, {}, frozenset({200}), top1)


@functools.cache
def good_specs() -> tuple[tuple[RequestSpec, ...], tuple[float, ...]]:
    """Real photos of several sizes and formats in every body encoding, with their draw weights.

    The 12 MP JPEG is drawn rarely: it costs the 2-core server about ten small photos.
    """
    chelsea = _photo("chelsea", quality=92)  # 451x300
    coffee = _photo("coffee", quality=92)  # 600x400
    astronaut_png = _photo("astronaut", "PNG")  # 512x512
    rocket = _photo("rocket", quality=85)  # 640x427
    hubble = _photo("hubble_deep_field", quality=90)  # 1000x872
    chelsea_12mp = _photo("chelsea", size=(4000, 3000), quality=90)  # ~0.8 MB
    specs: list[tuple[RequestSpec, float]] = []
    for name, image, content_type, top1 in (
        ("chelsea.jpg", chelsea, "image/jpeg", CAT_LABELS),
        ("coffee.jpg", coffee, "image/jpeg", ESPRESSO),
        ("astronaut.png", astronaut_png, "image/png", None),
    ):
        specs += [
            (_raw(f"{name} raw", image, content_type, top1), 1.0),
            (_multipart(f"{name} multipart", image, content_type, top1), 1.0),
            (_json(f"{name} json", image, top1), 1.0),
        ]
    specs += [
        (_raw("rocket.jpg raw", rocket, "image/jpeg", None), 1.0),
        (_raw("hubble.jpg raw", hubble, "application/octet-stream", None), 1.0),
        (_raw("chelsea-12mp.jpg raw", chelsea_12mp, "image/jpeg", CAT_LABELS), 0.3),
    ]
    return tuple(s for s, _ in specs), tuple(w for _, w in specs)


@functools.cache
def bad_specs(max_item_bytes: int = MAX_BAD_ITEM_BYTES) -> tuple[RequestSpec, ...]:
    """Every corpus body of tests/bad_inputs.py, sent raw, plus mistakes in the request around a good image."""
    specs = [
        RequestSpec(f"bad:{item.name}", False, item.body, {"Content-Type": item.content_type}, {}, item.statuses)
        for item in bad_inputs()
        if len(item.body) <= max_item_bytes
    ]
    skipped = [item.name for item in bad_inputs() if len(item.body) > max_item_bytes]
    if skipped:
        logger.info("Left out corpus items over %d bytes: %s", max_item_bytes, ", ".join(skipped))
    photo = _photo("chelsea", quality=92)
    as_json = {"Content-Type": "application/json"}
    specs += [
        RequestSpec(
            "bad:json_invalid_base64",
            False,
            json.dumps({"image": "this is not base64 at all!", "top_k": TOP_K}).encode(),
            as_json,
            {},
            frozenset({400}),
        ),
        RequestSpec("bad:json_malformed", False, b'{"image": "abc', as_json, {}, frozenset({400})),
        RequestSpec("bad:json_top_k_0", False, _json_body(photo, 0), as_json, {}, frozenset({422})),
        RequestSpec("bad:raw_top_k_0", False, photo, {"Content-Type": "image/jpeg"}, {"top_k": "0"}, frozenset({422})),
        RequestSpec("bad:empty_no_content_type", False, b"", {}, {"top_k": str(TOP_K)}, frozenset({400})),
    ]
    return tuple(specs)


def plan(n: int, bad_fraction: float, rng: random.Random) -> list[RequestSpec]:
    """The request sequence, fixed by the seed: bad ones with probability ``bad_fraction``."""
    good, weights = good_specs()
    bad = bad_specs()
    return [rng.choice(bad) if rng.random() < bad_fraction else rng.choices(good, weights)[0] for _ in range(n)]


# --- sending and checking -------------------------------------------------------------------------


def check_answer(spec: RequestSpec, response: httpx.Response) -> str | None:
    """What is wrong with this answer, or None. Good: 200 with exactly top_k predictions (and the
    right top-1 for known photos). Bad: a status from the expected set, with a JSON ``detail``."""
    if response.status_code not in spec.statuses:
        return f"status {response.status_code} (expected {sorted(spec.statuses)}): {response.text[:160]!r}"
    try:
        body = response.json()
    except ValueError:
        return f"status {response.status_code} but the body is not JSON: {response.text[:160]!r}"
    if not spec.good:
        return None if isinstance(body, dict) and "detail" in body else f"no JSON detail: {response.text[:160]!r}"
    predictions = body.get("predictions") if isinstance(body, dict) else None
    if not isinstance(predictions, list) or len(predictions) != TOP_K:
        return f"expected {TOP_K} predictions, got {response.text[:160]!r}"
    if spec.top1 is not None and predictions[0].get("label") not in spec.top1:
        return f"top-1 {predictions[0].get('label')!r}, expected one of {sorted(spec.top1)}"
    return None


def outcome(spec: RequestSpec, done: Exchange) -> Outcome:
    """One answer judged against its request: lost, or what :func:`check_answer` finds wrong."""
    if done.response is None:
        return Outcome(spec.kind, spec.good, None, done.latency_ms, f"{type(done.error).__name__}: {done.error}")
    return Outcome(spec.kind, spec.good, done.response.status_code, done.latency_ms, check_answer(spec, done.response))


async def send_plan(client: httpx.AsyncClient, specs: Sequence[RequestSpec], concurrency: int) -> list[Outcome]:
    """Every request of ``specs`` once, through the load generator's closed loop (``concurrency``
    clients, each sends the next request when its last answer came); outcomes in the plan's order."""

    async def send(index: int) -> tuple[int, Outcome]:
        spec = specs[index]
        done = await exchange(client, "/predict", spec.content, spec.headers, params=spec.params)
        return index, outcome(spec, done)

    answered = await closed_loop(send, concurrency, range(len(specs)))
    return [result for _, result in sorted(answered, key=lambda pair: pair[0])]


async def wait_ready(client: httpx.AsyncClient, timeout: float = READY_TIMEOUT_S) -> bool:
    """GET /ready until 200: every inference worker loaded and warmed (a restarted one included)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if (await client.get("/ready")).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.5)
    return False


# --- memory ---------------------------------------------------------------------------------------


def process_role(proc: psutil.Process, server_pid: int) -> str:
    """main / worker / tracker / manager / http, from how each child of vision-serve was started.

    The manager and the HTTP processes are both forked from main (same cmdline) and both inherit the
    TCP listening socket; the manager alone listens on a multiprocessing unix socket.
    """
    if proc.pid == server_pid:
        return "main"
    cmdline = " ".join(proc.cmdline())
    if "spawn_main" in cmdline:
        return "worker"
    if "resource_tracker" in cmdline:
        return "tracker"
    if any("listener-" in str(c.laddr) for c in proc.net_connections(kind="unix")):
        return "manager"
    return "http"


def server_processes(server_pid: int) -> dict[int, tuple[str, psutil.Process]]:
    main = psutil.Process(server_pid)
    return {p.pid: (process_role(p, server_pid), p) for p in (main, *main.children(recursive=True))}


def rss_mb(processes: dict[int, tuple[str, psutil.Process]]) -> dict[int, float]:
    """RSS of each process still alive, in MiB."""
    sizes = {}
    for pid, (_, proc) in processes.items():
        with contextlib.suppress(psutil.NoSuchProcess):
            sizes[pid] = proc.memory_info().rss / 2**20
    return sizes


class PeakSampler:
    """Samples the RSS of the server's processes every second in a thread: each one's peak, and a
    timeline, which tells a plateau (allocator caches filling) from a steady climb (a leak)."""

    def __init__(self, processes: dict[int, tuple[str, psutil.Process]]) -> None:
        self.processes = processes
        self.peak: dict[int, float] = {}
        self.timeline: list[tuple[float, dict[int, float]]] = []
        self._started = time.perf_counter()
        self._task: asyncio.Task | None = None

    def sample(self) -> None:
        sizes = rss_mb(self.processes)
        self.timeline.append((time.perf_counter() - self._started, sizes))
        for pid, rss in sizes.items():
            self.peak[pid] = max(self.peak.get(pid, 0.0), rss)

    async def _loop(self) -> None:
        while True:
            await asyncio.to_thread(self.sample)
            await asyncio.sleep(MEMORY_SAMPLE_INTERVAL_S)

    def timeline_record(self) -> dict:
        """``{"t_s": [...], "rss_mb": {"worker 123": [...], ...}}`` for the JSON record."""
        names = {pid: f"{role} {pid}" for pid, (role, _) in self.processes.items()}
        return {
            "t_s": [round(t, 1) for t, _ in self.timeline],
            "rss_mb": {names[pid]: [round(sizes.get(pid, math.nan), 1) for _, sizes in self.timeline] for pid in names},
        }

    def __enter__(self) -> PeakSampler:
        self._started = time.perf_counter()
        self._task = asyncio.create_task(self._loop())
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._task is not None:
            self._task.cancel()


def memory_table(
    processes: dict[int, tuple[str, psutil.Process]],
    before: dict[int, float],
    after: dict[int, float],
    peak: dict[int, float],
) -> list[ProcessMemory]:
    return [
        ProcessMemory(role, pid, before[pid], after.get(pid), max(peak.get(pid, 0.0), before[pid], after.get(pid, 0)))
        for pid, (role, _) in sorted(processes.items(), key=lambda item: (item[1][0], item[0]))
        if pid in before
    ]


def process_changes(server_pid: int, before: dict[int, tuple[str, psutil.Process]]) -> list[str]:
    """A worker that crashed and was restarted shows up here as one pid gone and one new."""
    try:
        now = server_processes(server_pid)
    except psutil.NoSuchProcess:
        return [f"main (pid {server_pid}) exited during the soak"]
    gone = [f"{role} (pid {pid}) exited during the soak" for pid, (role, _) in before.items() if pid not in now]
    new = [f"{role} (pid {pid}) appeared during the soak" for pid, (role, _) in now.items() if pid not in before]
    return gone + new


def cpu_seconds(processes: dict[int, tuple[str, psutil.Process]]) -> dict[str, float]:
    """Busy CPU seconds so far: the whole machine, the server's processes, this load generator."""
    times = psutil.cpu_times()
    server = 0.0
    for _, proc in processes.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            server += sum(proc.cpu_times()[:2])
    return {
        "machine": sum(times) - times.idle - getattr(times, "iowait", 0.0),
        "server": server,
        "client": sum(psutil.Process().cpu_times()[:2]),
    }


def cpu_cores(start: dict[str, float], end: dict[str, float], seconds: float, server_known: bool) -> dict[str, float]:
    """Mean busy cores per party; ``other`` is everyone else on the machine, which slows the soak
    down on a shared box (so its throughput is only indicative when ``other`` is not near 0)."""
    cores = {name: (end[name] - start[name]) / seconds for name in start}
    if server_known:
        cores["other"] = max(0.0, cores["machine"] - cores["server"] - cores["client"])
    else:
        del cores["server"]  # the server's share cannot be told from the others'
    return {name: round(value, 2) for name, value in cores.items()}


# --- the soak -------------------------------------------------------------------------------------


async def _soak(
    url: str, server_pid: int | None, requests: int, concurrency: int, bad_fraction: float, warmup: int, seed: int
) -> SoakReport:
    rng = random.Random(seed)
    warmup_specs, specs = plan(warmup, bad_fraction, rng), plan(requests, bad_fraction, rng)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S, limits=limits) as client:
        if not await wait_ready(client):
            raise RuntimeError(f"{url}/ready did not answer 200 within {READY_TIMEOUT_S:.0f} s")
        logger.info("Warm-up: %d requests at concurrency %d", warmup, concurrency)
        await send_plan(client, warmup_specs, concurrency)
        if not await wait_ready(client):
            raise RuntimeError(f"{url}/ready is not 200 after the warm-up")
        await asyncio.sleep(SETTLE_S)
        processes = server_processes(server_pid) if server_pid is not None else {}
        before = rss_mb(processes)

        logger.info("Soak: %d requests at concurrency %d", requests, concurrency)
        with PeakSampler(processes) as sampler:
            cpu_start, started = cpu_seconds(processes), time.perf_counter()
            outcomes = await send_plan(client, specs, concurrency)
            duration = time.perf_counter() - started
            cpu = cpu_cores(cpu_start, cpu_seconds(processes), duration, server_known=server_pid is not None)
            ready_after = await wait_ready(client, timeout=30.0)
            await asyncio.sleep(SETTLE_S)
            after = rss_mb(processes)
    return SoakReport(
        url=url,
        requests=requests,
        concurrency=concurrency,
        bad_fraction=bad_fraction,
        warmup_requests=warmup,
        seed=seed,
        duration_s=duration,
        outcomes=outcomes,
        memory=memory_table(processes, before, after, sampler.peak),
        process_changes=process_changes(server_pid, processes) if server_pid is not None else [],
        ready_after=ready_after,
        rss_timeline=sampler.timeline_record(),
        cpu_cores=cpu,
    )


def run_soak(
    url: str,
    server_pid: int | None,
    *,
    requests: int = 5000,
    concurrency: int = 64,
    bad_fraction: float = 0.10,
    warmup_requests: int = 500,
    seed: int = 0,
) -> SoakReport:
    """Soak the server at ``url``; ``server_pid`` (its main process) turns on the RSS figures."""
    return asyncio.run(_soak(url, server_pid, requests, concurrency, bad_fraction, warmup_requests, seed))


# --- CLI ------------------------------------------------------------------------------------------


def _fmt_latency(summary: dict[str, float]) -> str:
    return " / ".join(f"{summary[k]:.0f}" for k in ("p50", "p90", "p99", "max")) + " ms"


def _fmt_counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{status}: {n}" for status, n in counts.items()) or "-"


def format_report(report: SoakReport, max_rss_growth_pct: float = DEFAULT_MAX_RSS_GROWTH_PCT) -> str:
    good_ok = sum(o.problem is None for o in report.good)
    wrong_label = sum(o.problem is not None and "top-1" in o.problem for o in report.good)
    rows = [
        ("requests (good / bad)", f"{len(report.outcomes)} ({len(report.good)} / {len(report.bad)})"),
        ("duration, throughput", f"{report.duration_s:.1f} s, {report.throughput:.1f} req/s"),
        ("lost (connection error / timeout)", str(len(report.lost))),
        ("statuses, all", _fmt_counts(report.status_counts())),
        ("5xx", str(len(report.server_errors))),
        ("good: ok / wrong label / other", f"{good_ok} / {wrong_label} / {len(report.good) - good_ok - wrong_label}"),
        ("bad: statuses", _fmt_counts(report.status_counts(report.bad))),
        ("bad: unexpected status", str(len(report.wrong(good=False)))),
        ("good latency p50 / p90 / p99 / max", _fmt_latency(latency_summary(report.good))),
        ("bad latency p50 / p90 / p99 / max", _fmt_latency(latency_summary(report.bad))),
        ("/ready after the load", "200" if report.ready_after else "NOT READY"),
        (f"busy cores during the load (of {psutil.cpu_count()})", _fmt_counts(report.cpu_cores)),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    lines = [
        f"soak of {report.url}: {report.requests} requests at concurrency {report.concurrency}, "
        f"{report.bad_fraction:.0%} bad, warm-up {report.warmup_requests}, seed {report.seed}",
        *(f"  {name:<{width}}  {value}" for name, value in rows),
    ]
    for o in report.wrong(good=False)[:20]:
        lines.append(f"    unexpected: {o.kind} -> {o.problem}")
    if report.memory:
        lines.append(f"  RSS (MiB), before = after warm-up; growth limit {max_rss_growth_pct:g} %:")
        lines.append(f"    {'role':<8} {'pid':>7} {'before':>8} {'peak':>8} {'after':>8} {'growth':>8}")
        for p in report.memory:
            after = f"{p.rss_after_mb:8.1f}" if p.rss_after_mb is not None else f"{'gone':>8}"
            growth = f"{p.growth_pct:+7.1f}%" if p.growth_pct is not None else f"{'-':>8}"
            lines.append(f"    {p.role:<8} {p.pid:>7} {p.rss_before_mb:8.1f} {p.rss_peak_mb:8.1f} {after} {growth}")
    else:
        lines.append("  RSS: not measured (no server pid: --url)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--bad-fraction", type=float, default=0.10)
    parser.add_argument("--warmup-requests", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", default=None, help="soak this running server instead of starting one (no RSS)")
    parser.add_argument("--model", default="efficientnet-lite0")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--output", type=Path, default=None, help="results folder (default benchmarks/results/...)")
    parser.add_argument("--max-rss-growth-pct", type=float, default=DEFAULT_MAX_RSS_GROWTH_PCT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    soak = functools.partial(
        run_soak,
        requests=args.requests,
        concurrency=args.concurrency,
        bad_fraction=args.bad_fraction,
        warmup_requests=args.warmup_requests,
        seed=args.seed,
    )
    log_tail = ""
    if args.url:
        report = soak(args.url, None)
    else:
        server_args = ["--model", args.model, "--max-batch-size", str(args.max_batch_size), "--log-level", "warning"]
        with (
            tempfile.TemporaryDirectory() as tmp,
            ServerProcess(server_args, log_path=Path(tmp) / "server.log") as server,
        ):
            report = soak(server.url, server.process.pid)
            log_tail = server.log_tail()

    text = format_report(report, args.max_rss_growth_pct)
    print(text)
    record = {
        "model": None if args.url else args.model,
        "max_batch_size": None if args.url else args.max_batch_size,
        "machine": machine_record(),
        **report.to_dict(args.max_rss_growth_pct),
    }
    write_results(results_dir(args.output), "soak", record, text)
    failures = report.failures(args.max_rss_growth_pct)
    if failures:
        print("\nSOAK FAILED:\n" + "\n".join(f"  - {reason}" for reason in failures))
        if log_tail:
            print(f"\nserver log (last lines):\n{log_tail}")
        return 1
    print("\nsoak passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
