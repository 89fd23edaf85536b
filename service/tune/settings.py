"""One settings object for vision-tune; every field is one flag (service/tune/cli.py).

Checked here for syntax only, without torch, so that ``--help`` and usage errors stay fast; what the
machine offers (GPUs, bf16 units, preprocessing libraries) is asked in machine.py.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

from compile import _defaults as compile_defaults
from compile.cli_flags import check_device_flag, flag
from compile.model_request import ModelRequest, check_model_flags
from compile.settings import CALIBRATION_ADVICE, CALIBRATION_NEEDED, CompileSettings
from compile.settings_errors import SettingsError
from preprocessing._defaults import BACKENDS as PREPROCESS_BACKENDS
from service.tune import _defaults

ENGINE_PATTERN = re.compile(rf"^(?P<backend>[a-z]+)-(?P<precision>{'|'.join(compile_defaults.PRECISIONS)})$")
COMPILE_BACKENDS = tuple(b for b in compile_defaults.BACKENDS if b != "auto")
# compile-trt's gate overrides, each a field of TuneSettings too, passed on as given (engines.py: PASSED_ON).
GATE_THRESHOLD_FIELDS = tuple(f.name for f in dataclasses.fields(CompileSettings) if f.name.startswith("gate_m"))


@dataclass(frozen=True)
class TuneSettings(ModelRequest):
    """What to tune (ModelRequest's fields first: the model as compile-trt and vision-serve take it),
    against which target, over which grid, and how to measure. Empty grid fields take the machine's
    grid (_defaults.py: CPU_* or GPU_*)."""

    weights: str = compile_defaults.DEFAULT_WEIGHTS
    p99_ms: float = 0.0  # required
    objective: str = _defaults.DEFAULT_OBJECTIVE
    # The latency objective's load, Poisson arrivals per second; 0: what the defaults sustain at the target.
    rate: float = 0.0
    budget_min: float = 0.0  # 0: no time limit
    search: str = _defaults.DEFAULT_SEARCH
    images: str = ""  # empty: the project's benchmark photos
    output: str = "tuned.toml"
    work: str = ""  # empty: <output without .toml>.work beside it
    artifacts: str = ""  # empty: <work>/artifacts
    device: str = "auto"
    engines: str = ""
    max_batch_sizes: str = ""
    batch_timeouts_ms: str = ""
    workers_per_device: str = ""
    api_servers: str = ""
    pipeline_depths: str = ""
    preprocess: str = ""
    devices: str = ""
    step_seconds: float = _defaults.STEP_SECONDS
    min_requests: int = _defaults.MIN_REQUESTS
    poisson_seconds: float = _defaults.POISSON_SECONDS
    load_factor: float = _defaults.LOAD_FACTOR
    max_concurrency: int = 0  # 0: from each configuration's batch capacity
    client_processes: int = 0  # 0: 1 on a CPU, 4 on a GPU
    confirm_rounds: int = _defaults.CONFIRM_ROUNDS
    max_memory_mib: float = 0.0  # 0: no limit
    gate_images: str = ""
    # Quantized engines (int8, fp8): the images their scales are calibrated on, as compile-trt takes them.
    # Given without --engines, it adds the machine's int8 engines to the grid (machine.py: build_grid).
    calibration: str = ""
    calibration_count: int = compile_defaults.DEFAULT_CALIBRATION_COUNT
    calibration_method: str = compile_defaults.DEFAULT_CALIBRATION_METHOD
    gate_min_top1_agreement: float | None = None
    gate_min_top5_overlap: float | None = None
    gate_min_cosine: float | None = None
    gate_max_rel_error: float | None = None
    gate_min_top5_agreement: float | None = None
    gate_max_prob_drop: float | None = None
    restart: bool = False
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.p99_ms) and self.p99_ms > 0):
            raise SettingsError(
                "--p99-ms",
                self.p99_ms or None,
                "--p99-ms is required: the latency target, in milliseconds, that the tuned configuration's p99 "
                f"must meet{'' if self.p99_ms == 0 else f', got {self.p99_ms}'}.",
                "Give the p99 your users need, e.g. --p99-ms 100.",
            )
        if self.objective not in _defaults.OBJECTIVES:
            raise SettingsError.must(
                "--objective",
                self.objective,
                "be throughput (most images/s within the target) or latency (lowest p99 at --rate)",
                "Leave it out for throughput.",
            )
        if self.search not in _defaults.SEARCHES:
            raise SettingsError.must(
                "--search",
                self.search,
                "be quick (coordinate descent) or full (every configuration)",
                "Leave it out for quick.",
            )
        if not (math.isfinite(self.rate) and self.rate >= 0):
            raise SettingsError.must(
                "--rate",
                self.rate,
                "be requests per second >= 0 (0: what the defaults sustain)",
                "Give the load your server takes at its peak, or leave it out.",
            )
        if self.rate and self.objective != "latency":
            raise SettingsError(
                "--rate",
                self.rate,
                f"--rate is the load of --objective latency; --objective {self.objective} finds its own load, got "
                f"--rate {self.rate:g}.",
                "Leave --rate out, or add --objective latency.",
            )
        for name in ("budget_min", "max_memory_mib"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise SettingsError.must(flag(name), value, "be >= 0 (0: no limit)", "Leave it out for no limit.")
        check_measuring(self)
        if not self.output.endswith(".toml"):
            raise SettingsError.must(
                "--output",
                self.output,
                "name a .toml file (vision-serve --config reads it)",
                f"Use e.g. --output {Path(self.output).stem or 'tuned'}.toml.",
            )
        check_device_flag(self.device)
        check_model_flags(ModelRequest.from_settings(self))
        check_compile_flags(self)
        self.grid_values()  # every grid list parses
        check_calibration(self)

    def grid_values(self) -> dict[str, tuple]:
        """The grid lists that were given, parsed (a dimension left out is not in the mapping)."""
        parsers = {
            "engines": parse_engines,
            "max_batch_sizes": lambda text: parse_numbers("--max-batch-sizes", text, int, minimum=1),
            "batch_timeouts_ms": lambda text: parse_numbers("--batch-timeouts-ms", text, float, minimum=0),
            "workers_per_device": lambda text: parse_numbers("--workers-per-device", text, int, minimum=0),
            "api_servers": lambda text: parse_numbers("--api-servers", text, int, minimum=0),
            "pipeline_depths": lambda text: parse_numbers("--pipeline-depths", text, int, minimum=0),
            "preprocess": parse_preprocess,
            "devices": parse_devices,
        }
        return {name: parse(getattr(self, name)) for name, parse in parsers.items() if getattr(self, name)}

    @property
    def output_path(self) -> Path:
        return Path(self.output).expanduser().resolve()

    @property
    def work_dir(self) -> Path:
        if self.work:
            return Path(self.work).expanduser().resolve()
        return self.output_path.with_suffix(_defaults.WORK_SUFFIX)

    @property
    def artifacts_dir(self) -> Path:
        return Path(self.artifacts).expanduser().resolve() if self.artifacts else self.work_dir / "artifacts"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_measuring(settings: TuneSettings) -> None:
    """How each configuration is measured: the load steps, the Poisson run, the clients, the confirm rounds."""
    for name in ("step_seconds", "poisson_seconds"):
        value = getattr(settings, name)
        if not (math.isfinite(value) and value > 0):
            default = getattr(TuneSettings, name)
            raise SettingsError.must(flag(name), value, "be > 0 seconds", f"Leave it out for {default:g} s.")
    if not 0 < settings.load_factor <= 1:
        raise SettingsError.must(
            "--load-factor",
            settings.load_factor,
            "be in (0, 1]: the share of the closed-loop throughput offered as Poisson arrivals",
            f"Leave it out for {_defaults.LOAD_FACTOR:g}.",
        )
    if settings.min_requests < 10:
        raise SettingsError.must(
            "--min-requests",
            settings.min_requests,
            "be >= 10 (a p99 needs samples)",
            f"Leave it out for {_defaults.MIN_REQUESTS}.",
        )
    for name in ("max_concurrency", "client_processes", "confirm_rounds"):
        if getattr(settings, name) < 0:
            raise SettingsError.must(flag(name), getattr(settings, name), "be >= 0", "Leave it out for the default.")


def check_compile_flags(settings: TuneSettings) -> None:
    """The calibration flags and gate thresholds, checked by compile-trt's own settings (its words),
    as the engines' compile-trt commands will pass them on."""
    int8, fp32 = compile_defaults.QUANTIZED_PRECISIONS[0], compile_defaults.DEFAULT_PRECISION
    CompileSettings(
        precision=int8 if settings.calibration else fp32,  # compile-trt refuses --calibration at fp32
        calibration=settings.calibration,
        calibration_count=settings.calibration_count,
        calibration_method=settings.calibration_method,
        **{f: getattr(settings, f) for f in GATE_THRESHOLD_FIELDS},
    )


def check_calibration(settings: TuneSettings) -> None:
    """--engines and --calibration together: a quantized engine needs calibration images, and
    calibration images need a quantized engine."""
    engines = settings.grid_values().get("engines")
    if engines is None:
        return  # the machine's grid: --calibration adds its int8 engines
    quantized = quantized_engines(engines)
    if quantized and not settings.calibration:
        raise SettingsError("--calibration", None, calibration_needed(quantized), CALIBRATION_ADVICE)
    # A usage error rather than a warning: compile-trt refuses --calibration for a precision that
    # is not quantized, and a tune is long; a flag dropped silently would let the user believe int8
    # was tried. Without --engines the flag is what adds the int8 engines, so it always does something.
    if settings.calibration and not quantized:
        raise SettingsError(
            "--calibration",
            settings.calibration,
            f"--calibration calibrates quantized engines ({'/'.join(compile_defaults.QUANTIZED_PRECISIONS)}), "
            f"and --engines {','.join(engines)} holds none.",
            "Add one (e.g. onnx-int8) to --engines, drop --engines to take the machine's grid with its int8 "
            "engines, or drop --calibration.",
        )


def quantized_engines(engines: tuple[str, ...]) -> tuple[str, ...]:
    """The engines of ``engines`` at a quantized precision (int8, fp8): those that need --calibration."""
    return tuple(e for e in engines if e.rpartition("-")[2] in compile_defaults.QUANTIZED_PRECISIONS)


def calibration_needed(engines: tuple[str, ...]) -> str:
    """compile-trt's words for a quantized precision without --calibration, said of vision-tune's --engines."""
    precision = engines[0].rpartition("-")[2]
    text = CALIBRATION_NEEDED.format(precision=precision)
    head = f"--precision {precision} "
    rest = text[len(head) :] if text.startswith(head) else f"needs --calibration DIR: {text}"
    return f"--engines {','.join(engines)} {rest}"


def split_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_numbers(flag: str, text: str, kind: type, minimum: float) -> tuple:
    try:
        values = tuple(kind(part) for part in split_list(text))
    except ValueError:
        values = ()
    if not values or any(not math.isfinite(v) or v < minimum for v in values):
        example = "1,4,8,32" if kind is int else "0,10"
        raise SettingsError(
            flag,
            text,
            f"{flag} takes numbers >= {minimum:g} separated by commas, e.g. {example}; got {text!r}.",
            "Leave it out for the machine's grid (docs/tuning.md).",
        )
    return tuple(sorted(set(values)))


def parse_engines(text: str) -> tuple[str, ...]:
    engines = []
    for part in split_list(text):
        match = ENGINE_PATTERN.match(part)
        if not match or match.group("backend") not in COMPILE_BACKENDS:
            raise SettingsError(
                "--engines",
                text,
                f"--engines takes BACKEND-PRECISION pairs separated by commas, e.g. onnx-fp32,inductor-bf16 "
                f"(backends: {', '.join(COMPILE_BACKENDS)}; precisions: {', '.join(compile_defaults.PRECISIONS)}); "
                f"got {part!r}.",
                "Leave it out for the machine's grid (docs/tuning.md).",
            )
        if part not in engines:
            engines.append(part)
    if not engines:
        raise SettingsError(
            "--engines", text, f"--engines names no engine: {text!r}.", "Leave it out for the machine's grid."
        )
    return tuple(engines)


def parse_preprocess(text: str) -> tuple[str, ...]:
    names = split_list(text)
    unknown = [n for n in names if n not in PREPROCESS_BACKENDS]
    if unknown or not names:
        raise SettingsError(
            "--preprocess",
            text,
            f"--preprocess takes backends from {', '.join(PREPROCESS_BACKENDS)}, got {text!r}.",
            "Leave it out to try those this machine can run.",
        )
    return tuple(dict.fromkeys(names))


def parse_devices(text: str) -> tuple[str, ...]:
    names = split_list(text)
    if not names:
        raise SettingsError(
            "--devices", text, f"--devices names no device: {text!r}.", "Leave it out for the machine's own."
        )
    for name in names:
        if name == "auto":
            raise SettingsError(
                "--devices",
                text,
                "--devices takes cpu, cuda (every GPU) or cuda:N; auto is not a point of the grid.",
                "Name the devices to compare (e.g. cuda:0,cuda), or leave it out.",
            )
        check_device_flag(name)
    return tuple(dict.fromkeys(names))
