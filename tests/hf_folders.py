"""Tiny image classifiers saved the way transformers and timm save them, for the folder tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

LABELS = ("cat", "coffee", "rocket")
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
# Logit spread the classifier head is scaled to: a random tiny model's softmax is nearly flat, so its
# top-1 would be decided by noise; with logits a few units apart it means something.
LOGIT_SPREAD = 3.0


def id2label() -> dict[int, str]:
    return dict(enumerate(LABELS))


def _architectures(tf) -> dict:
    """kind -> (model config maker, processor maker): each processor with non-default sizes (a non-square
    input where the model takes one), so that a geometry bug changes the pixels."""
    vit_like = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}
    return {
        # ViT's processor: an exact (aspect-ratio-changing) resize; also Swin's.
        "vit": (
            lambda: tf.ViTConfig(image_size=(40, 56), patch_size=8, **vit_like),
            lambda: tf.ViTImageProcessor(size={"height": 40, "width": 56}),
        ),
        "swin": (
            lambda: tf.SwinConfig(image_size=(40, 56), patch_size=4, embed_dim=8, depths=[1], num_heads=[1]),
            lambda: tf.ViTImageProcessor(
                size={"height": 40, "width": 56}, resample=3, image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD
            ),
        ),
        # DeiT's: an exact resize, then a (non-square) center crop with int() offsets.
        "deit": (
            lambda: tf.DeiTConfig(image_size=(40, 56), patch_size=8, **vit_like),
            lambda: tf.DeiTImageProcessor(size={"height": 51, "width": 61}, crop_size={"height": 40, "width": 56}),
        ),
        "beit": (
            lambda: tf.BeitConfig(image_size=(40, 56), patch_size=8, **vit_like),
            lambda: tf.BeitImageProcessor(size={"height": 40, "width": 56}),
        ),
        # ConvNeXt's: below 384 the shorter side to int(48 / 0.875) = 54, then a 48 crop; from 384 a warp.
        "convnext": (
            lambda: tf.ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1]),
            lambda: tf.ConvNextImageProcessor(size={"shortest_edge": 48}, crop_pct=0.875),
        ),
        "convnext-384": (
            lambda: tf.ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1]),
            lambda: tf.ConvNextImageProcessor(size={"shortest_edge": 384}, resample=2),
        ),
        "convnextv2": (
            lambda: tf.ConvNextV2Config(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1]),
            lambda: tf.ConvNextImageProcessor(size={"shortest_edge": 52}, crop_pct=0.95),
        ),
        "resnet": (
            lambda: tf.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic"),
            lambda: tf.ConvNextImageProcessor(
                size={"shortest_edge": 64}, crop_pct=0.875, resample=2, image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD
            ),
        ),
        "regnet": (
            lambda: tf.RegNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=8),
            lambda: tf.ConvNextImageProcessor(size={"shortest_edge": 44}, crop_pct=0.9, resample=2),
        ),
        # MobileViT's: shorter side 41, then a 48 x 40 crop (padded with 0 where 48 > 41), BGR, no normalize.
        "mobilevit": (
            lambda: tf.MobileViTConfig(
                image_size=48,
                hidden_sizes=[16, 16, 16],
                neck_hidden_sizes=[8, 8, 8, 8, 8, 8, 16],
                num_attention_heads=2,
            ),
            lambda: tf.MobileViTImageProcessor(size={"shortest_edge": 41}, crop_size={"height": 48, "width": 40}),
        ),
        # EfficientNet's: rescale_offset and include_top, a normalization done twice (folded into one).
        "efficientnet": (
            lambda: tf.EfficientNetConfig(image_size=48, width_coefficient=0.1, depth_coefficient=0.1, hidden_dim=128),
            lambda: tf.EfficientNetImageProcessor(
                size={"height": 43, "width": 57},
                do_center_crop=True,
                crop_size={"height": 40, "width": 48},
                rescale_offset=True,
                include_top=True,
            ),
        ),
        # LeViT's: shortest_edge 49 scaled by 256/224 to 56, then a 48 crop (LeViT takes a square input).
        "levit": (
            lambda: tf.LevitConfig(
                image_size=48,
                hidden_sizes=[32, 48, 64],
                num_attention_heads=[2, 2, 2],
                depths=[1, 1, 1],
                key_dim=[8, 8, 8],
            ),
            lambda: tf.LevitImageProcessor(size={"shortest_edge": 49}, crop_size={"height": 48, "width": 48}),
        ),
        # Dinov2ForImageClassification's processor is BiT's: shorter side, then a center crop.
        "dinov2": (
            lambda: tf.Dinov2Config(image_size=56, patch_size=8, **vit_like),
            lambda: tf.BitImageProcessor(size={"shortest_edge": 45}, crop_size={"height": 40, "width": 56}),
        ),
        "bit": (
            lambda: tf.BitConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_groups=2),
            lambda: tf.BitImageProcessor(size={"shortest_edge": 45}, crop_size={"height": 41, "width": 43}),
        ),
        # PoolFormer's: shortest_edge / crop_pct (int(45 / 0.9) = 50), then the crop.
        "poolformer": (
            lambda: tf.PoolFormerConfig(depths=[1, 1], hidden_sizes=[8, 16], num_encoder_blocks=2),
            lambda: tf.PoolFormerImageProcessor(size={"shortest_edge": 45}, crop_size={"height": 41, "width": 43}),
        ),
        # MobileNetV1's, with nearest resampling.
        "mobilenet_v1": (
            lambda: tf.MobileNetV1Config(depth_multiplier=0.25, image_size=41),
            lambda: tf.MobileNetV1ImageProcessor(size={"shortest_edge": 45}, crop_size=41, resample=0),
        ),
        "mobilenet_v2": (
            # ReLU6's kinks make a random MobileNetV2 answer a one-level pixel change with logits 0.1 apart.
            lambda: tf.MobileNetV2Config(depth_multiplier=1.0, image_size=48, hidden_act="gelu"),
            lambda: tf.MobileNetV2ImageProcessor(size={"shortest_edge": 46}, crop_size={"height": 40, "width": 56}),
        ),
        "pvt": (
            lambda: tf.PvtConfig(
                image_size=48,
                depths=[1, 1],
                hidden_sizes=[8, 16],
                num_encoder_blocks=2,
                sequence_reduction_ratios=[2, 1],
                patch_sizes=[4, 2],
                strides=[4, 2],
                num_attention_heads=[1, 1],
                mlp_ratios=[2, 2],
                num_labels=len(LABELS),
            ),
            lambda: tf.PvtImageProcessor(size={"height": 48, "width": 48}),
        ),
        "segformer": (
            lambda: tf.SegformerConfig(
                depths=[1, 1],
                hidden_sizes=[8, 16],
                num_encoder_blocks=2,
                sr_ratios=[2, 1],
                patch_sizes=[7, 3],
                strides=[4, 2],
                num_attention_heads=[1, 1],
                mlp_ratios=[2, 2],
                decoder_hidden_size=16,
            ),
            lambda: tf.SegformerImageProcessor(size={"height": 40, "width": 56}),
        ),
    }


def transformers_kinds() -> tuple[str, ...]:
    import transformers as tf

    return tuple(_architectures(tf))


def save_transformers(
    kind: str, folder: Path, seed: int = 0, problem_type: str | None = None, spread: float | None = None
) -> Path:
    """A randomly initialized tiny ``kind`` (see ``transformers_kinds``) with its processor, via
    save_pretrained; ``problem_type``: its config's (multi_label_classification: a multi-label
    classifier); ``spread``: scale its head so its logits on random inputs spread about that much."""
    import transformers as tf

    make_config, make_processor = _architectures(tf)[kind]
    config = make_config()
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES

    classes = MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES[config.model_type]
    config.architectures = [classes if isinstance(classes, str) else classes[0]]  # DeiT, LeViT: two heads
    config.id2label, config.label2id = id2label(), {v: k for k, v in id2label().items()}
    if problem_type is not None:
        config.problem_type = problem_type
    processor = make_processor()
    torch.manual_seed(seed)
    model = tf.AutoModelForImageClassification.from_config(config).eval()
    _calibrate_batch_norms(model, processor)
    if spread:
        _spread_logits(model, processor, spread)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def _smooth_random_pixels(processor, count: int = 8) -> torch.Tensor:
    """The processor's pixel values of ``count`` smooth random images (seeded)."""
    from PIL import Image

    generator = torch.Generator().manual_seed(1)
    images = [
        Image.fromarray(
            (torch.nn.functional.interpolate(torch.rand(1, 3, 6, 6, generator=generator), size=(80, 96)) * 255)
            .to(torch.uint8)[0]
            .permute(1, 2, 0)
            .numpy()
        )
        for _ in range(count)
    ]
    return processor(images=images, return_tensors="pt").pixel_values


