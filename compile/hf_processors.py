"""transformers' image processors as a ``PreprocessSpec``: the processor ``AutoImageProcessor`` builds by
default (transformers 5's torchvision backend, ``XImageProcessor``) reproduced step for step, or a refusal.

The saved config (``preprocessor_config.json``) is not read key by key: transformers fills absent keys
with the class's defaults, and a ``null`` it saved overrides them (``ImageProcessingMixin.__init__``
sets every key as an attribute first). So the processor class, one of transformers' own and only
after its name is checked against the classes mapped here, is instantiated from the saved dict
(``from_dict``: in memory, no file, no network, no code from the folder) and its effective attributes
are read: what ``preprocess()`` passes to ``_preprocess``.

Each mapped class is the torchvision backend's pipeline with, at most, the overrides reviewed below
(``MAPPED``); a class that overrides any other step of it (a later transformers) is refused rather
than guessed. The steps, as ``TorchvisionBackend`` runs them:

* resize (``tvF.resize`` of a uint8 tensor, antialiased): ``size`` ``shortest_edge`` -> the shorter side
  (the other ``int(...)``, as torchvision), ``height``/``width`` -> exactly that (aspect not kept);
* center crop ``crop_size`` with offsets ``int((size - crop) / 2)`` (``crop_rounding="floor"``), padded
  with 0 where the crop is larger;
* ``pixel * rescale_factor``, then ``(value - mean) / std`` (fused, the same numbers).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from compile.config_values import FLAGS_HINT, channel_triplet, crop_fraction
from compile.preprocess_flags import spec_flags
from compile.settings_errors import SettingsError
from preprocessing.spec import MAX_SIDE, PreprocessSpec

logger = logging.getLogger(__name__)

# PIL's resample codes (transformers' PILImageResampling): the ones PreprocessSpec reproduces, and the
# nearest of those for the others (transformers itself falls back from lanczos to bicubic).
RESAMPLE_NAMES = {0: "nearest", 2: "bilinear", 3: "bicubic"}
UNSERVED_RESAMPLE = {1: ("lanczos", "bicubic"), 4: ("box", "bilinear"), 5: ("hamming", "bilinear")}

# The TorchvisionBackend steps whose code decides the pixels; a mapped class may override only those
# listed for it in MAPPED (checked on the installed transformers, so a changed class is refused).
PIXEL_STEPS = (
    "process_image",
    "convert_to_rgb",
    "_preprocess_image_like_inputs",
    "_preprocess",
    "resize",
    "center_crop",
    "pad",
    "rescale",
    "normalize",
    "rescale_and_normalize",
    "_fuse_mean_std_and_rescale_factor",
)
_LABEL_MAPS = ("_preprocess", "_preprocess_image_like_inputs")  # segmentation maps beside the images

# Class -> the PIXEL_STEPS it overrides in transformers 5.24, each reviewed: the overrides of the
# segmentation processors (BEiT, MobileNetV2, Segformer, MobileViT) add label maps and run the images
# through the same steps (Segformer never crops; MobileViT never normalizes and flips to BGR).
MAPPED: dict[str, tuple[str, ...]] = {
    "ViTImageProcessor": (),  # also Swin, Swinv2, DINAT, SwiftFormer, I-JEPA, ViT-MSN
    "DeiTImageProcessor": (),
    "BeitImageProcessor": _LABEL_MAPS,  # also Data2Vec-vision
    "BitImageProcessor": (),  # also DINOv2, FocalNet, Hiera
    "CLIPImageProcessor": (),  # also MetaCLIP 2
    "MobileNetV1ImageProcessor": (),
    "MobileNetV2ImageProcessor": _LABEL_MAPS,
    "PvtImageProcessor": (),  # also PVTv2
    "SiglipImageProcessor": (),
    "SegformerImageProcessor": _LABEL_MAPS,
    "LevitImageProcessor": ("resize",),
    "PoolFormerImageProcessor": ("_preprocess", "resize"),
    "ConvNextImageProcessor": ("_preprocess", "resize"),  # also ConvNeXtV2, CvT, ResNet, RegNet
    "EfficientNetImageProcessor": ("_preprocess", "rescale", "_fuse_mean_std_and_rescale_factor"),
    "MobileViTImageProcessor": _LABEL_MAPS,  # also MobileViTV2
}

# transformers' classifiers' processors that vision-serve cannot reproduce, and why; the fix where no
# flags come near (else the nearest flags).
NO_NEAREST = {
    "ImageGPTImageProcessor": "No preprocessing flag makes ImageGPT's color-cluster ids: serve a model that takes "
    "normalized pixels.",
    "TimmWrapperImageProcessor": "Save the timm model with timm's save_for_hf: a timm folder is served from its "
    "pretrained_cfg.",
}
REFUSED = {
    "ImageGPTImageProcessor": "turns pixels into color-cluster ids, not a normalized image",
    "PerceiverImageProcessor": "center-crops the photo (a share of its shorter side) before resizing it",
    "Siglip2ImageProcessor": "resizes each photo to its own number of patches (NaFlex), a size that varies",
    "DonutImageProcessor": "makes a thumbnail, may rotate the photo to its long axis and pads it to size",
    "TextNetImageProcessor": "rounds the resized sides up to a multiple of size_divisor",
    "PPLCNetImageProcessor": "rounds the resized sides with round() to a multiple of size_divisor",
    "Gemma3ImageProcessor": "is a multimodal processor (pan and scan crops)",
    "TimmWrapperImageProcessor": "runs the timm transform of a TimmWrapper model",
}

_Fail = Callable[[str, str], SettingsError]


def processor_class_name(config: dict, model_type: object) -> str:
    """The torchvision-backend class ``AutoImageProcessor`` builds for ``config``: its
    ``image_processor_type`` (a legacy ``...Fast`` or a ``...Pil`` name: the same class), else its
    ``feature_extractor_type`` renamed, else the one transformers maps ``model_type`` to ('' if none)."""
    name = config.get("image_processor_type")
    if not isinstance(name, str) and isinstance(config.get("feature_extractor_type"), str):
        name = config["feature_extractor_type"].replace("FeatureExtractor", "ImageProcessor")
    if not isinstance(name, str):
        from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

        mapping = IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type) if isinstance(model_type, str) else None
        name = (mapping or {}).get("torchvision") or (mapping or {}).get("pil") or ""
    for suffix in ("Fast", "Pil"):
        name = name.removesuffix(suffix)
    return name


def processor_spec(config: dict, model_type: object, where: str, model: str) -> PreprocessSpec:
    """``config`` (a saved processor dict, read from ``where``) as the ``PreprocessSpec`` that reproduces
    its processor, or a one-line ``SettingsError`` naming the field and the nearest setting to pass."""

    def fail(message: str, fix: str = FLAGS_HINT) -> SettingsError:
        return SettingsError("--model", model, f"{where}: {message}", fix)

    if "auto_map" in config:
        raise fail(
            "its auto_map names an image processor shipped as code in the folder, and vision-serve runs no code "
            "from a model folder.",
        )
    name = processor_class_name(config, model_type)
    if name in REFUSED:
        fix = NO_NEAREST.get(name) or nearest_fix(_instantiate_or_none(name, config))
        raise fail(f"{name} {REFUSED[name]}, which vision-serve does not reproduce.", fix)
    if name not in MAPPED:
        known = ", ".join(sorted(MAPPED))
        raise fail(f"its image processor {name or '(none named)'!r} is not one vision-serve maps ({known}).")
    processor = _instantiate(name, config, fail)
    spec = _Reader(name, processor, where, model, fail).spec()
    logger.info("%s: %s served as %s", where, name, spec.describe())
    return spec


def _processor_class(name: str, fail: _Fail) -> type:
    import transformers
    from transformers.image_processing_backends import TorchvisionBackend

    cls = getattr(transformers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, TorchvisionBackend)) or getattr(cls, "is_dummy", False):
        raise fail(
            f"transformers {transformers.__version__} has no torchvision-backend {name}.", "pip install torchvision."
        )
    changed = overridden_steps(cls)
    if changed != sorted(MAPPED[name]):
        raise fail(
            f"{name} of transformers {transformers.__version__} overrides {changed}, not the {sorted(MAPPED[name])} "
            "vision-serve maps (transformers 5.24's), so its pixels are not known.",
        )
    return cls


def overridden_steps(cls: type) -> list[str]:
    """The ``PIXEL_STEPS`` of ``TorchvisionBackend`` that ``cls`` replaces with its own code."""
    from transformers.image_processing_backends import TorchvisionBackend

    return sorted(step for step in PIXEL_STEPS if getattr(cls, step) is not getattr(TorchvisionBackend, step))


def _instantiate(name: str, config: dict, fail: _Fail) -> Any:
    cls = _processor_class(name, fail)
    try:
        return cls.from_dict(dict(config))
    except Exception as exc:  # transformers' own validation of a value no processor writes
        raise fail(f"its preprocessing config cannot be read ({str(exc).splitlines()[0][:200]}).") from None


def _instantiate_or_none(name: str, config: dict) -> Any:
    """The processor, for the hint of a refusal only: None where it cannot be built."""
    try:
        import transformers

        return getattr(transformers, name).from_dict(dict(config))
    except Exception:  # any failure just leaves the generic hint
        return None


def nearest_fix(processor: Any) -> str:
    """The flags of the preprocessing nearest to ``processor``'s, as a refusal's fix: every part, since a
    folder's processor is set aside only when the flags make a whole spec (the generic hint where the
    processor's own values are unusable)."""
    try:
        spec = _nearest_spec(processor)
    except Exception:  # values no spec can hold: the generic hint
        return FLAGS_HINT
    return f"Pass {spec_flags(spec)} to serve it with the nearest setting vision-serve has."


