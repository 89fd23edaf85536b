"""The benchmark photos: real scikit-image photos as ImageNet-sized JPEGs, written once to a folder.

    python -m service.tune.images /tmp/bench-images     # 12 JPEGs, 500x375 and 375x500, ~40-70 kB

Every experiment cycles the same folder (``service.tune.loadgen --images DIR``), so vision-serve and
TorchServe see identical bytes. Any folder of JPEG/PNG/WebP files works in its place.
"""

from __future__ import annotations

import argparse
import io
import logging
from pathlib import Path

import numpy as np
from PIL import Image

from compile._defaults import IMAGE_SUFFIXES
from compile.sample_photos import sample_photo

logger = logging.getLogger(__name__)

# skimage.data colour photos that ship with the package (no download).
PHOTOS = ("chelsea", "coffee", "astronaut", "rocket", "hubble_deep_field", "immunohistochemistry")
IMAGENET_SIZE = (500, 375)  # width x height of a typical ImageNet validation photo
JPEG_QUALITY = 90
NOISE_SIGMA = 4.0  # sensor-like noise, so JPEG sizes look like photos rather than clean renders


def photo_jpegs(width: int, height: int, sources: tuple[str, ...] = PHOTOS, seed: int = 0) -> list[bytes]:
    """One JPEG per source photo: center-cropped to the target aspect, Lanczos-resized, noise added."""
    rng = np.random.default_rng(seed)
    jpegs = []
    for name in sources:
        photo = Image.fromarray(sample_photo(name))
        scale = min(photo.width / width, photo.height / height)
        crop_w, crop_h = round(width * scale), round(height * scale)
        left, top = (photo.width - crop_w) // 2, (photo.height - crop_h) // 2
        resized = photo.crop((left, top, left + crop_w, top + crop_h)).resize((width, height), Image.Resampling.LANCZOS)
        pixels = np.asarray(resized, dtype=np.float32)
        pixels += rng.standard_normal(pixels.shape, dtype=np.float32) * NOISE_SIGMA
        buf = io.BytesIO()
        Image.fromarray(np.clip(pixels + 0.5, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=JPEG_QUALITY)
        jpegs.append(buf.getvalue())
    return jpegs


def write_benchmark_images(directory: Path) -> list[Path]:
    """Landscape and portrait ImageNet-sized JPEGs of every photo in ``directory``; returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    width, height = IMAGENET_SIZE
    paths = []
    for orientation, (w, h) in (("landscape", (width, height)), ("portrait", (height, width))):
        for name, jpeg in zip(PHOTOS, photo_jpegs(w, h), strict=True):
            path = directory / f"{name}-{orientation}.jpg"
            path.write_bytes(jpeg)
            paths.append(path)
    logger.info("Wrote %d benchmark images to %s", len(paths), directory)
    return paths


def read_images(directory: Path) -> list[bytes]:
    """The image files of ``directory`` (by suffix, sorted by name), as bytes."""
    directory = Path(directory)
    paths = sorted(p for p in directory.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES) if directory.is_dir() else []
    if not paths:
        raise ValueError(
            f"{directory} holds no images ({', '.join(IMAGE_SUFFIXES)}); write the benchmark set with "
            f"`python -m service.tune.images {directory}`."
        )
    return [p.read_bytes() for p in paths]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    args = parser.parse_args()
    for path in write_benchmark_images(args.directory):
        print(f"{path}  {path.stat().st_size // 1024} kB")


if __name__ == "__main__":
    main()
