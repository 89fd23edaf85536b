"""The GPU session's orchestration (benchmarks/gpu/session.py, carry.py, machine.py) on this
CPU: budgets, timeouts, nothing left running, delivery after every step whatever happens, reruns, the
carried stream and lists, and the phases' plumbing. A GPU is lent rarely and for 15 device-minutes: a
typo, an overrun or a missing module found there costs the run."""

from __future__ import annotations

import hashlib
import io
import json
import random
import shlex
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from benchmarks.gpu import carry as gpu_carry
from benchmarks.gpu import machine as gpu_machine
from benchmarks.gpu import session as gpu_session
from benchmarks.gpu import suite as gpu_suite
from benchmarks.gpu.session import PHASES, Outcome, Session, Step, receive_parts, run_phase, run_step

SH = "/bin/sh"
PY = sys.executable


def session(tmp_path: Path, budget_s: float = 60.0, phase: str = "test", **kwargs: object) -> Session:
    return Session(phase, budget_s, dry_run=False, results=tmp_path / "results", out=tmp_path / "out", **kwargs)


def unpacked(tarball: Path) -> dict[str, bytes]:
    with tarfile.open(tarball) as archive:
        return {m.name: archive.extractfile(m).read() for m in archive.getmembers() if m.isfile()}


def statuses(out: Path, phase: str = "test") -> dict[str, str]:
    record = json.loads((out / "session.json").read_text())[phase]
    return {name: step["status"] for name, step in record["steps"].items()}


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_step_past_its_cap_is_killed_with_its_children_and_the_phase_goes_on(tmp_path) -> None:
    marker = tmp_path / "child-survived"
    slow = Step("slow", (SH, "-c", f"(sleep 1.5; touch {marker}) & sleep 30"), cap_s=1, min_s=0)
    fast = Step("fast", (SH, "-c", "echo measured"), cap_s=10, min_s=0)
    started = time.monotonic()
    outcomes = run_phase("test", [slow, fast], session(tmp_path))
    assert time.monotonic() - started < 15
    assert outcomes["slow"].status == "timed out after 1 s" and outcomes["fast"].status == "ok"
    time.sleep(max(0.0, started + 2.0 - time.monotonic()))  # past the child's 1.5 s, had it lived
    assert not marker.exists(), "the step's whole process group must die with it"


# A "server": a process in a session of its own (as vision-serve is started), which outlives its
# starter and is no member of the step's process group: only the step's tag finds it.
SERVER = textwrap.dedent("""
    import pathlib, subprocess, sys
    server = subprocess.Popen(["sleep", "300"], start_new_session=True)
    pathlib.Path(sys.argv[1]).write_text(str(server.pid))
""")


