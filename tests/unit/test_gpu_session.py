"""The GPU session's orchestration (benchmarks/gpu_session.py, gpu_carry.py) on this CPU: budgets,
timeouts, packing whatever happens, the carried stream, and the phases' plumbing. A GPU is lent
rarely and for 30 minutes: a typo or an overrun found there costs a run."""

from __future__ import annotations

import hashlib
import io
import json
import random
import shlex
import sys
import tarfile
import time
from pathlib import Path

import pytest

from benchmarks import gpu_carry, gpu_session, gpu_suite
from benchmarks.gpu_session import PHASES, Session, Step, receive_parts, run_phase, run_step

SH = "/bin/sh"


def session(tmp_path: Path, budget_s: float = 60.0, phase: str = "test") -> Session:
    return Session(phase, budget_s, dry_run=False, results=tmp_path / "results")


def unpacked(tarball: Path) -> dict[str, bytes]:
    with tarfile.open(tarball) as archive:
        return {m.name: archive.extractfile(m).read() for m in archive.getmembers() if m.isfile()}


def test_a_step_past_its_cap_is_killed_with_its_children_and_the_phase_goes_on(tmp_path) -> None:
    marker = tmp_path / "child-survived"
    slow = Step("slow", (SH, "-c", f"(sleep 3; touch {marker}) & sleep 30"), cap_s=1, min_s=0)
    fast = Step("fast", (SH, "-c", "echo measured"), cap_s=10, min_s=0)
    started = time.monotonic()
    outcomes = run_phase("test", [slow, fast], session(tmp_path), tmp_path / "out")
    assert time.monotonic() - started < 10
    assert outcomes["slow"].status == "timed out after 1 s" and outcomes["fast"].status == "ok"
    time.sleep(3.5)
    assert not marker.exists(), "the step's whole process group must die with it"


def test_steps_that_no_longer_fit_the_budget_are_skipped_and_say_why(tmp_path) -> None:
    budget = gpu_session.PACK_RESERVE_S + 2.0
    steps = [Step("first", (SH, "-c", "sleep 1.5"), cap_s=10, min_s=0), Step("second", (SH, "-c", "true"), 10, 5)]
    outcomes = run_phase("test", steps, session(tmp_path, budget), tmp_path / "out")
    assert outcomes["first"].status == "ok"
    assert outcomes["second"].status.startswith("skipped: 0 s left of the budget, needs 5")


def test_every_log_and_the_statuses_come_back_also_after_a_failure(tmp_path) -> None:
    steps = [
        Step("fails", (SH, "-c", "echo about to fail; exit 3"), cap_s=10, min_s=0),
        Step("writes", (sys.executable, "-c", "import pathlib; pathlib.Path('{results}/r.json').write_text('{}')"),
             cap_s=30, min_s=0),
        Step("missing", ("/nonexistent/tool",), cap_s=10, min_s=0),
    ]  # fmt: skip
    run_phase("test", steps, session(tmp_path), tmp_path / "out")
    files = unpacked(tmp_path / "out" / "gpu-results.tar.gz")
    assert b"about to fail" in files["results/logs/test-fails.log"]
    assert files["results/r.json"] == b"{}"  # "{results}" is the session's results folder
    record = json.loads(files["results/session.json"])["test"]
    statuses = {name: step["status"] for name, step in record["steps"].items()}
    assert statuses["fails"] == "failed (exit 3)" and statuses["writes"] == "ok"
    assert statuses["missing"].startswith("failed: ")


def test_a_background_step_is_waited_for_and_its_outcome_recorded(tmp_path) -> None:
    steps = [
        Step("compile", (SH, "-c", "sleep 1; echo built"), cap_s=60, background=True),
        Step("meanwhile", (SH, "-c", "echo tests"), cap_s=10, min_s=0),
        Step("wait:compile", (), cap_s=30, min_s=0),
    ]
    outcomes = run_phase("test", steps, session(tmp_path), tmp_path / "out")
    assert outcomes["compile"].status == "ok" and outcomes["compile"].seconds >= 1
    assert outcomes["wait:compile"].status == "ok"
    assert b"built" in unpacked(tmp_path / "out" / "gpu-results.tar.gz")["results/logs/test-compile.log"]


def test_a_dry_run_runs_dry_forms_and_skips_gpu_only_steps(tmp_path) -> None:
    dry = Session("test", 60.0, dry_run=True, results=tmp_path / "results")
    assert run_step(dry, Step("nvidia-smi", ("nvidia-smi",), 10), {}).status == "skipped: not in a dry run"
    assert run_step(dry, Step("suite", ("/nonexistent",), 10, min_s=0, dry=(SH, "-c", "true")), {}).status == "ok"


