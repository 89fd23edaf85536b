"""Swap under load: model loads (version swaps) while a closed loop of clients keeps inferring.

The driver behind ``benchmarks.model_swap`` (vision-serve) and ``benchmarks.triton_swap`` (NVIDIA
Triton); it knows nothing of either server. A :class:`SwapTarget` says where to infer, how to wrap an
image, how to read the answering model version off a response, and how to ask the server to load a
version (or a corrupt one). :func:`run_swap` then, for the whole run:

* keeps ``concurrency`` (32) connections busy: closed loop, each client sends the next image of the
  folder as soon as its last answer came (httpx, as ``service.tune.loadgen``), and records per answer
  its send time, latency, HTTP status (None: connection error or client timeout) and the version
  that answered (the OIP response's ``model_version``);
* meanwhile a control coroutine waits ``steady_s`` of steady load, then performs the plan's loads one
  after another with ``steady_s`` between them: version 2, 1, 2, 1, ... (``cycles`` times v1 -> v2 ->
  v1, so ``2 * cycles`` loads), then one load of a corrupt version 3 that must fail while the old
  version keeps serving; per load it records when the call started and returned, its HTTP status and
  its error text.

The summary (:func:`summarize`) has the counts (requests, non-2xx, connection errors), the versions
that answered (must be a subset of {"1", "2"}), the p99 latency of answers sent in steady state and
of answers sent in a swap window (from a load call's start to 1 s after it returned) and their ratio
(target: at most 2), and per load the time from the call to the first answer, sent after the call,
that came from the new version (median and max over the good loads).

By send time alone a stall hides: in a closed loop, a server that answers nothing while it loads also
stops the clients from sending, so the requests it holds were sent *before* the window and count as
steady. The summary therefore also has the same p99 ratio by time in flight (answers in flight at
any moment of a swap window against answers that overlap none), the longest stretch without any
answer inside and outside swap windows, and per load how many answers came back while the call ran
(0: nothing was served during the load).

:func:`plot` draws each answer's latency at its send time coloured by version, failed answers marked,
and below it the answers per second by version: the load windows are shaded in both.

Answers sent in the first ``warmup_s`` are not recorded (connections opening, first batches).

:func:`requests_during_loads` is a probe for after the run, with no other traffic: per case one swap
and a single request sent a set time into the load call (to the model, or pinned to the version
served until then), to see whether a server holds requests during a load and which version answers.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import httpx

from service.tune.loadgen import CLIENT_TIMEOUT_S, Exchange, check_loopback, closed_loop, exchange, percentile

logger = logging.getLogger(__name__)

CONCURRENCY = 32
SWAP_TAIL_S = 1.0  # a swap window lasts until this long after the load call returned
MAX_P99_RATIO = 2.0  # the target: swap-window p99 at most twice the steady p99
ALLOWED_VERSIONS = frozenset({"1", "2"})
CORRUPT_VERSION = 3


class SwapTarget(Protocol):
    """A server under test, as the driver sees it."""

    infer_url: str

    def encode(self, image: bytes) -> tuple[bytes, dict[str, str]]:
        """An image -> the infer request's body and headers."""
        ...

    def version_of(self, response: httpx.Response) -> str | None:
        """The model version that answered a 200 response (None: the answer does not say)."""
        ...

    async def load(self, version: int) -> tuple[int | None, str]:
        """Ask the server to serve ``version`` (only it) from now on: ``(HTTP status, error text)``;
        status None when the call itself failed (connection error, client timeout)."""
        ...

    async def load_corrupt(self) -> tuple[int | None, str]:
        """Ask the server to serve the corrupt version: the load must fail and the old version stay."""
        ...


def benchmark_images(folder: Path | None, scratch: Path) -> list[bytes]:
    """The images of ``folder``, or (None) the benchmark photos of ``service.tune.images`` written to ``scratch``:
    the set every experiment cycles."""
    from service.tune.images import read_images, write_benchmark_images

    if folder is None:
        write_benchmark_images(scratch)
        folder = scratch
    return read_images(folder)


def version_policy_config(version: int) -> str:
    """Triton's JSON model config that serves ``version`` only: a load call's ``parameters.config``."""
    return json.dumps({"version_policy": {"specific": {"versions": [version]}}})


def oip_model_version(response: httpx.Response) -> str | None:
    """``model_version`` of an Open Inference Protocol JSON answer (Triton's and vision-serve's)."""
    try:
        version = response.json().get("model_version")
    except (ValueError, AttributeError):
        return None
    return None if version is None else str(version)