def _calibrate_batch_norms(model: torch.nn.Module, processor) -> None:
    """Batch norms at their usual start (scale 1, shift 0) with running statistics measured on images:
    as transformers initializes them (EfficientNet's scales drawn around 0, statistics 0 and 1) the deep
    narrow stacks of a tiny MobileNet or EfficientNet shrink every input to 0 (logits that ignore the
    photo)."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    for norm in norms:
        if norm.affine:
            torch.nn.init.ones_(norm.weight)
            torch.nn.init.zeros_(norm.bias)
        norm.reset_running_stats()
        norm.momentum = None  # a plain average over the calibration batches
    model.train()
    with torch.no_grad():
        model(pixel_values=_smooth_random_pixels(processor, 16))
    model.eval()


def _spread_logits(model: torch.nn.Module, processor, spread: float) -> None:
    """Scale the classifier head (every Linear with one output per label) so that logits of smooth
    random images spread ``spread`` (std over labels and images)."""
    pixels = _smooth_random_pixels(processor)
    heads = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features == len(LABELS)]
    assert heads, f"{type(model).__name__} has no {len(LABELS)}-output Linear head"
    with torch.no_grad():
        logits = model(pixel_values=pixels).logits
        centred = logits - logits.mean(0)  # what differs between images, not the shared bias
        assert centred.std().item() > 1e-5, f"{type(model).__name__}'s logits do not depend on the image"
        scale = spread / centred.std().item()
        for head in heads:
            head.weight.mul_(scale)
            head.bias.mul_(scale) if head.bias is not None else None


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
