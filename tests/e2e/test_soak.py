"""The short CI soak: a real Lite0 server under mixed good and bad load must lose nothing, answer no
5xx, refuse every bad request with its expected 4xx, and keep every process's RSS flat.

The full-size soak is ``python -m benchmarks.soak`` (5,000 requests at concurrency 64).
"""

from __future__ import annotations

import pytest

from benchmarks.soak import DEFAULT_MAX_RSS_GROWTH_PCT, Outcome, ProcessMemory, SoakReport, format_report, run_soak
from service.client.launcher import ServerProcess

LITE = ["--model", "efficientnet-lite0", "--max-batch-size", "8", "--log-level", "warning"]


def _report(outcomes: list[Outcome], memory: list[ProcessMemory]) -> SoakReport:
    return SoakReport(
        url="http://test",
        requests=len(outcomes),
        concurrency=1,
        bad_fraction=0.5,
        warmup_requests=0,
        seed=0,
        duration_s=1.0,
        outcomes=outcomes,
        memory=memory,
    )


def test_failures_name_every_kind_of_problem() -> None:
    """The verdict logic alone, without a server: each problem class yields its own reason."""
    outcomes = [
        Outcome("chelsea.jpg raw", True, 200, 10.0, None),
        Outcome("bad:text_plain", False, 415, 1.0, None),
        Outcome("chelsea.jpg raw", True, None, 120_000.0, "ReadTimeout: "),
        Outcome("coffee.jpg json", True, 503, 5.0, "status 503"),
        Outcome("coffee.jpg raw", True, 200, 10.0, "top-1 'cup', expected one of ['espresso']"),
        Outcome("bad:empty", False, 200, 10.0, "status 200 (expected [400])"),
    ]
    memory = [ProcessMemory("worker", 1, 100.0, 111.0, 120.0), ProcessMemory("http", 2, 100.0, 105.0, 106.0)]
    reasons = _report(outcomes, memory).failures(DEFAULT_MAX_RSS_GROWTH_PCT)
    assert len(reasons) == 5, reasons
    for words in ("1 requests lost", "1 answers were 5xx", "wrong answer", "unexpected status", "worker (pid 1)"):
        assert any(words in reason for reason in reasons), (words, reasons)
    assert _report(outcomes[:2], memory[1:]).failures() == []


@pytest.mark.slow
def test_short_soak_loses_nothing_and_memory_stays_flat(tmp_path) -> None:
    with ServerProcess(LITE, log_path=tmp_path / "server.log") as server:
        report = run_soak(
            server.url,
            server.process.pid,
            requests=600,
            concurrency=32,
            bad_fraction=0.10,
            warmup_requests=200,
            seed=0,
        )
        log_tail = server.log_tail()

    assert len(report.outcomes) == 600
    assert report.bad, "the mix must contain bad requests"
    assert {p.role for p in report.memory} >= {"main", "http", "worker"}
    summary = f"{format_report(report)}\n\nserver log:\n{log_tail}"
    assert report.failures(DEFAULT_MAX_RSS_GROWTH_PCT) == [], summary
