"""Resize + crop geometry of a ``PreprocessSpec`` for one image, with each library's rounding; shared
by every backend so that they all cut the same pixels."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from preprocessing.probe import TRANSPOSING_ORIENTATIONS
from preprocessing.spec import PreprocessSpec

Box = tuple[int, int, int, int]  # (left, top, right, bottom)


def resized_size(width: int, height: int, shorter_side: int) -> tuple[int, int]:
    """Size after scaling the shorter side to ``shorter_side``; same rounding as torchvision's Resize."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(shorter_side * long / short)
    return (shorter_side, new_long) if width <= height else (new_long, shorter_side)


def keep_ratio_size(width: int, height: int, box_height: int, box_width: int, *, longest: bool) -> tuple[int, int]:
    """timm's ``ResizeKeepRatio``: one scale for both sides, the one that makes the image cover the box
    (``longest=False``) or fit inside it (``longest=True``); sides rounded with ``round``, at least 1."""
    ratio_h, ratio_w = height / box_height, width / box_width
    ratio = max(ratio_h, ratio_w) if longest else min(ratio_h, ratio_w)
    return max(1, round(width / ratio)), max(1, round(height / ratio))


def spec_resized_size(width: int, height: int, spec: PreprocessSpec) -> tuple[int, int]:
    """``(width, height)`` that an upright ``width x height`` image is resized to under ``spec``."""
    if spec.resize_mode == "shorter":
        return resized_size(width, height, spec.resize_size)
    if spec.resize_mode == "exact":
        return spec.resize_width, spec.resize_height
    return keep_ratio_size(width, height, spec.resize_height, spec.resize_width, longest=spec.resize_mode == "contain")


