"""The ``Server-Timing`` response header (W3C): the server's own breakdown of a request, in ms.

The worker writes queue, preprocess, pipeline_wait (pipelined workers only), inference and
postprocess; the HTTP process appends total.
"""

from __future__ import annotations


def server_timing(timings_ms: dict[str, float]) -> str:
    """The header value, e.g. ``queue;dur=1.20, inference;dur=30.50``."""
    return ", ".join(f"{name};dur={ms:.2f}" for name, ms in timings_ms.items())
