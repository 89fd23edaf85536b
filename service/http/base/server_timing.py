"""The ``Server-Timing`` response header, from the timings of a request's stages."""

from __future__ import annotations


def server_timing(timings_ms: dict[str, float]) -> str:
    """The ``Server-Timing`` header (W3C), e.g. ``queue;dur=1.20, inference;dur=30.50``: the worker's
    stages (queue, preprocess, pipeline_wait when pipelined, inference), then postprocess (rendering)
    and total (admission to answer) from the HTTP process."""
    return ", ".join(f"{name};dur={ms:.2f}" for name, ms in timings_ms.items())