@dataclass(frozen=True)
class SwapPlan:
    """When to load what. Loads are ``2 * cycles`` good ones (2, 1, 2, 1, ...) then, with ``corrupt``,
    one of the corrupt version; ``steady_s`` of load before the first, between two, and after the last."""

    cycles: int = 5
    steady_s: float = 4.0
    warmup_s: float = 3.0
    corrupt: bool = True
    concurrency: int = CONCURRENCY
    max_seconds: float = 900.0  # a bound on the whole run: loads that hang do not make it endless

    def __post_init__(self) -> None:
        if self.cycles < 0 or self.concurrency < 1:
            raise ValueError(f"cycles must be >= 0 and concurrency >= 1, got {self.cycles}, {self.concurrency}")
        if self.steady_s <= 0 or self.warmup_s < 0 or self.max_seconds <= 0:
            raise ValueError("steady_s and max_seconds must be > 0 and warmup_s >= 0")

    def versions(self) -> list[int]:
        """The versions loaded, in order: 2, 1, 2, 1, ... then the corrupt one."""
        good = [2 if i % 2 == 0 else 1 for i in range(2 * self.cycles)]
        return [*good, CORRUPT_VERSION] if self.corrupt else good


QUICK_PLAN = SwapPlan(cycles=1, steady_s=3.0, warmup_s=2.0)  # --quick: for trying things out


@dataclass(frozen=True)
class Answer:
    """One infer request as the client saw it; times in seconds from the start of recording."""

    sent_s: float
    latency_ms: float
    status: int | None  # None: connection error or client timeout
    version: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def done_s(self) -> float:
        """When the answer (or the error) came."""
        return self.sent_s + self.latency_ms / 1e3


@dataclass(frozen=True)
class LoadCall:
    """One load call: the version asked for, when it started and returned, what the server said."""

    version: int
    corrupt: bool
    start_s: float
    end_s: float
    status: int | None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200


@dataclass
class SwapRun:
    plan: SwapPlan
    answers: list[Answer] = field(default_factory=list)
    loads: list[LoadCall] = field(default_factory=list)
    elapsed_s: float = 0.0
    initial_version: str = "1"

    @classmethod
    def from_dict(cls, record: dict) -> SwapRun:
        """A run back from :meth:`to_dict`'s record (to summarize or plot a saved run again)."""
        answers = [Answer(**answer) for answer in record["answers"]]
        elapsed = record.get("summary", {}).get("elapsed_s", 0.0)
        return cls(SwapPlan(**record["plan"]), answers, [LoadCall(**call) for call in record["loads"]], elapsed)

    def to_dict(self) -> dict:
        return {
            "plan": asdict(self.plan),
            "summary": summarize(self),
            "loads": [asdict(call) for call in self.loads],
            "answers": [asdict(answer) for answer in self.answers],
        }


def answer_of(done: Exchange, target: SwapTarget, record_from: float) -> Answer:
    """One exchange as the run records it: its send time from ``record_from``, the version that answered."""
    sent_s = done.sent - record_from
    response = done.response
    if response is None:
        return Answer(sent_s, done.latency_ms, None, error=repr(done.error)[:200])
    ok = 200 <= response.status_code < 300
    return Answer(
        sent_s,
        done.latency_ms,
        response.status_code,
        target.version_of(response) if ok else None,
        None if ok else response.text[:200],
    )


async def _control(target: SwapTarget, plan: SwapPlan, record_from: float, run: SwapRun) -> None:
    """The loads of the plan, one after another, ``steady_s`` of steady load before, between and after."""
    await asyncio.sleep(max(0.0, record_from - time.perf_counter()) + plan.steady_s)
    for version in plan.versions():
        corrupt = version == CORRUPT_VERSION
        start = time.perf_counter()
        logger.info("Load %s%s", version, " (corrupt)" if corrupt else "")
        try:
            status, text = await (target.load_corrupt() if corrupt else target.load(version))
        except Exception as exc:  # a load call that raises is a result, not the run's end
            status, text = None, repr(exc)
        end = time.perf_counter()
        call = LoadCall(version, corrupt, start - record_from, end - record_from, status, text[:2000])
        run.loads.append(call)
        logger.info("  -> %s in %.2f s %s", status, end - start, text[:200])
        await asyncio.sleep(plan.steady_s)


