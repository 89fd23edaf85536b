"""The headline GPU run, dry, end to end on this CPU in the stand-in of the GPU machine
(benchmarks/gpu_headline.sh --dry-run): Python 3.12 with only the machine's packages plus the carried
wheels, so that an import the machine would fail fails here; every step's real command in its dry
form; what comes back under $OUT; nothing left running."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import psutil
import pytest

from benchmarks.gpu import machine as gpu_machine
from benchmarks.gpu.session import DELIVERED, PHASES, STEP_TAG, TARBALL
from tests.tools import REQUIRE_ENV

REPO = Path(__file__).resolve().parents[2]


def standin_python() -> str:
    """Builds the stand-in venv once (minutes: torch 2.11 with its CUDA libraries, as on the machine)."""
    build = subprocess.run(
        ["bash", "benchmarks/gpu/standin.sh"], cwd=REPO, capture_output=True, text=True, timeout=1800
    )
    if "no Python 3.12 here" in build.stderr and os.environ.get(REQUIRE_ENV) != "1":
        pytest.skip(build.stderr.strip())
    assert build.returncode == 0, build.stderr[-3000:]
    return build.stdout.strip()


def tagged() -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if STEP_TAG in process.environ():
                found.append(process)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def unpacked_packages() -> set[Path]:
    """Folders of /tmp holding an unpacked AOTInductor package: where torch 2.11 unpacks, whatever TMPDIR says."""
    return {path.parents[2] for path in Path("/tmp").glob("*/*/data/aotinductor")}


@pytest.mark.slow  # the stand-in's first build (~3 min) and the headline phase, dry (~4 min on 2 cores)
def test_the_headline_runs_dry_in_the_standin_and_brings_back_every_step(tmp_path) -> None:
    standin_python()
    unpacked_before = unpacked_packages()
    out, results = tmp_path / "out", tmp_path / "results"
    command = ["bash", "benchmarks/gpu_headline.sh", "--dry-run", "--results", str(results), "--site",
               str(tmp_path / "site")]  # fmt: skip
    run = subprocess.run(command, cwd=REPO, env={**os.environ, "OUT": str(out)}, capture_output=True, text=True,
                         timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-3000:]
    # What the run tool brings back: at most 8 plain files, the results whole and their summaries.
    assert sorted(path.name for path in out.iterdir()) == sorted([TARBALL, *DELIVERED])
    session = json.loads((out / "session.json").read_text())["headline"]
    statuses = {name: step["status"] for name, step in session["steps"].items()}
    expected = {step.name: "ok" for step in PHASES["headline"]} | {"nvidia-smi": "skipped: not in a dry run"}
    carried = len(gpu_machine.read_names(gpu_machine.CARRY_LIST))
    assert statuses == expected | {"install": f"installed {carried} wheels"}
    with tarfile.open(out / TARBALL) as archive:
        names = set(archive.getnames())
        suite = json.load(archive.extractfile(f"{results.name}/gpu_suite.json"))
        check = json.load(archive.extractfile(f"{results.name}/pipeline_check.json"))
        versions = archive.extractfile(f"{results.name}/logs/headline-versions.log").read().decode()
    # It ran in the stand-in: the machine's Python and torch, the carried web stack and simplejpeg.
    assert "python 3.12." in versions and "| torch 2.11." in versions and "simplejpeg 1.9.0" in versions
    assert {name: step["status"] for name, step in suite["steps"].items()} == dict.fromkeys(
        ("compile", "serve", "answers", "images", "baseline", "client", "ceiling"), "ok"
    )
    assert suite["compile"]["backend"] == "inductor" and suite["answers"]["passed"]
    assert suite["answers"]["bad_sent"] > 0 and set(suite["answers"]["bad_statuses"]) == {"400"}
    for runs in suite["sweeps"].values():
        assert all(run["errors"] == 0 and run["ok"] > 0 for run in runs.values())
    assert check["passed"] and all(depth["ok"] == check["requests"] for depth in check["depths"].values())
    assert {f"{results.name}/logs/server-compiled.log", f"{results.name}/gpu_suite.md"} <= names
    assert not tagged(), "a step left a process running"
    # The compile's gate and each server's workers loaded the engine with torch 2.11: none left a copy.
    assert unpacked_packages() <= unpacked_before
