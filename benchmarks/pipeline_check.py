"""Does the pipelined worker give the same answers as the sequential one under sustained load?

    python -m benchmarks.pipeline_check --device cuda:0                    # on a GPU: 4,000 requests each
    python -m benchmarks.pipeline_check --device cpu --requests 300 --concurrency 16

At ``--pipeline-depth 2`` a worker prepares the next batch (decode, resize, upload; on a GPU on a
CUDA stream of its own) while the engine runs the current one. A stream-ordering or buffer-reuse bug
there gives wrong answers only under real overlap, which a test of one batch does not create. So:

1. reference: a ``--pipeline-depth 1`` server answers each of ``--distinct`` different photos alone;
2. the same server, then a ``--pipeline-depth 2`` one, each take ``--requests`` requests from
   ``--concurrency`` connections (photo ``i % distinct`` for request ``i``), batches of up to 32;
3. every answer is compared with its photo's reference: status 200, the same top-1 class, and a
   top-1 probability within ``PROBABILITY_TOLERANCE`` (batch size changes the kernels a little, a
   swapped or half-written input changes much more; photos of one class differ in probability, so
   an answer given to the wrong request of the same class is caught too).

EfficientNet-Lite0 with its real ImageNet weights (they ship in a package), eager fp32 and
``--preprocess torch`` (nvJPEG on a GPU). Exit code 1 if any answer differs. Results:
``pipeline_check.json`` and ``.md`` in the output folder.

``check_under_load`` is the same comparison against any running server, with bad JPEGs in the mix
(each must get its own 4xx and harm no photo of its batch): the GPU suite's ``answers`` step.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from benchmarks.harness.common import results_dir, write_results
from benchmarks.harness.suite import markdown_table
from service.client.launcher import ServerProcess
from service.tune.images import IMAGENET_SIZE, PHOTOS, photo_jpegs
from tests.bad_inputs import BadInput

logger = logging.getLogger(__name__)

MODEL = "efficientnet-lite0"
MAX_BATCH = 32
PROBABILITY_TOLERANCE = 1e-3
# Photo sizes x noise seeds: distinct bytes, distinct probabilities.
VARIANTS = ((IMAGENET_SIZE, 0), (IMAGENET_SIZE[::-1], 1), ((640, 480), 2), ((320, 240), 3),
            ((512, 512), 4), ((800, 600), 5), ((300, 400), 6), ((1024, 768), 7))  # fmt: skip
CLIENT_TIMEOUT_S = 120.0
BAD_EVERY = 16  # check_under_load: one request in this many sends a bad image


@dataclass(frozen=True)
class Answer:
    photo: int
    status: int
    top1: int | None = None
    probability: float | None = None
    batch_size: int | None = None
    latency_ms: float = 0.0
    top5: tuple[tuple[int, float], ...] = ()  # (class index, probability), best first

    def probability_of(self, index: int | None) -> float | None:
        """This answer's probability of class ``index``, if it is among its top 5."""
        return next((p for i, p in self.top5 if i == index), None)


def check_photos(distinct: int) -> list[bytes]:
    """``distinct`` different JPEGs of the benchmark photos (sizes and noise vary)."""
    photos: list[bytes] = []
    for (width, height), seed in VARIANTS:
        photos += photo_jpegs(width, height, PHOTOS, seed=seed)
        if len(photos) >= distinct:
            return photos[:distinct]
    raise ValueError(f"--distinct at most {len(photos)}, got {distinct}.")


async def _send(client: httpx.AsyncClient, url: str, photo: int, body: bytes) -> Answer:
    started = time.perf_counter()
    response = await client.post(url, content=body, headers={"Content-Type": "image/jpeg"})
    latency_ms = (time.perf_counter() - started) * 1e3
    if response.status_code != 200:
        return Answer(photo, response.status_code, latency_ms=latency_ms)
    predictions = response.json()["predictions"]
    top5 = tuple((p["index"], p["probability"]) for p in predictions)
    batch = response.headers.get("X-Batch-Size")
    top = predictions[0]
    return Answer(photo, 200, top["index"], top["probability"], int(batch) if batch else None, latency_ms, top5)