@pytest.mark.parametrize("ending", ["exits", "times out"])
def test_a_server_a_step_started_in_a_session_of_its_own_dies_with_the_step(tmp_path, ending: str) -> None:
    pid_file = tmp_path / "server.pid"
    command = (PY, "-c", SERVER + ("" if ending == "exits" else "import time; time.sleep(60)\n"), str(pid_file))
    outcomes = run_phase("test", [Step("serve", command, cap_s=2, min_s=0)], session(tmp_path))
    assert outcomes["serve"].status == ("ok" if ending == "exits" else "timed out after 2 s")
    server = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while alive(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(server), "a step's server must not outlive the step (it would take the next step's cores)"


def test_steps_that_no_longer_fit_the_budget_are_skipped_and_say_why(tmp_path) -> None:
    budget = gpu_session.PACK_RESERVE_S + 2.0
    steps = [Step("first", (SH, "-c", "sleep 1.5"), cap_s=10, min_s=0), Step("second", (SH, "-c", "true"), 10, 5)]
    outcomes = run_phase("test", steps, session(tmp_path, budget))
    assert outcomes["first"].status == "ok"
    assert outcomes["second"].status.startswith("skipped: only 0 s left of the budget, needs 5")
    assert outcomes["second"].missed  # a step the budget dropped was not done: the run says so


def test_every_log_and_the_statuses_come_back_also_after_a_failure(tmp_path) -> None:
    steps = [
        Step("fails", (SH, "-c", "echo about to fail; exit 3"), cap_s=10, min_s=0),
        Step("writes", (PY, "-c", "import pathlib; pathlib.Path('{results}/gpu_suite.md').write_text('# r')"),
             cap_s=30, min_s=0),
        Step("missing", ("/nonexistent/tool",), cap_s=10, min_s=0),
    ]  # fmt: skip
    run_phase("test", steps, session(tmp_path))
    out = tmp_path / "out"
    files = unpacked(out / gpu_session.TARBALL)
    assert b"about to fail" in files["results/logs/test-fails.log"]
    assert files["results/gpu_suite.md"] == b"# r"  # "{results}" is the session's results folder
    assert (out / "gpu_suite.md").read_text() == "# r"  # and the report also comes back unpacked
    found = statuses(out)
    assert found["fails"] == "failed (exit 3)" and found["writes"] == "ok"
    assert found["missing"].startswith("failed: ")
    # What the run tool brings back: at most 8 plain files, at most 2 folders down.
    assert len(list(out.iterdir())) <= 8 and all(path.is_file() for path in out.iterdir())


def test_a_background_step_is_waited_for_and_its_outcome_recorded(tmp_path) -> None:
    steps = [
        Step("compile", (SH, "-c", "sleep 1; echo built"), cap_s=60, background=True),
        Step("meanwhile", (SH, "-c", "echo tests"), cap_s=10, min_s=0),
        Step("wait:compile", (), cap_s=30, min_s=0),
        Step("serve", (SH, "-c", "true"), cap_s=10, min_s=0, needs=("compile",)),
    ]
    outcomes = run_phase("test", steps, session(tmp_path))
    assert outcomes["compile"].status == "ok" and outcomes["compile"].seconds >= 1
    assert outcomes["wait:compile"].status == "ok" and outcomes["serve"].status == "ok"
    assert b"built" in unpacked(tmp_path / "out" / gpu_session.TARBALL)["results/logs/test-compile.log"]


def test_a_failed_compile_fails_its_wait_and_no_later_step_compiles_again(tmp_path) -> None:
    ran = tmp_path / "ran"
    steps = [
        Step("compile", (SH, "-c", "echo gate failed; exit 3"), cap_s=60, background=True),
        Step("wait:compile", (), cap_s=30, min_s=0),
        Step("serve", (SH, "-c", f"touch {ran}"), cap_s=10, min_s=0, needs=("compile",)),
        Step("client", (SH, "-c", "true"), cap_s=10, min_s=0),
    ]
    outcomes = run_phase("test", steps, session(tmp_path))
    assert outcomes["compile"].status == "failed (exit 3)"
    assert outcomes["wait:compile"].status == "failed: compile failed (exit 3)"
    assert outcomes["serve"].status == "skipped: needs compile, which failed (exit 3)" and not ran.exists()
    assert outcomes["client"].status == "ok"  # what does not need the engine still runs


def test_a_background_step_never_waited_for_is_stopped_with_the_phase(tmp_path) -> None:
    pid_file = tmp_path / "server.pid"
    steps = [
        Step("compile", (PY, "-c", SERVER + "import time; time.sleep(60)\n", str(pid_file)), 60, background=True),
        Step("meanwhile", (SH, "-c", f"while [ ! -s {pid_file} ]; do sleep 0.1; done"), cap_s=30, min_s=0),
    ]
    started = time.monotonic()
    outcomes = run_phase("test", steps, session(tmp_path))
    assert time.monotonic() - started < 20 and outcomes["compile"].status == "stopped: the phase ended before it"
    assert not alive(int(pid_file.read_text()))


def test_results_come_back_while_a_step_runs_and_a_killed_run_keeps_its_finished_steps(tmp_path) -> None:
    """SIGKILL to the whole run mid-step (the run tool's time limit): what the finished steps and the
    running one saved is in $OUT already."""
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from benchmarks.gpu import session as gpu_session
        from benchmarks.gpu.session import Session, Step, run_phase
        gpu_session.PACK_EVERY_S = 0.5
        write = "import pathlib, time; pathlib.Path('{{results}}/{{name}}').write_text('x'); time.sleep({{sleep}})"
        first = write.format(results="{{results}}", name="first.json", sleep=0)
        second = write.format(results="{{results}}", name="second.json", sleep=60)
        steps = [Step("first", ("{PY}", "-c", first), 30, 0), Step("second", ("{PY}", "-c", second), 90, 0)]
        run_phase("test", steps, Session("test", 120.0, False, Path(sys.argv[1]), Path(sys.argv[2])))
    """)
    run = subprocess.Popen([PY, "-c", script, str(tmp_path / "results"), str(out)], cwd=gpu_session.REPO)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        tarball = out / gpu_session.TARBALL
        if tarball.exists() and "results/second.json" in unpacked(tarball):
            break
        time.sleep(0.2)
    run.send_signal(signal.SIGKILL)
    run.wait()
    gpu_session.kill_tagged(f"{run.pid}:test:second", grace_s=1)  # what the run tool would end: its step
    assert statuses(out)["first"] == "ok"
    files = unpacked(out / gpu_session.TARBALL)
    assert {"results/first.json", "results/second.json", "results/logs/test-first.log"} <= set(files)
    assert not list(out.glob(".*.tmp")) or all(p.name.startswith(".") for p in out.glob(".*"))


def test_a_rerun_runs_again_only_what_time_cut_short(tmp_path) -> None:
    """A rerun on the warm machine: what ended ok is not run again, nor what failed (a failure wants a
    fix; repeating it would spend the rerun's minutes before the headline's steps); what was skipped
    for time or timed out runs now."""
    ran = tmp_path / "ran"
    steps = [
        Step("compile", (SH, "-c", f"echo compile >> {ran}"), cap_s=10, min_s=0),
        Step("tests", (SH, "-c", f"echo tests >> {ran}; exit 1"), cap_s=10, min_s=0),
        Step("serve", (SH, "-c", f"echo serve >> {ran}; sleep 5"), cap_s=1, min_s=0, needs=("compile",)),
        Step("ceiling", (SH, "-c", f"echo ceiling >> {ran}"), cap_s=10, min_s=0, needs=("tests",)),
    ]
    run_phase("test", steps, session(tmp_path))
    assert ran.read_text().split() == ["compile", "tests", "serve"]
    previous = gpu_session.previous_outcomes(tmp_path / "results", "test")
    outcomes = run_phase("test", steps, session(tmp_path, previous=previous))
    assert ran.read_text().split() == ["compile", "tests", "serve", "serve"]
    assert outcomes["compile"].status == "ok in the run before"
    assert outcomes["tests"].status == "failed in the run before: (exit 1)" and outcomes["tests"].missed
    assert outcomes["serve"].status == "timed out after 1 s"
    assert outcomes["ceiling"].status == "skipped: needs tests, which failed in the run before: (exit 1)"
    assert gpu_session.previous_outcomes(tmp_path / "nowhere", "test") is None


def test_a_rerun_on_a_fresh_machine_refuses_at_once(tmp_path, capsys) -> None:
    started = time.monotonic()
    code = gpu_session.main(["headline", "--rerun", "--results", str(tmp_path / "r"), "--out", str(tmp_path / "o")])
    assert code == 2 and time.monotonic() - started < 5
    assert "fresh machine" in capsys.readouterr().out and not (tmp_path / "o").exists()


def test_a_signal_to_the_run_stops_the_running_step_and_its_servers(tmp_path) -> None:
    """SIGTERM mid-step (a person's Ctrl-C, or a supervisor's stop): the step and the server it started
    in a session of its own are stopped, and what finished is delivered."""
    pid_file = tmp_path / "server.pid"
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from benchmarks.gpu.session import Session, Step, run_phase
        serve = Step("serve", ("{PY}", "-c", {SERVER + "import time; time.sleep(60)" + chr(10)!r}, "{pid_file}"), 90, 0)
        run_phase("test", [serve], Session("test", 120.0, False, Path(sys.argv[1]), Path(sys.argv[2])))
    """)
    out = tmp_path / "out"
    run = subprocess.Popen([PY, "-c", script, str(tmp_path / "results"), str(out)], cwd=gpu_session.REPO)
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    run.send_signal(signal.SIGTERM)
    assert run.wait(30) == 0
    assert not alive(int(pid_file.read_text()))
    assert statuses(out)["(interrupted)"] == "stopped by a signal"


