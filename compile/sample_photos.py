"""scikit-image's sample photos (public domain or CC0), rendered one way for the accuracy gate, the
demo, the benchmarks and the tests, so that the project ships no image files."""

from __future__ import annotations

import functools
import io
from pathlib import Path

import numpy as np
from PIL import Image

from compile import _defaults

# What a real ImageNet classifier answers for the "chelsea" photo (a tabby cat), best first or not:
# the classes it is split between. Coffee is "espresso".
CAT_LABELS = frozenset({"tabby", "tiger cat", "Egyptian cat"})


@functools.cache
def sample_photo(name: str) -> np.ndarray:
    """``skimage.data.<name>()`` as an RGB uint8 array; read-only, since every caller shares it."""
    from skimage import data  # the demo extra: imported late, so importing this module needs no scikit-image

    photo = np.asarray(Image.fromarray(getattr(data, name)()).convert("RGB"))
    photo.flags.writeable = False
    return photo


@functools.cache
def sample_photo_file(name: str, fmt: str = "JPEG") -> bytes:
    """The sample photo ``name`` as the bytes of an image file: JPEG (at the quality cameras save) or
    any other format Pillow writes."""
    options = {"quality": _defaults.SAMPLE_PHOTO_JPEG_QUALITY} if fmt == "JPEG" else {}
    buffer = io.BytesIO()
    Image.fromarray(sample_photo(name)).save(buffer, format=fmt, **options)
    return buffer.getvalue()


def sample_photo_files(fmt: str = "JPEG", names: tuple[str, ...] = _defaults.SAMPLE_PHOTOS) -> list[tuple[str, bytes]]:
    """``(name, file bytes)`` of each sample photo in ``names``; raises ImportError without scikit-image."""
    return [(name, sample_photo_file(name, fmt)) for name in names]


def write_sample_calibration_set(
    folder: str | Path, augmentations: int = _defaults.SAMPLE_CALIBRATION_AUGMENTATIONS
) -> list[Path]:
    """Write scikit-image's calibration photos (none of the gate's) and seeded augmentations of each
    as JPEGs into ``folder``: a calibration set for ``compile-trt --precision int8`` that needs no
    download. Returns the files written."""
    from compile.quantization.datasets import augmented_photos

    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    photos = sample_photo_files("JPEG", _defaults.SAMPLE_CALIBRATION_PHOTOS)
    written = []
    for name, data in augmented_photos(photos, augmentations):
        path = root / f"{name}.jpg"
        path.write_bytes(data)
        written.append(path)
    return written
