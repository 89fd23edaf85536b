"""Command-line flags made from a settings dataclass, one way for both commands (compile-trt, vision-serve).

Every field of the dataclass is one flag, ``--field-name``. A flag that is not given parses to None,
so that what lies under it decides: vision-serve's env vars and config file, the dataclass defaults.
Imports no torch, so that ``--help`` and usage errors stay fast.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import Field, fields
from typing import Any, TypeVar

from compile.settings_errors import SettingsError

Settings = TypeVar("Settings")

# The help of the flags both commands have, worded once.
SHARED_HELP = {
    "model": "resnet152, efficientnet-lite0, any torchvision classifier, timm:<name>, or a model file made "
    "elsewhere: path/model.onnx or path/model.pt2 (torch.export.save)",
    "weights": "imagenet (torchvision download + cache), a state_dict file PATH, or random (seeded); "
    "a model file holds its own",
    "labels": "class labels, one per line in output order (Triton's labels.txt); sets the number of classes. "
    "'imagenet' for ImageNet's 1,000; not given: the model's own (model files need it)",
    "name": "the served model name (OIP routes, answers, metrics, /info); not given: from --model",
    # The preprocessing (compile/preprocess_flags.py; docs/configuration.md#preprocessing-flags): each flag
    # overrides its own part of the model's; a model file needs --resize-size (or --crop-pct), --crop-size,
    # --mean and --std.
    "resize_size": "N: resize the shorter side to N pixels; HxW (height x width): resize to that box, exact "
    "(aspect ratio not kept) unless --resize-mode says cover or contain; not given: the model's",
    "resize_mode": "shorter (one side, aspect kept), exact (the box, aspect not kept), cover (aspect kept, the "
    "smallest size covering the box) or contain (aspect kept, the largest fitting in it, then padded); not "
    "given: as --resize-size says, else the model's",
    "crop_size": "center-crop N (a square) or HxW pixels, or none (with an exact resize: its box is the model's "
    "input); not given: the model's",
    "crop_pct": "set the resize from the crop, floor(crop / F) per side, as timm's crop_pct (e.g. 0.875: crop "
    "224 of 256); instead of --resize-size",
    "crop_rounding": "where the crop window starts: round((size - crop) / 2) (torchvision, timm) or floor "
    "(transformers); not given: the model's",
    "pad_fill": "R,G,B (0..255) of what a crop past the image's edge holds (contain, or a crop larger than the "
    "resize); not given: the model's (black)",
    "interpolation": "resize interpolation: bilinear, bicubic or nearest; not given: the model's (bilinear for "
    "model files)",
    "antialias": "on: antialias when shrinking (Pillow, torchvision, transformers); off: plain interpolation "
    "(F.interpolate, OpenCV); not given: the model's (on)",
    "rescale_factor": "what 0..255 pixels are multiplied by before normalizing, a number or 1/N; not given: "
    "the model's (1/255)",
    "normalize": "on: (value - mean) / std per channel; off: the rescaled values as they are (then no --mean "
    "or --std); not given: the model's (on)",
    "channel_order": "RGB, or BGR (channels flipped; --mean and --std then in B,G,R order); not given: the "
    "model's (RGB)",
    "mean": "normalization mean per channel of rescaled (0..1) pixels, R,G,B, e.g. 0.485,0.456,0.406; not given: "
    "the model's (model files need it)",
    "std": "normalization std per channel, R,G,B, e.g. 0.229,0.224,0.225; not given: the model's (model files need it)",
    "log_level": "logging level",
    "log_format": "text, or json: one object per line, as vision-serve --log-format json (the images use it)",
}
# How the preprocessing flags read in --help (all text: a size is N or HxW, a switch on or off).
SHARED_OPTIONS: dict[str, dict[str, Any]] = {
    name: {"type": str, "metavar": metavar}
    for name, metavar in (
        ("resize_size", "N|HxW"),
        ("resize_mode", "shorter|exact|cover|contain"),
        ("crop_size", "N|HxW|none"),
        ("crop_pct", "F"),
        ("crop_rounding", "round|floor"),
        ("pad_fill", "R,G,B"),
        ("interpolation", "bilinear|bicubic|nearest"),
        ("antialias", "on|off"),
        ("rescale_factor", "F|1/N"),
        ("normalize", "on|off"),
        ("channel_order", "RGB|BGR"),
        ("mean", "R,G,B"),
        ("std", "R,G,B"),
    )
}
# What --device takes besides cuda:N.
NAMED_DEVICES = ("auto", "cpu", "cuda")


def flag(field_name: str) -> str:
    """``max_batch_size`` -> ``--max-batch-size``."""
    return "--" + field_name.replace("_", "-")


def check_device_flag(device: str) -> None:
    """Raise ``SettingsError`` unless ``device`` is a form ``--device`` takes. Whether that GPU exists is
    asked where torch is loaded (``compile.devices.parse_device``)."""
    if not (device in NAMED_DEVICES or device.startswith("cuda:")):
        raise SettingsError.must(
            "--device", device, "be auto, cpu, cuda or cuda:N", "Use cuda:0 for the first GPU, or cpu."
        )


def visible_device(index: int, visible_devices: str | None) -> str:
    """GPU ``index`` as torch numbers it (within ``CUDA_VISIBLE_DEVICES``) as the machine names it: the
    entry of ``visible_devices`` at that place (a number, or a ``GPU-...``/``MIG-...`` UUID), else the
    index itself. What a worker shown one GPU must be given, and what nvidia-smi calls it."""
    visible = [d.strip() for d in visible_devices.split(",")] if visible_devices else []
    if index < len(visible) and visible[index]:
        return visible[index]
    return str(index)


def add_settings_flags(
    parser: argparse.ArgumentParser,
    settings_type: type,
    help_of: Callable[[Field], str],
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """One flag per field of ``settings_type``, helped by ``help_of(field)``. A field's ``options``
    (argparse keywords) replace the default ones: ``SHARED_OPTIONS`` for the shared flags, else typed as
    the field's default and named by its name."""
    options = {**SHARED_OPTIONS, **(options or {})}
    for f in fields(settings_type):
        kwargs = options.get(f.name, {"type": type(f.default), "metavar": f.name.upper()})
        parser.add_argument(flag(f.name), help=help_of(f), **{"default": None, **kwargs})


def parse_settings(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    settings_from: Callable[[argparse.Namespace], Settings],
) -> tuple[argparse.Namespace, Settings]:
    """The parsed ``argv`` and the settings made from it. A value the settings refuse raises their
    ``SettingsError``, which the command's ``main`` turns into a usage error (compile/settings_errors.py)."""
    args = parser.parse_args(argv)
    return args, settings_from(args)