async def send_schedule(
    url: str, schedule: Sequence[tuple[int, bytes]], concurrency: int
) -> tuple[list[Answer], float]:
    """Each ``(photo, body)`` of ``schedule`` once, from ``concurrency`` connections, closed loop."""
    answers: list[Answer] = []
    order = iter(schedule)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, limits=limits) as client:

        async def connection() -> None:
            for photo, body in order:  # shared: each request is sent by exactly one connection
                answers.append(await _send(client, url, photo, body))

        started = time.perf_counter()
        await asyncio.gather(*(connection() for _ in range(concurrency)))
        return answers, time.perf_counter() - started


async def send_all(url: str, photos: list[bytes], requests: int, concurrency: int) -> tuple[list[Answer], float]:
    """Request ``i`` sends photo ``i % len(photos)``; ``concurrency`` connections, closed loop."""
    schedule = [(i % len(photos), photos[i % len(photos)]) for i in range(requests)]
    return await send_schedule(url, schedule, concurrency)


def compare(answers: list[Answer], reference: dict[int, Answer], tolerance: float = PROBABILITY_TOLERANCE) -> dict:
    """Answers that differ from their photo's reference: the probability the answer gives the
    reference's top-1 class must be within ``tolerance`` of the reference's. Judged by that class,
    not by the answer's own top-1: a near tie (two classes closer than the engine's rounding, as a
    random model's can be in fp16) may swap places with the batch's kernels; ``top1_swaps`` counts
    those, which passed because the reference's class kept its probability."""
    differing = []
    largest = 0.0
    swaps = 0
    for answer in answers:
        expected = reference[answer.photo]
        given = answer.probability_of(expected.top1) if answer.status == 200 else None
        delta = abs(given - expected.probability) if given is not None else float("inf")
        largest = max(largest, delta)
        if delta > tolerance:
            differing.append({"answer": asdict(answer), "reference": asdict(expected)})
        elif answer.top1 != expected.top1:
            swaps += 1
    return {"differing": len(differing), "examples": differing[:10], "max_probability_delta": largest,
            "top1_swaps": swaps}  # fmt: skip


def references(url: str, photos: list[bytes]) -> dict[int, Answer]:
    """Each photo's answer alone (batch of one): what every later answer of it is compared with."""
    alone, _ = asyncio.run(send_all(url, photos, len(photos), 1))
    bad = [a for a in alone if a.status != 200]
    if bad:
        raise RuntimeError(f"the reference answers failed: {bad[:3]}")
    return {answer.photo: answer for answer in alone}


def answer_groups(reference: dict[int, Answer], tolerance: float) -> int:
    """Into how many groups the photos' reference answers fall, photos whose top-1 class and
    probability lie within ``tolerance`` of each other sharing one: a check can tell an answer given
    to the wrong request only across groups (a random model answers a photo's resized and noisier
    variants alike)."""
    groups = 0
    last: tuple[int | None, float] | None = None
    for answer in sorted(reference.values(), key=lambda a: (a.top1, a.probability)):
        if last is None or answer.top1 != last[0] or answer.probability - last[1] > tolerance:
            groups += 1
        last = (answer.top1, answer.probability)
    return groups


