"""Pillow preprocessing: the CPU reference every other backend is measured against."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image, ImageOps

from preprocessing import _defaults
from preprocessing.base import ImageDecodeError, ImageError, Normalizer, PreparedBatch, Preprocessor
from preprocessing.geometry import CropPlan, interpolate_crop, plan_crop
from preprocessing.probe import JPEG_FORMATS, check_jpeg_data, open_image
from preprocessing.spec import PreprocessSpec

logger = logging.getLogger(__name__)

_RESAMPLE = {
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "nearest": Image.Resampling.NEAREST,
}
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


def to_rgb(img: Image.Image, background: tuple[int, int, int] = _defaults.ALPHA_BACKGROUND) -> Image.Image:
    """Any Pillow mode to 8-bit RGB: alpha composited onto ``background``, 16-bit scaled (not clipped)."""
    if img.mode == "RGB":
        return img
    if img.mode in _SIXTEEN_BIT_MODES:
        # Pillow's own I;16 -> L conversion clips at 255 instead of scaling; scale 0..65535 to 0..255.
        values = np.asarray(img, dtype=np.float32)
        return Image.fromarray(np.clip(values / 257.0 + 0.5, 0, 255).astype(np.uint8), "L").convert("RGB")
    if img.mode == "F":
        values = np.asarray(img, dtype=np.float32)
        if values.size and float(values.max()) <= 1.0:  # float images are usually 0..1
            values = values * 255.0
        return Image.fromarray(np.clip(values + 0.5, 0, 255).astype(np.uint8), "L").convert("RGB")
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in _ALPHA_MODES:
        rgba = img.convert("RGBA")
        flat = Image.new("RGB", rgba.size, background)
        flat.paste(rgba, mask=rgba.getchannel("A"))
        return flat
    return img.convert("RGB")


class PilPreprocessor(Preprocessor):
    """Decode with Pillow on the CPU, then normalize the uint8 batch on the model's device.

    Per image: header check (pixel limit, decode cost, a JPEG's data against its frame) -> JPEG
    draft when the photo is far larger than needed -> EXIF orientation -> RGB -> the spec's resize
    (antialiased unless it says not) -> its crop, padded with ``pad_fill`` where it reaches past.
    """

    name = "pil"

    def __init__(
        self,
        spec: PreprocessSpec,
        device: torch.device | str = "cpu",
        *,
        num_threads: int | None = None,
        use_jpeg_draft: bool = True,
        max_image_pixels: int = _defaults.MAX_IMAGE_PIXELS,
    ) -> None:
        super().__init__(spec, device)
        if num_threads is None:
            num_threads = min(_defaults.PIL_MAX_THREADS, os.cpu_count() or 1)
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}.")
        self.num_threads = num_threads
        self.use_jpeg_draft = use_jpeg_draft
        self.max_image_pixels = max_image_pixels
        self._resample = _RESAMPLE[spec.interpolation]
        self._normalize = Normalizer(spec, self.device)
        self._pool: ThreadPoolExecutor | None = None

    def __call__(self, images: Sequence[bytes]) -> PreparedBatch:
        if len(images) > 1 and self.num_threads > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="pil-decode")
            decoded = list(self._pool.map(self._decode_or_error, images))
        else:
            decoded = [self._decode_or_error(data) for data in images]
        errors = [d if isinstance(d, ImageError) else None for d in decoded]
        arrays = [d for d in decoded if not isinstance(d, ImageError)]
        if not arrays:
            return self.empty_batch(errors)
        batch = torch.from_numpy(np.stack(arrays))
        if self.device.type == "cuda":
            batch = batch.pin_memory()
        return PreparedBatch(self._normalize(batch), errors)

    def _decode_or_error(self, data: bytes) -> np.ndarray | ImageError:
        try:
            return self.decode(data)
        except ImageDecodeError as exc:
            return exc.error

    def decode(self, data: bytes) -> np.ndarray:
        """One encoded image -> ``crop x crop x 3`` uint8 array; raises ``ImageDecodeError``."""
        img = open_image(data, self.max_image_pixels)
        if img.format in JPEG_FORMATS:
            check_jpeg_data(data)
        try:
            return self._transform(img)
        except ImageDecodeError:
            raise
        except Exception as exc:  # truncated or corrupt pixel data
            raise ImageDecodeError(400, f"The image data is corrupt or truncated: {exc}") from None

    def _transform(self, img: Image.Image) -> np.ndarray:
        spec = self.spec
        if self.use_jpeg_draft and img.format in JPEG_FORMATS:
            wanted = spec.resize_target * _defaults.JPEG_DRAFT_HEADROOM
            if min(img.size) >= 2 * wanted:
                # draft() picks the largest 1/2, 1/4, 1/8 scale that keeps both sides >= wanted, so every
                # side the resize makes is still shrunk at least JPEG_DRAFT_HEADROOM times.
                img.draft(None, (wanted, wanted))
        img = ImageOps.exif_transpose(img)  # loads the pixels; phone photos are stored sideways
        img = to_rgb(img)
        plan = plan_crop(*img.size, spec)
        if not spec.antialias:
            return self._interpolate(img, plan)
        new_width, new_height = plan.resized
        if new_width * new_height <= _defaults.MAX_RESIZED_AREA_FACTOR * spec.resize_target**2:
            # Resize, then crop: exactly torchvision's Resize + CenterCrop.
            img = img.resize(plan.resized, self._resample).crop(plan.inner)
        else:
            # A long strip (a 1 x 100000 PNG is 300 bytes) would resize to gigabytes: resample only
            # the crop region. Same geometry; pixels within 2 uint8 levels of the path above.
            img = img.resize(plan.inner_size, self._resample, box=plan.source_box)
        if plan.pads:
            canvas = Image.new("RGB", plan.output_size, spec.pad_fill)
            canvas.paste(img, plan.inner_offset)
            img = canvas
        return np.asarray(img, dtype=np.uint8)

    def _interpolate(self, img: Image.Image, plan: CropPlan) -> np.ndarray:
        """Resize without antialiasing (Pillow always antialiases when shrinking): torch's
        ``F.interpolate`` on the region the crop keeps, as ``antialias=False`` does in torchvision."""
        pixels = torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1)
        bound = _defaults.MAX_RESIZED_AREA_FACTOR * self.spec.resize_target**2
        crop = interpolate_crop(pixels, plan, self.spec, max_resized_area=bound)
        return crop.permute(1, 2, 0).contiguous().numpy()
