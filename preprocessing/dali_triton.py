"""The DALI preprocessing graph for Triton's DALI backend: JPEG bytes in, the model's input out.

In vision-serve each image's plan (``geometry.plan_crop``) is computed on the host from its header
and fed to DALI. Inside Triton no host code runs, so this graph computes the same plan itself, from
the image's shape, in DALI arithmetic with each library's rounding, for every ``PreprocessSpec``:

* resize: ``shorter`` (the shorter side to ``resize_size``, the longer one truncated, as ``int()``
  does), ``exact`` (the box), ``cover``/``contain`` (one scale, sides rounded half to even as
  Python's ``round``, at least 1);
* the crop window centred with ``round`` (half to even) or ``floor`` offsets (``crop_rounding``),
  or none; where it reaches past the image, ``(crop - size) // 2`` before, padded with ``pad_fill``;
* the part inside the image mapped back to source pixels and resampled as the served DALI backend
  does (``dali_backend.resize_pad_normalize``, which also does padding and values): not Triton's own
  example, which squeezes the whole image to 224 x 224.

EXIF orientation is applied by DALI's decoder (``adjust_orientation``), and the plan is computed on
the upright image; vision-serve reads the orientation with Pillow, which differs only for odd
headers (duplicate APP1 segments, XMP orientation). A spec DALI cannot reproduce is refused
(``check_triton_spec``), as the served DALI backend refuses it.
"""

from __future__ import annotations

from typing import NamedTuple

from preprocessing.dali_backend import decoder_output_type, may_pad, resize_pad_normalize, spec_problem
from preprocessing.spec import PreprocessSpec

# The names Triton's model configuration uses for the graph's input and output (the external
# source's name must be the config's input name; outputs are matched in order).
TRITON_DALI_INPUT = "IMAGE"
TRITON_DALI_OUTPUT = "DALI_OUTPUT_0"


class PlanNodes(NamedTuple):
    """DALI nodes of each sample's plan, in the (y, x) order of an HWC image's shape."""

    roi_start: object  # FLOAT (top, left) of the resampled region, in source pixels
    roi_end: object  # FLOAT (bottom, right)
    size: object  # FLOAT (height, width) it is resampled to
    pad_start: object  # INT32 (y, x) of the model input in that resample: <= 0, 0 where nothing pads


def check_triton_spec(spec: PreprocessSpec) -> None:
    """``ValueError`` naming the field when the Triton DALI graph cannot reproduce ``spec``."""
    problem = spec_problem(spec)
    if problem:
        raise ValueError(problem)


def _round_half_even(value):
    """Python's ``round`` (half to even) of a non-negative FLOAT64 DALI node."""
    from nvidia.dali import math as dmath

    low = dmath.floor(value)
    frac = value - low  # 0 <= frac < 1
    above_half = dmath.ceil(frac - 0.5)  # 1 where frac > 0.5, else 0 (ceil(-0.5 .. 0) is 0)
    is_half = 1.0 - dmath.ceil(dmath.abs(frac - 0.5))  # 1 where frac == 0.5 exactly, else 0
    low_is_odd = low - 2.0 * dmath.floor(low * 0.5)  # 0 or 1
    return low + above_half + is_half * low_is_odd


def _offset(size, crop: int, rounding: str):
    """``geometry.crop_offset`` of an integer-valued FLOAT64 node ``size``: where a centred window of
    ``crop`` starts; ``-((crop - size) // 2)`` where it is larger."""
    from nvidia.dali import math as dmath

    margin = size - crop
    # One of the two terms is 0: min/max pick the branch without comparisons.
    inside, outside = dmath.max(margin, 0.0) * 0.5, dmath.min(margin, 0.0) * 0.5
    start = _round_half_even(inside) if rounding == "round" else dmath.floor(inside)
    return start + dmath.ceil(outside)  # ceil(-(c - s) / 2) == -((c - s) // 2)


