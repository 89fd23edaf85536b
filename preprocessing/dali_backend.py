"""NVIDIA DALI: one pipeline decodes (nvJPEG), resizes, crops and normalizes the whole batch.

On a GPU the decoder runs in DALI's ``mixed`` mode (nvJPEG, with the hardware JPEG engine of
A100/H100-class GPUs taking part of the batch) and resize + normalize run on the GPU; the output
is copied device-to-device into a torch tensor, never through the host. On a machine without a
GPU the same graph runs on the CPU (``device_id=None``), which is how CI tests it.

EXIF orientation: the crop is cut in the stored image's coordinates and turned upright afterwards,
with the orientation the header probe read (the same one Pillow applies). The crop is resampled
straight from the decoded image (``roi_start``/``roi_end`` of the crop in
source pixels, computed from the header with torchvision's rounding), which is the same as
resizing the whole image and center-cropping, without resampling the margins that are thrown away.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np
import torch

from preprocessing import _defaults
from preprocessing.device_base import DeviceDecodePreprocessor, DeviceItem
from preprocessing.geometry import orient_rows, stored_box
from preprocessing.spec import PreprocessSpec

logger = logging.getLogger(__name__)

_INPUT_ENCODED, _INPUT_ROI_START, _INPUT_ROI_END = "encoded", "roi_start", "roi_end"


def dali_problem() -> str | None:
    """Why DALI cannot be used in this environment, or ``None``."""
    try:
        import nvidia.dali.plugin.pytorch  # noqa: F401  (imports nvidia.dali too)
    except ImportError as exc:
        return f"NVIDIA DALI is not importable ({exc}); install it with: pip install 'vision-serve[dali]'"
    return None


def build_pipeline(spec: PreprocessSpec, batch_size: int, num_threads: int, device_id: int | None):
    """The DALI graph: encoded bytes + crop ROI per sample -> normalized float32 CHW crops."""
    from nvidia.dali import fn, pipeline_def, types

    on_gpu = device_id is not None

    # exec_dynamic + prefetch_queue_depth=1: after a run() fails on a bad image the pipeline stays
    # usable (with the default executor it stays broken, measured with DALI 2.4), and nothing is
    # decoded ahead, since every batch is fed by the caller.
    @pipeline_def(
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=device_id,
        exec_dynamic=True,
        prefetch_queue_depth=1,
    )
    def pipeline():
        encoded = fn.external_source(name=_INPUT_ENCODED, dtype=types.UINT8, ndim=1)
        roi_start = fn.external_source(name=_INPUT_ROI_START, dtype=types.FLOAT, ndim=1)
        roi_end = fn.external_source(name=_INPUT_ROI_END, dtype=types.FLOAT, ndim=1)
        # adjust_orientation=False: the crop is taken in stored coordinates and turned upright
        # afterwards with the orientation Pillow read, so DALI's own EXIF reading (which differs
        # for duplicate APP1 segments, XMP orientation, odd tag types) cannot move the crop.
        images = fn.decoders.image(
            encoded, device="mixed" if on_gpu else "cpu", output_type=types.RGB, adjust_orientation=False
        )
        return crop_and_normalize(images, roi_start, roi_end, spec)

    pipe = pipeline()
    pipe.build()
    return pipe


def crop_and_normalize(images, roi_start, roi_end, spec: PreprocessSpec):
    """DALI graph nodes: resample the ``roi_start``..``roi_end`` box (source pixels, (y, x)) of each
    decoded HWC image to the crop size, then normalize to float32 CHW."""
    from nvidia.dali import fn, types

    interp = {"bilinear": types.INTERP_LINEAR, "bicubic": types.INTERP_CUBIC, "nearest": types.INTERP_NN}
    images = fn.resize(
        images,
        size=(spec.crop_size, spec.crop_size),
        roi_start=roi_start,
        roi_end=roi_end,
        roi_relative=False,
        interp_type=interp[spec.interpolation],
        antialias=spec.interpolation != "nearest",
    )
    return fn.crop_mirror_normalize(
        images,
        mean=[255.0 * m for m in spec.mean],
        std=[255.0 * s for s in spec.std],
        output_layout="CHW",
        dtype=types.FLOAT,
    )


class DaliPreprocessor(DeviceDecodePreprocessor):
    name = "dali"

    def __init__(
        self,
        spec: PreprocessSpec,
        device: torch.device | str = "cpu",
        *,
        num_threads: int | None = None,
        **options: int,
    ) -> None:
        """``options``: ``max_batch_size`` and ``max_image_pixels`` of ``DeviceDecodePreprocessor``."""
        super().__init__(spec, device, num_threads=num_threads, **options)
        problem = dali_problem()
        if problem:
            raise RuntimeError(problem)
        if num_threads is None:
            num_threads = min(_defaults.DALI_MAX_THREADS, os.cpu_count() or 1)
        device_id = None
        if self.device.type == "cuda":
            device_id = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self._pipe = build_pipeline(spec, self.max_batch_size, num_threads, device_id)

    def decode_on_device(self, items: Sequence[DeviceItem]) -> torch.Tensor:
        from nvidia.dali.plugin.pytorch import feed_ndarray

        # DALI's size/ROI arguments follow the tensor's shape order: (y, x) for HWC images.
        starts, ends = [], []
        for item in items:
            box = stored_box(item.plan.source_box, item.probe.orientation, item.probe.width, item.probe.height)
            left, top, right, bottom = box
            starts.append(np.array([top, left], dtype=np.float32))
            ends.append(np.array([bottom, right], dtype=np.float32))
        self._pipe.feed_input(_INPUT_ENCODED, [np.frombuffer(item.data, dtype=np.uint8) for item in items])
        self._pipe.feed_input(_INPUT_ROI_START, starts)
        self._pipe.feed_input(_INPUT_ROI_END, ends)
        (crops,) = self._pipe.run()
        dense = crops.as_tensor()  # every crop has the same shape, so this is one contiguous tensor
        # Copy out (device-to-device on a GPU, on torch's current stream): DALI reuses its buffers.
        rows = torch.empty(dense.shape(), dtype=torch.float32, device=self.device)
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        feed_ndarray(dense, rows, cuda_stream=stream)
        return orient_rows(rows, [item.probe.orientation for item in items])
