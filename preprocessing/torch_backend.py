"""torchvision + torch: decode JPEGs with ``torchvision.io.decode_jpeg`` (nvJPEG on a GPU, batched),
then every step of the ``PreprocessSpec`` with torch ops on the device: the resize of its mode
(``F.interpolate``, antialiased unless the spec says not), the crop window, ``pad_fill`` where the
window reaches past the image, and the values (``Normalizer.nchw``: channel order, rescale, normalize).
No dependency beyond torch.

Each image is turned upright (EXIF) before it is resized, so every crop has the model input's shape
whatever its orientation. It runs on the CPU too (libjpeg-turbo decode), which keeps it tested where
no GPU is; ``auto`` only picks it on a GPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torchvision.io import ImageReadMode, decode_jpeg

from preprocessing.device_base import DeviceDecodePreprocessor, DeviceItem
from preprocessing.geometry import CropPlan, interpolate_window, orient, pad_window


class TorchPreprocessor(DeviceDecodePreprocessor):
    name = "torch"

    def decode_on_device(self, items: Sequence[DeviceItem]) -> torch.Tensor:
        if self.device.type == "cuda":
            # torchvision's CUDA decoder allocates its outputs on our stream but decodes on its own
            # without waiting for ours (pytorch/vision#9606): let freed blocks settle first.
            torch.cuda.current_stream(self.device).synchronize()
        # bytearray: torch.frombuffer wants a writable buffer (the decoder only reads it).
        encoded = [torch.frombuffer(bytearray(item.data), dtype=torch.uint8) for item in items]
        # decode_jpeg ignores apply_exif_orientation on CUDA (torchvision 0.29), so the orientation
        # from the header probe is applied here, the same way on every device.
        with warnings.catch_warnings():
            # torchvision 0.29 deprecates its decoders in favour of TorchCodec; they still work.
            warnings.simplefilter("ignore", DeprecationWarning)
            images = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=self.device)
        crops = [
            self._resize_crop(orient(image, item.probe.orientation), item.plan)
            for image, item in zip(images, items, strict=True)
        ]
        return self.normalize.nchw(torch.stack(crops))

    def _resize_crop(self, image: torch.Tensor, plan: CropPlan) -> torch.Tensor:
        """Upright uint8 CHW -> float CHW model-input window of 0..255 values, with the probe's
        geometry (the decoder does not rotate, ``orient`` does, so the image has the probe's
        displayed size)."""
        # antialias off: the same F.interpolate as the Pillow path's (geometry.interpolate_crop).
        window = interpolate_window(image.float(), plan, self.spec, antialias=self.spec.antialias)
        # Bicubic overshoots at edges; Pillow clamps to the 0..255 range, so do we.
        return pad_window(window.clamp_(0.0, 255.0), plan, self.spec.pad_fill)