def _resized(height, width, spec: PreprocessSpec):
    """``geometry.spec_resized_size`` as FLOAT64 nodes ``(height, width)``."""
    from nvidia.dali import math as dmath

    if spec.resize_mode == "shorter":
        shorter = dmath.min(height, width)
        return dmath.floor(spec.resize_size * height / shorter), dmath.floor(spec.resize_size * width / shorter)
    if spec.resize_mode == "exact":
        return height * 0.0 + spec.resize_height, width * 0.0 + spec.resize_width
    ratio_h, ratio_w = height / spec.resize_height, width / spec.resize_width
    ratio = dmath.max(ratio_h, ratio_w) if spec.resize_mode == "contain" else dmath.min(ratio_h, ratio_w)
    return dmath.max(_round_half_even(height / ratio), 1.0), dmath.max(_round_half_even(width / ratio), 1.0)


def plan_nodes(encoded, spec: PreprocessSpec) -> PlanNodes:
    """``geometry.plan_crop`` of each encoded image, computed from its header in the graph."""
    from nvidia.dali import fn, types
    from nvidia.dali import math as dmath

    # float64: the truncations and roundings must see the same values as Python's float arithmetic.
    shape = fn.cast(fn.peek_image_shape(encoded, adjust_orientation=True), dtype=types.FLOAT64)
    height, width = shape[0], shape[1]
    new_height, new_width = _resized(height, width, spec)
    if spec.crop_height:
        top = _offset(new_height, spec.crop_height, spec.crop_rounding)
        left = _offset(new_width, spec.crop_width, spec.crop_rounding)
        bottom, right = top + spec.crop_height, left + spec.crop_width
    else:  # exact, no crop: the window is the resized image
        top = left = height * 0.0
        bottom, right = new_height, new_width
    inner_top, inner_left = dmath.max(top, 0.0), dmath.max(left, 0.0)
    inner_bottom, inner_right = dmath.min(bottom, new_height), dmath.min(right, new_width)
    scale_y, scale_x = height / new_height, width / new_width
    start = fn.stack(inner_top * scale_y, inner_left * scale_x)
    end = fn.stack(inner_bottom * scale_y, inner_right * scale_x)
    size = fn.stack(inner_bottom - inner_top, inner_right - inner_left)
    pad_start = fn.stack(top - inner_top, left - inner_left)
    return PlanNodes(
        fn.cast(start, dtype=types.FLOAT),
        fn.cast(end, dtype=types.FLOAT),
        fn.cast(size, dtype=types.FLOAT),
        fn.cast(pad_start, dtype=types.INT32),
    )


def crop_box(encoded, spec: PreprocessSpec):
    """DALI nodes ``(roi_start, roi_end)``: the part of the crop window inside the resized image, in the
    upright source image's pixels, (y, x) order, computed from the encoded image's header."""
    nodes = plan_nodes(encoded, spec)
    return nodes.roi_start, nodes.roi_end


def build_triton_pipeline(spec: PreprocessSpec, batch_size: int, num_threads: int, device_id: int | None):
    """The graph, not built: ``.serialize()`` it into ``model.dali``; ``device_id`` None keeps it on the CPU.

    Serializing a GPU graph (nvJPEG decoding, ``device_id`` set) needs a GPU in the machine.
    Raises ``ValueError`` for a spec DALI cannot reproduce (``check_triton_spec``).
    """
    from nvidia.dali import fn, pipeline_def, types

    check_triton_spec(spec)
    height, width = spec.input_size

    @pipeline_def(batch_size=batch_size, num_threads=num_threads, device_id=device_id)
    def pipeline():
        encoded = fn.external_source(name=TRITON_DALI_INPUT, dtype=types.UINT8, ndim=1)
        nodes = plan_nodes(encoded, spec)
        images = fn.decoders.image(
            encoded,
            device="cpu" if device_id is None else "mixed",
            output_type=decoder_output_type(spec),
            adjust_orientation=True,
        )
        pad = (nodes.pad_start, [height, width]) if may_pad(spec) else None
        return resize_pad_normalize(images, nodes.roi_start, nodes.roi_end, nodes.size, pad, spec)

    return pipeline()