def check_under_load(
    url: str,
    photos: list[bytes],
    bad: Sequence[BadInput],
    requests: int,
    concurrency: int,
    tolerance: float,
    bad_every: int = BAD_EVERY,
) -> dict:
    """Answers under load against each photo's answer alone, with a bad image every ``bad_every``
    requests: every photo must get its own answer (the probability of its class within ``tolerance``,
    as ``compare`` judges) and every bad image its own 4xx, whatever batch it shared."""
    reference = references(url, photos)
    schedule = []
    for i in range(requests):
        if bad and i % bad_every == bad_every - 1:
            item = (i // bad_every) % len(bad)
            schedule.append((len(photos) + item, bad[item].body))
        else:
            schedule.append((i % len(photos), photos[i % len(photos)]))
    answers, elapsed = asyncio.run(send_schedule(url, schedule, concurrency))
    good = [a for a in answers if a.photo < len(photos)]
    refused = [a for a in answers if a.photo >= len(photos)]
    wrong_refusals = [
        {"input": bad[a.photo - len(photos)].name, "status": a.status}
        for a in refused
        if a.status not in bad[a.photo - len(photos)].statuses
    ]
    found = {
        **summary(good, elapsed),
        **compare(good, reference, tolerance),
        "requests": len(answers),
        "distinct_photos": len(photos),
        "answer_groups": answer_groups(reference, tolerance),
        "probability_tolerance": tolerance,
        "bad_sent": len(refused),
        "bad_inputs": [item.name for item in bad],
        "bad_statuses": dict(sorted(Counter(str(a.status) for a in refused).items())),
        "bad_wrongly_answered": wrong_refusals[:10],
    }
    found["passed"] = found["differing"] == 0 and not wrong_refusals and found["ok"] == len(good)
    return found


def summary(answers: list[Answer], elapsed_s: float) -> dict:
    latencies = sorted(a.latency_ms for a in answers if a.status == 200)
    batches = [a.batch_size for a in answers if a.batch_size]
    return {
        "requests": len(answers),
        "ok": len(latencies),
        "img_per_s": len(latencies) / elapsed_s,
        "p50_ms": statistics.median(latencies) if latencies else None,
        "p99_ms": latencies[int(0.99 * (len(latencies) - 1))] if latencies else None,
        "mean_batch": statistics.fmean(batches) if batches else None,
        "max_batch": max(batches, default=None),
    }


def server_args(device: str, depth: int, preprocess: str) -> list[str]:
    return [
        *("--model", MODEL, "--device", device, "--preprocess", preprocess, "--pipeline-depth", str(depth)),
        *("--max-batch-size", str(MAX_BATCH), "--max-queue", "4096", "--request-timeout-s", "120"),
        *("--log-level", "warning"),
    ]


def run_check(args: argparse.Namespace, out: Path) -> dict:
    photos = check_photos(args.distinct)
    record: dict = {
        "device": args.device,
        "model": MODEL,
        "preprocess": args.preprocess,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "distinct_photos": len(photos),
        "probability_tolerance": PROBABILITY_TOLERANCE,
        "depths": {},
    }
    reference: dict[int, Answer] = {}
    for depth in (1, 2):
        log = out / "logs" / f"server-pipeline-check-depth{depth}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with ServerProcess(server_args(args.device, depth, args.preprocess), log_path=log, with_parent=True) as server:
            url = f"{server.url}/predict"
            if not reference:
                reference = references(url, photos)
            asyncio.run(send_all(url, photos, min(args.requests, 2 * args.concurrency), args.concurrency))  # warm
            answers, elapsed = asyncio.run(send_all(url, photos, args.requests, args.concurrency))
        record["depths"][depth] = {**summary(answers, elapsed), **compare(answers, reference)}
        logger.info("depth %d: %s", depth, {k: v for k, v in record["depths"][depth].items() if k != "examples"})
        record["passed"] = all(result["differing"] == 0 for result in record["depths"].values())
        write_results(out, "pipeline_check", record, report(record), text_suffix=".md")  # a kill keeps depth 1
    return record


def report(record: dict) -> str:
    rows = [
        [
            depth,
            r["requests"],
            r["ok"],
            f"{r['img_per_s']:.1f}",
            f"{r['p50_ms']:.1f}" if r["p50_ms"] is not None else "",
            f"{r['p99_ms']:.1f}" if r["p99_ms"] is not None else "",
            f"{r['mean_batch']:.1f}" if r["mean_batch"] else "",
            r["differing"],
            f"{r['max_probability_delta']:.2g}",
        ]
        for depth, r in record["depths"].items()
    ]
    header = ["pipeline depth", "requests", "200", "img/s", "p50 ms", "p99 ms", "mean batch", "differing",
              "max |Δ top-1 prob|"]  # fmt: skip
    verdict = "PASSED: every answer matched its photo's reference" if record["passed"] else "FAILED: answers differ"
    return (
        f"# Pipeline check: {record['model']} on {record['device']}, --preprocess {record['preprocess']}\n\n"
        f"{record['requests']} requests per depth from {record['concurrency']} connections over "
        f"{record['distinct_photos']} distinct photos; reference: each photo alone at depth 1; "
        f"tolerance on the top-1 probability {record['probability_tolerance']:g}.\n\n"
        + markdown_table(header, rows)
        + f"\n\n**{verdict}**\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--distinct", type=int, default=48, help="distinct photos (at most 48)")
    parser.add_argument("--preprocess", default="torch", help="the server's --preprocess (torch: nvJPEG on a GPU)")
    parser.add_argument("--output-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    out = results_dir(args.output_dir)
    record = run_check(args, out)  # writes pipeline_check.json and .md after each depth
    print(report(record))
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