def _nearest_spec(p: Any) -> PreprocessSpec:
    """The processor's sizes, crop, resample and values as far as one plain spec holds them."""
    size, crop = _sides(p.size), _sides(p.crop_size) if p.do_center_crop else {}
    crop_hw = (crop["height"], crop["width"]) if "height" in crop and "width" in crop else None
    if type(p).__name__ == "PerceiverImageProcessor" and crop_hw and size.get("height") == size.get("width"):
        # It crops size/crop_size of the shorter side, then resizes that to size: crop_pct's way round.
        geometry, crop_hw = {"resize_size": crop_hw[0], "crop_size": 0}, (size["height"],) * 2
    elif size.get("shortest_edge"):
        geometry = {"resize_size": size["shortest_edge"], "crop_size": 0}
        crop_hw = crop_hw or (size["shortest_edge"],) * 2
    elif size.get("height") and size.get("width"):
        geometry = {"resize_mode": "exact", "resize_size": 0, "crop_size": 0}
        geometry.update(resize_height=size["height"], resize_width=size["width"])
    else:
        geometry, crop_hw = {"resize_size": 224, "crop_size": 0}, crop_hw or (224, 224)
    if crop_hw:
        geometry.update(crop_height=crop_hw[0], crop_width=crop_hw[1])
    code = p.resample if isinstance(p.resample, int) else 2
    interpolation = RESAMPLE_NAMES.get(code) or UNSERVED_RESAMPLE.get(code, ("", "bilinear"))[1]
    normalize = bool(p.do_normalize) and type(p).__name__ != "MobileViTImageProcessor"
    return PreprocessSpec(
        mean=p.image_mean if normalize else (0.0,) * 3,
        std=p.image_std if normalize else (1.0,) * 3,
        interpolation=interpolation,
        crop_rounding="floor",
        antialias=interpolation != "nearest",
        rescale_factor=p.rescale_factor if p.do_rescale else 1.0,
        normalize=normalize,
        channel_order="BGR" if getattr(p, "do_flip_channel_order", False) else "RGB",
        **geometry,
    )


