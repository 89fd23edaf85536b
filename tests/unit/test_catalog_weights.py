"""Model catalog entries and the three ways of getting weights."""

from __future__ import annotations

import logging
import urllib.error

import pytest
import torch
import torchvision

from compile.catalog import get_model_entry, imagenet_labels, known_models
from compile.weights import WeightsError, load_model, torchvision_cache_file


def test_resnet152_is_the_default_with_torchvision_preprocessing() -> None:
    from compile import _defaults

    entry = get_model_entry(_defaults.DEFAULT_MODEL)
    assert entry.name == "resnet152" and entry.family == "torchvision"
    spec = entry.preprocess
    # DEFAULT is IMAGENET1K_V2, trained and evaluated with a 232 resize (V1 used 256).
    assert (spec.resize_size, spec.crop_size, spec.interpolation) == (232, 224, "bilinear")
    assert spec.mean == pytest.approx((0.485, 0.456, 0.406)) and spec.std == pytest.approx((0.229, 0.224, 0.225))
    assert entry.num_classes == 1000 and entry.labels[281] == "tabby" and entry.labels[967] == "espresso"


def test_any_torchvision_classifier_by_name_uses_its_own_preset() -> None:
    entry = get_model_entry("efficientnet_v2_s")  # a model whose preset differs from ResNet's
    assert entry.family == "torchvision"
    assert (entry.preprocess.resize_size, entry.preprocess.crop_size) == (384, 384)
    assert entry.preprocess.interpolation == "bilinear"
    assert "vit_b_16" in known_models() and "maskrcnn_resnet50_fpn" not in known_models()


def test_efficientnet_lite0_uses_tf_lite_normalization_and_imagenet_labels() -> None:
    entry = get_model_entry("efficientnet-lite0")
    assert entry.family == "efficientnet-lite"
    assert (entry.preprocess.resize_size, entry.preprocess.crop_size) == (256, 224)
    assert entry.preprocess.mean == pytest.approx((127 / 255,) * 3)
    assert entry.labels == imagenet_labels()


def test_unknown_model_suggests_close_names() -> None:
    with pytest.raises(ValueError, match="Did you mean 'resnet152'"):
        get_model_entry("resnet125")


def test_imagenet_download_failure_names_the_offline_options(monkeypatch, tmp_path) -> None:
    """The network is the boundary here: make the download fail as it does offline."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))

    def offline(*args, **kwargs):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(torch.hub, "urlopen", offline)
    with pytest.raises(WeightsError) as caught:
        load_model(get_model_entry("resnet18"), "imagenet")
    message = str(caught.value)
    assert "--weights PATH" in message and "--weights random" in message
    assert str(tmp_path / "hub" / "checkpoints" / "resnet18-f37072fd.pth") in message


def test_imagenet_weights_come_from_torchvisions_cache(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    entry = get_model_entry("resnet18")
    cached = torchvision.models.resnet18()
    cache_file = torchvision_cache_file(entry)
    cache_file.parent.mkdir(parents=True)
    torch.save(cached.state_dict(), cache_file)
    loaded = load_model(entry, "imagenet")
    assert loaded.weights_source == "imagenet:ResNet18_Weights.IMAGENET1K_V1"
    assert loaded.weights_file == cache_file
    assert torch.equal(loaded.module.fc.weight, cached.fc.weight)


def test_random_weights_are_seeded_and_warn_loudly(caplog) -> None:
    entry = get_model_entry("resnet18")
    with caplog.at_level(logging.WARNING):
        first = load_model(entry, "random")
    second = load_model(entry, "random")
    assert torch.equal(first.module.fc.weight, second.module.fc.weight)
    assert not torch.equal(first.module.fc.weight, load_model(entry, "random", seed=1).module.fc.weight)
    assert "MEANINGLESS" in caplog.text and first.weights_source == "random(seed=0)"


WRAPPINGS = {
    "plain": lambda sd: sd,
    "checkpoint-dict": lambda sd: {"state_dict": sd},
    "data-parallel": lambda sd: {f"module.{k}": v for k, v in sd.items()},
}


@pytest.mark.parametrize("wrap", WRAPPINGS.values(), ids=WRAPPINGS.keys())
def test_state_dict_file(tmp_path, wrap) -> None:
    source = torchvision.models.resnet18()
    path = tmp_path / "weights.pt"
    torch.save(wrap(source.state_dict()), path)
    loaded = load_model(get_model_entry("resnet18"), str(path))
    assert loaded.weights_source == f"file:{path}" and not loaded.module.training
    assert torch.equal(loaded.module.conv1.weight, source.conv1.weight)


def test_state_dict_of_another_architecture_is_explained(tmp_path) -> None:
    path = tmp_path / "resnet18.pt"
    torch.save(torchvision.models.resnet18().state_dict(), path)
    with pytest.raises(WeightsError, match="does not fit the resnet34 architecture"):
        load_model(get_model_entry("resnet34"), str(path))


def test_missing_or_unreadable_weights_file(tmp_path) -> None:
    with pytest.raises(WeightsError, match="not found"):
        load_model(get_model_entry("resnet18"), str(tmp_path / "nope.pt"))
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(WeightsError, match="Could not read"):
        load_model(get_model_entry("resnet18"), str(garbage))


def test_efficientnet_lite0_loads_its_packaged_pretrained_weights() -> None:
    loaded = load_model(get_model_entry("efficientnet-lite0"), "imagenet")
    assert loaded.weights_file is not None and loaded.weights_file.name.startswith("efficientnet-lite0")
    # The Lite variants use ReLU6 (not swish) throughout.
    assert isinstance(loaded.module._swish, torch.nn.ReLU6)