async def run_swap_async(target: SwapTarget, images: Sequence[bytes], plan: SwapPlan) -> SwapRun:
    """The load and the loads, as the module docstring says; returns every answer and load call."""
    check_loopback(target.infer_url)
    if not images:
        raise ValueError("No images to send.")
    run = SwapRun(plan)
    bodies = [target.encode(image) for image in images]  # encoded once, before the clock starts
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    stop = asyncio.Event()
    answers: list[Answer] = []
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, limits=limits) as client:
        record_from = time.perf_counter() + plan.warmup_s

        async def send(index: int) -> Answer:
            body, headers = bodies[index % len(bodies)]
            return answer_of(await exchange(client, target.infer_url, body, headers), target, record_from)

        # The clients take the images in turn until the loads are done; ``answers`` fills as they come.
        load = asyncio.create_task(closed_loop(send, plan.concurrency, itertools.count(), stop.is_set, answers))
        try:
            await asyncio.wait_for(_control(target, plan, record_from, run), plan.max_seconds)
        except TimeoutError:
            logger.error("The run passed its bound of %.0f s; stopping with the loads done so far.", plan.max_seconds)
        finally:
            stop.set()
            # Each client finishes the request it has in flight (recorded), then stops.
            try:
                await asyncio.wait_for(load, CLIENT_TIMEOUT_S)
            except TimeoutError:
                logger.error("Clients still waiting %.0f s after the run: their requests are lost.", CLIENT_TIMEOUT_S)
            except Exception as exc:  # a client's error ends the load, not the run: its answers stay
                logger.error("A client stopped on %r", exc)
        run.elapsed_s = time.perf_counter() - record_from
    # Answers sent in the warm-up are not recorded.
    answers = [answer for answer in answers if answer.sent_s >= 0]
    run.answers = sorted(answers, key=lambda a: a.sent_s)
    return run


def run_swap(target: SwapTarget, images: Sequence[bytes], plan: SwapPlan) -> SwapRun:
    """Blocking :func:`run_swap_async`."""
    return asyncio.run(run_swap_async(target, images, plan))


# ---- single requests during a load ---------------------------------------------------------------

# (seconds after the load call started, pinned to the version served until then?)
PROBE_CASES = ((0.0, False), (0.5, False), (1.0, False), (2.0, False), (3.0, False), (0.0, True), (1.0, True))
PROBE_PAUSE_S = 2.0
PROBE_TIMEOUT_S = 600.0


async def _timed(call: Awaitable[tuple[int | None, str]]) -> tuple[int | None, str, float]:
    status, text = await call
    return status, text, time.perf_counter()


async def requests_during_loads(
    target: SwapTarget,
    image: bytes,
    served: int,
    versioned_url: Callable[[int], str],
    cases: Sequence[tuple[float, bool]] = PROBE_CASES,
) -> list[dict]:
    """With no other traffic: per case one swap to the other version (1 <-> 2), and one request sent
    ``offset`` seconds after the load call started, to ``target.infer_url`` (the server picks the
    version) or, pinned, to ``versioned_url(served)``. Per case: when the request was answered, by
    which version and with what, and whether before the load call returned."""
    body, headers = target.encode(image)
    records = []
    async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S) as client:
        for offset, pinned in cases:
            other = 2 if served == 1 else 1
            started = time.perf_counter()
            load = asyncio.create_task(_timed(target.load(other)))
            await asyncio.sleep(offset)
            sent = time.perf_counter()
            url = versioned_url(served) if pinned else target.infer_url
            try:
                response = await client.post(url, content=body, headers=headers)
                status_code, error = response.status_code, "" if response.status_code == 200 else response.text[:300]
                version = target.version_of(response) if response.status_code == 200 else None
            except httpx.HTTPError as exc:
                status_code, error, version = None, repr(exc), None
            answered = time.perf_counter()
            status, text, returned = await load
            records.append(
                {
                    "served_version": served,
                    "loading_version": other,
                    "request_pinned_to": served if pinned else None,
                    "sent_after_load_call_s": sent - started,
                    "request_status": status_code,
                    "request_latency_s": answered - sent,
                    "answered_by": version,
                    "request_error": error,
                    "load_status": status,
                    "load_error": text[:300],
                    "load_call_s": returned - started,
                    "answered_before_load_returned": answered < returned,
                }
            )
            logger.info("Probe: %s", records[-1])
            if status == 200:
                served = other
            await asyncio.sleep(PROBE_PAUSE_S)
    return records