def _sides(size: object) -> dict:
    """A SizeDict (or dict) as a dict of its set sides."""
    if size is None:
        return {}
    return {k: v for k, v in (dict(size) if not isinstance(size, dict) else size).items() if v is not None}


class _Reader:
    """The effective attributes of one instantiated processor, turned into a PreprocessSpec."""

    def __init__(self, name: str, processor: Any, where: str, model: str, fail: _Fail) -> None:
        self.name, self.p, self.where, self.model = name, processor, where, model
        self._fail = fail

    def fail(self, message: str) -> SettingsError:
        return self._fail(message, nearest_fix(self.p))

    def spec(self) -> PreprocessSpec:
        geometry = {"resize_size": 0, "crop_size": 0, **self.geometry()}
        rescale, mean, std, normalize, channel_order = self.values()
        interpolation = self.interpolation()
        return PreprocessSpec(
            mean=mean,
            std=std,
            interpolation=interpolation,
            crop_rounding="floor",  # TorchvisionBackend.center_crop: int((size - crop) / 2)
            # tvF.resize(..., antialias=True) of a uint8 tensor: antialiased as Pillow, but nearest has no
            # antialiasing there: F.interpolate's nearest-exact, whose float32 ties Pillow's nearest breaks
            # otherwise (a whole column apart where (x + 0.5) * scale is a whole number).
            antialias=interpolation != "nearest",
            rescale_factor=rescale,
            normalize=normalize,
            channel_order=channel_order,
            **geometry,
        )

    # ---- geometry --------------------------------------------------------------------------------

    def geometry(self) -> dict[str, Any]:
        """resize_mode, sizes and crop of the spec (PreprocessSpec's geometry keywords), each side at most
        MAX_SIDE: a folder is untrusted, and a side of 10**6 would be a resize of terabytes."""
        geometry = self.resize_and_crop()
        sides = {k: v for k, v in geometry.items() if k.startswith(("resize_", "crop_")) and isinstance(v, int)}
        if max(sides.values()) > MAX_SIDE:
            raise self.fail(f"its sizes come to {sides}: a side over {MAX_SIDE} is not a classifier's input.")
        return geometry

    def resize_and_crop(self) -> dict[str, Any]:
        p, name = self.p, self.name
        if not p.do_resize:
            raise self.fail(f"do_resize is {p.do_resize!r}: the model input's size would be each photo's own.")
        # These classes' own resize reads shortest_edge first and ignores a longest_edge beside it.
        shortest_first = name in ("ConvNextImageProcessor", "LevitImageProcessor") or (
            name == "PoolFormerImageProcessor" and p.crop_pct is not None
        )
        size = self.size_of("size", p.size, shortest_first=shortest_first)
        if name == "ConvNextImageProcessor":
            return self.convnext(size)
        if "shortest_edge" in size:
            edge = size["shortest_edge"]
            if name == "LevitImageProcessor":
                edge = int((256 / 224) * edge)  # LevitImageProcessor.resize
            elif name == "PoolFormerImageProcessor" and p.crop_pct is not None:
                edge = int(edge / self.crop_pct())  # PoolFormerImageProcessor.resize
            resize = {"resize_mode": "shorter", "resize_size": edge}
        else:
            height, width = size["height"], size["width"]
            if name == "PoolFormerImageProcessor" and p.crop_pct is not None:
                crop_pct = self.crop_pct()
                if height == width:  # an int to get_resize_output_image_size: the shorter side
                    resize = {"resize_mode": "shorter", "resize_size": int(height / crop_pct)}
                else:
                    resize = self.exact(int(height / crop_pct), int(width / crop_pct))
            else:
                resize = self.exact(height, width)
        crop = self.crop() if name != "SegformerImageProcessor" else {}  # Segformer's _preprocess never crops
        if not crop and resize["resize_mode"] == "shorter":
            raise self.fail(
                f"size {size} resizes the shorter side and do_center_crop is {p.do_center_crop!r}: the model input's "
                "size would vary with the photo's aspect ratio."
            )
        self.check_pad(crop or {"crop_height": resize.get("resize_height"), "crop_width": resize.get("resize_width")})
        return {**resize, **crop}

    def convnext(self, size: dict) -> dict[str, Any]:
        """ConvNextImageProcessor.resize: below 384, the shorter side to ``int(edge / crop_pct)`` and a
        center crop of ``edge``; from 384, a warp to ``edge x edge``. Its ``_preprocess`` does not pad."""
        p = self.p
        if "shortest_edge" not in size:
            raise self.fail(f"size {size} has no shortest_edge, which ConvNextImageProcessor requires.")
        edge = size["shortest_edge"]
        crop = self.crop()
        if edge >= 384:
            return {**self.exact(edge, edge), **crop}
        if p.crop_pct is None:
            raise self.fail("crop_pct is null, which ConvNextImageProcessor divides by below 384 (it fails).")
        if crop and (crop["crop_height"], crop["crop_width"]) != (edge, edge):
            # A second centred crop of the edge x edge crop: int() of two halves is not int() of one.
            raise self.fail(
                f"do_center_crop with crop_size {self.size_of('crop_size', p.crop_size)} crops a second time, "
                f"after crop_pct's {edge}x{edge} crop."
            )
        return {"resize_mode": "shorter", "resize_size": int(edge / self.crop_pct()), "crop_size": edge}

    def exact(self, height: int, width: int) -> dict[str, Any]:
        return {"resize_mode": "exact", "resize_height": height, "resize_width": width}

    def crop(self) -> dict[str, int]:
        if not self.p.do_center_crop:
            return {}
        crop = self.size_of("crop_size", self.p.crop_size, ("height", "width"))
        return {"crop_height": crop["height"], "crop_width": crop["width"]}

    def check_pad(self, output: dict) -> None:
        """``do_pad`` pads each image at its bottom right to ``pad_size`` (or the batch's largest): a no-op
        where that is the model input's size, which every image of a batch has."""
        p = self.p
        if "_preprocess" in MAPPED[self.name] and self.name != "PoolFormerImageProcessor":
            return  # the other classes' own _preprocess never pads
        if not getattr(p, "do_pad", None) or getattr(p, "pad_size", None) is None:
            return
        pad = self.size_of("pad_size", p.pad_size, ("height", "width"))
        if (pad["height"], pad["width"]) != (output["crop_height"], output["crop_width"]):
            raise self.fail(
                f"do_pad pads the {output['crop_height']}x{output['crop_width']} input at its bottom and right to "
                f"pad_size {pad['height']}x{pad['width']}."
            )

    def size_of(
        self, key: str, value: object, wanted: tuple[str, ...] = (), shortest_first: bool = False
    ) -> dict[str, int]:
        """A size attribute with every side a whole number > 0: ``wanted`` sides, or the one resize
        ``TorchvisionBackend.resize`` picks (``shortest_first``: a ``shortest_edge`` wins outright);
        refused where that resize keeps no fixed size."""
        sides = _sides(value)
        for side, number in sides.items():
            if type(number) is not int or number <= 0:
                raise self._fail(f"its preprocessing config cannot be read ({key} {side} is {number!r}).", FLAGS_HINT)
        if wanted:
            if not all(s in sides for s in wanted):
                raise self.fail(f"{key} is {sides or value!r}; it needs {' and '.join(wanted)}.")
            return sides
        if "shortest_edge" in sides and "longest_edge" in sides and not shortest_first:
            raise self.fail(f"size {sides} caps the longer side (longest_edge), so the resize keeps no fixed side.")
        if "shortest_edge" in sides:
            return {"shortest_edge": sides["shortest_edge"]}
        if "max_height" in sides and "max_width" in sides:
            raise self.fail(f"size {sides} fits each photo inside max_height x max_width: a size that varies.")
        if "height" in sides and "width" in sides:
            return {"height": sides["height"], "width": sides["width"]}
        raise self.fail(f"size {sides or value!r} names no shortest_edge, nor height and width.")

    def crop_pct(self) -> float:
        return crop_fraction(self.p.crop_pct, "crop_pct", self.where, self.model)

    # ---- resample and values ------------------------------------------------------------------------

    def interpolation(self) -> str:
        resample = self.p.resample
        if resample is None:
            return "bilinear"  # TorchvisionBackend.resize's own default
        if isinstance(resample, bool) or not isinstance(resample, int):
            raise self._fail(f"its resample is {resample!r}; it must be a PIL resample code.", FLAGS_HINT)
        code = int(resample)
        if code in RESAMPLE_NAMES:
            return RESAMPLE_NAMES[code]
        if code in UNSERVED_RESAMPLE:
            got, nearest = UNSERVED_RESAMPLE[code]
            raise self.fail(
                f"resample is {code} ({got}), which vision-serve does not resample with; the nearest is {nearest}."
            )
        raise self._fail(f"its resample is {code}, not a PIL resample code (0 to 5).", FLAGS_HINT)

    def values(self) -> tuple[float, tuple, tuple, bool, str]:
        """(rescale_factor, mean, std, normalize, channel_order): ``value = (pixel * rescale - mean) / std``."""
        p = self.p
        rescale = self.rescale_factor() if p.do_rescale else 1.0
        if self.name == "MobileViTImageProcessor":
            # Its _preprocess rescales and flips; it takes no do_normalize, mean or std.
            order = "BGR" if p.do_flip_channel_order else "RGB"
            return rescale, (0.0,) * 3, (1.0,) * 3, False, order
        mean, std = ((0.0,) * 3, (1.0,) * 3)
        if p.do_normalize:
            mean, std = self.triplet("image_mean"), self.triplet("image_std", positive=True)
        if self.name == "EfficientNetImageProcessor":
            # ((pixel * rescale - offset) - mean) / std, then / std again (include_top): one mean and std.
            offset = 1.0 if p.do_rescale and p.rescale_offset else 0.0
            mean = tuple(offset + m for m in mean)
            if p.include_top:
                top = self.triplet("image_std", positive=True)
                std = tuple(s * t for s, t in zip(std, top, strict=True))
            return rescale, mean, std, mean != (0.0,) * 3 or std != (1.0,) * 3, "RGB"
        return rescale, mean, std, bool(p.do_normalize), "RGB"

    def rescale_factor(self) -> float:
        value = self.p.rescale_factor
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise self._fail(f"its rescale_factor is {value!r}; it must be a number > 0.", FLAGS_HINT)
        return float(value)

    def triplet(self, key: str, positive: bool = False) -> tuple[float, float, float]:
        value = getattr(self.p, key)
        shown = list(value) if isinstance(value, tuple) else value  # as the JSON file has it
        return channel_triplet(shown, key, self.where, self.model, positive=positive)
