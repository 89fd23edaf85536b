"""The DALI preprocessing graph for Triton's DALI backend: JPEG bytes in, the model's input out.

In vision-serve the crop box of each image is computed on the host from its header
(preprocessing/geometry.py) and fed to DALI. Inside Triton no host code runs, so this graph
computes the same box itself, from the image's shape, with torchvision's rounding: the shorter side
scaled to ``resize_size`` (the longer one truncated, as ``int()`` does), the ``crop_size`` square
centered with round-half-to-even offsets (Python's ``round``), mapped back to source pixels. Then it
resamples that box as the served DALI backend does (``crop_and_normalize``): not Triton's own
example, which squeezes the whole image to 224 x 224.

EXIF orientation is applied by DALI's decoder (``adjust_orientation``), and the box is computed on
the upright image; vision-serve reads the orientation with Pillow, which differs only for odd
headers (duplicate APP1 segments, XMP orientation).
"""

from __future__ import annotations

from preprocessing.dali_backend import crop_and_normalize
from preprocessing.spec import PreprocessSpec

# The names Triton's model configuration uses for the graph's input and output (the external
# source's name must be the config's input name; outputs are matched in order).
TRITON_DALI_INPUT = "IMAGE"
TRITON_DALI_OUTPUT = "DALI_OUTPUT_0"


def _round_half_even(value):
    """``round(value / 2)`` for a non-negative integer-valued DALI node, as Python rounds ``x.5``."""
    from nvidia.dali import math as dmath

    half = value * 0.5
    low = dmath.floor(half)
    is_half = half - low  # 0 or 0.5
    low_is_odd = low - 2.0 * dmath.floor(low * 0.5)  # 0 or 1
    return low + 2.0 * is_half * low_is_odd


def crop_box(encoded, spec: PreprocessSpec):
    """DALI nodes ``(roi_start, roi_end)``: the center crop of the resized image, in the upright
    source image's pixels, (y, x) order, computed from the encoded image's header."""
    from nvidia.dali import fn, types
    from nvidia.dali import math as dmath

    # float64: the longer side's truncation must see the same value as Python's float division.
    shape = fn.cast(fn.peek_image_shape(encoded, adjust_orientation=True), dtype=types.FLOAT64)
    height, width = shape[0], shape[1]
    shorter = dmath.min(height, width)
    resized_height = dmath.floor(spec.resize_size * height / shorter)
    resized_width = dmath.floor(spec.resize_size * width / shorter)
    top = _round_half_even(resized_height - spec.crop_size)
    left = _round_half_even(resized_width - spec.crop_size)
    scale_y, scale_x = height / resized_height, width / resized_width
    start = fn.stack(top * scale_y, left * scale_x)
    end = fn.stack((top + spec.crop_size) * scale_y, (left + spec.crop_size) * scale_x)
    return fn.cast(start, dtype=types.FLOAT), fn.cast(end, dtype=types.FLOAT)


def build_triton_pipeline(spec: PreprocessSpec, batch_size: int, num_threads: int, device_id: int | None):
    """The graph, not built: ``.serialize()`` it into ``model.dali``; ``device_id`` None keeps it on the CPU.

    Serializing a GPU graph (nvJPEG decoding, ``device_id`` set) needs a GPU in the machine.
    """
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch_size, num_threads=num_threads, device_id=device_id)
    def pipeline():
        encoded = fn.external_source(name=TRITON_DALI_INPUT, dtype=types.UINT8, ndim=1)
        roi_start, roi_end = crop_box(encoded, spec)
        images = fn.decoders.image(
            encoded, device="cpu" if device_id is None else "mixed", output_type=types.RGB, adjust_orientation=True
        )
        return crop_and_normalize(images, roi_start, roi_end, spec)

    return pipeline()
