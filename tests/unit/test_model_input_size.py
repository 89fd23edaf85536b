"""A non-square model input (``PreprocessSpec.input_size`` = (height, width), here 48 high and 64
wide) where the compile side builds inputs or checks shapes without a backend: the gate's inputs and
a model file's fixed image size. Every check tells (48, 64) from the swapped (64, 48)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn

from compile.catalog import get_model_entry
from compile.gate import gate_inputs
from compile.model_files import ModelFileError, ModelFileFacts, read_model_file
from compile.model_request import ModelRequest
from compile.model_source import resolve_model
from compile.sample_photos import sample_photo_file
from preprocessing.pil_backend import PilPreprocessor
from preprocessing.spec import PreprocessSpec
from tests.conftest import encode, sample_array

NON_SQUARE = PreprocessSpec(0, 0, (0.5,) * 3, (0.25,) * 3, resize_mode="exact", resize_height=48, resize_width=64)


def odd_photos() -> list[tuple[str, bytes]]:
    """A real photo, one stored sideways with an EXIF rotation, a 900x120 strip and a 7x5 speck."""
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display, as phones store portraits
    sideways = Image.fromarray(sample_array("astronaut")).transpose(Image.Transpose.ROTATE_90)
    return [
        ("chelsea", sample_photo_file("chelsea")),
        ("sideways", encode(sideways, quality=95, exif=exif)),
        ("wide", encode(Image.fromarray(sample_array("rocket")).resize((900, 120)))),
        ("tiny", encode(Image.fromarray(sample_array("coffee")).resize((7, 5)), "PNG")),
    ]


def test_the_gates_inputs_are_height_by_width_photos_then_random_images() -> None:
    entry = dataclasses.replace(get_model_entry("efficientnet-lite0"), preprocess=NON_SQUARE)
    photos = odd_photos()
    inputs = gate_inputs(entry, photos, random_count=3, seed=0)
    assert inputs.images.shape == (7, 3, 48, 64) and inputs.real_count == 4
    assert inputs.names == ["chelsea", "sideways", "wide", "tiny", "random-0", "random-1", "random-2"]
    served = PilPreprocessor(NON_SQUARE, "cpu", num_threads=1)([data for _, data in photos]).images
    torch.testing.assert_close(inputs.images[:4], served.float())  # the photos exactly as the server sees them


@pytest.fixture(scope="module")
def fixed_48x64_onnx(tmp_path_factory) -> Path:
    """An ONNX classifier with a fixed 48x64 image input and a dynamic batch, as made elsewhere."""
    pytest.importorskip("onnxscript")
    from compile.backends.onnx import export_kwargs

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    path = tmp_path_factory.mktemp("fixed") / "fixed.onnx"
    with torch.no_grad():
        torch.onnx.export(model.eval(), (torch.randn(2, 3, 48, 64),), str(path), **export_kwargs((1, 4, 8)))
    return path


def test_a_files_fixed_image_size_is_checked_as_height_by_width(fixed_48x64_onnx) -> None:
    facts = read_model_file(str(fixed_48x64_onnx))
    assert facts.image_size == (48, 64)
    facts.check_crop((48, 64))
    with pytest.raises(ModelFileError) as swapped:
        facts.check_crop((64, 48))
    message = str(swapped.value)
    assert "takes 48x64 images" in message and "gives 64x48" in message and "--crop-size 48x64" in message
    with pytest.raises(ModelFileError, match="Pass --crop-size 48x64"):
        facts.check_crop((48, 48))


def test_a_dynamic_side_takes_any_size_and_a_square_file_asks_for_one_number() -> None:
    free_height = ModelFileFacts(Path("m.onnx"), "onnx", "x", "y", 3, (None, 64), (1, None))
    free_height.check_crop((48, 64))
    free_height.check_crop((300, 64))
    with pytest.raises(ModelFileError, match=r"takes anyx64 images .* Pass --crop-size 48x64"):
        free_height.check_crop((48, 48))
    square = ModelFileFacts(Path("m.onnx"), "onnx", "x", "y", 3, (32, 32), (1, None))
    with pytest.raises(ModelFileError, match=r"takes 32x32 images .* Pass --crop-size 32 "):
        square.check_crop((24, 24))


def test_resolving_a_file_checks_the_preprocessings_input_against_it(fixed_48x64_onnx, tmp_path) -> None:
    labels = tmp_path / "labels.txt"
    labels.write_text("a\nb\nc\n")
    request = ModelRequest(
        model=str(fixed_48x64_onnx),
        labels=str(labels),
        resize_size=64,
        crop_size=48,
        mean="0.5,0.5,0.5",
        std="0.5,0.5,0.5",
    )
    with pytest.raises(ModelFileError, match=r"gives 48x48 \(--crop-size\)\. Pass --crop-size 48x64"):
        resolve_model(request)
