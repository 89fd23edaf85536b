"""Resize-then-center-crop geometry, with torchvision's rounding, shared by every backend."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from preprocessing.probe import TRANSPOSING_ORIENTATIONS
from preprocessing.spec import PreprocessSpec


def resized_size(width: int, height: int, shorter_side: int) -> tuple[int, int]:
    """Size after scaling the shorter side to ``shorter_side``; same rounding as torchvision's Resize."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(shorter_side * long / short)
    return (shorter_side, new_long) if width <= height else (new_long, shorter_side)


def center_crop_box(width: int, height: int, crop: int) -> tuple[int, int, int, int]:
    """``(left, top, right, bottom)`` with torchvision CenterCrop's offsets."""
    left = round((width - crop) / 2.0)
    top = round((height - crop) / 2.0)
    return left, top, left + crop, top + crop


@dataclass(frozen=True)
class CropPlan:
    """Where one image's model input comes from: resize to ``resized``, then crop ``box`` out of it.

    ``source_box`` is the same crop in the original image's pixel coordinates (floats), so a
    backend that can resample a region (Pillow's ``box``, DALI's ``roi_*``) resamples only what the
    model will see, with the same result as resizing the whole image and cropping.
    """

    resized: tuple[int, int]  # (width, height)
    box: tuple[int, int, int, int]  # (left, top, right, bottom) in the resized image
    source_box: tuple[float, float, float, float]  # the crop in original pixel coordinates


def plan_crop(width: int, height: int, spec: PreprocessSpec) -> CropPlan:
    """The resize + center-crop of ``spec`` for an upright ``width x height`` image."""
    new_width, new_height = resized_size(width, height, spec.resize_size)
    box = center_crop_box(new_width, new_height, spec.crop_size)
    scale_x, scale_y = width / new_width, height / new_height
    left, top, right, bottom = box
    source_box = (left * scale_x, top * scale_y, right * scale_x, bottom * scale_y)
    return CropPlan((new_width, new_height), box, source_box)


def stored_box(
    box: tuple[float, float, float, float], orientation: int, width: int, height: int
) -> tuple[float, float, float, float]:
    """A ``(left, top, right, bottom)`` box of the displayed ``width x height`` image, in the stored
    (not yet EXIF-rotated) image's coordinates; ``orient`` turns what is cropped there upright."""
    left, top, right, bottom = box
    to_stored = {
        1: lambda x, y: (x, y),
        2: lambda x, y: (width - x, y),
        3: lambda x, y: (width - x, height - y),
        4: lambda x, y: (x, height - y),
        5: lambda x, y: (y, x),
        6: lambda x, y: (y, width - x),
        7: lambda x, y: (height - y, width - x),
        8: lambda x, y: (height - y, x),
    }[orientation]
    (x0, y0), (x1, y1) = to_stored(left, top), to_stored(right, bottom)
    return min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1)


def stored_resize_and_crop(plan: CropPlan, orientation: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``plan`` (made for the displayed image) for the stored, not yet EXIF-rotated one:
    ``((width, height), (left, top))`` to resize the stored image to and to crop at; ``orient``
    turns the crop upright, with the same pixels as resizing and cropping the displayed image."""
    width, height = plan.resized
    left, top, _, _ = stored_box(plan.box, orientation, width, height)
    size = (height, width) if orientation in TRANSPOSING_ORIENTATIONS else (width, height)
    return size, (round(left), round(top))


def orient(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """A CHW image as it is displayed under EXIF ``orientation`` (1..8), as Pillow's exif_transpose does."""
    height_width = (1, 2)
    if orientation == 2:
        return image.flip(2)
    if orientation == 3:
        return image.flip(1, 2)
    if orientation == 4:
        return image.flip(1)
    if orientation == 5:
        return image.transpose(1, 2)
    if orientation == 6:
        return torch.rot90(image, k=-1, dims=height_width)  # 90 degrees clockwise
    if orientation == 7:
        return image.transpose(1, 2).flip(1, 2)
    if orientation == 8:
        return torch.rot90(image, k=1, dims=height_width)  # 90 degrees counter-clockwise
    return image


def orient_rows(rows: torch.Tensor, orientations: Sequence[int]) -> torch.Tensor:
    """An N x C x H x W batch of square crops with row ``i`` turned upright under ``orientations[i]``.

    A new tensor, never an in-place write: a transposed crop is a view of the row it came from, and
    writing it back onto that row overlaps (torch refuses it), which once sent every orientation-5
    photo of the DALI backend to the Pillow fallback.
    """
    if all(orientation == 1 for orientation in orientations):
        return rows
    return torch.stack([orient(row, orientation) for row, orientation in zip(rows, orientations, strict=True)])
