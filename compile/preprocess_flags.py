"""The preprocessing flags of compile-trt, vision-serve and vision-tune: each parsed (no torch), then
laid over the model's own ``PreprocessSpec`` (preprocessing/spec.py), or made into one for a model file.

Each flag overrides its own part of the model's preprocessing and leaves the rest as the model has it:

* ``--resize-size N`` resizes the shorter side to N (torchvision's ``Resize(N)``); ``--resize-size HxW``
  resizes to that box, height first as torchvision's ``Resize((h, w))`` takes it, ``exact`` (ViT's
  processor, timm's ``squash``) unless ``--resize-mode`` says ``cover`` or ``contain``.
* ``--resize-mode`` alone re-reads the model's own size in that mode: a shorter side S is the box SxS
  (what timm's ``squash``/``border`` make of a square input), a square box HxH is the shorter side H.
* ``--crop-pct F`` sets the resize from the crop, ``floor(crop / F)`` per side, as timm's eval
  transform and transformers' ConvNeXt processor do; it replaces ``--resize-size``, never joins it.
* ``--crop-size N`` (a square), ``HxW`` or ``none`` (the exact resize is the model's input).
* the others (``--crop-rounding``, ``--pad-fill``, ``--interpolation``, ``--antialias``,
  ``--rescale-factor``, ``--normalize``, ``--channel-order``, ``--mean``, ``--std``) set their field.

A value or a combination that cannot mean one preprocessing is a ``SettingsError`` naming the flag and
the fix; nothing is approximated.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

from compile.settings_errors import SettingsError
from preprocessing.spec import (
    CHANNEL_ORDERS,
    CROP_ROUNDINGS,
    DEFAULT_RESCALE_FACTOR,
    MAX_SIDE,
    RESIZE_MODES,
    SUPPORTED_INTERPOLATIONS,
    PreprocessSpec,
)

# The preprocessing fields of ModelRequest, in --help's order (the order the steps run in).
PREPROCESS_FIELDS = (
    "resize_size",
    "resize_mode",
    "crop_size",
    "crop_pct",
    "crop_rounding",
    "pad_fill",
    "interpolation",
    "antialias",
    "rescale_factor",
    "normalize",
    "channel_order",
    "mean",
    "std",
)
# Fields whose text is a number or a size: a config file may give them as a TOML number.
NUMBER_FIELDS = ("resize_size", "crop_size", "crop_pct", "rescale_factor")
# Fields of three numbers (R,G,B): a config file may give them as a TOML array.
TRIPLET_FIELDS = ("pad_fill", "mean", "std")
# Fields that are switched on or off: a config file may give them as a TOML boolean.
SWITCH_FIELDS = ("antialias", "normalize")
SWITCHES = {"on": True, "off": False}
NO_CROP = "none"
SIZE_PATTERN = re.compile(r"^\s*(\d{1,6})\s*(?:[xX]\s*(\d{1,6})\s*)?$", re.ASCII)
# The fields a flag sets as they are (the geometry is worked out from several: resize_of).
VALUE_FIELDS = (
    "crop_rounding",
    "pad_fill",
    "interpolation",
    "antialias",
    "rescale_factor",
    "normalize",
    "channel_order",
    "mean",
    "std",
)
# What a model file is given when its values are not normalized: the mean and std then do nothing.
IDENTITY_MEAN, IDENTITY_STD = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)


def flag_of(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def given(value: object) -> bool:
    """A flag's field holds a value: not the empty text (or 0, None) that stands for "not given"."""
    return value not in ("", 0, None)


@dataclass(frozen=True)
class PreprocessFlags:
    """The preprocessing flags that were given, parsed; None: not given (the model's own)."""

    resize: int | tuple[int, int] | None = None  # a shorter side N, or a (height, width) box
    resize_mode: str | None = None
    crop: tuple[int, int] | None = None  # (height, width); (0, 0): none
    crop_pct: float | None = None
    crop_rounding: str | None = None
    pad_fill: tuple[int, int, int] | None = None
    interpolation: str | None = None
    antialias: bool | None = None
    rescale_factor: float | None = None
    normalize: bool | None = None
    channel_order: str | None = None
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None
    # The flags as given (field name -> text), for the messages that name them.
    texts: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def any(self) -> bool:
        return bool(self.texts)

    def shown(self, *names: str) -> str:
        """``--resize-size 240x200 --crop-size none``: the named flags (all given ones by default) as typed."""
        return " ".join(f"{flag_of(n)} {self.texts[n]}" for n in names or self.texts if n in self.texts)

    def missing(self, interpolation: bool = False) -> list[str]:
        """The flags that a spec made from the flags alone lacks (a model file's); ``interpolation``:
        count it too (a folder whose own preprocessing cannot be read: nothing says it is bilinear)."""
        missing = []
        if self.resize is None and self.crop_pct is None:
            missing.append("--resize-size")
        if self.crop is None:
            missing.append("--crop-size")
        if self.normalize is not False:  # with --normalize off no mean or std is used
            missing += [flag_of(n) for n in ("mean", "std") if getattr(self, n) is None]
        if interpolation and self.interpolation is None:
            missing.append("--interpolation")
        return missing


