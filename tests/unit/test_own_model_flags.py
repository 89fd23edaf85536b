"""The own-model flags without a model run: labels files, the flag syntax, and timm's preprocessing
translated into a PreprocessSpec (checked against timm's own eval transform on real photos)."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from compile.labels import LabelsError, read_labels
from compile.model_request import ModelRequest, check_model_flags, parse_triplet
from compile.model_source import model_kind, served_name_of, timm_preprocess
from compile.settings import CompileSettings
from preprocessing.pil_backend import PilPreprocessor
from service.settings import ServeSettings
from tests.conftest import encode, sample_array


def labels_file(tmp_path, content: bytes):
    path = tmp_path / "labels.txt"
    path.write_bytes(content)
    return path


@pytest.mark.parametrize(
    "content",
    [b"cat\ndog\n", b"cat\ndog", b"\xef\xbb\xbfcat\r\ndog\r\n", b"cat\ndog\n\n\n"],
    ids=["plain", "no final newline", "BOM and CRLF", "trailing blank lines"],
)
def test_a_labels_file_is_one_label_per_line(tmp_path, content: bytes) -> None:
    assert read_labels(labels_file(tmp_path, content)) == ("cat", "dog")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"cat\n\ndog\n", "line 2 is blank"),
        (b"\ncat\n", "line 1 is blank"),
        (b"cat\n dog\n", r"line 2 \(' dog'\) has spaces"),
        (b"", "is empty"),
        (b"\n\n", "is empty"),
        (b"caf\xe9\n", "not UTF-8"),
    ],
)
def test_a_labels_file_that_would_shift_or_garble_classes_is_refused(tmp_path, content: bytes, expected: str) -> None:
    with pytest.raises(LabelsError, match=expected):
        read_labels(labels_file(tmp_path, content))


def test_a_missing_labels_file_says_what_one_is(tmp_path) -> None:
    with pytest.raises(LabelsError, match="one class label per line"):
        read_labels(tmp_path / "nope.txt")


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"name": "my model"}, "--name"),
        ({"name": "-x"}, "--name"),
        ({"name": "a" * 129}, "--name"),
        ({"mean": "0.5,0.5"}, "--mean takes three numbers"),
        ({"std": "a,b,c"}, "--std takes three numbers"),
        ({"interpolation": "lanczos"}, "--interpolation must be one of"),
        ({"crop_size": -1}, "--crop-size must be a size in pixels"),
        ({"resize_size": "256x"}, "--resize-size must be a size in pixels"),
    ],
)
def test_model_flags_are_checked_by_both_commands_before_torch(values: dict, expected: str) -> None:
    for settings_type in (CompileSettings, ServeSettings):
        with pytest.raises(ValueError, match=expected):
            settings_type(**values)


def test_model_flags_parse() -> None:
    check_model_flags(ModelRequest("resnet50", name="prod.resnet-50_v2", mean="0.5,0.5,0.5", interpolation="bicubic"))
    assert parse_triplet("--mean", " 0.485, 0.456,0.406") == (0.485, 0.456, 0.406)
    flags = ModelRequest("m", resize_size=256, std="1,1,1").preprocess_flags  # a number from code: its text
    assert (flags.resize, flags.std, flags.crop, flags.mean) == (256, (1.0,) * 3, None, None)
    assert flags.texts == {"resize_size": "256", "std": "1,1,1"}


@pytest.mark.parametrize(
    ("model", "kind"),
    [
        ("resnet50", "catalog"),
        ("timm:vit_small_patch16_224", "timm"),
        ("a/b.ONNX", "onnx"),
        ("m.pt2", "exported-program"),
    ],
)
def test_model_kinds(model: str, kind: str) -> None:
    assert model_kind(model) == kind


def test_served_names_made_from_files_fit_urls() -> None:
    assert served_name_of("my model (v2)") == "my-model-v2"
    assert served_name_of("...") == "model"


TIMM_MODELS = ("mobilenetv3_small_100", "vit_small_patch16_224", "resnet50", "convnext_tiny")


@pytest.mark.parametrize("name", TIMM_MODELS)
def test_timm_preprocessing_is_timms_own_eval_transform(name: str) -> None:
    """Pixel for pixel: Pillow resize and center crop as timm's transform does them (both are
    torchvision over Pillow). Bound: 0 uint8 levels on lossless photos (JPEG draft off: big photos
    are decoded at reduced scale first, docs/preprocessing.md)."""
    import timm
    import timm.data
    import torch

    from compile.model_source import timm_entry

    spec = timm_entry(name).preprocess
    config = timm.data.resolve_model_data_config(timm.create_model(name, pretrained=False))
    theirs_transform = timm.data.create_transform(**config)
    ours = PilPreprocessor(spec, "cpu", num_threads=1, use_jpeg_draft=False)
    std = torch.tensor(spec.std).view(3, 1, 1)
    for photo in ("chelsea", "coffee", "astronaut", "rocket"):
        data = encode(sample_array(photo), "PNG")
        theirs = theirs_transform(Image.open(io.BytesIO(data)).convert("RGB"))
        levels = ((ours([data]).images.float()[0] - theirs).abs() * std * 255).max().item()
        assert levels < 1e-3, (name, photo, levels)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"interpolation": "lanczos"}, "interpolation is 'lanczos'"),
        ({"interpolation": "hamming"}, "interpolation is 'hamming'"),
        ({"crop_border_pixels": 2}, "crop_border_pixels is 2"),
    ],
)
def test_timm_preprocessing_we_cannot_reproduce_is_refused(config: dict, expected: str) -> None:
    base = {"input_size": (3, 224, 224), "interpolation": "bicubic", "mean": (0.5,) * 3, "std": (0.5,) * 3}
    with pytest.raises(ValueError, match=expected):
        timm_preprocess("x", {**base, "crop_pct": 0.9, **config})
    assert timm_preprocess("x", {**base, "crop_pct": 0.9}).resize_size == 248  # floor(224 / 0.9)
