"""The models vision-serve knows: how to preprocess for each, and what its classes are called.

`resnet152` is the default; any torchvision classification model works by name, with the
preprocessing and labels of its default weights; `efficientnet-lite0` ships its pretrained
weights in a registry package, so it gives real predictions offline.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass

import torchvision
from torchvision.models import ResNet152_Weights, get_model_weights

from compile import _defaults
from compile.manifest import Manifest
from compile.settings_errors import SettingsError
from preprocessing.spec import PreprocessSpec

EFFICIENTNET_LITE_MODELS = {"efficientnet-lite0": 224}


@dataclass(frozen=True)
class ModelEntry:
    """One servable model: its served name, where its architecture comes from, its input contract."""

    name: str  # the served name (OIP routes, answers, /info)
    family: str  # "torchvision", "efficientnet-lite", "timm", "onnx" or "exported-program"
    preprocess: PreprocessSpec
    labels: tuple[str, ...]  # their number is the number of classes
    labels_source: str
    model: str = ""  # what --model said (a catalog name, "timm:<name>", a file path); empty: ``name``
    # What turns its logits into scores (compile/_defaults.py ACTIVATIONS); the server's --activation overrides it.
    activation: str = _defaults.MODEL_ACTIVATION

    def __post_init__(self) -> None:
        if not self.model:
            object.__setattr__(self, "model", self.name)

    @property
    def num_classes(self) -> int:
        return len(self.labels)


@functools.cache
def imagenet_labels() -> tuple[str, ...]:
    """ImageNet-1k class names in index order, from torchvision's metadata (no download)."""
    return tuple(ResNet152_Weights.DEFAULT.meta["categories"])


@functools.cache
def torchvision_classifiers() -> tuple[str, ...]:
    """Classification models in torchvision (not detection, segmentation, video or quantized)."""
    return tuple(torchvision.models.list_models(module=torchvision.models))


def known_models() -> list[str]:
    return sorted(EFFICIENTNET_LITE_MODELS) + list(torchvision_classifiers())


def get_model_entry(name: str) -> ModelEntry:
    """The catalog entry for ``name``; raises ``ValueError`` with close matches if unknown."""
    if name in EFFICIENTNET_LITE_MODELS:
        crop = EFFICIENTNET_LITE_MODELS[name]
        return ModelEntry(
            name=name,
            family="efficientnet-lite",
            preprocess=PreprocessSpec(
                resize_size=crop + 32,
                crop_size=crop,
                mean=_defaults.EFFICIENTNET_LITE_MEAN,
                std=_defaults.EFFICIENTNET_LITE_STD,
                interpolation="bilinear",
            ),
            labels=imagenet_labels(),
            labels_source=_defaults.IMAGENET_LABELS_SOURCE,
        )
    if name in torchvision_classifiers():
        weights = get_model_weights(name).DEFAULT
        preset = weights.transforms()
        return ModelEntry(
            name=name,
            family="torchvision",
            preprocess=PreprocessSpec(
                resize_size=preset.resize_size[0],
                crop_size=preset.crop_size[0],
                mean=tuple(preset.mean),
                std=tuple(preset.std),
                interpolation=preset.interpolation.value,
            ),
            labels=tuple(weights.meta["categories"]),
            labels_source=f"torchvision.models.{weights}.meta['categories']",
        )
    close = difflib.get_close_matches(name, known_models(), n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise SettingsError(
        "--model",
        name,
        f"Unknown model {name!r}.{hint}",
        "Use 'resnet152' (default), 'efficientnet-lite0' (ships its weights, works offline) or any torchvision "
        "classification model name, e.g. 'resnet50'.",
    )


def entry_from_manifest(manifest: Manifest) -> ModelEntry:
    """The entry an artifact was compiled from, as its manifest records it."""
    return ModelEntry(
        name=manifest.served_name,
        family=manifest.model_family,
        preprocess=manifest.preprocess,
        labels=manifest.labels,
        labels_source=manifest.labels_source,
        model=manifest.model,
        activation=manifest.activation,
    )