def parse_preprocess_flags(request: object) -> PreprocessFlags:
    """The preprocessing fields of ``request`` (a ModelRequest or the settings that extend it), parsed;
    ``SettingsError`` names the first flag whose value, or whose combination with another, is refused."""
    texts = {name: str(getattr(request, name)).strip() for name in PREPROCESS_FIELDS if given(getattr(request, name))}
    values: dict[str, object] = {}
    if "resize_size" in texts:
        values["resize"] = parse_size("--resize-size", texts["resize_size"])
    if "crop_size" in texts:
        crop = texts["crop_size"]
        side = (0, 0) if crop.lower() == NO_CROP else parse_size("--crop-size", crop, allow_none=True)
        values["crop"] = (side, side) if isinstance(side, int) else side
    for name, allowed in (
        ("resize_mode", RESIZE_MODES),
        ("crop_rounding", CROP_ROUNDINGS),
        ("interpolation", SUPPORTED_INTERPOLATIONS),
    ):
        if name in texts:
            values[name] = parse_choice(flag_of(name), texts[name], allowed)
    if "channel_order" in texts:
        values["channel_order"] = parse_choice("--channel-order", texts["channel_order"].upper(), CHANNEL_ORDERS)
    for name in SWITCH_FIELDS:
        if name in texts:
            values[name] = SWITCHES[parse_choice(flag_of(name), texts[name].lower(), tuple(SWITCHES))]
    if "crop_pct" in texts:
        values["crop_pct"] = parse_crop_pct(texts["crop_pct"])
    if "rescale_factor" in texts:
        values["rescale_factor"] = parse_rescale_factor(texts["rescale_factor"])
    if "pad_fill" in texts:
        values["pad_fill"] = parse_pad_fill(texts["pad_fill"])
    for name in ("mean", "std"):
        if name in texts:
            values[name] = parse_triplet(flag_of(name), texts[name], positive=name == "std")
    flags = PreprocessFlags(**values, texts=texts)  # type: ignore[arg-type]
    check_combinations(flags)
    return flags


def check_combinations(flags: PreprocessFlags) -> None:
    """The combinations refused whatever the model: those that name one part twice, or two that cannot meet."""
    if flags.crop_pct is not None and flags.resize is not None:
        raise SettingsError(
            "--crop-pct, --resize-size",
            flags.shown("crop_pct", "resize_size"),
            f"{flags.shown('crop_pct', 'resize_size')}: --crop-pct sets the resize from the crop (floor(crop / "
            "crop_pct) per side), so the two name the resize twice.",
            "Give one: --resize-size N (or HxW), or --crop-pct F.",
        )
    if flags.crop_pct is not None and flags.crop == (0, 0):
        raise SettingsError(
            "--crop-pct, --crop-size",
            flags.shown("crop_pct", "crop_size"),
            f"{flags.shown('crop_pct', 'crop_size')}: --crop-pct sets the resize from the crop, and there is none.",
            "Give a crop (--crop-size N or HxW), or --resize-size HxW without --crop-pct.",
        )
    if isinstance(flags.resize, tuple) and flags.resize_mode == "shorter":
        raise SettingsError(
            "--resize-size, --resize-mode",
            flags.shown("resize_size", "resize_mode"),
            f"{flags.shown('resize_size', 'resize_mode')}: the shorter-side resize takes one size, not a box.",
            "Give --resize-size N, or --resize-mode exact, cover or contain for the box.",
        )