# ---- the summary ----------------------------------------------------------------------------------


def in_swap_window(sent_s: float, loads: Sequence[LoadCall], tail_s: float = SWAP_TAIL_S) -> bool:
    """Sent between a load call's start and ``tail_s`` after it returned."""
    return any(call.start_s <= sent_s <= call.end_s + tail_s for call in loads)


def overlaps_swap_window(answer: Answer, loads: Sequence[LoadCall], tail_s: float = SWAP_TAIL_S) -> bool:
    """In flight at some moment of a swap window (sent before its end, answered after its start). In a
    closed loop a server that stops answering during a load stops the clients from sending: the
    requests it holds were sent *before* the window, so only this view catches such a stall."""
    return any(answer.sent_s <= call.end_s + tail_s and answer.done_s >= call.start_s for call in loads)


def completion_gaps(answers: Sequence[Answer]) -> list[tuple[float, float]]:
    """``(from, to)`` of each stretch between two consecutive answers coming back."""
    done = sorted(a.done_s for a in answers)
    return list(itertools.pairwise(done))


def _longest_gap(gaps: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """The longest stretch without an answer that overlaps ``[start, end]``."""
    return max((b - a for a, b in gaps if b > start and a < end), default=math.nan)


def _latency_stats(values: Sequence[float]) -> dict:
    ordered = sorted(values)
    return {
        "count": len(ordered),
        "p50": percentile(ordered, 0.50),
        "p99": percentile(ordered, 0.99),
        "max": ordered[-1] if ordered else math.nan,
    }


def _expected_versions(run: SwapRun) -> list[str]:
    """The version that should answer after each load returned: the new one after a good load, the
    one before after a failed one."""
    current, expected = run.initial_version, []
    for call in run.loads:
        if call.ok and not call.corrupt:
            current = str(call.version)
        expected.append(current)
    return expected


def per_load(run: SwapRun) -> list[dict]:
    """Per load: the call's duration and status; for a good load, the time from the call's start to the
    first answer sent after that start which came from the new version; answers sent after the call
    returned (and answered before the next load began) that came from another version than expected."""
    records = []
    expected = _expected_versions(run)
    gaps = completion_gaps(run.answers)
    for i, call in enumerate(run.loads):
        next_start = run.loads[i + 1].start_s if i + 1 < len(run.loads) else math.inf
        first_new = next(
            (a.sent_s for a in run.answers if a.sent_s >= call.start_s and a.ok and a.version == str(call.version)),
            None,
        )
        # sent after the call returned and answered before the next load began (one that the next load
        # held belongs to that load)
        after = [a for a in run.answers if call.end_s <= a.sent_s and a.done_s < next_start and a.ok]
        records.append(
            {
                "version": call.version,
                "corrupt": call.corrupt,
                "status": call.status,
                "call_s": call.end_s - call.start_s,
                "first_new_answer_s": None if call.corrupt or first_new is None else first_new - call.start_s,
                "expected_after": expected[i],
                "other_version_answers_after_return": sum(a.version != expected[i] for a in after),
                # 0 while a load runs: the server answered nothing for the whole call
                "answers_during_call": sum(1 for a in run.answers if call.start_s <= a.done_s <= call.end_s),
                "longest_answer_gap_s": _longest_gap(gaps, call.start_s, call.end_s + SWAP_TAIL_S),
                "error": call.error[:300],
            }
        )
    return records


def summarize(run: SwapRun) -> dict:
    answers, loads = run.answers, run.loads
    ok = [a for a in answers if a.ok]
    statuses = Counter("connection-error" if a.status is None else str(a.status) for a in answers)
    versions = sorted({a.version or "?" for a in ok})
    steady = [a.latency_ms for a in ok if not in_swap_window(a.sent_s, loads)]
    swap = [a.latency_ms for a in ok if in_swap_window(a.sent_s, loads)]
    steady_stats, swap_stats = _latency_stats(steady), _latency_stats(swap)
    ratio = swap_stats["p99"] / steady_stats["p99"] if steady and swap else math.nan
    in_flight = _latency_stats([a.latency_ms for a in ok if overlaps_swap_window(a, loads)])
    untouched = _latency_stats([a.latency_ms for a in ok if not overlaps_swap_window(a, loads)])
    in_flight_ratio = in_flight["p99"] / untouched["p99"] if in_flight["count"] and untouched["count"] else math.nan
    gaps = completion_gaps(answers)
    outside_gaps = [b - a for a, b in gaps if not any(b > c.start_s and a < c.end_s + SWAP_TAIL_S for c in loads)]
    loads_table = per_load(run)
    good = [r for r in loads_table if not r["corrupt"]]
    to_new = [r["first_new_answer_s"] for r in good if r["first_new_answer_s"] is not None]
    corrupt = [r for r in loads_table if r["corrupt"]]
    checks = {
        "no_non_2xx": not any(a.status is not None and not a.ok for a in answers),
        "no_connection_errors": statuses.get("connection-error", 0) == 0,
        "versions_subset_of_1_2": set(versions) <= ALLOWED_VERSIONS,
        "good_loads_200": all(r["status"] == 200 for r in good),
        "every_good_load_answered_by_new_version": len(to_new) == len(good),
        "corrupt_load_refused": all(r["status"] != 200 for r in corrupt),
        # after a good load only the new version answers; after a failed one, only the old one
        "only_expected_version_after_each_load": all(r["other_version_answers_after_return"] == 0 for r in loads_table),
        f"swap_p99_at_most_{MAX_P99_RATIO:g}x_steady": ratio <= MAX_P99_RATIO,
        f"in_flight_p99_at_most_{MAX_P99_RATIO:g}x_untouched": in_flight_ratio <= MAX_P99_RATIO,
    }
    return {
        "concurrency": run.plan.concurrency,
        "elapsed_s": run.elapsed_s,
        "requests": len(answers),
        "ok": len(ok),
        "throughput_rps": len(ok) / run.elapsed_s if run.elapsed_s else 0.0,
        "statuses": dict(sorted(statuses.items())),
        "non_2xx": sum(1 for a in answers if a.status is not None and not a.ok),
        "connection_errors": statuses.get("connection-error", 0),
        "versions_answered": versions,
        "answers_by_version": dict(sorted(Counter(a.version or "?" for a in ok).items())),
        "steady_latency_ms": steady_stats,
        "swap_window_latency_ms": swap_stats,
        "swap_window_tail_s": SWAP_TAIL_S,
        "p99_ratio_swap_over_steady": ratio,
        # The same question asked by time in flight rather than send time (see overlaps_swap_window).
        "in_flight_during_swap_latency_ms": in_flight,
        "untouched_by_swaps_latency_ms": untouched,
        "p99_ratio_in_flight_over_untouched": in_flight_ratio,
        "longest_answer_gap_s": {
            "outside_swap_windows": max(outside_gaps, default=math.nan),
            "in_swap_windows": max((r["longest_answer_gap_s"] for r in loads_table), default=math.nan),
        },
        "loads": len(loads),
        "good_loads": len(good),
        "load_call_s": {
            "median": statistics.median(r["call_s"] for r in good) if good else math.nan,
            "max": max((r["call_s"] for r in good), default=math.nan),
        },
        "load_to_first_new_answer_s": {
            "median": statistics.median(to_new) if to_new else math.nan,
            "max": max(to_new, default=math.nan),
        },
        "per_load": loads_table,
        "checks": checks,
        "passed": all(checks.values()),
    }


def format_summary(summary: dict) -> str:
    steady, swap = summary["steady_latency_ms"], summary["swap_window_latency_ms"]
    to_new = summary["load_to_first_new_answer_s"]
    flight, untouched = summary["in_flight_during_swap_latency_ms"], summary["untouched_by_swaps_latency_ms"]
    gap = summary["longest_answer_gap_s"]
    lines = [
        f"{summary['requests']} requests at concurrency {summary['concurrency']} in {summary['elapsed_s']:.1f} s "
        f"({summary['throughput_rps']:.1f} ok/s): statuses {summary['statuses']}, "
        f"versions {summary['answers_by_version']}",
        f"  steady p50 {steady['p50']:.0f} ms p99 {steady['p99']:.0f} ms ({steady['count']} answers); "
        f"swap-window p50 {swap['p50']:.0f} ms p99 {swap['p99']:.0f} ms ({swap['count']} answers); "
        f"p99 ratio {summary['p99_ratio_swap_over_steady']:.2f}",
        f"  in flight during a swap p99 {flight['p99']:.0f} ms ({flight['count']} answers) vs untouched p99 "
        f"{untouched['p99']:.0f} ms: ratio {summary['p99_ratio_in_flight_over_untouched']:.2f}; longest time "
        f"without an answer {gap['in_swap_windows']:.2f} s in swap windows, {gap['outside_swap_windows']:.2f} s "
        "outside",
        f"  {summary['good_loads']} good loads: call median {summary['load_call_s']['median']:.2f} s, "
        f"max {summary['load_call_s']['max']:.2f} s; call -> first answer of the new version median "
        f"{to_new['median']:.2f} s, max {to_new['max']:.2f} s",
    ]
    for record in summary["per_load"]:
        new = record["first_new_answer_s"]
        lines.append(
            f"    load v{record['version']}{' (corrupt)' if record['corrupt'] else ''}: status {record['status']}, "
            f"{record['call_s']:.2f} s, first new answer {'-' if new is None else f'{new:.2f} s'}, "
            f"answers during the call {record['answers_during_call']}, longest gap "
            f"{record['longest_answer_gap_s']:.2f} s, stale after return {record['other_version_answers_after_return']}"
            + (f", error: {record['error'][:120]}" if record["error"] else "")
        )
    lines.append(
        "  checks: " + ", ".join(f"{name} {'ok' if ok else 'FAILED'}" for name, ok in summary["checks"].items())
    )
    return "\n".join(lines)


# ---- the plot -------------------------------------------------------------------------------------

VERSION_COLOURS = {"1": "tab:blue", "2": "tab:orange"}


ANSWER_BIN_S = 0.5


def plot(run: SwapRun, title: str, path: Path) -> Path:
    """Top: each answer's latency at its send time, coloured by the version that answered, failed
    answers as red crosses. Bottom: answers coming back per second (0.5 s bins), by version: a stall
    shows as a gap. Load calls shaded in both (grey: good loads, red: the corrupt one; lighter: the
    1 s after the call returned that still counts as its swap window)."""
    from benchmarks.harness import plots  # matplotlib, headless, only when plotting

    plt = plots.plt
    fig, (ax, rate_ax) = plt.subplots(2, 1, figsize=(11.0, 6.0), sharex=True, gridspec_kw={"height_ratios": [2.2, 1.0]})
    for axis in (ax, rate_ax):
        for call in run.loads:
            colour = "tab:red" if call.corrupt else "0.6"
            axis.axvspan(call.start_s, call.end_s, color=colour, alpha=0.25, lw=0)
            axis.axvspan(call.end_s, call.end_s + SWAP_TAIL_S, color=colour, alpha=0.08, lw=0)
    for call in run.loads:
        ax.annotate(
            f"v{call.version}{'!' if not call.ok else ''}",
            (call.start_s, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(1, -10),
            textcoords="offset points",
            fontsize="x-small",
            color="tab:red" if not call.ok else "0.3",
        )
    ok = [a for a in run.answers if a.ok]
    end = max((a.done_s for a in run.answers), default=0.0)
    bins = [i * ANSWER_BIN_S for i in range(math.ceil(end / ANSWER_BIN_S) + 2)]
    versions = sorted({a.version or "?" for a in ok})
    colours = [VERSION_COLOURS.get(version, "tab:purple") for version in versions]
    by_version = [[a for a in ok if (a.version or "?") == version] for version in versions]
    for version, colour, points in zip(versions, colours, by_version, strict=True):
        ax.scatter(
            [a.sent_s for a in points],
            [a.latency_ms for a in points],
            s=4,
            color=colour,
            label=f"version {version} ({len(points)})",
        )
    if ok:
        rate_ax.hist(
            [[a.done_s for a in points] for points in by_version],
            bins=bins,
            weights=[[1 / ANSWER_BIN_S] * len(points) for points in by_version],
            color=colours,
            stacked=True,
        )
    failed = [a for a in run.answers if not a.ok]
    if failed:
        ax.scatter(
            [a.sent_s for a in failed],
            [max(a.latency_ms, 1.0) for a in failed],
            s=30,
            marker="x",
            color="tab:red",
            label=f"failed ({len(failed)})",
        )
    ax.set_yscale("log")
    ax.set_ylabel("latency (ms, log scale)\nat the send time")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small", loc="lower right", markerscale=3)
    rate_ax.set_xlabel("time (s)")
    rate_ax.set_ylabel("answers/s\nat the answer time")
    rate_ax.grid(alpha=0.3)
    return plots._save(fig, path)
