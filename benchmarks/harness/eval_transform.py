"""A ``PreprocessSpec`` as the torchvision transforms a peer script would write for it.

The peers the benchmarks measure beside vision-serve (the per-process script, Triton's Python model)
preprocess the way such code usually does: Pillow decode, then a ``torchvision.transforms.Compose``.
``eval_transform`` builds that Compose for a spec, and gives the same pixels as vision-serve's
Pillow reference (preprocessing/pil_backend.py) on an upright RGB image (``upright_rgb``): torchvision's
``Resize`` and ``CenterCrop`` on a PIL image are Pillow's resize and torchvision's rounding, which
the reference follows. A spec those transforms cannot express is refused (``ValueError`` naming the
field), never approximated: a peer that preprocessed differently would not be measured fairly.
"""

from __future__ import annotations

from PIL import Image, ImageOps
from torchvision import transforms

from preprocessing import PreprocessSpec, to_rgb

TO_TENSOR_SCALE = 1 / 255  # what ToTensor multiplies uint8 pixels by


def eval_transform(spec: PreprocessSpec) -> transforms.Compose:
    """``spec`` as torchvision transforms: upright RGB PIL image -> the model's CHW float32 input,
    ``(3, *spec.input_size)``. ``ValueError`` for a spec that torchvision's transforms cannot express."""
    problem = unexpressible(spec)
    if problem:
        raise ValueError(problem)
    interpolation = transforms.InterpolationMode(spec.interpolation)
    if spec.resize_mode == "shorter":
        resize = transforms.Resize(spec.resize_size, interpolation=interpolation)
    else:  # exact: a (height, width) sequence resizes to exactly that size
        resize = transforms.Resize((spec.resize_height, spec.resize_width), interpolation=interpolation)
    steps: list = [resize]
    if spec.crop_height:
        steps.append(transforms.CenterCrop(spec.input_size))  # (height, width)
    steps.append(transforms.ToTensor())  # uint8 / 255
    if spec.rescale_factor != TO_TENSOR_SCALE:
        scale = spec.rescale_factor / TO_TENSOR_SCALE
        steps.append(transforms.Lambda(lambda tensor: tensor * scale))
    if spec.channel_order == "BGR":  # mean and std are given in the model's channel order
        steps.append(transforms.Lambda(lambda tensor: tensor.flip(0)))
    if spec.normalize:
        steps.append(transforms.Normalize(spec.mean, spec.std))
    return transforms.Compose(steps)


def upright_rgb(image: Image.Image) -> Image.Image:
    """The image as vision-serve's preprocessing sees it: EXIF-rotated upright, then 8-bit RGB (alpha
    composited as preprocessing/pil_backend.py does); what ``eval_transform`` expects."""
    return to_rgb(ImageOps.exif_transpose(image))


def unexpressible(spec: PreprocessSpec) -> str:
    """Why torchvision's transforms on a PIL image cannot reproduce ``spec``; empty if they can."""
    if spec.resize_mode in ("cover", "contain"):
        return (
            f"resize_mode {spec.resize_mode!r} (keep the aspect ratio to a {spec.resize_height}x{spec.resize_width} "
            "box) has no torchvision transform; the nearest that has one is 'shorter' (Resize(int)) or 'exact' "
            "(Resize((h, w))). Use preprocessing.pil_backend.PilPreprocessor for this spec."
        )
    if not spec.antialias:
        return (
            "antialias=False: torchvision's Resize on a PIL image always antialiases (Pillow's resize); the nearest "
            "expressible setting is antialias=True."
        )
    if spec.crop_height and spec.crop_rounding != "round":
        return (
            f"crop_rounding {spec.crop_rounding!r}: torchvision's CenterCrop rounds the offset with round(); the "
            "nearest expressible setting is crop_rounding='round'."
        )
    if spec.pad_fill != (0, 0, 0) and _may_pad(spec):
        return (
            f"pad_fill {spec.pad_fill}: torchvision's CenterCrop pads a crop larger than the image with 0; the "
            "nearest expressible setting is pad_fill=(0, 0, 0)."
        )
    return ""


def _may_pad(spec: PreprocessSpec) -> bool:
    """Whether the crop can reach past the resized image (``shorter``: the short side is resize_size)."""
    if not spec.crop_height:
        return False
    if spec.resize_mode == "shorter":
        return max(spec.crop_height, spec.crop_width) > spec.resize_size
    return spec.crop_height > spec.resize_height or spec.crop_width > spec.resize_width
