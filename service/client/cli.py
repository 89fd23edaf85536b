"""`vision-classify IMAGE... --url URL`: send images to a vision-serve server, print their top-k."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx

from service.client import _defaults
from service.client.vision_client import AsyncVisionClient, Classification, ClassifyError

API_KEY_ENV = _defaults.API_KEY_ENV


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vision-classify", description="Classify images with a vision-serve server.")
    parser.add_argument("images", nargs="+", type=Path, metavar="IMAGE", help="image files to classify")
    parser.add_argument("--url", default=_defaults.URL, help=f"server URL (default: {_defaults.URL})")
    parser.add_argument(
        "--top-k", type=int, default=_defaults.TOP_K, help=f"labels per image (default: {_defaults.TOP_K})"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per image instead of tables")
    parser.add_argument("--concurrency", type=int, default=_defaults.CONCURRENCY, help="requests in flight at once")
    parser.add_argument(
        "--images-per-request",
        type=int,
        default=1,
        help="images sent in each request (several image fields; the server classifies each as its own batch "
        "item, and the request costs less than as many single ones); default: 1",
    )
    parser.add_argument("--timeout", type=float, default=_defaults.TIMEOUT_S, help="seconds per request")
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"the server's API key, if it needs one (default: env {API_KEY_ENV})",
    )
    return parser


def format_table(name: str, result: Classification) -> str:
    width = max(len(p.label) for p in result.predictions)
    lines = [f"{name}  ({result.model}, {result.latency_ms:.0f} ms)"]
    lines += [
        f"  {rank}. {p.label:<{width}}  {p.probability * 100:6.2f} %" for rank, p in enumerate(result.predictions, 1)
    ]
    return "\n".join(lines)


def as_json(name: str, outcome: Classification | Exception) -> str:
    if isinstance(outcome, Classification):
        body = {
            "image": name,
            "predictions": [vars(p) for p in outcome.predictions],
            "model": outcome.model,
            "engine": outcome.engine,
            "latency_ms": round(outcome.latency_ms, 2),
        }
    else:
        body = {"image": name, "error": describe_error(outcome)}
    return json.dumps(body)


def describe_error(exc: Exception) -> str:
    if isinstance(exc, ClassifyError):
        return str(exc)
    if isinstance(exc, OSError):
        return f"cannot read file: {exc.strerror or exc}"
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer in time ({exc.__class__.__name__}); a busy server may need a larger --timeout"
    if isinstance(exc, httpx.TransportError):
        return f"cannot reach the server ({exc.__class__.__name__}: {exc}); is vision-serve running at that --url?"
    return f"{exc.__class__.__name__}: {exc}"


async def classify_all(
    images: Sequence[Path],
    url: str,
    top_k: int,
    concurrency: int,
    timeout: float,
    api_key: str | None = None,
    images_per_request: int = 1,
) -> list[Classification | Exception]:
    """Each image's outcome, in order; ``images_per_request`` > 1 sends them in groups of that many."""
    limit = asyncio.Semaphore(concurrency)
    groups = [list(images[i : i + images_per_request]) for i in range(0, len(images), images_per_request)]
    async with AsyncVisionClient(url, timeout=timeout, api_key=api_key) as client:

        async def one_group(paths: list[Path]) -> list[Classification | Exception]:
            async with limit:
                try:
                    if images_per_request == 1:
                        return [await client.classify(paths[0], top_k=top_k)]
                    return list(await client.classify_many(paths, top_k=top_k))
                except (ClassifyError, OSError, httpx.HTTPError) as exc:
                    return [exc] * len(paths)

        outcomes = await asyncio.gather(*(one_group(group) for group in groups))
        return [outcome for group in outcomes for outcome in group]


def print_outcomes(
    names: Sequence[str], outcomes: Sequence[Classification | Exception], *, json_lines: bool = False
) -> int:
    """Print a table (or a JSON line) per image; returns how many failed."""
    failed = 0
    for name, outcome in zip(names, outcomes, strict=True):
        if json_lines:
            print(as_json(name, outcome))
        elif isinstance(outcome, Classification):
            print(format_table(name, outcome) + "\n")
        else:
            print(f"{name}  ERROR: {describe_error(outcome)}\n")
        failed += not isinstance(outcome, Classification)
    return failed


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 1 <= args.top_k <= _defaults.MAX_TOP_K:
        parser.error(f"--top-k must be from 1 to {_defaults.MAX_TOP_K}")
    if args.concurrency < 1:
        parser.error("--concurrency must be >= 1")
    if args.images_per_request < 1:
        parser.error("--images-per-request must be >= 1 (the server's limit is its --max-images-per-request)")
    outcomes = asyncio.run(
        classify_all(
            args.images, args.url, args.top_k, args.concurrency, args.timeout, args.api_key, args.images_per_request
        )
    )
    failed = print_outcomes([str(p) for p in args.images], outcomes, json_lines=args.json)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
