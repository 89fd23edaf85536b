"""How fast a running server answers, read from its own counter of images answered.

A load generator's count over its run (requests answered / seconds) is short by up to one batch's
time at the start, when nothing has been answered yet, and cuts the last batch off at the end. For a
model whose batch takes seconds (ResNet-152 on a CPU core: about 3 s for 8 images), that is several
percent of a 40 s run, against an in-process loop timed from one batch to another. ``steady_rate``
times the server the same way: from one change of ``vision_serve_images_total`` (a batch answered)
to another about ``duration_s`` later, with the load running before and after.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

IMAGES_ANSWERED = "vision_serve_images_total"
POLL_S = 0.05  # how finely a change is timed; each poll is one /metrics scrape


@dataclass(frozen=True)
class SteadyRate:
    """Images answered after one batch's answers up to another's, seen at ``began`` and ``ended``
    (``time.monotonic()``)."""

    images: float
    began: float
    ended: float

    @property
    def images_per_s(self) -> float:
        return self.images / (self.ended - self.began)


def images_answered(url: str) -> float:
    """``vision_serve_images_total`` summed over its labels."""
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        total += sum(sample.value for sample in family.samples if sample.name == IMAGES_ANSWERED)
    return total


def next_change(url: str, timeout_s: float) -> tuple[float, float]:
    """``(time.monotonic(), count)`` when the count of images answered is first seen to change."""
    before = images_answered(url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(POLL_S)
        count = images_answered(url)
        if count != before:
            return time.monotonic(), count
    raise TimeoutError(f"{url} answered no image within {timeout_s:g} s: is the load still running?")


def steady_rate(url: str, duration_s: float, timeout_s: float = 120.0) -> SteadyRate:
    """The server's rate while a load runs: from one batch's answers to the first after ``duration_s``.

    The load must keep running until this returns (up to one batch's time past ``duration_s``).
    """
    began, first = next_change(url, timeout_s)
    time.sleep(max(0.0, duration_s - (time.monotonic() - began)))
    ended, last = next_change(url, timeout_s)
    return SteadyRate(images=last - first, began=began, ended=ended)
