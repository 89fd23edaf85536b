"""The model flags that compile-trt and vision-serve share, as given: ``ModelRequest``.

Checked here for syntax only (no torch: ``--help`` and usage errors stay fast); what the model
itself says is resolved in compile/model_source.py.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from compile import _defaults
from compile.settings_errors import SettingsError
from preprocessing.spec import SUPPORTED_INTERPOLATIONS

# The preprocessing flags, by field name; a model file needs all of these (interpolation may be left out).
PREPROCESS_FLAGS = ("resize_size", "crop_size", "mean", "std")


@dataclass(frozen=True)
class ModelRequest:
    """The model flags shared by compile-trt, vision-serve and vision-tune, as given (empty or 0: not
    given). Their settings extend it, so each flag is declared here once."""

    model: str = _defaults.DEFAULT_MODEL
    labels: str = ""  # a labels file, "imagenet", or empty: the model's own
    name: str = ""  # the served name; empty: derived from the model
    resize_size: int = 0
    crop_size: int = 0
    mean: str = ""  # "R,G,B" in 0..1
    std: str = ""
    interpolation: str = ""

    @classmethod
    def from_settings(cls, settings: object) -> ModelRequest:
        """The request alone, out of any settings that extend it (CompileSettings, ServeSettings, TuneSettings)."""
        return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(cls)})

    @property
    def preprocess_overrides(self) -> dict[str, object]:
        """The preprocessing flags that were given, parsed."""
        given: dict[str, object] = {}
        if self.resize_size:
            given["resize_size"] = self.resize_size
        if self.crop_size:
            given["crop_size"] = self.crop_size
        if self.mean:
            given["mean"] = parse_triplet("--mean", self.mean)
        if self.std:
            given["std"] = parse_triplet("--std", self.std)
        if self.interpolation:
            given["interpolation"] = self.interpolation
        return given


def check_model_flags(request: ModelRequest) -> None:
    """The checks that need no torch (flag syntax): ``SettingsError`` says what to change."""
    if request.name and not re.fullmatch(_defaults.MODEL_NAME_PATTERN, request.name):
        raise SettingsError(
            "--name",
            request.name[:200],
            f"--name {request.name[:200]!r}: use 1..128 letters, digits, '.', '_' or '-', starting with a letter "
            "or digit (it appears in URLs, metric labels and folder names).",
            "Leave --name out to serve under the model's own name.",
        )
    for field_name in ("resize_size", "crop_size"):
        flag_name = "--" + field_name.replace("_", "-")
        if getattr(request, field_name) < 0:
            raise SettingsError.must(
                flag_name,
                getattr(request, field_name),
                "be > 0 (or left out)",
                f"Give the {field_name.split('_')[0]} size the model was trained with, in pixels (e.g. "
                f"{256 if field_name == 'resize_size' else 224}), or leave it out.",
            )
    if request.interpolation and request.interpolation not in SUPPORTED_INTERPOLATIONS:
        raise SettingsError.must(
            "--interpolation",
            request.interpolation,
            f"be one of {', '.join(SUPPORTED_INTERPOLATIONS)}",
            "Use the one the model was trained with (bilinear for most), or leave it out.",
        )
    request.preprocess_overrides  # noqa: B018 - parses --mean and --std


def parse_triplet(flag_name: str, text: str) -> tuple[float, float, float]:
    """``"0.485,0.456,0.406"`` -> a float per RGB channel."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or not all(math.isfinite(v) for v in values):
        raise SettingsError(
            flag_name,
            text,
            f"{flag_name} takes three numbers R,G,B (on 0..1 pixel values), e.g. 0.485,0.456,0.406; got {text!r}.",
            "Give the values the model was trained with, or leave the flag out for the model's own.",
        )
    return values  # type: ignore[return-value]
