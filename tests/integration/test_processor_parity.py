"""Each transformers image processor vision-serve maps, against transformers in-process.

A tiny randomly initialized model of each architecture (tests/hf_folders.py, non-default and mostly
non-square sizes so that a geometry bug moves pixels) is saved with its processor, then answered two
ways on the same photos: vision-serve's (``folder_entry`` -> its ``PreprocessSpec`` -> the Pillow
reference backend -> ``load_folder_model``) and transformers' own (``AutoImageProcessor`` and
``AutoModelForImageClassification`` on the upright PIL image). Photos: the four samples, an
EXIF-rotated JPEG, a 900x120 strip and a 7x5 thumbnail.

JPEG draft decoding is off: it only starts on photos at least 4x the resize target, which these
photos are for the tiny sizes here but not for a real model's (224 px and up).
"""

from __future__ import annotations

import io

import pytest
import torch

from compile.pretrained_folders import folder_entry, load_folder_model
from compile.sample_photos import sample_photo_file
from preprocessing.base import value_affine
from preprocessing.pil_backend import PilPreprocessor
from tests.hf_folders import LOGIT_SPREAD, save_transformers, transformers_kinds

pytest.importorskip("transformers")

PROBABILITY_TOLERANCE = 5e-3
# Pillow and torchvision's antialiased resizes round to uint8 apart by at most one level (two where
# ConvNeXt's 384 warp enlarges the photo with bicubic); nearest is the same pixels.
PIXEL_LEVELS = 2.0


@pytest.fixture(scope="module")
def photos() -> list[tuple[str, bytes]]:
    from PIL import Image

    files = [(name, sample_photo_file(name)) for name in ("chelsea", "coffee", "astronaut", "rocket")]
    cat = Image.open(io.BytesIO(files[0][1])).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: turn 90 degrees clockwise to show
    files.append(("exif-6", _encode(cat.transpose(Image.Transpose.ROTATE_90), "JPEG", exif=exif)))
    coffee = Image.open(io.BytesIO(files[1][1])).convert("RGB")
    files.append(("wide", _encode(coffee.resize((900, 120)), "PNG")))
    files.append(("tiny", _encode(coffee.resize((7, 5)), "PNG")))
    return files


def _encode(image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def upright(data: bytes):
    from PIL import Image, ImageOps

    return ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")


def transformers_answers(folder, images) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' pixel values and softmax for ``images``, with its own processor and model."""
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    processor = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    model = AutoModelForImageClassification.from_pretrained(folder, local_files_only=True).eval()
    pixels = processor(images=images, return_tensors="pt").pixel_values
    with torch.no_grad():
        return pixels, model(pixel_values=pixels).logits.softmax(-1)


@pytest.mark.parametrize("kind", transformers_kinds())
def test_a_folder_is_served_as_transformers_serves_it(tmp_path, photos, kind) -> None:
    folder = save_transformers(kind, tmp_path / kind, spread=LOGIT_SPREAD)
    entry = folder_entry(str(folder), "transformers")
    model, _ = load_folder_model(entry)
    spec = entry.preprocess
    ours = PilPreprocessor(spec, "cpu", num_threads=1, use_jpeg_draft=False)([data for _, data in photos]).images
    with torch.no_grad():
        mine = model(ours.float().contiguous()).softmax(-1)
    pixels, reference = transformers_answers(folder, [upright(data) for _, data in photos])

    assert ours.shape == pixels.shape, (spec.describe(), ours.shape, pixels.shape)
    # Per channel, in uint8 levels of the input: |ours - theirs| / (rescale / std).
    level = torch.tensor(value_affine(spec)[0]).abs().view(1, 3, 1, 1)
    levels = ((ours - pixels).abs() / level).amax(dim=(1, 2, 3))
    assert levels.max().item() <= PIXEL_LEVELS + 1e-3, dict(zip([n for n, _ in photos], levels.tolist(), strict=True))
    assert torch.equal(mine.argmax(-1), reference.argmax(-1)), (mine, reference)
    assert (mine - reference).abs().max().item() < PROBABILITY_TOLERANCE, (mine - reference).abs().max().item()
    # The head is scaled so that top-1 is decided by the photo, not by noise: the photos disagree.
    assert len(set(reference.argmax(-1).tolist())) > 1 or reference.max(-1).values.min() > 0.5, reference
