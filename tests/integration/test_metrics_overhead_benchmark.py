"""The metrics-overhead benchmark (benchmarks/metrics_overhead.py) run for real: it spawns the
processes whose metric files one scrape reads (about 16 s on 2 cores), so it is not in the unit tier."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow  # two servers started by the benchmark
def test_metrics_overhead_benchmark_measures_and_saves(tmp_path, capsys) -> None:
    from benchmarks import metrics_overhead

    assert metrics_overhead.main(["--calls", "50", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "metrics_overhead.json").read_text())
    assert record["record_per_request_us"] > 0 and record["scrape_ms_7_processes"] > 0
    assert record["scrape_bytes"] > 1000  # the scrape read what the spawned processes recorded
    assert "one scrape, files of 7 processes" in capsys.readouterr().out
