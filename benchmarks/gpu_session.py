"""A GPU session on a lent machine, in phases that each fit one 10-minute command and bring back
every log and result, whatever fails or runs out of time.

    python3 -m benchmarks.gpu_session core          # run 1 (carry .carry/core)
    python3 -m benchmarks.gpu_session serve         # run 2, at once (the machine goes back ~30 s after a run)
    python3 -m benchmarks.gpu_session extra         # run 3
    python3 -m benchmarks.gpu_session cvcuda|dali   # later runs, each with its .carry/NN part
    python3 -m benchmarks.gpu_session core --dry-run   # here, on a CPU: the same steps, GPU work in its dry form

The lent machine (../shared/GPU.md) has Python 3.12 with torch but not the web stack, and no package
registry: benchmarks/gpu_pack.sh makes what travels (``.carry/core`` wheels, ``.carry/NN`` parts of
the CV-CUDA and DALI packs). This module needs only the standard library, since it installs the rest.

Every phase has a time budget (``--budget-s``, default 540 s of the 600 s a command may run). Each
step runs as its own process group under a timeout: its own cap, and never past the budget less
what packing needs; a step that would start with less than its minimum left is skipped and says so.
Packing runs last, always (also after a failure or Ctrl-C): the results folder with every step's log
(``logs/<phase>-<step>.log``) and every server's log goes to ``$OUT/gpu-results.tar.gz``, and
``session.json`` records each step's status and seconds. Results accumulate over phases in the
results folder (``/tmp/gpu-results``), so the last pack holds the whole session.

``--dry-run`` runs each step's dry form on this machine (the GPU benchmarks on the CPU with a small
model and seconds of load; ``pytest -m gpu`` collects and skips) and skips what only a GPU can do
(installing the carried wheels, nvidia-smi, the CV-CUDA and DALI packs): the plumbing of every
phase, end to end, before a GPU is spent on it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path("/tmp/gpu-results")
SITE = Path("/tmp/site")  # the carried packages, next to the machine's own torch
STREAM = Path("/tmp/wh")  # the carried parts, appended run by run
CARRY = REPO / ".carry"
BUDGET_S = 540.0  # of the 600 s one command may run: the rest covers Python's start and the copy back
PACK_RESERVE_S = 20.0
TAIL_LINES = 25  # of each step's log, printed: the run's output comes back only in part
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
    background: bool = False  # started and left running (its own session); "wait:NAME" waits for it


@dataclass
class Outcome:
    status: str  # ok, failed (exit N), timed out after N s, skipped: why, started
    seconds: float = 0.0


@dataclass
class Session:
    phase: str
    budget_s: float
    dry_run: bool
    results: Path
    started: float = field(default_factory=time.monotonic)
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    background: dict[str, tuple[subprocess.Popen, float]] = field(default_factory=dict)  # process, started

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started) - PACK_RESERVE_S


# "{results}" in a command is the session's results folder.
def suite(*steps: str, dry: bool = False) -> tuple[str, ...]:
    command = (
        PYTHON,
        "-m",
        "benchmarks.gpu_suite",
        "--resume",
        "--output-dir",
        "{results}",
        "--steps",
        ",".join(steps),
    )
    return (*command, "--dry-run") if dry else command


def gpu_tests(expression: str) -> tuple[str, ...]:
    return (PYTHON, "-m", "pytest", "-m", "gpu", "-k", expression, "-p", "no:cacheprovider", "-p", "no:randomly",
            "-ra", "-q", *GPU_TESTS)  # fmt: skip


VERSIONS = (
    PYTHON,
    "-c",
    "import importlib.metadata as md, platform, torch\n"
    "print('python', platform.python_version(), '| torch', torch.__version__, '| cuda', torch.version.cuda,\n"
    "      '| cudnn', torch.backends.cudnn.version(), '|', torch.cuda.get_device_name(0) if torch.cuda.is_available()"
    " else 'no GPU')\n"
    "for name in ('torchvision', 'litserve', 'fastapi', 'uvicorn', 'pyzmq', 'nvidia-dali-cuda130', 'cvcuda-cu13',\n"
    "             'nvidia-nvimgcodec-cu13', 'nvidia-nvjpeg', 'torch-tensorrt', 'tensorrt', 'onnxruntime',\n"
    "             'onnxruntime-gpu'):\n"
    "    try:\n"
    "        print(' ', name, md.version(name))\n"
    "    except md.PackageNotFoundError:\n"
    "        print(' ', name, 'not installed')\n",
)
NVIDIA_SMI = ("nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv")
PIPELINE_CHECK = (PYTHON, "-m", "benchmarks.pipeline_check", "--output-dir", "{results}")
PARITY = (PYTHON, "-m", "benchmarks.preprocess_parity", "--device", "cuda", "--output", "{results}")
PREPROCESS_ALL = (PYTHON, "-m", "benchmarks.preprocess_throughput", "--device", "cuda", "--repeats", "3",
                  "--output", "{results}/preprocess")  # fmt: skip


def cpu_form(command: tuple[str, ...]) -> tuple[str, ...]:
    """``command`` with ``--device cuda`` made ``--device cpu``: its dry form."""
    return tuple("cpu" if arg == "cuda" and previous == "--device" else arg
                 for previous, arg in zip(("", *command[:-1]), command, strict=True))  # fmt: skip


def suite_step(step: str, cap_s: float, min_s: float) -> Step:
    """One step of benchmarks.gpu_suite, in a process of its own: a timeout loses that step only."""
    return Step(step, suite(step), cap_s, min_s=min_s, dry=suite(step, dry=True))


SUITE_REPORT = (*suite(), "--report-only")
REPORT = Step("report", SUITE_REPORT, 60, min_s=5, dry=(*SUITE_REPORT, "--dry-run"))

# The first three runs (../shared/GPU.md) need only .carry/core; cvcuda and dali need their packs.
# Caps and minimums come from the first H100 session (2026-11-22): ResNet-152's fp16 compile took
# 136 s, pytest -m gpu 320 s (of which the two AOTInductor tests 258 s), a server start ~30 s.
FAST_GPU_TESTS = "not dali and not cvcuda and not inductor"
PHASES: dict[str, list[Step]] = {
    "core": [
        Step("nvidia-smi", NVIDIA_SMI, 30, min_s=5),
        Step("versions", VERSIONS, 60, min_s=5, dry=VERSIONS),
        # Beside the other steps, in a session of its own: it outlives this run if it must, and the
        # serve phase's compile step waits for it (the artifact's folder lock), then gets a cache hit.
        Step("compile", suite("compile"), 900, background=True, dry=suite("compile", dry=True)),
        Step(
            "pipeline-check",
            PIPELINE_CHECK,
            150,
            min_s=60,
            dry=(*PIPELINE_CHECK, "--device", "cpu", "--requests", "200", "--concurrency", "8", "--distinct", "12"),
        ),
        Step("pytest-gpu", gpu_tests(FAST_GPU_TESTS), 240, min_s=60, dry=gpu_tests(FAST_GPU_TESTS)),
        Step("wait:compile", (), 300, min_s=5, dry=()),
        suite_step("ceiling", 90, 45),
        # Last: Lite0's AOTInductor build alone took ~200 s, and these passed on the first H100.
        Step("pytest-gpu-inductor", gpu_tests("inductor"), 300, min_s=150, dry=gpu_tests("inductor")),
        REPORT,
    ],
    "serve": [
        suite_step("compile", 300, 30),  # a cache hit after the core run; else it builds it now
        suite_step("client", 90, 45),  # the load generator's ceiling, before the sweeps it qualifies
        suite_step("serve", 180, 90),
        suite_step("images", 90, 45),
        suite_step("baseline", 150, 90),
        REPORT,
    ],
    "extra": [
        suite_step("depth", 240, 120),
        suite_step("preprocess", 200, 60),
        REPORT,
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


def environment(dry_run: bool) -> dict[str, str]:
    paths = [str(REPO)] if dry_run else [str(SITE), str(REPO)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


def log(message: str) -> None:
    print(f"== {time.strftime('%H:%M:%S')} {message}", flush=True)


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def run_step(session: Session, step: Step, env: dict[str, str]) -> Outcome:
    command = step.dry if session.dry_run else step.command
    if command is None:
        return Outcome("skipped: not in a dry run")
    command = tuple(arg.replace("{results}", str(session.results)) for arg in command)
    left = session.left_s()
    if left < step.min_s:
        return Outcome(f"skipped: {left:.0f} s left of the budget, needs {step.min_s:.0f}")
    if step.name.startswith("wait:"):
        return wait_for(session, step.name.removeprefix("wait:"), min(step.cap_s, left))
    logs = session.results / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{session.phase}-{step.name}.log"
    started = time.monotonic()
    with log_path.open("ab") as out:
        out.write(f"$ {' '.join(command)}\n".encode())
        out.flush()
        try:
            process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        except OSError as exc:
            out.write(f"could not start: {exc}\n".encode())
            return Outcome(f"failed: {exc}")
    if step.background:
        session.background[step.name] = (process, started)
        return Outcome("started")
    timeout = min(step.cap_s, left)
    try:
        code = process.wait(timeout)
        outcome = Outcome("ok" if code == 0 else f"failed (exit {code})", time.monotonic() - started)
    except subprocess.TimeoutExpired:
        kill_group(process)
        outcome = Outcome(f"timed out after {timeout:.0f} s", time.monotonic() - started)
    print(tail(log_path), flush=True)
    return outcome


def wait_for(session: Session, name: str, timeout: float) -> Outcome:
    if name not in session.background:
        return Outcome(f"skipped: {name} was not started")
    process, started = session.background[name]
    waited = time.monotonic()
    try:
        code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        # Left running on purpose: the next run, if the machine is still up, finds it done.
        return Outcome(f"{name} still running after {timeout:.0f} s; left running", time.monotonic() - waited)
    session.outcomes[name] = Outcome("ok" if code == 0 else f"failed (exit {code})", time.monotonic() - started)
    print(tail(session.results / "logs" / f"{session.phase}-{name}.log"), flush=True)
    return Outcome("ok", time.monotonic() - waited)


def kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def install_core(carry: Path = CARRY) -> str:
    """The carried core wheels into SITE, once per machine; what happened, in words."""
    marker = SITE / ".core"
    if marker.exists():
        return "already installed"
    wheels = sorted((carry / "core").glob("*.whl"))
    if not wheels:
        raise SystemExit(
            f"No core wheels in {carry / 'core'} and none installed on this machine: run benchmarks/gpu_pack.sh "
            "and carry .carry/core in this run (a fresh machine has lost what an earlier run installed)."
        )
    SITE.mkdir(parents=True, exist_ok=True)
    command = [PYTHON, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", str(SITE)]
    subprocess.run([*command, *map(str, wheels)], check=True)
    marker.touch()
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


def pack(session: Session, out_dir: Path) -> Path:
    """The whole results folder as one tarball in ``out_dir`` (what comes back from the machine)."""
    record_path = session.results / "session.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    record[session.phase] = {
        "dry_run": session.dry_run,
        "budget_s": session.budget_s,
        "seconds": round(time.monotonic() - session.started, 1),
        "steps": {name: {"status": o.status, "seconds": round(o.seconds, 1)} for name, o in session.outcomes.items()},
    }
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    tarball = out_dir / "gpu-results.tar.gz"
    with tarfile.open(tarball, "w:gz") as archive:
        archive.add(session.results, arcname=session.results.name)
    return tarball


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def packed_at_exit(session: Session, out_dir: Path) -> Iterator[None]:
    """Pack whatever happens in the block: a failure, a timeout, Ctrl-C or SIGTERM."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    except KeyboardInterrupt:
        session.outcomes["(interrupted)"] = Outcome("stopped by a signal")
    finally:
        signal.signal(signal.SIGTERM, previous)
        tarball = pack(session, out_dir)
        log(f"packed {tarball} ({tarball.stat().st_size / 1e6:.1f} MB)")