def preprocess_spec(flags: PreprocessFlags, base: PreprocessSpec | None) -> PreprocessSpec:
    """``base`` (the model's own) with each given flag's part replaced; without a base (a model file),
    the spec the flags make (``flags.missing()`` must be empty) with PreprocessSpec's defaults beside."""
    mode, resize = resize_of(flags, base)
    crop = flags.crop if flags.crop is not None else (base.crop_height, base.crop_width)  # type: ignore[union-attr]
    if crop == (0, 0) and mode != "exact":
        check_uncropped(flags, mode)
    values: dict[str, object] = {
        "resize_mode": mode,
        "resize_size": resize if isinstance(resize, int) else 0,
        "resize_height": resize[0] if isinstance(resize, tuple) else 0,
        "resize_width": resize[1] if isinstance(resize, tuple) else 0,
        "crop_size": crop[0] if crop[0] == crop[1] else 0,
        "crop_height": crop[0],
        "crop_width": crop[1],
    }
    for name in VALUE_FIELDS:
        if getattr(flags, name) is not None:
            values[name] = getattr(flags, name)
    if base is not None:
        check_channel_order(flags, base)
    try:
        if base is None:
            values.setdefault("mean", IDENTITY_MEAN)
            values.setdefault("std", IDENTITY_STD)
            spec = PreprocessSpec(**values)  # type: ignore[arg-type]
        else:
            spec = dataclasses.replace(base, **values)
    except ValueError as exc:  # PreprocessSpec's own check (preprocessing/ knows no flags)
        names = [n for n in PREPROCESS_FIELDS if n in flags.texts]
        raise SettingsError(
            ", ".join(flag_of(n) for n in names),
            flags.shown(),
            f"The preprocessing flags do not fit together ({flags.shown()}): {exc}",
            "Give the resize and crop the model was trained with (docs/configuration.md#preprocessing-flags).",
        ) from None
    extra = [n for n in ("mean", "std") if n in flags.texts]
    if extra and not spec.normalize:
        why = "--normalize off" if flags.normalize is False else "the model's own preprocessing (no normalize)"
        raise SettingsError(
            ", ".join(flag_of(n) for n in extra),
            flags.shown(*extra),
            f"{flags.shown(*extra)} with {why}: nothing is normalized, so they would do nothing.",
            "Drop them, or add --normalize on to normalize with them.",
        )
    return spec


def check_channel_order(flags: PreprocessFlags, base: PreprocessSpec) -> None:
    """The mean and std are per channel of the model's input, in its channel order: a new order needs
    them restated in it, unless they are the same for every channel (or nothing is normalized)."""
    if flags.channel_order in (None, base.channel_order) or flags.normalize is False or not base.normalize:
        return
    stale = [n for n in ("mean", "std") if getattr(flags, n) is None and len(set(getattr(base, n))) > 1]
    if stale:
        own = " ".join(f"--{n} {','.join(f'{v:g}' for v in getattr(base, n))}" for n in stale)
        raise SettingsError(
            "--channel-order",
            flags.texts["channel_order"],
            f"--channel-order {flags.channel_order}: the mean and std are per channel of the model's input, in its "
            f"channel order, and the model's own ({own}) are in {base.channel_order} order.",
            f"Give {' and '.join(flag_of(n) for n in stale)} in {','.join(flags.channel_order)} order too.",
        )


def resize_of(flags: PreprocessFlags, base: PreprocessSpec | None) -> tuple[str, int | tuple[int, int]]:
    """The resize the flags and ``base`` make: (mode, the shorter side) or (mode, (height, width))."""
    if flags.crop_pct is not None:
        return resize_from_crop_pct(flags, base)
    if isinstance(flags.resize, tuple):
        return flags.resize_mode or "exact", flags.resize
    if flags.resize is not None:
        mode = flags.resize_mode or "shorter"
        return mode, flags.resize if mode == "shorter" else (flags.resize, flags.resize)
    assert base is not None, "a spec from the flags alone needs --resize-size or --crop-pct (flags.missing())"
    own = base.resize_size if base.resize_mode == "shorter" else (base.resize_height, base.resize_width)
    mode = flags.resize_mode or base.resize_mode
    if mode == "shorter" and isinstance(own, tuple):
        if own[0] != own[1]:
            raise SettingsError(
                "--resize-mode",
                flags.texts["resize_mode"],
                f"--resize-mode shorter takes one size, but the model resizes to the box {own[0]}x{own[1]}.",
                "Add --resize-size N (the shorter side).",
            )
        return mode, own[0]
    if mode != "shorter" and isinstance(own, int):
        return mode, (own, own)  # timm's squash and border of a square input: the side as a square box
    return mode, own


