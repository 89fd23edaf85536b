"""CV-CUDA: nvImageCodec decodes the batch on the GPU, CV-CUDA resizes, crops, normalizes and
reformats it, and the result is handed to torch without a copy.

``import cvcuda`` needs the NVIDIA driver (``libcuda.so.1``), so everything is imported lazily
and only on a CUDA device. Written against the cvcuda 0.19 and nvImageCodec 0.9 Python APIs;
it has never run in this project's CI (no GPU there), only in the ``gpu`` tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from preprocessing.device_base import DeviceDecodePreprocessor, DeviceItem, DeviceItemsFailed
from preprocessing.geometry import orient_rows, stored_resize_and_crop
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
        # (x - base) * scale with flags=0: base = 255 * mean, scale = 1 / (255 * std), per channel.
        base = torch.tensor([255.0 * m for m in spec.mean], dtype=torch.float32, device=self.device)
        scale = torch.tensor([1.0 / (255.0 * s) for s in spec.std], dtype=torch.float32, device=self.device)
        self._base_torch, self._scale_torch = base.view(1, 1, 1, 3), scale.view(1, 1, 1, 3)
        self._base = cvcuda.as_tensor(self._base_torch, "NHWC")
        self._scale = cvcuda.as_tensor(self._scale_torch, "NHWC")

    def decode_on_device(self, items: Sequence[DeviceItem]) -> torch.Tensor:
        import cvcuda

        torch_stream = torch.cuda.current_stream(self.device)
        stream = cvcuda.as_stream(torch_stream)  # every op below runs in torch's stream order
        images = self._decoder.decode(
            [item.data for item in items], params=self._decode_params, cuda_stream=torch_stream.cuda_stream
        )
        failed = [position for position, image in enumerate(images) if image is None]
        if failed:  # nvImageCodec reports failures per item instead of raising
            raise DeviceItemsFailed(failed)

        # Geometry from the probe (the displayed image's plan), mapped to stored coordinates: the
        # resize swaps its sides where the orientation transposes, and the crop box moves with it.
        crop = self.spec.crop_size
        sizes, boxes = [], []
        for item in items:
            (width, height), (left, top) = stored_resize_and_crop(item.plan, item.probe.orientation)
            sizes.append((height, width))
            boxes.append([left, top, crop, crop])  # [x, y, width, height]
        batch = cvcuda.as_images(images, format=cvcuda.Format.RGB8)
        resized = cvcuda.hq_resize(
            batch,
            sizes,
            antialias=self.spec.interpolation != "nearest",
            interpolation=self._interp,
            stream=stream,
        )
        rects = torch.tensor(boxes, dtype=torch.int32, device=self.device).view(-1, 1, 1, 4)
        flips = torch.full((len(items), 1), _NO_FLIP, dtype=torch.int32, device=self.device)
        out = cvcuda.crop_flip_normalize_reformat(
            resized,
            (len(items), 3, crop, crop),
            np.float32,
            "NCHW",
            cvcuda.as_tensor(rects, "NHWC"),
            cvcuda.as_tensor(flips, "NC"),
            self._base,
            self._scale,
            flags=0,
            stream=stream,
        )
        rows = torch.as_tensor(out.cuda(), device=self.device)
        return orient_rows(rows, [item.probe.orientation for item in items])