def crop_offset(size: int, crop: int, rounding: str = "round") -> int:
    """Where a centred window of ``crop`` pixels starts in ``size``: negative where it is larger (the
    image is then padded by ``(crop - size) // 2`` before, as torchvision, timm and transformers pad)."""
    if crop > size:
        return -((crop - size) // 2)
    half = (size - crop) / 2.0
    return round(half) if rounding == "round" else int(half)


@dataclass(frozen=True)
class CropPlan:
    """Where one image's model input comes from: resize to ``resized``, then cut the window ``box``.

    ``box`` is the model input's window in the resized image; it may reach past the image (a
    ``contain`` resize), where the input is ``spec.pad_fill``. ``inner`` is the part of ``box`` inside
    the image, the only pixels that are resampled, and ``source_box`` is ``inner`` in the original
    image's pixel coordinates (floats), so a backend that can resample a region (Pillow's ``box``,
    DALI's ``roi_*``) resamples only what the model will see, with the same result as resizing the whole
    image and cropping. Without padding ``inner == box``.
    """

    resized: tuple[int, int]  # (width, height)
    box: Box  # the model input's window in the resized image
    source_box: tuple[float, float, float, float]  # ``inner`` in original pixel coordinates
    inner: Box  # ``box`` clipped to the resized image

    @property
    def output_size(self) -> tuple[int, int]:
        """``(width, height)`` of the model input."""
        left, top, right, bottom = self.box
        return right - left, bottom - top

    @property
    def inner_size(self) -> tuple[int, int]:
        left, top, right, bottom = self.inner
        return right - left, bottom - top

    @property
    def inner_offset(self) -> tuple[int, int]:
        """``(x, y)`` where ``inner`` lands in the model input; (0, 0) without padding."""
        return self.inner[0] - self.box[0], self.inner[1] - self.box[1]

    @property
    def pads(self) -> bool:
        return self.inner != self.box


def plan_crop(width: int, height: int, spec: PreprocessSpec) -> CropPlan:
    """The resize + crop of ``spec`` for an upright ``width x height`` image."""
    new_width, new_height = spec_resized_size(width, height, spec)
    out_height, out_width = spec.input_size
    if spec.crop_height:
        left = crop_offset(new_width, out_width, spec.crop_rounding)
        top = crop_offset(new_height, out_height, spec.crop_rounding)
    else:
        left = top = 0
    box = (left, top, left + out_width, top + out_height)
    inner = (max(0, left), max(0, top), min(new_width, box[2]), min(new_height, box[3]))
    scale_x, scale_y = width / new_width, height / new_height
    source_box = (inner[0] * scale_x, inner[1] * scale_y, inner[2] * scale_x, inner[3] * scale_y)
    return CropPlan((new_width, new_height), box, source_box, inner)


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


def stored_plan(plan: CropPlan, orientation: int, width: int, height: int) -> CropPlan:
    """``plan`` (made for the displayed ``width x height`` image) for the stored, not yet EXIF-rotated
    one: the same pixels, in the stored image's coordinates. Resize the stored image to its
    ``resized`` (sides swapped where ``orientation`` transposes), cut its ``box`` (padding where it
    reaches past), and ``orient`` turns the cut upright, equal to cutting the displayed image.

    Its ``output_size`` is the displayed one's, swapped where the orientation transposes: with a
    non-square crop the rows of one batch then differ in shape until they are turned upright."""
    resized_width, resized_height = plan.resized
    box = tuple(int(v) for v in stored_box(plan.box, orientation, resized_width, resized_height))
    inner = tuple(int(v) for v in stored_box(plan.inner, orientation, resized_width, resized_height))
    source_box = stored_box(plan.source_box, orientation, width, height)
    if orientation in TRANSPOSING_ORIENTATIONS:
        resized_width, resized_height = resized_height, resized_width
    return CropPlan((resized_width, resized_height), box, source_box, inner)  # type: ignore[arg-type]


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


def orient_rows(rows: torch.Tensor | Sequence[torch.Tensor], orientations: Sequence[int]) -> torch.Tensor:
    """Crops (C x H x W each, an N x C x H x W batch or a list) with row ``i`` turned upright under
    ``orientations[i]``, stacked. Rows may differ in shape before (a non-square crop of a transposing
    orientation is stored sideways) but must agree after.

    A new tensor, never an in-place write: a transposed crop is a view of the row it came from, and
    writing it back onto that row overlaps (torch refuses it), which once sent every orientation-5
    photo of the DALI backend to the Pillow fallback.
    """
    if isinstance(rows, torch.Tensor) and all(orientation == 1 for orientation in orientations):
        return rows
    return torch.stack([orient(row, orientation) for row, orientation in zip(rows, orientations, strict=True)])


def _axis_taps(
    in_size: int, out_size: int, start: int, stop: int, mode: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(source index, weight)`` taps of output pixels ``start..stop`` of a plain (not antialiased)
    ``in_size -> out_size`` interpolation along one axis, with ``F.interpolate``'s coordinate mapping
    (``align_corners=False``), its border handling and its bicubic (A = -0.75)."""
    scale = in_size / out_size
    j = torch.arange(start, stop, dtype=torch.float64)
    last = in_size - 1
    if mode == "nearest":  # nearest-exact: the source pixel whose centre is nearest, as Pillow picks it
        index = torch.floor((j + 0.5) * scale).clamp(max=last).long()
        return [(index, torch.ones_like(j))]
    src = (j + 0.5) * scale - 0.5
    if mode == "bilinear":
        src = src.clamp(min=0.0)
        low = torch.floor(src).clamp(max=last)
        frac = src - low
        low = low.long()
        return [(low, 1.0 - frac), ((low + 1).clamp(max=last), frac)]
    low = torch.floor(src)
    t = src - low
    a = -0.75

    def near(x: torch.Tensor) -> torch.Tensor:  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x: torch.Tensor) -> torch.Tensor:  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    weights = (far(t + 1), near(t), near(1 - t), far(2 - t))
    low = low.long()
    return [((low + k - 1).clamp(0, last), w) for k, w in enumerate(weights)]


def _interpolate_axis(image: torch.Tensor, axis: int, out_size: int, start: int, stop: int, mode: str) -> torch.Tensor:
    result = None
    for index, weight in _axis_taps(image.shape[axis], out_size, start, stop, mode):
        shape = [1] * image.dim()
        shape[axis] = -1
        term = image.index_select(axis, index) * weight.to(image.dtype).view(shape)
        result = term if result is None else result + term
    return result


def interpolate_window(image: torch.Tensor, plan: CropPlan, spec: PreprocessSpec, antialias: bool) -> torch.Tensor:
    """A float CHW image -> ``plan.inner`` of ``F.interpolate`` of the whole image to ``plan.resized``,
    with the spec's filter (nearest as nearest-exact: pixel centres, as Pillow samples; plain nearest
    floors). Float 0..255 values, not clamped."""
    width, height = plan.resized
    nearest = spec.interpolation == "nearest"
    resized = torch.nn.functional.interpolate(
        image.unsqueeze(0),
        size=(height, width),
        mode="nearest-exact" if nearest else spec.interpolation,
        antialias=antialias and not nearest,
        align_corners=None if nearest else False,
    )
    left, top, right, bottom = plan.inner
    return resized[0, :, top:bottom, left:right]


def pad_window(window: torch.Tensor, plan: CropPlan, fill: Sequence[int]) -> torch.Tensor:
    """``window`` (CHW, ``plan.inner``'s pixels) placed in the model input's window, ``fill`` around it
    where the plan pads; ``window`` itself where it does not."""
    if not plan.pads:
        return window
    out_width, out_height = plan.output_size
    canvas = torch.tensor(fill, dtype=window.dtype, device=window.device).view(3, 1, 1).repeat(1, out_height, out_width)
    x, y = plan.inner_offset
    canvas[:, y : y + window.shape[1], x : x + window.shape[2]] = window
    return canvas


def interpolate_crop(
    image: torch.Tensor, plan: CropPlan, spec: PreprocessSpec, max_resized_area: int = 0
) -> torch.Tensor:
    """An upright uint8 CHW image -> the uint8 CHW model-input window of ``plan``, resized without
    antialiasing (``spec.antialias`` false): ``F.interpolate(antialias=False)`` of the whole image,
    cropped and padded. Above ``max_resized_area`` resized pixels (a long strip's full resize would
    not fit in memory) only the window is computed, tap by tap, within one level of the same."""
    width, height = plan.resized
    left, top, right, bottom = plan.inner
    pixels = image.to(torch.float32)
    if width * height <= max_resized_area:
        pixels = interpolate_window(pixels, plan, spec, antialias=False)
    else:
        # The axes in the order that keeps the intermediate smaller: a wide strip's rows first would
        # be window height x the whole source width (gigabytes for a 1 x 50000 JPEG under bicubic).
        rows_first = (bottom - top) * image.shape[2] <= image.shape[1] * (right - left)
        axes = [(1, height, top, bottom), (2, width, left, right)]
        for axis, size, start, stop in axes if rows_first else axes[::-1]:
            pixels = _interpolate_axis(pixels, axis, size, start, stop, spec.interpolation)
    window = pixels.round_().clamp_(0, 255).to(torch.uint8)
    return pad_window(window, plan, spec.pad_fill)