def resize_from_crop_pct(flags: PreprocessFlags, base: PreprocessSpec | None) -> tuple[str, int | tuple[int, int]]:
    """--crop-pct F: the resize is ``floor(crop / F)`` per side, in --resize-mode, else the model's mode; a
    shorter-side resize with a non-square crop becomes ``cover``, as timm's ``center`` crop mode does."""
    pct = flags.crop_pct
    assert pct is not None
    crop = flags.crop if flags.crop is not None else (base.crop_height, base.crop_width) if base else None
    if not crop or crop == (0, 0):
        raise SettingsError(
            "--crop-pct",
            flags.texts["crop_pct"],
            f"--crop-pct {flags.texts['crop_pct']} sets the resize from the crop, and "
            + ("no --crop-size is given." if crop is None else "the model's own preprocessing crops nothing."),
            "Add --crop-size N (or HxW).",
        )
    sides = (math.floor(crop[0] / pct), math.floor(crop[1] / pct))
    mode = flags.resize_mode or (base.resize_mode if base else "shorter")
    if mode == "shorter" and sides[0] == sides[1] and crop[0] == crop[1]:
        return mode, sides[0]
    if mode == "shorter" and flags.resize_mode:
        raise SettingsError(
            "--resize-mode, --crop-pct",
            flags.shown("resize_mode", "crop_pct"),
            f"--resize-mode shorter takes one size, but --crop-pct {flags.texts['crop_pct']} of the crop "
            f"{crop[0]}x{crop[1]} makes two ({sides[0]}x{sides[1]}).",
            "Use --resize-mode cover (timm's center crop of a non-square input), or a square crop.",
        )
    return ("cover" if mode == "shorter" else mode), sides


def check_uncropped(flags: PreprocessFlags, mode: str) -> None:
    """No crop with a resize that keeps the aspect ratio: the model's input size would vary by photo."""
    if flags.crop == (0, 0):
        raise SettingsError(
            "--crop-size",
            flags.texts["crop_size"],
            f"--crop-size none needs an exact resize (the resize is then the model's input), but the resize is "
            f"{mode!r}, which keeps each photo's aspect ratio.",
            "Give --resize-size HxW (exact unless --resize-mode says otherwise), or a crop size.",
        )
    names = [n for n in ("resize_size", "resize_mode", "crop_pct") if n in flags.texts]
    raise SettingsError(
        ", ".join(flag_of(n) for n in names),
        flags.shown(*names),
        f"{flags.shown(*names)} makes a {mode!r} resize, which keeps each photo's aspect ratio, and the model's "
        "own preprocessing crops nothing (its exact resize is its input): the input size would vary.",
        "Add --crop-size N (or HxW), or give --resize-size HxW for an exact resize.",
    )


def parse_size(flag_name: str, text: str, allow_none: bool = False) -> int | tuple[int, int]:
    """``"256"`` -> 256, ``"240x200"`` -> (240, 200) (height x width); each side 1..MAX_SIDE."""
    match = SIZE_PATTERN.match(text)
    sides = tuple(int(s) for s in match.groups() if s is not None) if match else ()
    if not sides or not all(1 <= s <= MAX_SIDE for s in sides):
        forms = "N (a square), HxW, or none (with an exact resize)" if allow_none else "N (the shorter side) or HxW"
        raise SettingsError.must(
            flag_name,
            text,
            f"be a size in pixels: {forms}, each side 1..{MAX_SIDE}",
            f"e.g. {flag_name} {224 if allow_none else 256}, or {flag_name} 240x320 (height x width).",
        )
    return sides[0] if len(sides) == 1 else sides  # type: ignore[return-value]


def parse_choice(flag_name: str, text: str, allowed: tuple[str, ...]) -> str:
    if text not in allowed:
        raise SettingsError.must(
            flag_name,
            text,
            f"be one of {', '.join(allowed)}",
            "Use the one the model was trained with, or leave it out for the model's own.",
        )
    return text