def xz_pack(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_packs_unpack_once_all_their_parts_arrived_run_by_run(tmp_path, monkeypatch) -> None:
    noise = random.Random(0)  # incompressible: packs of a few kB
    packs = {"cv.tar.xz": xz_pack({"cvcuda/__init__.py": b"# cv", "cvcuda/lib.so": noise.randbytes(6000)}),
             "dali.tar.xz": xz_pack({"dali/x.py": b"# d", "dali/lib.so": noise.randbytes(3000)})}  # fmt: skip
    stream, index = tmp_path / "stream", tmp_path / "stream.txt"
    stream.write_bytes(b"".join(packs.values()))
    index.write_text("".join(f"{n} {len(d)} {hashlib.sha256(d).hexdigest()}\n" for n, d in packs.items()))
    # Parts of 2/3 of the first pack (beside a tree of 100 bytes and the index): it spans two runs.
    part = len(packs["cv.tar.xz"]) * 2 // 3
    monkeypatch.setattr(gpu_carry, "CARRY_LIMIT", gpu_carry.MARGIN + 100 + index.stat().st_size + part)
    made = gpu_carry.split(stream, index, tmp_path / "made", tree=100)
    assert [len((p / f"chunk.{p.name}").read_bytes()) for p in made][:-1] == [part] * (len(made) - 1)
    site, received = tmp_path / "site", tmp_path / "received"
    seen = []
    for part in made:  # each run carries one part; the earlier ones are gone from its tree
        carry = tmp_path / f"carry-{part.name}"
        carry.mkdir()
        part.rename(carry / part.name)
        seen.append(receive_parts(carry, received, site))
    assert seen == [[], ["cv.tar.xz: unpacked"], ["dali.tar.xz: unpacked"]]  # each once, when complete
    assert (site / "cvcuda" / "__init__.py").read_bytes() == b"# cv" and (site / "dali" / "x.py").exists()


def test_a_corrupt_pack_is_reported_not_unpacked(tmp_path) -> None:
    data = xz_pack({"a.py": b"a"})
    carry = tmp_path / "carry" / "01"
    carry.mkdir(parents=True)
    (carry / "chunk.01").write_bytes(data)
    (carry / "stream.txt").write_text(f"a.tar.xz {len(data)} {'0' * 64}\n")
    assert receive_parts(tmp_path / "carry", tmp_path / "received", tmp_path / "site") == [
        "a.tar.xz: checksum mismatch"
    ]
    assert not (tmp_path / "site").exists()


def test_every_run_of_the_carry_plan_fits_with_room(tmp_path) -> None:
    limit = gpu_carry.CARRY_LIMIT - gpu_carry.MARGIN
    assert gpu_carry.part_bytes(3 * gpu_carry.MiB) == limit - 3 * gpu_carry.MiB
    with pytest.raises(ValueError, match="no room"):
        gpu_carry.part_bytes(limit)
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "a.whl").write_bytes(b"x" * 1000)
    (tmp_path / "01").mkdir()
    (tmp_path / "01" / "chunk.01").write_bytes(b"x" * 500)
    assert gpu_carry.plan(tmp_path, tree=10) == [(".carry/core", 1010), (".carry/01", 510)]
    assert gpu_carry.tree_bytes() < 16 * gpu_carry.MiB  # what every run carries besides its share


def commands() -> list[tuple[str, Step, tuple[str, ...]]]:
    return [(phase, step, form) for phase, steps in PHASES.items() for step in steps
            for form in (step.command, step.dry) if form]  # fmt: skip


def test_the_phases_name_only_suite_steps_tests_and_flags_that_exist() -> None:
    """A typo in a phase would cost a GPU run: check what each command names, here."""
    for phase, step, command in commands():
        if "benchmarks.gpu_suite" in command:
            named = command[command.index("--steps") + 1]
            assert set(filter(None, named.split(","))) <= set(gpu_suite.STEPS), (phase, step.name)
        if "pytest" in command:
            assert all(Path(gpu_session.REPO, path).is_file() for path in gpu_session.GPU_TESTS)
        if "benchmarks.pipeline_check" in command:
            from benchmarks.pipeline_check import main

            with pytest.raises(SystemExit) as parsed:  # parses every flag, then stops at --help
                main([arg.replace("{results}", "/tmp") for arg in command[3:]] + ["--help"])
            assert parsed.value.code == 0, shlex.join(command)
    serve = [step.name for step in PHASES["serve"]]
    assert serve.index("client") < serve.index("serve"), "the client's ceiling comes before the sweeps it qualifies"
