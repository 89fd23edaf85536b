"""The three plots every experiment writes: throughput vs concurrency, latency CDF, batch sizes."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: benchmarks run headless
import matplotlib.pyplot as plt  # after choosing the backend

logger = logging.getLogger(__name__)


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    logger.info("wrote %s", path)
    return path


def throughput_vs_concurrency(series: Mapping[str, Sequence[tuple[int, float]]], title: str, path: Path) -> Path:
    """``series``: label -> [(concurrency, images per second)]."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, points in series.items():
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("throughput (img/s)")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def latency_cdf(series: Mapping[str, Sequence[float]], title: str, path: Path) -> Path:
    """``series``: label -> latencies in ms (of answered requests)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, latencies in series.items():
        values = sorted(latencies)
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.01)
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    return _save(fig, path)


def batch_histogram(series: Mapping[str, Mapping[str, int]], title: str, path: Path) -> Path:
    """``series``: label -> {batch size: requests served in a batch of that size}."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    labels = [label for label, counts in series.items() if counts]
    sizes = sorted({int(size) for label in labels for size in series[label]})
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        total = sum(series[label].values())
        fractions = [series[label].get(str(size), 0) / total for size in sizes]
        ax.bar([s + (i - (len(labels) - 1) / 2) * width for s in range(len(sizes))], fractions, width, label=label)
    ax.set_xticks(range(len(sizes)), [str(s) for s in sizes])
    ax.set_xlabel("batch size the request was served in")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize="small")
    return _save(fig, path)
