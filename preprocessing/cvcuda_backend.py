"""CV-CUDA: nvImageCodec decodes the batch on the GPU, CV-CUDA resizes, crops, normalizes and
reformats it, and the result is handed to torch without a copy.

Every ``PreprocessSpec`` geometry is planned on the host (``geometry.plan_crop``, mapped to the
stored image by ``geometry.stored_plan``): ``hq_resize`` to each image's resized size (per sample,
antialiased unless the spec says not), then ``crop_flip_normalize_reformat`` cuts each window (per
sample rects, reaching past the image where the spec pads) and does the values. Padding is then
written with ``pad_fill``'s values in torch (the operator's border value is one number for all
channels), and the channels put in BGR order where the spec asks.

``import cvcuda`` needs the NVIDIA driver (``libcuda.so.1``), so everything is imported lazily
and only on a CUDA device. Written against the cvcuda 0.19 and nvImageCodec 0.9 Python APIs;
it has never run in this project's CI (no GPU there), only in the ``gpu`` tests, and the geometry
beyond shorter side + square crop (other resize modes, non-square crops, padding) has not run on a
GPU yet: its host side is tested on the CPU (tests/unit/test_backend_geometries.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from preprocessing.base import value_affine
from preprocessing.device_base import DeviceDecodePreprocessor, DeviceItem, DeviceItemsFailed
from preprocessing.geometry import CropPlan, orient_rows, stored_plan
from preprocessing.spec import PreprocessSpec

# crop_flip_normalize_reformat flips with codes 0, 1 and -1; any other code means "no flip".
_NO_FLIP = 2


def cvcuda_problem() -> str | None:
    """Why CV-CUDA cannot be used in this environment, or ``None``."""
    try:
        import cvcuda  # noqa: F401
        from nvidia import nvimgcodec  # noqa: F401
    except ImportError as exc:
        return (
            f"CV-CUDA or nvImageCodec is not importable ({exc}); it needs an NVIDIA driver and "
            "pip install 'vision-serve[gpu]'"
        )
    return None


def window_rect(plan: CropPlan) -> list[int]:
    """``[x, y, width, height]`` of ``plan.box`` (stored coordinates) for crop_flip_normalize_reformat:
    it may start before 0 or end past the resized image, where the operator reads its border."""
    left, top, right, bottom = plan.box
    return [left, top, right - left, bottom - top]


def shape_groups(shapes: Sequence[tuple[int, int]]) -> dict[tuple[int, int], list[int]]:
    """Positions of ``shapes`` grouped by shape, in first-seen order: one operator call per output
    shape (a non-square window of a sideways-stored photo has its sides swapped until oriented)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for position, shape in enumerate(shapes):
        groups.setdefault(shape, []).append(position)
    return groups


def rgb_affine(spec: PreprocessSpec) -> tuple[list[float], list[float]]:
    """``(base, scale)`` per decoded (RGB) channel for ``(pixel - base) * scale``: ``value_affine``'s
    multiply-add, whose values are per model channel (reversed where the model takes BGR, as the
    channels are flipped after)."""
    scale, bias = value_affine(spec)
    if spec.channel_order == "BGR":
        scale, bias = scale[::-1], bias[::-1]
    return [-b / s for s, b in zip(scale, bias, strict=True)], list(scale)


def fill_padding(rows: torch.Tensor, plans: Sequence[CropPlan], fill: torch.Tensor) -> torch.Tensor:
    """Set every pixel of upright NCHW ``rows`` outside its plan's ``inner`` window to ``fill`` (one
    value per channel, already normalized); rows whose plan does not pad are left as they are."""
    for row, plan in zip(rows, plans, strict=True):
        if not plan.pads:
            continue
        x, y = plan.inner_offset
        width, height = plan.inner_size
        keep = row[:, y : y + height, x : x + width].clone()
        row[:] = fill.view(3, 1, 1)
        row[:, y : y + height, x : x + width] = keep
    return rows


