"""The first GPU run's phase, dry, end to end on this CPU (benchmarks/gpu_session.py): every step's
real command in its dry form (the background compile, the pipeline check against real servers, the
GPU tests collected and skipped, the report), and everything packed for the trip back."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile

import pytest

from benchmarks.gpu_session import PHASES


@pytest.mark.slow  # the whole core phase, dry: about 100 s
def test_the_core_phase_runs_dry_and_brings_back_every_log_and_result(tmp_path) -> None:
    results, out = tmp_path / "results", tmp_path / "out"
    command = [sys.executable, "-m", "benchmarks.gpu_session", "core", "--dry-run", "--results", str(results),
               "--out", str(out)]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with tarfile.open(out / "gpu-results.tar.gz") as archive:
        names = set(archive.getnames())
        record = json.load(archive.extractfile("results/session.json"))["core"]
        check = json.load(archive.extractfile("results/pipeline_check.json"))
        suite = json.load(archive.extractfile("results/gpu_suite.json"))
    statuses = {name: step["status"] for name, step in record["steps"].items()}
    expected = {step.name: "ok" for step in PHASES["core"]} | {"nvidia-smi": "skipped: not in a dry run"}
    assert statuses == expected
    for step in ("versions", "compile", "pipeline-check", "pytest-gpu", "report"):
        assert f"results/logs/core-{step}.log" in names
    assert {"results/logs/server-pipeline-check-depth1.log", "results/logs/server-pipeline-check-depth2.log"} <= names
    # Depth 1 and 2 under load: every answer matched its photo's reference.
    assert check["passed"] and all(depth["ok"] == check["requests"] for depth in check["depths"].values())
    assert suite["dry_run"] and suite["compile"]["engine"] and "results/gpu_suite.md" in names
