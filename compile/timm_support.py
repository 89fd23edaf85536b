"""What timm models need wherever they come from (``timm:<name>`` or a folder saved the timm way), and
the served name made from a model's own name: below both compile/model_source.py and
compile/pretrained_folders.py, which use them."""

from __future__ import annotations

import math
import re

from compile import _defaults
from compile.settings_errors import SettingsError
from preprocessing.spec import SUPPORTED_INTERPOLATIONS, PreprocessSpec


def served_name_of(text: str) -> str:
    """A name that fits ``MODEL_NAME_PATTERN``, made from a file stem or a timm name."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")[:128]
    return name or "model"


def timm_preprocess(name: str, config: dict) -> PreprocessSpec:
    """timm's eval transform (``transforms_imagenet_eval``, crop mode ``center``) as a ``PreprocessSpec``:
    resize the shorter side to ``floor(size / crop_pct)``, center-crop ``size``, normalize."""
    _, height, width = config["input_size"]
    crop_mode = config.get("crop_mode") or "center"
    crop_pct = config.get("crop_pct") or _defaults.TIMM_DEFAULT_CROP_PCT
    interpolation = config.get("interpolation") or "bilinear"
    problems = []
    if height != width:
        problems.append(f"its input is {height}x{width}, not square")
    if crop_mode != "center":
        problems.append(f"its crop mode is {crop_mode!r}, not 'center'")
    if interpolation not in SUPPORTED_INTERPOLATIONS:
        problems.append(f"its interpolation is {interpolation!r}")
    if problems:
        raise SettingsError(
            "--model",
            f"{_defaults.TIMM_PREFIX}{name}",
            f"timm:{name}'s preprocessing cannot be served exactly: {'; '.join(problems)}. vision-serve resizes the "
            f"shorter side, center-crops a square and interpolates {'/'.join(SUPPORTED_INTERPOLATIONS)}.",
            "Pass --resize-size, --crop-size and --interpolation to serve it with those instead.",
        )
    return PreprocessSpec(
        resize_size=math.floor(height / crop_pct),
        crop_size=height,
        mean=tuple(config["mean"]),
        std=tuple(config["std"]),
        interpolation=interpolation,
    )


def import_timm():
    """timm, or a ``SettingsError`` saying how to install it (an optional extra)."""
    try:
        import timm
        import timm.data
    except ImportError:
        raise SettingsError(
            "--model", "timm:<name>", "--model timm:<name> needs timm.", "pip install 'vision-serve[timm]'."
        ) from None
    return timm