class CvcudaPreprocessor(DeviceDecodePreprocessor):
    name = "cvcuda"

    def __init__(self, spec: PreprocessSpec, device: torch.device | str = "cuda", **options: int | None) -> None:
        """``options``: those of ``DeviceDecodePreprocessor`` (max_batch_size, max_image_pixels, num_threads)."""
        super().__init__(spec, device, **options)
        if self.device.type != "cuda":
            raise ValueError(f"The cvcuda backend needs a CUDA device, got {self.device}. Use dali, torch or pil.")
        problem = cvcuda_problem()
        if problem:
            raise RuntimeError(problem)
        import cvcuda
        from nvidia import nvimgcodec

        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self._decoder = nvimgcodec.Decoder(device_id=index)
        # Decoded as stored, not EXIF-rotated: nvImageCodec reads orientation tags Pillow ignores
        # (a BYTE or ASCII "6": measured on an H100, the crop came out rotated), so the crop is cut
        # in stored coordinates and turned upright with the header probe's orientation, as in the
        # dali backend. Grayscale comes out as 3 equal channels.
        self._decode_params = nvimgcodec.DecodeParams(
            apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB, allow_any_depth=False
        )
        interp = {"bilinear": cvcuda.Interp.LINEAR, "bicubic": cvcuda.Interp.CUBIC, "nearest": cvcuda.Interp.NEAREST}
        self._interp = interp[spec.interpolation]
        base, scale = rgb_affine(spec)
        base_t = torch.tensor(base, dtype=torch.float32, device=self.device).view(1, 1, 1, 3)
        scale_t = torch.tensor(scale, dtype=torch.float32, device=self.device).view(1, 1, 1, 3)
        self._base_torch, self._scale_torch = base_t, scale_t  # kept alive: the cvcuda tensors wrap them
        self._base = cvcuda.as_tensor(base_t, "NHWC")
        self._scale = cvcuda.as_tensor(scale_t, "NHWC")
        # pad_fill as the model sees it: its R, G, B values through the same values step.
        fill = torch.tensor(spec.pad_fill, dtype=torch.float32, device=self.device).view(1, 3, 1, 1)
        self._fill = self.normalize.nchw(fill).view(3)

    def decode_on_device(self, items: Sequence[DeviceItem]) -> torch.Tensor:
        torch_stream = torch.cuda.current_stream(self.device)
        images = self._decoder.decode(
            [item.data for item in items], params=self._decode_params, cuda_stream=torch_stream.cuda_stream
        )
        failed = [position for position, image in enumerate(images) if image is None]
        if failed:  # nvImageCodec reports failures per item instead of raising
            raise DeviceItemsFailed(failed)

        # Geometry from the probe (the displayed image's plan), mapped to stored coordinates: the
        # resize swaps its sides where the orientation transposes, and the window moves with it.
        plans = [stored_plan(item.plan, item.probe.orientation, item.probe.width, item.probe.height) for item in items]
        rows: list[torch.Tensor | None] = [None] * len(items)
        for (width, height), positions in shape_groups([plan.output_size for plan in plans]).items():
            group = self._windows([images[p] for p in positions], [plans[p] for p in positions], width, height)
            for position, row in zip(positions, group, strict=True):
                rows[position] = row
        upright = orient_rows(rows, [item.probe.orientation for item in items])
        if self.spec.channel_order == "BGR":
            upright = upright.flip(1)
        return fill_padding(upright, [item.plan for item in items], self._fill)

    def _windows(self, images: list, plans: list[CropPlan], width: int, height: int) -> torch.Tensor:
        """Decoded (stored) images -> their ``width x height`` windows, normalized NCHW float32."""
        import cvcuda

        stream = cvcuda.as_stream(torch.cuda.current_stream(self.device))  # in torch's stream order
        batch = cvcuda.as_images(images, format=cvcuda.Format.RGB8)
        resized = cvcuda.hq_resize(
            batch,
            [(plan.resized[1], plan.resized[0]) for plan in plans],  # (height, width)
            antialias=self.spec.antialias and self.spec.interpolation != "nearest",
            interpolation=self._interp,
            stream=stream,
        )
        rects = torch.tensor([window_rect(plan) for plan in plans], dtype=torch.int32, device=self.device)
        flips = torch.full((len(plans), 1), _NO_FLIP, dtype=torch.int32, device=self.device)
        out = cvcuda.crop_flip_normalize_reformat(
            resized,
            (len(plans), 3, height, width),
            np.float32,
            "NCHW",
            cvcuda.as_tensor(rects.view(-1, 1, 1, 4), "NHWC"),
            cvcuda.as_tensor(flips, "NC"),
            self._base,
            self._scale,
            flags=0,
            border=cvcuda.Border.CONSTANT,  # where the window reaches past: overwritten by fill_padding
            stream=stream,
        )
        return torch.as_tensor(out.cuda(), device=self.device)
