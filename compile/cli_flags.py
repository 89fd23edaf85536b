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
    "resize_size": "resize the shorter side to this many pixels; not given: the model's (model files need it)",
    "crop_size": "center-crop a square of this many pixels; not given: the model's (model files need it)",
    "mean": "normalization mean R,G,B of 0..1 pixels, e.g. 0.485,0.456,0.406; not given: the model's "
    "(model files need it)",
    "std": "normalization std R,G,B, e.g. 0.229,0.224,0.225; not given: the model's (model files need it)",
    "interpolation": "resize interpolation: bilinear, bicubic or nearest; not given: the model's (bilinear for "
    "model files)",
    "log_level": "logging level",
    "log_format": "text, or json: one object per line, as vision-serve --log-format json (the images use it)",
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
    (argparse keywords) replace the default ones: typed as the field's default, named by its name."""
    options = options or {}
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
