"""One settings object for `compile-trt`; every field is one flag (see compile/cli.py)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from compile import _defaults
from compile.cli_flags import check_device_flag, flag
from compile.model_request import ModelRequest, check_model_flags
from compile.settings_errors import SettingsError


def parse_batch(text: str) -> tuple[int, int, int]:
    """``"1,8,32"`` -> (1, 8, 32); a single number N means N,N,N (a static batch)."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        raise SettingsError(
            "--batch",
            text,
            f"--batch takes MIN,OPT,MAX as integers, e.g. 1,8,32; got {text!r}.",
            "Give one number for a static batch, or three.",
        ) from None
    if len(values) == 1:
        values = values * 3
    if len(values) != 3:
        raise SettingsError(
            "--batch",
            text,
            f"--batch takes three numbers MIN,OPT,MAX (e.g. 1,8,32) or one, got {text!r}.",
            "One number N is a static batch of N; three are the smallest, the tuned-for and the largest.",
        )
    return values  # type: ignore[return-value]


# What --precision int8 without --calibration is told: what the flag needs, then (the fix) what a good set is.
CALIBRATION_NEEDED = (
    "--precision {precision} needs --calibration DIR: a folder of images (any format the server decodes; "
    "subfolders are read too) like the ones the model will serve, from which the activation ranges are "
    "measured."
)
CALIBRATION_ADVICE = (
    f"A good set: {_defaults.ADVISED_MIN_CALIBRATION_IMAGES}-{_defaults.DEFAULT_CALIBRATION_COUNT * 2} "
    "images from your training or production data, covering every class and the lighting and framing users "
    "send; not the images you evaluate on (--eval DIR). --calibration-count N takes a seeded sample of N "
    f"(default {_defaults.DEFAULT_CALIBRATION_COUNT})."
)
# What a gate threshold out of range is told.
GATE_OVERRIDE_FIX = "Leave it out for the precision's own threshold (compile-trt --help lists them)."


