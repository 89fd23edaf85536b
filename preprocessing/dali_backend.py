"""NVIDIA DALI: one pipeline decodes (nvJPEG), resizes, crops, pads and normalizes the whole batch.

On a GPU the decoder runs in DALI's ``mixed`` mode (nvJPEG, with the hardware JPEG engine of
A100/H100-class GPUs taking part of the batch) and resize + normalize run on the GPU; the output
is copied device-to-device into a torch tensor, never through the host. On a machine without a
GPU the same graph runs on the CPU (``device_id=None``), which is how CI tests it.

Geometry: every ``PreprocessSpec`` (all four resize modes, any crop or none, padding) is planned on
the host from the header (``geometry.plan_crop``) and fed per sample: the part of the crop window
inside the image (``CropPlan.inner``, as ``source_box`` in source pixels) is resampled straight from
the decoded image to its resized size (``roi_start``/``roi_end`` + ``size``), which is the same as
resizing the whole image and cutting the window, without resampling the margins that are thrown
away; where the window reaches past the image, ``fn.slice`` pads it with ``pad_fill``. Values:
``crop_mirror_normalize`` with ``base.value_affine``'s multiply-add (rescale, normalize or not),
in the decoder's channel order (BGR decoded as BGR).

EXIF orientation: the window is cut in the stored image's coordinates (``geometry.stored_plan``) and
turned upright afterwards, with the orientation the header probe read (the same one Pillow applies).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np
import torch

from preprocessing import _defaults
from preprocessing.base import value_affine
from preprocessing.device_base import DeviceDecodePreprocessor, DeviceItem
from preprocessing.geometry import orient_rows, stored_plan
from preprocessing.spec import PreprocessSpec

logger = logging.getLogger(__name__)

_INPUT_ENCODED, _INPUT_ROI_START, _INPUT_ROI_END = "encoded", "roi_start", "roi_end"
_INPUT_SIZE, _INPUT_PAD_START, _INPUT_PAD_SHAPE = "size", "pad_start", "pad_shape"


def dali_problem() -> str | None:
    """Why DALI cannot be used in this environment, or ``None``."""
    try:
        import nvidia.dali.plugin.pytorch  # noqa: F401  (imports nvidia.dali too)
    except ImportError as exc:
        return f"NVIDIA DALI is not importable ({exc}); install it with: pip install 'vision-serve[dali]'"
    return None


def spec_problem(spec: PreprocessSpec) -> str | None:
    """Why DALI cannot reproduce ``spec``'s preprocessing, or ``None``; names the field and the way out."""
    if spec.interpolation == "bicubic" and not spec.antialias:
        # Measured (DALI 2.4): without antialiasing DALI's cubic is exactly Catmull-Rom (a = -0.5), while
        # a spec's plain bicubic is F.interpolate's (a = -0.75): up to 13 uint8 levels apart on photos.
        return (
            "PreprocessSpec.antialias=false with interpolation 'bicubic': DALI's plain cubic resize (a=-0.5) is "
            "not F.interpolate's bicubic (a=-0.75) that this spec means. Use --preprocess torch or pil "
            "(or a spec with antialias true, or interpolation 'bilinear')."
        )
    return None


def may_pad(spec: PreprocessSpec) -> bool:
    """Whether some image's crop window can reach past its resized image under ``spec`` (then the
    graph has a padding step; without it, none is spent)."""
    if not spec.crop_height:
        return False  # exact, no crop: the window is the resized image
    if spec.resize_mode == "contain":
        return True
    if spec.resize_mode == "shorter":  # the shorter side is resize_size, the longer one any size >= it
        return max(spec.crop_height, spec.crop_width) > spec.resize_size
    # exact: the resized image is the box; cover: at least the box (its limiting side rounds to it)
    return spec.crop_height > spec.resize_height or spec.crop_width > spec.resize_width


def decoder_output_type(spec: PreprocessSpec):
    """The decoder's ``output_type``: the model's channel order, so no flip is needed after."""
    from nvidia.dali import types

    return types.BGR if spec.channel_order == "BGR" else types.RGB


def build_pipeline(spec: PreprocessSpec, batch_size: int, num_threads: int, device_id: int | None):
    """The DALI graph: encoded bytes + each sample's plan (ROI, size, pad window) -> normalized
    float32 CHW windows, in stored orientation."""
    from nvidia.dali import fn, pipeline_def, types

    on_gpu = device_id is not None
    padding = may_pad(spec)

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
        size = fn.external_source(name=_INPUT_SIZE, dtype=types.FLOAT, ndim=1)
        pad = None
        if padding:
            pad = (
                fn.external_source(name=_INPUT_PAD_START, dtype=types.INT32, ndim=1),
                fn.external_source(name=_INPUT_PAD_SHAPE, dtype=types.INT32, ndim=1),
            )
        # adjust_orientation=False: the window is taken in stored coordinates and turned upright
        # afterwards with the orientation Pillow read, so DALI's own EXIF reading (which differs
        # for duplicate APP1 segments, XMP orientation, odd tag types) cannot move it.
        images = fn.decoders.image(
            encoded,
            device="mixed" if on_gpu else "cpu",
            output_type=decoder_output_type(spec),
            adjust_orientation=False,
        )
        return resize_pad_normalize(images, roi_start, roi_end, size, pad, spec)

    pipe = pipeline()
    pipe.build()
    return pipe


