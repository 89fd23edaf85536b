"""What timm models need wherever they come from (``timm:<name>`` or a folder saved the timm way), and
the served name made from a model's own name: below both compile/model_source.py and
compile/pretrained_folders.py, which use them."""

from __future__ import annotations

import difflib
import math
import re

from compile import _defaults
from compile.config_values import FLAGS_HINT, channel_triplet
from compile.offline_loads import untrusted_load
from compile.settings_errors import SettingsError
from preprocessing.spec import SUPPORTED_INTERPOLATIONS, PreprocessSpec


def served_name_of(text: str) -> str:
    """A name that fits ``MODEL_NAME_PATTERN``, made from a file stem or a timm name."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")[:128]
    return name or "model"


# timm's own values for a config that leaves one out, as ``timm.data.resolve_data_config`` and
# ``transforms_imagenet_eval`` fill them in (tests/unit/test_timm_preprocess.py holds them to timm's).
TIMM_CROP_MODES = ("center", "squash", "border")
_DEFAULT_INPUT_SIZE = (3, 224, 224)
_DEFAULT_INTERPOLATION = "bicubic"
_DEFAULT_CROP_MODE = "center"
_DEFAULT_MEAN = (0.485, 0.456, 0.406)
_DEFAULT_STD = (0.229, 0.224, 0.225)
# The interpolations timm knows that no backend here resamples with, and the nearest one it has.
_NEAREST_INTERPOLATION = {"lanczos": "bicubic", "box": "bilinear", "hamming": "bilinear", "random": "bicubic"}


def timm_preprocess(name: str, config: dict, where: str = "") -> PreprocessSpec:
    """timm's eval transform (``transforms_imagenet_eval``) for ``config`` (``resolve_data_config``'s
    output, or a folder's ``pretrained_cfg``, whose missing values take timm's defaults) as a
    ``PreprocessSpec``, exactly; what it cannot hold is refused. With ``scale = floor(side / crop_pct)``
    per side of ``input_size`` [3, H, W] (docs/compiling.md, "timm crop modes"):

    * ``center``: the shorter side to ``scale`` when both scales are equal (torchvision's
      ``Resize(int)``), else cover the ``scale`` box (``ResizeKeepRatio``); crop ``H x W``;
    * ``squash``: to the ``scale`` box exactly, crop ``H x W``;
    * ``border``: fit inside the ``scale`` box, crop (pad) ``H x W`` with ``round(255 * mean)``.

    Crops are centred with ``round`` (torchvision's ``CenterCrop``, timm's ``CenterCropOrPad``).
    ``where``: the file the config came from (a folder's config.json), for the refusals."""
    model = f"{_defaults.TIMM_PREFIX}{name}"
    where = where or model
    height, width = _input_size(config.get("input_size"), where, model)
    crop_pct = _crop_pct(config.get("crop_pct") or _defaults.TIMM_DEFAULT_CROP_PCT, where, model)
    crop_mode = config.get("crop_mode") or _DEFAULT_CROP_MODE
    interpolation = config.get("interpolation") or _DEFAULT_INTERPOLATION
    _refuse_inexact(config, crop_mode, interpolation, where, model)
    mean = channel_triplet(config.get("mean") or _DEFAULT_MEAN, "mean", where, model)
    std = channel_triplet(config.get("std") or _DEFAULT_STD, "std", where, model, positive=True)
    scale_height, scale_width = math.floor(height / crop_pct), math.floor(width / crop_pct)
    if min(scale_height, scale_width) < 1:
        raise SettingsError(
            "--model", model, f"{where}: its crop_pct {crop_pct} resizes {height}x{width} to nothing.", FLAGS_HINT
        )
    common = {
        "mean": mean,
        "std": std,
        "interpolation": interpolation,
        "crop_size": 0,
        "crop_height": height,
        "crop_width": width,
    }
    box = {"resize_size": 0, "resize_height": scale_height, "resize_width": scale_width}
    if crop_mode == "squash":
        return _spec(where, model, resize_mode="exact", **box, **common)
    if crop_mode == "border":
        if not all(0 <= m <= 1 for m in mean):  # the border's colour is the mean's, in 0..255
            raise SettingsError(
                "--model",
                model,
                f"{where}: its crop_mode 'border' pads with its mean, {list(mean)}, which is not a colour (0..1).",
                FLAGS_HINT,
            )
        fill = tuple(round(255 * m) for m in mean)
        return _spec(where, model, resize_mode="contain", pad_fill=fill, **box, **common)
    if scale_height == scale_width:  # timm's test: torchvision's Resize(int), the shorter side
        return _spec(where, model, resize_mode="shorter", resize_size=scale_height, **common)
    return _spec(where, model, resize_mode="cover", **box, **common)


def _input_size(size: object, where: str, model: str) -> tuple[int, int]:
    """``(height, width)`` of ``input_size`` [3, H, W] (timm's default where there is none)."""
    size = _DEFAULT_INPUT_SIZE if size is None else size
    if not (isinstance(size, (list, tuple)) and len(size) == 3 and all(type(s) is int and s > 0 for s in size)):
        raise SettingsError(
            "--model", model, f"{where}: its input_size is {size!r}; it must be [3, height, width].", FLAGS_HINT
        )
    channels, height, width = size
    if channels != 3:
        raise SettingsError(
            "--model",
            model,
            f"{where}: its input_size is {list(size)}, {channels} channel(s); vision-serve feeds models RGB "
            f"images, [3, {height}, {width}].",
            "Serve a model of 3 input channels.",
        )
    return height, width


def _crop_pct(value: object, where: str, model: str) -> float:
    """timm's ``crop_pct``: the share of the resized side that the crop keeps. Over 1 (volo's 1.15)
    the crop is larger than the resize, and pads with 0 as torchvision's ``CenterCrop`` does."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise SettingsError(
            "--model",
            model,
            f"{where}: its crop_pct is {value!r}; it must be a number > 0 (timm's default is "
            f"{_defaults.TIMM_DEFAULT_CROP_PCT}).",
            FLAGS_HINT,
        )
    return float(value)


def _refuse_inexact(config: dict, crop_mode: object, interpolation: object, where: str, model: str) -> None:
    """``SettingsError`` for what timm would do that no backend here does the same way, naming each
    field and the nearest setting there is."""
    problems = []
    if crop_mode not in TIMM_CROP_MODES:
        close = difflib.get_close_matches(str(crop_mode), TIMM_CROP_MODES, n=1)
        nearest = close[0] if close else _DEFAULT_CROP_MODE
        problems.append(
            f"its crop_mode is {crop_mode!r}, not one of {', '.join(TIMM_CROP_MODES)} (timm would center-crop; "
            f"nearest: {nearest!r})"
        )
    if interpolation not in SUPPORTED_INTERPOLATIONS:
        nearest = _NEAREST_INTERPOLATION.get(str(interpolation), _DEFAULT_INTERPOLATION)
        problems.append(
            f"its interpolation is {interpolation!r}, which vision-serve does not resample with (it has "
            f"{', '.join(SUPPORTED_INTERPOLATIONS)}; nearest: {nearest!r})"
        )
    border = config.get("crop_border_pixels")
    if border:
        problems.append(f"its crop_border_pixels is {border!r}, a trim vision-serve does not make (nearest: 0)")
    if problems:
        raise SettingsError(
            "--model",
            model,
            f"{where}: timm's eval transform cannot be served exactly: {'; '.join(problems)}.",
            "Set the nearest value in its pretrained_cfg (a timm folder's config.json), or pass --resize-size, "
            "--crop-size, --mean, --std and --interpolation to serve a folder with those instead.",
        )


def _spec(where: str, model: str, **fields: object) -> PreprocessSpec:
    try:
        return PreprocessSpec(**fields)  # type: ignore[arg-type]
    except ValueError as exc:  # a value PreprocessSpec holds to its own rules
        raise SettingsError(
            "--model", model, f"{where}: its preprocessing cannot be served: {exc}", FLAGS_HINT
        ) from None


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
