"""The image sets of a quantized compile: the calibration set (--calibration DIR) and the gate's
evaluation set (--eval DIR, or the sample photos and their augmentations), read once, checked, and
preprocessed exactly as the server preprocesses what it serves.

Every problem with a set is a ``DatasetError`` (a ``ValueError``: compile-trt answers it as a usage
error, exit code 2) that names the folder, the files and what to do.
"""

from __future__ import annotations

import hashlib
import io
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageEnhance, ImageFilter

from compile import _defaults
from preprocessing.pil_backend import PilPreprocessor
from preprocessing.spec import PreprocessSpec

logger = logging.getLogger(__name__)

# How many bad file names an error lists before it says "and N more".
LISTED_FILES = 5


class DatasetError(ValueError):
    """A calibration or evaluation set that cannot be used; the message says which files and why."""


@dataclass(frozen=True)
class ImageFiles:
    """Encoded images read from one folder (or made from the sample photos), in a fixed order."""

    source: str  # the folder as given, or a description of the built-in set
    files: tuple[tuple[str, bytes], ...]  # (name relative to the folder, file bytes)
    found: int  # image files in the folder, before sampling down to the count asked for

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.files]

    @property
    def digest(self) -> str:
        return files_digest(self.files)

    def describe(self) -> dict[str, object]:
        """What the manifest records of the set."""
        return {"source": self.source, "count": len(self.files), "found": self.found, "sha256": self.digest}


def files_digest(files: Sequence[tuple[str, bytes]]) -> str:
    """sha256 over names and contents: two compiles calibrated on the same files agree on it."""
    digest = hashlib.sha256()
    for name, data in sorted(files):
        digest.update(name.encode())
        digest.update(hashlib.sha256(data).digest())
    return digest.hexdigest()


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:LISTED_FILES])
    return shown + (f" and {len(items) - LISTED_FILES} more" if len(items) > LISTED_FILES else "")


def read_image_folder(folder: str, flag: str, count: int, seed: int = _defaults.CALIBRATION_SEED) -> ImageFiles:
    """Up to ``count`` image files of ``folder`` and its subfolders (a seeded sample when it holds more)."""
    root = Path(folder).expanduser()
    if not root.exists():
        raise DatasetError(f"{flag} {folder!r} does not exist. Give a folder of images.")
    if not root.is_dir():
        raise DatasetError(f"{flag} {folder!r} is a file. Give the folder that holds the images.")
    try:
        paths = sorted(p for p in root.rglob("*") if p.suffix.lower() in _defaults.IMAGE_SUFFIXES and p.is_file())
    except OSError as exc:
        raise DatasetError(
            f"{flag} {folder!r} cannot be read ({exc.strerror or exc}). Check its permissions."
        ) from None
    if not paths:
        suffixes = ", ".join(_defaults.IMAGE_SUFFIXES)
        raise DatasetError(f"{flag} {folder!r} holds no images (files ending in {suffixes}, in it or its subfolders).")
    found = len(paths)
    if found > count:
        paths = sorted(random.Random(seed).sample(paths, count))
    files, problems = [], []
    for path in paths:
        name = path.relative_to(root).as_posix()
        try:
            size = path.stat().st_size
            if size > _defaults.MAX_DATASET_IMAGE_BYTES:
                problems.append(f"{name} ({size} bytes, over {_defaults.MAX_DATASET_IMAGE_BYTES})")
                continue
            data = path.read_bytes()
        except OSError as exc:
            problems.append(f"{name} ({exc.strerror or exc})")
            continue
        if not data:
            problems.append(f"{name} (empty)")
            continue
        files.append((name, data))
    if problems:
        raise DatasetError(
            f"{flag} {folder!r}: {len(problems)} of {len(paths)} images cannot be read: {_listed(problems)}. "
            "Remove or fix them."
        )
    return ImageFiles(str(folder), tuple(files), found)