@dataclass(frozen=True)
class CompileSettings(ModelRequest):
    """What to compile and how. Defaults live in compile/_defaults.py."""

    # ModelRequest's fields first: the model, its classes and served name, and its preprocessing where
    # it differs from the model's own (required for model files).
    weights: str = _defaults.DEFAULT_WEIGHTS
    backend: str = _defaults.DEFAULT_BACKEND
    precision: str = _defaults.DEFAULT_PRECISION
    batch: tuple[int, int, int] = _defaults.DEFAULT_BATCH
    device: str = _defaults.DEFAULT_DEVICE
    output: str = ""  # empty: artifacts/<model>-<backend>-<precision>-<device type>
    workspace_gib: float = _defaults.DEFAULT_TRT_WORKSPACE_GIB
    optimization_level: int = _defaults.DEFAULT_TRT_OPTIMIZATION_LEVEL
    gate_images: str = ""  # a folder of images for the accuracy gate (also --eval); empty: scikit-image's samples
    # Quantized precisions (int8, fp8): the folder of images whose activation ranges set the scales.
    calibration: str = ""
    calibration_count: int = _defaults.DEFAULT_CALIBRATION_COUNT
    calibration_method: str = _defaults.DEFAULT_CALIBRATION_METHOD
    # Gate thresholds; None takes the precision's defaults from _defaults.GATE_THRESHOLDS.
    gate_min_top1_agreement: float | None = None
    gate_min_top5_overlap: float | None = None
    gate_min_cosine: float | None = None
    gate_max_rel_error: float | None = None
    gate_min_top5_agreement: float | None = None
    gate_max_prob_drop: float | None = None
    # Also write a Triton model repository here (onnx artifacts): the model, a DALI preprocessing
    # model and an ensemble of the two. Not part of the cache key: it is written from the artifact.
    triton_repository: str = ""
    force: bool = False
    log_level: str = "info"
    log_format: str = "text"

    def __post_init__(self) -> None:
        if self.log_format not in _defaults.LOG_FORMATS:
            formats = ", ".join(_defaults.LOG_FORMATS)
            raise SettingsError.must(
                "--log-format",
                self.log_format,
                f"be one of {formats}",
                "Use text for a terminal, json for a log pipeline.",
            )
        if self.backend not in _defaults.BACKENDS:
            raise SettingsError.must(
                "--backend",
                self.backend,
                f"be one of {', '.join(_defaults.BACKENDS)}",
                "Use auto to take the measured best for the device and precision.",
            )
        if self.precision not in _defaults.PRECISIONS:
            raise SettingsError.must(
                "--precision",
                self.precision,
                f"be one of {', '.join(_defaults.PRECISIONS)}",
                "Use fp32 for the model's own accuracy, fp16 or bf16 for speed.",
            )
        low, opt, high = self.batch
        if not 1 <= low <= opt <= high:
            raise SettingsError(
                "--batch",
                f"{low},{opt},{high}",
                f"--batch MIN,OPT,MAX needs 1 <= MIN <= OPT <= MAX, got {low},{opt},{high}.",
                "Example: 1,8,32 (OPT is the size TensorRT tunes for).",
            )
        self._check_calibration()
        check_device_flag(self.device)
        check_model_flags(ModelRequest.from_settings(self))
        if not math.isfinite(self.workspace_gib) or self.workspace_gib <= 0:
            raise SettingsError.must(
                "--workspace-gib",
                self.workspace_gib,
                "be a number > 0",
                f"Leave it out for {_defaults.DEFAULT_TRT_WORKSPACE_GIB:g} GiB, or give what the builder may use.",
            )
        if self.optimization_level not in _defaults.TRT_OPTIMIZATION_LEVELS:
            raise SettingsError.must(
                "--optimization-level",
                self.optimization_level,
                "be 0..5 (TensorRT's range)",
                f"Leave it out for {_defaults.DEFAULT_TRT_OPTIMIZATION_LEVEL}; higher levels build longer, for speed.",
            )
        for name in ("gate_min_top1_agreement", "gate_min_top5_overlap", "gate_min_cosine", "gate_min_top5_agreement"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise SettingsError.must(flag(name), value, "be in 0..1", GATE_OVERRIDE_FIX)
        if self.gate_max_rel_error is not None and not (
            math.isfinite(self.gate_max_rel_error) and self.gate_max_rel_error >= 0
        ):
            raise SettingsError.must(
                "--gate-max-rel-error", self.gate_max_rel_error, "be a number >= 0", GATE_OVERRIDE_FIX
            )
        if self.gate_max_prob_drop is not None and not 0.0 <= self.gate_max_prob_drop <= 1.0:
            raise SettingsError.must("--gate-max-prob-drop", self.gate_max_prob_drop, "be in 0..1", GATE_OVERRIDE_FIX)

    @property
    def quantized(self) -> bool:
        return self.precision in _defaults.QUANTIZED_PRECISIONS

    def _check_calibration(self) -> None:
        if self.quantized and not self.calibration:
            message = CALIBRATION_NEEDED.format(precision=self.precision)
            raise SettingsError("--calibration", None, message, CALIBRATION_ADVICE)
        if self.calibration and not self.quantized:
            raise SettingsError(
                "--calibration",
                self.calibration,
                f"--calibration sets the scales of a quantized engine (--precision int8 or fp8); --precision "
                f"{self.precision} needs none.",
                "Drop --calibration, or ask for --precision int8.",
            )
        if not 1 <= self.calibration_count <= _defaults.MAX_CALIBRATION_COUNT:
            raise SettingsError(
                "--calibration-count",
                self.calibration_count,
                f"--calibration-count must be 1..{_defaults.MAX_CALIBRATION_COUNT}, got {self.calibration_count}.",
                f"A few hundred images is what calibration needs; leave it out for "
                f"{_defaults.DEFAULT_CALIBRATION_COUNT}.",
            )
        if self.calibration_method not in _defaults.CALIBRATION_METHODS:
            methods = ", ".join(_defaults.CALIBRATION_METHODS)
            raise SettingsError.must(
                "--calibration-method",
                self.calibration_method,
                f"be one of {methods}",
                "Use auto: the engine's measured best.",
            )

    def gate_thresholds(self) -> dict[str, float]:
        """The precision's thresholds (logit measures only for random weights), then the overrides."""
        thresholds = dict(_defaults.GATE_THRESHOLDS[self.precision])
        if self.weights == "random" and self.quantized:
            thresholds = dict(_defaults.RANDOM_WEIGHTS_QUANTIZED_THRESHOLDS)
        elif self.weights == "random":
            thresholds = {k: v for k, v in thresholds.items() if k in _defaults.RANDOM_WEIGHTS_GATED}
        overrides = {
            "top1_agreement": self.gate_min_top1_agreement,
            "top5_overlap": self.gate_min_top5_overlap,
            "cosine": self.gate_min_cosine,
            "max_rel_error": self.gate_max_rel_error,
            "top5_agreement": self.gate_min_top5_agreement,
            "mean_prob_drop": self.gate_max_prob_drop,
        }
        thresholds.update({k: v for k, v in overrides.items() if v is not None})
        return thresholds

    def as_dict(self) -> dict:
        values = asdict(self)
        values["batch"] = list(self.batch)
        return values
