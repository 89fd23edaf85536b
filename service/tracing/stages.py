"""What the worker hands to the span recorder: a batch's traced requests and its stages' times."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

# The worker's stages, as its spans are named. ``queue`` comes from each request itself (admission
# in the HTTP process to the batch's start); the others are the worker's ``Stage``s.
QUEUE, PREPROCESS, PIPELINE_WAIT, ENGINE = "queue", "preprocess", "pipeline_wait", "engine"
Stage = tuple[str, float, float]  # (name, start, end): time.perf_counter() seconds


class TracedRequest(NamedTuple):
    index: int  # in the batch
    trace_parent: str
    queued_at: float | None  # time.monotonic() at admission in the HTTP process
    request_id: str | None


@dataclass(frozen=True)
class BatchTrace:
    """The traced requests of one batch; ``taken_at``: time.monotonic() as it began preparing (the
    end of their queue stage)."""

    requests: list[TracedRequest]
    taken_at: float