def preprocess_files(files: ImageFiles, spec: PreprocessSpec, flag: str) -> torch.Tensor:
    """The images as the server feeds them to the engine: float32 NCHW, normalized, on the CPU.

    A file that does not decode is an error naming it: a set the server could not read either is
    not what the engine should be calibrated or judged on.
    """
    preprocessor = PilPreprocessor(spec, "cpu", num_threads=max(1, torch.get_num_threads()))
    parts, bad = [], []
    step = 64  # bounds the decoded uint8 images held at once
    for start in range(0, len(files.files), step):
        chunk = files.files[start : start + step]
        prepared = preprocessor([data for _, data in chunk])
        bad.extend(f"{chunk[i][0]} ({error})" for i, error in enumerate(prepared.errors) if error is not None)
        if not bad:
            parts.append(prepared.images.float().contiguous())
    if bad:
        raise DatasetError(
            f"{flag} {files.source!r}: {len(bad)} of {len(files.files)} images do not decode: {_listed(bad)}. "
            "Remove them, or convert them to JPEG or PNG."
        )
    return torch.cat(parts)


def augmented_photos(
    photos: list[tuple[str, bytes]], per_photo: int, seed: int = _defaults.CALIBRATION_SEED
) -> list[tuple[str, bytes]]:
    """Each photo, then ``per_photo`` seeded variants of it as JPEGs: a crop of 50-100% of its area at
    3:4..4:3, a mirror half the time, a tilt of up to 10 degrees, brightness, contrast and colour
    within 25%, a slight blur a third of the time, and a JPEG quality of 60..95."""
    rng = np.random.default_rng(seed)
    out: list[tuple[str, bytes]] = []
    for name, data in photos:
        out.append((name, data))
        original = Image.open(io.BytesIO(data)).convert("RGB")
        for index in range(per_photo):
            image = _tilt(original, float(rng.uniform(-10, 10)))
            image = _random_crop(image, rng)
            if rng.random() < 0.5:
                image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            image = ImageEnhance.Brightness(image).enhance(float(rng.uniform(0.75, 1.25)))
            image = ImageEnhance.Contrast(image).enhance(float(rng.uniform(0.75, 1.25)))
            image = ImageEnhance.Color(image).enhance(float(rng.uniform(0.75, 1.25)))
            if rng.random() < 1 / 3:
                image = image.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.3, 1.2))))
            buffer = io.BytesIO()
            image.save(buffer, format="JPEG", quality=int(rng.integers(60, 96)))
            out.append((f"{name}-aug{index:02d}", buffer.getvalue()))
    return out


def _tilt(image: Image.Image, degrees: float) -> Image.Image:
    """Rotated, then cropped to the largest centred rectangle without the corners it brings in."""
    rotated = image.rotate(degrees, resample=Image.Resampling.BILINEAR)
    width, height = image.size
    angle = abs(np.deg2rad(degrees))
    keep = 1.0 / (np.cos(angle) + np.sin(angle) * max(width, height) / min(width, height))
    w, h = int(width * keep), int(height * keep)
    left, top = (width - w) // 2, (height - h) // 2
    return rotated.crop((left, top, left + w, top + h))


def _random_crop(image: Image.Image, rng: np.random.Generator) -> Image.Image:
    width, height = image.size
    area = width * height * rng.uniform(0.5, 1.0)
    ratio = float(np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3))))
    w = int(min(width, round(np.sqrt(area * ratio))))
    h = int(min(height, round(np.sqrt(area / ratio))))
    left = int(rng.integers(0, width - w + 1))
    top = int(rng.integers(0, height - h + 1))
    return image.crop((left, top, left + w, top + h))


def thumbnails(images: torch.Tensor) -> torch.Tensor:
    """16x16 average-pooled images, flattened: what two copies of one photo share after preprocessing."""
    return F.adaptive_avg_pool2d(images.float(), 16).flatten(1)


def check_disjoint(
    calibration: torch.Tensor, calibration_names: list[str], evaluation: torch.Tensor, evaluation_names: list[str]
) -> None:
    """Refuse an evaluation set that holds calibration images: the gate would grade the engine on
    what it was calibrated with. Copies are found on their preprocessed thumbnails, so a photo saved
    again (another format or quality) is found too."""
    evaluated = thumbnails(evaluation)
    distance = torch.cdist(evaluated, thumbnails(calibration), p=1) / evaluated.shape[1]  # mean |difference|
    same = (distance < _defaults.NEAR_DUPLICATE_DISTANCE).nonzero().tolist()
    if same:
        pairs = [f"{evaluation_names[e]} = {calibration_names[c]}" for e, c in same]
        raise DatasetError(
            f"{len(pairs)} evaluation images are also in the calibration set: {_listed(pairs)}. The gate must "
            "judge the engine on images it was not calibrated with: remove them from one of the two folders "
            "(--calibration, --eval)."
        )