def parse_crop_pct(text: str) -> float:
    """``--crop-pct``: the share of the resize the crop keeps, in (0, 1] (timm's ``crop_pct``)."""
    value = _number(text)
    if value is None or not 0 < value <= 1:
        raise SettingsError.must(
            "--crop-pct",
            text,
            "be a number in (0, 1]: the share of the resized image the crop keeps",
            "e.g. --crop-pct 0.875 (224 of 256, timm's default), or leave it out.",
        )
    return value


def parse_rescale_factor(text: str) -> float:
    """``--rescale-factor``: what a 0..255 pixel is multiplied by, a number or ``1/N`` (e.g. 1/127.5)."""
    numerator, _, denominator = text.partition("/")
    top, bottom = _number(numerator), _number(denominator) if denominator else 1.0
    value = top / bottom if top is not None and bottom else None
    if value is None or not 0 < value < math.inf:
        raise SettingsError.must(
            "--rescale-factor",
            text,
            "be a number > 0, or 1/N",
            "e.g. --rescale-factor 1/255 (0..1 values, the default), or 1/127.5 with --mean 1,1,1 --std 1,1,1 "
            "for -1..1.",
        )
    return value


def parse_pad_fill(text: str) -> tuple[int, int, int]:
    """``--pad-fill``: the R,G,B (0..255) of what a crop past the image's edge holds; one number: all three."""
    parts = [p.strip() for p in text.split(",")]
    values = tuple(int(p) for p in parts if re.fullmatch(r"\d{1,3}", p, re.ASCII) and int(p) <= 255)
    if len(values) != len(parts) or len(values) not in (1, 3):
        raise SettingsError.must(
            "--pad-fill",
            text,
            "be R,G,B of whole numbers 0..255 (or one number for all three)",
            "e.g. --pad-fill 124,116,104 (ImageNet's mean, as timm's border mode), or leave it out for black.",
        )
    return values * 3 if len(values) == 1 else values  # type: ignore[return-value]


def parse_triplet(flag_name: str, text: str, positive: bool = False) -> tuple[float, float, float]:
    """``"0.485,0.456,0.406"`` -> a float per channel; ``positive``: each > 0 (a std divides)."""
    values = tuple(_number(part) for part in text.split(","))
    if len(values) == 3 and positive and all(v is not None for v in values) and min(values) <= 0:  # type: ignore[type-var]
        raise SettingsError.must(
            flag_name, text, "be three numbers > 0 (each channel is divided by its std)", "e.g. 0.229,0.224,0.225."
        )
    if len(values) != 3 or any(v is None for v in values):
        raise SettingsError(
            flag_name,
            text,
            f"{flag_name} takes three numbers R,G,B (on 0..1 pixel values), e.g. 0.485,0.456,0.406; got {text!r}.",
            "Give the values the model was trained with, or leave the flag out for the model's own.",
        )
    return values  # type: ignore[return-value]


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def spec_flags(spec: PreprocessSpec) -> str:
    """The preprocessing flags that make ``spec`` from nothing: each part, and each value that is not
    PreprocessSpec's default (docs/configuration.md#preprocessing-flags)."""
    if spec.resize_mode == "shorter":
        parts = [f"--resize-size {spec.resize_size}"]
    else:
        parts = [f"--resize-size {spec.resize_height}x{spec.resize_width}"]
        parts += [f"--resize-mode {spec.resize_mode}"] if spec.resize_mode != "exact" else []
    height, width = spec.crop_height, spec.crop_width
    parts.append(f"--crop-size {'none' if not height else height if height == width else f'{height}x{width}'}")
    if height and spec.crop_rounding != "round":
        parts.append(f"--crop-rounding {spec.crop_rounding}")
    if spec.pad_fill != (0, 0, 0):
        parts.append(f"--pad-fill {','.join(map(str, spec.pad_fill))}")
    parts.append(f"--interpolation {spec.interpolation}")
    parts += ["--antialias off"] if not spec.antialias else []
    if not math.isclose(spec.rescale_factor, DEFAULT_RESCALE_FACTOR, rel_tol=1e-12):
        parts.append(f"--rescale-factor {spec.rescale_factor:.10g}")
    if spec.normalize:
        parts += [f"--mean {_triplet_text(spec.mean)}", f"--std {_triplet_text(spec.std)}"]
    else:
        parts.append("--normalize off")
    parts += [f"--channel-order {spec.channel_order}"] if spec.channel_order != "RGB" else []
    return " ".join(parts)


def _triplet_text(values: tuple[float, ...]) -> str:
    return ",".join(f"{v:.8g}" for v in values)
