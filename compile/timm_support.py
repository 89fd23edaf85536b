"""What timm models need wherever they come from (``timm:<name>`` or a folder saved the timm way), and
the served name made from a model's own name: below both compile/model_source.py and
compile/pretrained_folders.py, which use them."""

from __future__ import annotations

import difflib
import math
import re

from compile import _defaults
from compile.config_values import FLAGS_HINT, channel_triplet, crop_fraction
from compile.offline_loads import untrusted_load
from compile.settings_errors import SettingsError
from preprocessing.spec import SUPPORTED_INTERPOLATIONS, PreprocessSpec


def served_name_of(text: str) -> str:
    """A name that fits ``MODEL_NAME_PATTERN``, made from a file stem or a timm name."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")[:128]
    return name or "model"


def timm_preprocess(name: str, config: dict, where: str = "") -> PreprocessSpec:
    """timm's eval transform (``transforms_imagenet_eval``, crop mode ``center``) as a ``PreprocessSpec``:
    resize the shorter side to ``floor(size / crop_pct)``, center-crop ``size``, normalize. ``where``:
    the file the config came from (a folder's config.json), for the refusal of a value it cannot hold."""
    model = f"{_defaults.TIMM_PREFIX}{name}"
    where = where or model
    size = config["input_size"]
    if not (isinstance(size, (list, tuple)) and len(size) == 3 and all(type(s) is int and s > 0 for s in size)):
        raise SettingsError(
            "--model", model, f"{where}: its input_size is {size!r}; it must be [3, height, width].", FLAGS_HINT
        )
    _, height, width = size
    crop_mode = config.get("crop_mode") or "center"
    crop_pct = config.get("crop_pct")
    if crop_pct is None:
        crop_pct = _defaults.TIMM_DEFAULT_CROP_PCT
    crop_pct = crop_fraction(crop_pct, "crop_pct", where, model)
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
        mean=channel_triplet(config.get("mean"), "mean", where, model),
        std=channel_triplet(config.get("std"), "std", where, model, positive=True),
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


def check_timm_architecture(name: str, where: str, model: str, prefix: str = "") -> None:
    """``SettingsError`` unless ``name`` is an architecture of timm's own registry: a source prefix
    (``hf-hub:``, ``local-dir:``) or a path would have ``create_model`` read the Hugging Face Hub or
    another folder, where model files and folders are read offline and alone (docs/security.md).
    ``prefix``: what the names suggested instead start with (``timm:`` for ``--model timm:<name>``)."""
    timm = import_timm()
    if any(c in name for c in ":/\\"):
        raise SettingsError(
            "--model",
            model,
            f"{where} names the timm architecture {name!r}: a source (hf-hub:, local-dir:) or a path would have "
            "timm fetch it from the Hugging Face Hub or read another folder, and models are read offline, alone.",
            "Name one of timm's own architectures (e.g. resnet50: timm.list_models() lists them), and bring "
            "its weights in the folder.",
        )
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3)
        hint = f" Did you mean {', '.join(prefix + c for c in close)}?" if close else ""
        raise SettingsError(
            "--model",
            model,
            f"{where}: timm has no model {name!r}.{hint}",
            '`python -c "import timm; print(timm.list_models())"` lists them.',
        )


def create_timm_model(name: str, where: str, model: str, prefix: str = "", **kwargs):
    """``timm.create_model(name, pretrained=False, **kwargs)`` once ``name`` is checked, offline."""
    check_timm_architecture(name, where, model, prefix)
    with untrusted_load():
        return import_timm().create_model(name, pretrained=False, **kwargs)
