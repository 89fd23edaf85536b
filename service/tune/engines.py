"""Each engine of the grid, compiled by compile-trt itself (a child process), with its accuracy gate.

An engine that fails its gate, cannot be built here, or is refused for this model is reported with
compile-trt's own words and dropped from the grid; it is never measured.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from compile import _defaults as compile_defaults
from compile.cli import EXIT_GATE_FAILED, EXIT_UNAVAILABLE
from compile.cli_flags import flag
from compile.model_request import ModelRequest
from service.client.launcher import parent_death_hook
from service.tune.settings import GATE_THRESHOLD_FIELDS, TuneSettings
from service.tune.space import split_engine

logger = logging.getLogger(__name__)

OK, GATE_FAILED, UNAVAILABLE, REFUSED, FAILED = "ok", "gate failed", "unavailable", "refused", "failed"
EXIT_USAGE = 2  # argparse's: a flag or the model refused
STATUS_BY_EXIT = {0: OK, EXIT_GATE_FAILED: GATE_FAILED, EXIT_UNAVAILABLE: UNAVAILABLE, EXIT_USAGE: REFUSED}
# compile-trt's model flags and gate overrides that vision-tune passes on as they were given.
# The gate overrides go to every engine, as the user's thresholds for the whole tune (compile-trt takes
# each at every precision); a threshold not given leaves compile-trt's own for the precision.
PASSED_ON = (
    *(f for f in ModelRequest.__dataclass_fields__ if f != "model"),
    "gate_images",
    *GATE_THRESHOLD_FIELDS,
)
# What a quantized engine (int8, fp8) is also given, always, so that its command says how it was
# calibrated; never a non-quantized one (compile-trt refuses --calibration there).
QUANTIZED_PASSED_ON = ("calibration", "calibration_count", "calibration_method")
MESSAGE_LINES = 14


@dataclass(frozen=True)
class EngineBuild:
    """What compile-trt made of one engine: an artifact that passed its gate, or why there is none."""

    engine: str  # backend-precision
    status: str  # OK, GATE_FAILED, UNAVAILABLE, REFUSED or FAILED
    artifact: str  # the artifact directory ("" unless OK)
    seconds: float
    message: str  # the gate's metrics, or compile-trt's reason
    command: list[str] = field(default_factory=list)  # the compile-trt command, as a user would type it
    batch: tuple[int, ...] = ()  # MIN,OPT,MAX it was compiled for

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def key(self) -> str:
        return build_key(self.engine, self.batch)

    @property
    def retry_on_resume(self) -> bool:
        """A build that failed for want of a library or by a crash may work once that is mended; a gate
        failure is the engine's own answer (and other thresholds make another tune)."""
        return self.status in (UNAVAILABLE, FAILED)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> EngineBuild:
        return cls(**{**values, "batch": tuple(values.get("batch", ()))})


def build_key(engine: str, batch: Sequence[int]) -> str:
    """How the journal names a build: ``onnx-fp32 1,8,32``."""
    return f"{engine} {','.join(map(str, batch))}"


def model_slug(settings: TuneSettings) -> str:
    """A folder-safe name of the model: --name, else the catalog name or the model file's stem."""
    raw = settings.name or (
        Path(settings.model).stem if "/" in settings.model or "." in settings.model else settings.model
    )
    return re.sub(r"[^A-Za-z0-9._-]+", "_", raw).strip("_") or "model"


def artifact_dir(settings: TuneSettings, engine: str, batch: tuple[int, int, int]) -> Path:
    return settings.artifacts_dir / f"{model_slug(settings)}-{engine}-b{'-'.join(map(str, batch))}"


def compile_arguments(
    settings: TuneSettings, engine: str, batch: tuple[int, int, int], output: Path, accelerator: str
) -> list[str]:
    """compile-trt's arguments for ``engine`` (``backend-precision``) of the tuned model; one artifact
    serves every GPU (compiled on the first), or the CPU."""
    backend, precision = split_engine(engine)
    device = "cuda:0" if accelerator == "cuda" else "cpu"
    arguments = ["--model", settings.model, "--weights", settings.weights]
    for name in PASSED_ON:
        value = getattr(settings, name)
        given = value is not None if name.startswith("gate_m") else value not in ("", 0)  # a threshold may be 0
        if given:
            arguments += [flag(name), str(value)]
    if precision in compile_defaults.QUANTIZED_PRECISIONS:
        for name in QUANTIZED_PASSED_ON:
            arguments += [flag(name), str(getattr(settings, name))]
    arguments += [
        "--backend", backend, "--precision", precision, "--batch", ",".join(map(str, batch)),
        "--device", device, "--output", str(output),
    ]  # fmt: skip
    return arguments


def gate_or_reason(stderr: str) -> str:
    """What to tell of a compile that did not pass: compile-trt's own message (the gate's table, or the
    reason it refused), else the end of what it wrote."""
    lines = stderr.rstrip().splitlines()
    for index, line in enumerate(lines):
        if line.startswith("compile-trt: "):  # its gate table, or argparse's "compile-trt: error: ..."
            return "\n".join(lines[index : index + MESSAGE_LINES])
    return "\n".join(lines[-MESSAGE_LINES:])


def gate_summary(artifact: Path) -> str:
    """The gate's metrics of an artifact that passed, from its manifest."""
    try:
        manifest = json.loads((artifact / compile_defaults.MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return ""
    metrics = manifest.get("validation", {}).get("metrics", {})
    return ", ".join(f"{name} {value:.6g}" for name, value in metrics.items())


def build_engine(
    settings: TuneSettings, engine: str, batch: tuple[int, int, int], log_dir: Path, accelerator: str
) -> EngineBuild:
    """Run compile-trt for ``engine`` (a cache hit when the artifact is already built)."""
    output = artifact_dir(settings, engine, batch)
    arguments = compile_arguments(settings, engine, batch, output, accelerator)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"compile-{engine}-b{'-'.join(map(str, batch))}.log"
    started = time.perf_counter()
    with log_path.open("w") as log:
        completed = subprocess.run(
            [sys.executable, "-m", "compile.cli", *arguments, "--log-level", "warning"],
            stdout=log,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=parent_death_hook(True),
        )
        log.write(completed.stderr)
    seconds = round(time.perf_counter() - started, 1)
    status = STATUS_BY_EXIT.get(completed.returncode, FAILED)
    command = ["compile-trt", *arguments]
    if status == OK:
        cached = "cache hit" in log_path.read_text(errors="replace")  # compile-trt's own words
        summary = ("up to date (compile-trt's cache); " if cached else "") + gate_summary(output)
        return EngineBuild(engine, OK, str(output), seconds, summary, command, tuple(batch))
    message = gate_or_reason(completed.stderr)
    if status == FAILED:
        message = f"compile-trt exited with {completed.returncode} (log: {log_path}):\n{message}"
    return EngineBuild(engine, status, "", seconds, message, command, tuple(batch))