def test_a_dry_run_runs_dry_forms_and_skips_gpu_only_steps(tmp_path) -> None:
    dry = Session("test", 60.0, dry_run=True, results=tmp_path / "results", out=tmp_path / "out")
    assert run_step(dry, Step("nvidia-smi", ("nvidia-smi",), 10), {}).status == "skipped: not in a dry run"
    assert run_step(dry, Step("suite", ("/nonexistent",), 10, min_s=0, dry=(SH, "-c", "true")), {}).status == "ok"
    assert not Outcome("skipped: not in a dry run").missed and Outcome("timed out after 3 s").missed


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


def test_the_headline_carry_fits_its_limit_when_packed() -> None:
    core = gpu_carry.CARRY / "core"
    if not (core / ".carry").exists():
        pytest.skip("no .carry/core here: bash benchmarks/gpu/pack.sh makes it (the dry-run test does)")
    assert gpu_carry.tree_bytes() + gpu_carry.folder_bytes(core) <= gpu_carry.HEADLINE_LIMIT


def commands() -> list[tuple[str, Step, tuple[str, ...]]]:
    return [(phase, step, form) for phase, steps in PHASES.items() for step in steps
            for form in (step.command, step.dry) if form]  # fmt: skip


def test_the_phases_name_only_suite_steps_tests_and_flags_that_exist() -> None:
    """A typo in a phase would cost a GPU run: check what each command names, here."""
    for phase, step, command in commands():
        if "benchmarks.gpu.suite" in command:
            named = command[command.index("--steps") + 1]
            assert set(filter(None, named.split(","))) <= set(gpu_suite.STEPS), (phase, step.name)
        if "pytest" in command:
            assert all(Path(gpu_session.REPO, path).is_file() for path in gpu_session.GPU_TESTS)
        if "benchmarks.pipeline_check" in command:
            from benchmarks.pipeline_check import main

            with pytest.raises(SystemExit) as parsed:  # parses every flag, then stops at --help
                main([arg.replace("{results}", "/tmp") for arg in command[3:]] + ["--help"])
            assert parsed.value.code == 0, shlex.join(command)
    for phase, steps in PHASES.items():
        names = [step.name for step in steps]
        assert len(names) == len(set(names)), phase
        for step in steps:  # a step needs one that comes before it in its phase
            assert all(need in names[: names.index(step.name)] for need in step.needs), (phase, step.name)


