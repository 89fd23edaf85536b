"""The preprocessing a model expects: what every backend must reproduce.

One description covers the eval transforms of torchvision, transformers' image processors and timm:

* **resize** (``resize_mode``):
  ``shorter``: the shorter side to ``resize_size``, the other by torchvision's rounding (``int``);
  ``exact``: to ``resize_height x resize_width``, aspect ratio not kept (ViT's processor, timm's ``squash``);
  ``cover``: keep the aspect ratio, smallest size that covers ``resize_height x resize_width`` (timm's
  ``ResizeKeepRatio``, its ``center`` mode for non-square inputs; sides rounded with ``round``);
  ``contain``: keep the aspect ratio, largest size that fits inside it (timm's ``border`` mode).
* **crop**: a centred ``crop_height x crop_width`` window of the resized image (none: both 0, only with
  ``exact``). Where the window reaches past the image (``contain``, or a crop larger than the resize)
  the rest is ``pad_fill``, split as torchvision, timm and transformers pad: ``(crop - size) // 2``
  before. The offset of a window inside the image is ``round((size - crop) / 2)`` (torchvision, timm)
  or ``int(...)`` (transformers): ``crop_rounding``.
* **resample**: ``interpolation`` (bilinear, bicubic, nearest), ``antialias`` (Pillow, torchvision's
  tensors and transformers always antialias when shrinking; off: plain interpolation as
  ``F.interpolate`` and OpenCV do).
* **values**: ``pixel * rescale_factor``, then ``(value - mean) / std`` per channel when ``normalize``;
  channels in ``channel_order`` (RGB, or BGR as MobileViT's processor flips them), ``mean`` and ``std``
  given in that order, i.e. per channel of the model's input.

Images are EXIF-rotated upright first, as everywhere in vision-serve. The dataclass is plain data so
that an artifact manifest can carry it and every backend (Pillow, torchvision, DALI, CV-CUDA) can
rebuild it; ``preprocessing/geometry.py`` turns it into one image's pixel plan.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

SUPPORTED_INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
RESIZE_MODES = ("shorter", "exact", "cover", "contain")
# Modes whose target is a height x width box (resize_height, resize_width) rather than one side.
BOX_RESIZE_MODES = ("exact", "cover", "contain")
CROP_ROUNDINGS = ("round", "floor")
CHANNEL_ORDERS = ("RGB", "BGR")
DEFAULT_RESCALE_FACTOR = 1 / 255
# A side larger than this is a typo or a crafted file, not a classifier's input (4096 x 4096 x 3 bytes is
# 48 MiB an image): every route to a spec (flags, a folder, a timm config, a manifest) meets this bound.
MAX_SIDE = 4096
SIZE_FIELDS = ("resize_size", "crop_size", "resize_height", "resize_width", "crop_height", "crop_width")


@dataclass(frozen=True)
class PreprocessSpec:
    """How encoded images become the model's input tensor; see the module docstring for each field.

    ``PreprocessSpec(256, 224, mean, std)`` is torchvision's ``ClassificationPresetEval``: shorter side
    to 256, center crop 224. ``crop_size`` is a square crop's side; a non-square crop is
    ``crop_height``/``crop_width`` (``crop_size`` is then 0). Either way ``input_size`` is what the
    model receives.
    """

    resize_size: int
    crop_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    interpolation: str = "bilinear"
    resize_mode: str = "shorter"
    resize_height: int = 0
    resize_width: int = 0
    crop_height: int = 0
    crop_width: int = 0
    crop_rounding: str = "round"
    pad_fill: tuple[int, int, int] = (0, 0, 0)
    antialias: bool = True
    rescale_factor: float = DEFAULT_RESCALE_FACTOR
    normalize: bool = True
    channel_order: str = "RGB"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "mean", tuple(float(m) for m in self.mean))
        set_(self, "std", tuple(float(s) for s in self.std))
        set_(self, "pad_fill", tuple(int(v) for v in self.pad_fill))
        set_(self, "rescale_factor", float(self.rescale_factor))
        for name in SIZE_FIELDS:
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value <= MAX_SIDE:
                raise ValueError(f"PreprocessSpec.{name} must be a whole number from 0 to {MAX_SIDE}, got {value!r}.")
        self._check_choices()
        self._settle_crop()
        self._check_geometry()
        if len(self.mean) != 3 or len(self.std) != 3:
            raise ValueError("PreprocessSpec.mean and .std need one value per channel (3 values each).")
        if any(not s > 0 for s in self.std):
            raise ValueError(f"PreprocessSpec.std values must be > 0, got {self.std}.")
        if len(self.pad_fill) != 3 or any(not 0 <= v <= 255 for v in self.pad_fill):
            raise ValueError(f"PreprocessSpec.pad_fill needs 3 values 0..255 (R,G,B), got {self.pad_fill}.")
        if not 0 < self.rescale_factor < float("inf"):
            raise ValueError(f"PreprocessSpec.rescale_factor must be > 0 and finite, got {self.rescale_factor}.")

    def _check_choices(self) -> None:
        for name, allowed in (
            ("interpolation", SUPPORTED_INTERPOLATIONS),
            ("resize_mode", RESIZE_MODES),
            ("crop_rounding", CROP_ROUNDINGS),
            ("channel_order", CHANNEL_ORDERS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Unsupported {name} {getattr(self, name)!r}; choose one of {allowed}.")
        for name in ("antialias", "normalize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PreprocessSpec.{name} must be true or false, got {getattr(self, name)!r}.")

    def _settle_crop(self) -> None:
        """One canonical form: a square crop has ``crop_size`` and both sides; a non-square one has 0."""
        if self.crop_size:
            for name in ("crop_height", "crop_width"):
                if getattr(self, name) not in (0, self.crop_size):
                    raise ValueError(
                        f"PreprocessSpec: crop_size={self.crop_size} and {name}={getattr(self, name)} disagree; "
                        "give crop_size for a square crop, or crop_height and crop_width."
                    )
            object.__setattr__(self, "crop_height", self.crop_size)
            object.__setattr__(self, "crop_width", self.crop_size)
        elif (self.crop_height == 0) != (self.crop_width == 0):
            raise ValueError(
                f"PreprocessSpec: crop_height={self.crop_height}, crop_width={self.crop_width}: give both or neither."
            )
        elif self.crop_height and self.crop_height == self.crop_width:
            object.__setattr__(self, "crop_size", self.crop_height)

    def _check_geometry(self) -> None:
        if self.resize_mode == "shorter":
            if self.resize_size <= 0 or self.resize_height or self.resize_width:
                raise ValueError(
                    "PreprocessSpec: resize_mode 'shorter' takes resize_size (the shorter side) alone, got "
                    f"resize_size={self.resize_size}, resize_height={self.resize_height}, "
                    f"resize_width={self.resize_width}. Use e.g. resize_size=256, crop_size=224."
                )
        elif self.resize_size or not (self.resize_height and self.resize_width):
            raise ValueError(
                f"PreprocessSpec: resize_mode {self.resize_mode!r} takes resize_height and resize_width (resize_size "
                f"stays 0), got resize_size={self.resize_size}, {self.resize_height}x{self.resize_width}."
            )
        if not self.crop_height and self.resize_mode != "exact":
            raise ValueError(
                f"PreprocessSpec: resize_mode {self.resize_mode!r} keeps the aspect ratio, so the resized size varies: "
                "it needs a crop (crop_size, or crop_height and crop_width). Use e.g. resize_size=256, crop_size=224."
            )

    @property
    def input_size(self) -> tuple[int, int]:
        """``(height, width)`` of the model's input: the crop, or the exact resize where nothing is cropped."""
        if self.crop_height:
            return self.crop_height, self.crop_width
        return self.resize_height, self.resize_width

    @property
    def resize_target(self) -> int:
        """The larger side the resize aims at: the JPEG draft headroom and the long-strip bound use it."""
        return self.resize_size or max(self.resize_height, self.resize_width)

    def describe(self) -> str:
        """One line for logs and ``--help``-style output, e.g. ``shorter 256, crop 224x224, bilinear``."""
        if self.resize_mode == "shorter":
            resize = f"shorter {self.resize_size}"
        else:
            resize = f"{self.resize_mode} {self.resize_height}x{self.resize_width}"
        crop = f"crop {self.crop_height}x{self.crop_width}" if self.crop_height else "no crop"
        resample = self.interpolation if self.antialias else f"{self.interpolation}, no antialias"
        extras = []
        if not self.normalize:
            extras.append("no normalize")
        if self.channel_order != "RGB":
            extras.append(self.channel_order)
        return ", ".join([resize, crop, resample, *extras])

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name in ("mean", "std", "pad_fill"):
            data[name] = list(data[name])
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PreprocessSpec:
        """From ``to_dict``'s output, or a manifest written before the fields after ``interpolation``
        existed (those take their defaults: shorter-side resize, square crop). Unknown keys are refused."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown preprocessing field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)
