"""Tiny image classifiers saved the way transformers and timm save them, for the folder tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

LABELS = ("cat", "coffee", "rocket")


def id2label() -> dict[int, str]:
    return dict(enumerate(LABELS))


def save_transformers(kind: str, folder: Path, seed: int = 0, problem_type: str | None = None) -> Path:
    """A randomly initialized tiny ``kind`` (vit, convnext, resnet) with its processor, via save_pretrained;
    ``problem_type``: its config's (multi_label_classification: a multi-label classifier)."""
    import transformers as tf

    labels = {"id2label": id2label(), "label2id": {v: k for k, v in id2label().items()}}
    if problem_type is not None:
        labels["problem_type"] = problem_type
    if kind == "vit":
        config = tf.ViTConfig(
            image_size=32,
            patch_size=8,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            **labels,
        )
        processor = tf.ViTImageProcessor(size={"height": 32, "width": 32})
    elif kind == "convnext":
        config = tf.ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], **labels)
        processor = tf.ConvNextImageProcessor(size={"shortest_edge": 64}, crop_pct=0.875)
    else:
        config = tf.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", **labels)
        processor = tf.ConvNextImageProcessor(
            size={"shortest_edge": 64},
            crop_pct=0.875,
            resample=2,
            image_mean=[0.485, 0.456, 0.406],
            image_std=[0.229, 0.224, 0.225],
        )
    torch.manual_seed(seed)
    model = tf.AutoModelForImageClassification.from_config(config).eval()
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def save_timm(folder: Path, architecture: str = "resnet18", seed: int = 0) -> Path:
    """A timm model saved the timm way (config.json with architecture and pretrained_cfg, model.safetensors)."""
    import timm
    from timm.models._hub import save_for_hf

    torch.manual_seed(seed)
    model = timm.create_model(architecture, pretrained=False, num_classes=len(LABELS)).eval()
    folder.mkdir(parents=True, exist_ok=True)
    save_for_hf(model, folder, model_config={"label_names": list(LABELS)}, safe_serialization=True)
    config = json.loads((folder / "config.json").read_text())
    assert "architecture" in config and "pretrained_cfg" in config, config
    return folder
