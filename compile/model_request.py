"""The model flags that compile-trt and vision-serve share, as given: ``ModelRequest``.

Checked here for syntax only (no torch: ``--help`` and usage errors stay fast); what the model
itself says is resolved in compile/model_source.py.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from compile import _defaults
from compile.preprocess_flags import (
    PREPROCESS_FIELDS,
    PreprocessFlags,
    parse_preprocess_flags,
    parse_triplet,
)
from compile.settings_errors import SettingsError

__all__ = ["PREPROCESS_FIELDS", "ModelRequest", "check_model_flags", "parse_triplet"]


@dataclass(frozen=True)
class ModelRequest:
    """The model flags shared by compile-trt, vision-serve and vision-tune, as given (empty: not given,
    the model's own). Their settings extend it, so each flag is declared here once. The preprocessing
    fields are text, parsed by compile/preprocess_flags.py: a size is ``N`` or ``HxW``, a switch ``on``
    or ``off``; numbers given in code (``crop_size=224``) are taken as their text."""

    model: str = _defaults.DEFAULT_MODEL
    labels: str = ""  # a labels file, "imagenet", or empty: the model's own
    name: str = ""  # the served name; empty: derived from the model
    # The preprocessing (PREPROCESS_FIELDS, in the order its steps run), each the model's own unless given.
    resize_size: str = ""  # N: the shorter side; HxW: a box (height x width)
    resize_mode: str = ""  # shorter, exact, cover, contain
    crop_size: str = ""  # N: a square; HxW; none: no crop (exact resize only)
    crop_pct: str = ""  # the resize from the crop: floor(crop / crop_pct) per side
    crop_rounding: str = ""  # round, floor
    pad_fill: str = ""  # "R,G,B" in 0..255
    interpolation: str = ""
    antialias: str = ""  # on, off
    rescale_factor: str = ""  # a number or 1/N
    normalize: str = ""  # on, off
    channel_order: str = ""  # RGB, BGR
    mean: str = ""  # "R,G,B" in 0..1
    std: str = ""

    @classmethod
    def from_settings(cls, settings: object) -> ModelRequest:
        """The request alone, out of any settings that extend it (CompileSettings, ServeSettings, TuneSettings)."""
        return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(cls)})

    @property
    def preprocess_flags(self) -> PreprocessFlags:
        """The preprocessing flags that were given, parsed (``SettingsError`` for a value refused)."""
        return parse_preprocess_flags(self)


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
    parse_preprocess_flags(request)