def take_delivery(session: Session) -> None:
    """The carried core wheels and packs, on the GPU machine (not in a dry run)."""
    session.outcomes["install"] = Outcome(install_core())
    for line in receive_parts():
        log(line)


def run_phase(
    phase: str,
    steps: Sequence[Step],
    session: Session,
    out_dir: Path,
    setup: Callable[[Session], None] | None = None,
) -> dict[str, Outcome]:
    """``setup``, then every step in order, within the budget; packs the results whatever happens."""
    env = environment(session.dry_run)
    with packed_at_exit(session, out_dir):
        if setup is not None:
            setup(session)
        for step in steps:
            log(f"{phase}: {step.name} ({session.left_s():.0f} s of the budget left)")
            outcome = run_step(session, step, env)
            session.outcomes[step.name] = outcome
            log(f"{phase}: {step.name}: {outcome.status} ({outcome.seconds:.0f} s)")
    width = max(len(name) for name in session.outcomes)
    print("\n".join(f"  {name:<{width}}  {o.status} ({o.seconds:.0f} s)" for name, o in session.outcomes.items()))
    return session.outcomes


# Earlier names of phases, as notes written before the split (../shared/GPU.md) still call them.
ALIASES = {"suite": "serve"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=sorted([*PHASES, *ALIASES]))
    parser.add_argument("--dry-run", action="store_true", help="on this machine: dry forms, GPU-only steps skipped")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S)
    parser.add_argument("--results", type=Path, default=None, help=f"where results accumulate (default {RESULTS})")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")), help="where the pack goes")
    args = parser.parse_args(argv)
    if args.phase in ALIASES:
        log(f"phase {args.phase!r} is now {ALIASES[args.phase]!r} (the suite is split over serve and extra)")
        args.phase = ALIASES[args.phase]
    if args.results is None:
        args.results = RESULTS.with_name(RESULTS.name + "-dry-run") if args.dry_run else RESULTS
    args.results.mkdir(parents=True, exist_ok=True)
    session = Session(args.phase, args.budget_s, args.dry_run, args.results)
    outcomes = run_phase(args.phase, PHASES[args.phase], session, args.out, None if args.dry_run else take_delivery)
    failed = [name for name, o in outcomes.items() if o.status.startswith(("failed", "timed out"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
