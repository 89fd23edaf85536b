"""Folders saved by transformers (save_pretrained) and timm (save_for_hf): detection, labels, and their
preprocessing as a PreprocessSpec, checked against the library's own image processor on real photos."""

from __future__ import annotations

import json

import pytest

from compile.model_request import ModelRequest
from compile.model_source import model_kind, resolve_model, timm_preprocess
from compile.settings_errors import SettingsError
from preprocessing.pil_backend import PilPreprocessor
from tests.conftest import encode, sample_array

pytest.importorskip("transformers")


def transformers_folder(tmp_path, processor, id2label=None):
    folder = tmp_path / "model"
    folder.mkdir()
    id2label = {"0": "cat", "1": "coffee", "2": "rocket"} if id2label is None else id2label
    config = {"architectures": ["ConvNextForImageClassification"], "model_type": "convnext", "id2label": id2label}
    (folder / "config.json").write_text(json.dumps(config))
    processor.save_pretrained(folder)
    return folder


def convnext_processor(**kwargs):
    from transformers import ConvNextImageProcessor

    return ConvNextImageProcessor(**{"size": {"shortest_edge": 64}, "crop_pct": 0.875, **kwargs})


def test_folders_are_recognized_by_their_config(tmp_path) -> None:
    folder = transformers_folder(tmp_path, convnext_processor())
    assert model_kind(str(folder)) == "transformers"
    timm_dir = tmp_path / "timm"
    timm_dir.mkdir()
    (timm_dir / "config.json").write_text(json.dumps({"architecture": "resnet18", "pretrained_cfg": {}}))
    assert model_kind(str(timm_dir)) == "timm-folder"
    assert model_kind(str(tmp_path)) == "catalog"  # no config.json: a name, as before


def test_labels_come_from_id2label_in_index_order(tmp_path) -> None:
    folder = transformers_folder(tmp_path, convnext_processor(), {"2": "rocket", "0": "cat", "1": "coffee"})
    entry = resolve_model(ModelRequest(model=str(folder)))
    assert entry.labels == ("cat", "coffee", "rocket")
    assert entry.family == "transformers"
    assert entry.labels_source.endswith("config.json:id2label")


def test_labels_with_a_gap_are_refused(tmp_path) -> None:
    folder = transformers_folder(tmp_path, convnext_processor(), {"0": "cat", "2": "rocket"})
    with pytest.raises(SettingsError, match="no id2label with ids"):
        resolve_model(ModelRequest(model=str(folder)))


def test_the_labels_flag_overrides_the_folders(tmp_path) -> None:
    labels = tmp_path / "labels.txt"
    labels.write_text("a\nb\nc\n")
    folder = transformers_folder(tmp_path, convnext_processor())
    entry = resolve_model(ModelRequest(model=str(folder), labels=str(labels), crop_size=48))
    assert entry.labels == ("a", "b", "c")
    assert entry.preprocess.crop_size == 48  # a preprocessing flag overrides the processor's


def resnet_processor():
    # What microsoft/resnet-50 saves: ConvNextImageProcessor, bilinear, ImageNet's mean and std.
    return convnext_processor(resample=2, image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])


@pytest.mark.parametrize("make", [convnext_processor, resnet_processor], ids=["convnext", "resnet"])
def test_the_spec_gives_the_processors_pixel_values(tmp_path, make) -> None:
    """Bound: a few uint8 levels (transformers resizes with torchvision, vision-serve with Pillow)."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor

    folder = transformers_folder(tmp_path, make())
    spec = resolve_model(ModelRequest(model=str(folder))).preprocess
    assert (spec.resize_size, spec.crop_size) == (73, 64)  # int(64 / 0.875), then the crop
    theirs_processor = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    ours = PilPreprocessor(spec, "cpu", num_threads=1, use_jpeg_draft=False)
    std = torch.tensor(spec.std).view(3, 1, 1)
    for photo in ("chelsea", "coffee", "astronaut"):
        data = encode(sample_array(photo), "PNG")
        theirs = theirs_processor(images=Image.fromarray(sample_array(photo)), return_tensors="pt").pixel_values[0]
        diff = (ours([data]).images.float()[0] - theirs).abs() * std * 255
        assert diff.mean().item() < 1.0 and diff.max().item() < 40, (photo, diff.mean().item(), diff.max().item())


def test_vits_exact_resize_is_served_and_the_flags_still_override_it(tmp_path) -> None:
    """ViT's processor squashes a photo to its {height, width}: served as that exact resize now
    (tests/unit/test_hf_processors.py has every class), and the flags still replace it part by part."""
    from transformers import ViTImageProcessor

    folder = transformers_folder(tmp_path, ViTImageProcessor(size={"height": 32, "width": 48}))
    spec = resolve_model(ModelRequest(model=str(folder))).preprocess
    assert (spec.resize_mode, spec.input_size, spec.crop_height, spec.crop_rounding) == ("exact", (32, 48), 0, "floor")
    entry = resolve_model(ModelRequest(model=str(folder), resize_size="32", crop_size="32", interpolation="bicubic"))
    assert (entry.preprocess.resize_mode, entry.preprocess.resize_size, entry.preprocess.crop_size) == (
        "shorter",
        32,
        32,
    )


def test_a_timm_folder_uses_its_pretrained_cfg(tmp_path) -> None:
    folder = tmp_path / "timm"
    folder.mkdir()
    cfg = {"input_size": [3, 224, 224], "interpolation": "bicubic", "crop_pct": 0.95, "crop_mode": "center",
           "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}  # fmt: skip
    config = {"architecture": "resnet18", "label_names": ["a", "b"], "pretrained_cfg": cfg}
    (folder / "config.json").write_text(json.dumps(config))
    entry = resolve_model(ModelRequest(model=str(folder)))
    assert entry.family == "timm-folder" and entry.labels == ("a", "b")
    assert entry.preprocess == timm_preprocess("resnet18", cfg)