def resize_pad_normalize(images, roi_start, roi_end, size, pad, spec: PreprocessSpec):
    """DALI graph nodes: resample the ``roi_start``..``roi_end`` box (source pixels, (y, x)) of each
    decoded HWC image to ``size`` ((height, width)), cut the ``pad`` window ``(start, shape)``
    ((y, x) and (height, width) of the model input in that resample; ``None`` where nothing pads)
    with ``pad_fill`` beyond it, then the values, as float32 CHW. Shared with the Triton graph
    (preprocessing/dali_triton.py), which computes these nodes itself."""
    from nvidia.dali import fn, types

    interp = {"bilinear": types.INTERP_LINEAR, "bicubic": types.INTERP_CUBIC, "nearest": types.INTERP_NN}
    images = fn.resize(
        images,
        size=size,
        roi_start=roi_start,
        roi_end=roi_end,
        roi_relative=False,
        interp_type=interp[spec.interpolation],
        antialias=spec.antialias and spec.interpolation != "nearest",
    )
    if pad is not None:
        start, shape = pad
        # pad_fill is R, G, B; the decoded image is in the model's channel order.
        fill = spec.pad_fill[::-1] if spec.channel_order == "BGR" else spec.pad_fill
        images = fn.slice(
            images,
            start=start,
            shape=shape,
            axis_names="HW",
            out_of_bounds_policy="pad",
            fill_values=[float(v) for v in fill],
        )
    # pixel * scale + bias == (pixel - mean') / std' with mean' = -bias / scale, std' = 1 / scale.
    scale, bias = value_affine(spec)
    return fn.crop_mirror_normalize(
        images,
        mean=[-b / s for s, b in zip(scale, bias, strict=True)],
        std=[1.0 / s for s in scale],
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
        unsupported = spec_problem(spec)
        if unsupported:
            raise ValueError(unsupported)
        if num_threads is None:
            num_threads = min(_defaults.DALI_MAX_THREADS, os.cpu_count() or 1)
        device_id = None
        if self.device.type == "cuda":
            device_id = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self._padding = may_pad(spec)
        self._pipe = build_pipeline(spec, self.max_batch_size, num_threads, device_id)

    def decode_on_device(self, items: Sequence[DeviceItem]) -> torch.Tensor:
        # DALI's size/ROI/slice arguments follow the tensor's shape order: (y, x) for HWC images.
        starts, ends, sizes, pad_starts, pad_shapes = [], [], [], [], []
        for item in items:
            plan = stored_plan(item.plan, item.probe.orientation, item.probe.width, item.probe.height)
            left, top, right, bottom = plan.source_box
            starts.append(np.array([top, left], dtype=np.float32))
            ends.append(np.array([bottom, right], dtype=np.float32))
            inner_width, inner_height = plan.inner_size
            sizes.append(np.array([inner_height, inner_width], dtype=np.float32))
            x, y = plan.inner_offset
            out_width, out_height = plan.output_size
            pad_starts.append(np.array([-y, -x], dtype=np.int32))
            pad_shapes.append(np.array([out_height, out_width], dtype=np.int32))
        self._pipe.feed_input(_INPUT_ENCODED, [np.frombuffer(item.data, dtype=np.uint8) for item in items])
        self._pipe.feed_input(_INPUT_ROI_START, starts)
        self._pipe.feed_input(_INPUT_ROI_END, ends)
        self._pipe.feed_input(_INPUT_SIZE, sizes)
        if self._padding:
            self._pipe.feed_input(_INPUT_PAD_START, pad_starts)
            self._pipe.feed_input(_INPUT_PAD_SHAPE, pad_shapes)
        (windows,) = self._pipe.run()
        orientations = [item.probe.orientation for item in items]
        if windows.is_dense_tensor():
            return orient_rows(self._copy_out(windows.as_tensor()), orientations)
        # A non-square window of a sideways-stored photo has its sides swapped until it is turned
        # upright: copy the rows one by one and orient each before stacking.
        return orient_rows([self._copy_out(windows[i]) for i in range(len(items))], orientations)

    def _copy_out(self, dali_tensor) -> torch.Tensor:
        """A DALI tensor (on the CPU or the GPU) into a new torch tensor on ``self.device`` (device-to-
        device on a GPU, on torch's current stream): DALI reuses its buffers."""
        from nvidia.dali.plugin.pytorch import feed_ndarray

        rows = torch.empty(dali_tensor.shape(), dtype=torch.float32, device=self.device)
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        feed_ndarray(dali_tensor, rows, cuda_stream=stream)
        return rows