def test_the_headline_measures_the_served_engine_first_and_alone() -> None:
    names = [step.name for step in PHASES["headline"]]
    background = [step.name for step in PHASES["headline"] if step.background]
    assert background == ["compile"] and names.index("wait:compile") < names.index("serve")
    # Nothing runs beside the measurements: every background step is waited for before the first one.
    first = names.index("serve")
    assert all(names.index(f"wait:{name}") < first for name in background)
    assert names[first + 1 :] == ["baseline", "client", "ceiling"]  # then what qualifies it


def test_the_carry_covers_every_runtime_dependency_the_gpu_machine_lacks() -> None:
    """The lists as committed agree, and the check finds what broke the last GPU plan: simplejpeg, a
    runtime dependency neither on the machine nor carried, and a stand-in package the machine lacks."""
    machine = gpu_machine.read_names(gpu_machine.MACHINE_LIST)
    carried = gpu_machine.read_names(gpu_machine.CARRY_LIST)
    standin = gpu_machine.read_names(gpu_machine.STANDIN_LIST)
    runtime = gpu_machine.runtime_dependencies()
    assert gpu_machine.main(["check"]) == 0
    assert {"torch", "simplejpeg", "litserve", "pyzmq"} <= set(runtime)
    assert {"torch", "torchvision", "numpy", "pillow"} <= set(standin) and "simplejpeg" not in standin
    without = [name for name in carried if name != "simplejpeg"]
    problems = gpu_machine.list_problems(machine, without, standin, runtime)
    assert len(problems) == 1 and problems[0].startswith("simplejpeg: a runtime dependency")
    problems = gpu_machine.list_problems(machine, carried, [*standin, "simplejpeg"], runtime)
    assert len(problems) == 1 and problems[0].startswith("simplejpeg: in standin.txt but not on the GPU")


def test_requirement_lines_name_their_distribution() -> None:
    assert gpu_machine.requirement_name("tritonclient[grpc]>=2.40") == "tritonclient"
    assert gpu_machine.requirement_name("Typing_Extensions==4.16.0  # why") == "typing-extensions"
    assert gpu_machine.requirement_name("# a comment") is None
    assert gpu_machine.requirement_name("tomli>=2; python_version < '3.11'") == "tomli"
