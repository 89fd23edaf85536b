"""A real fine-tuned classifier of custom classes, made in seconds on a CPU, for the own-model tests.

The pretrained EfficientNet-Lite0 (ImageNet, shipped in a package) with a new 4-class head, trained
here on its pooled features of augmented crops of the four sample photos: the labels are ours,
in our order, and no ImageNet class name. Held-back crops (other positions, scales and flips than
any crop trained on) must come back with the right custom label through every import route.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image, ImageEnhance

from compile.catalog import get_model_entry
from compile.weights import load_model
from preprocessing.pil_backend import PilPreprocessor
from preprocessing.spec import PreprocessSpec
from tests.conftest import sample_array

# Custom classes, in an order of our own, named unlike any ImageNet class.
CLASSES = {"rocket": "launch-vehicle", "chelsea": "office-cat", "coffee": "morning-brew", "astronaut": "crew-member"}
LABELS = tuple(CLASSES.values())
TRAIN_CROPS_PER_PHOTO = 24
HELD_BACK_CROPS_PER_PHOTO = 2
TRAIN_STEPS = 300
# timm and torchvision classifiers are exported by their users in eval mode with a dynamic batch.
EXPORT_BATCH_MAX = 32


@dataclass(frozen=True)
class FineTuned:
    """The files a user would bring, and the crops to check them with."""

    weights: Path  # the whole model's state_dict, with the 4-class head
    labels: Path  # labels.txt, one label per line
    onnx: Path  # the same model exported to ONNX, dynamic batch
    program: Path  # the same model as a torch.export ExportedProgram (.pt2), dynamic batch
    held_back: list[tuple[bytes, str]]  # (JPEG bytes, expected label)
    preprocess_flags: list[str]  # the flags a model file needs: EfficientNet-Lite0's preprocessing


def random_crop(photo: Image.Image, rng: random.Random) -> Image.Image:
    """A crop of 45..100 % of the photo's area, aspect 3:4..4:3, maybe flipped, with jittered colors."""
    width, height = photo.size
    for _ in range(20):
        area = width * height * rng.uniform(0.45, 1.0)
        aspect = rng.uniform(3 / 4, 4 / 3)
        w, h = round((area * aspect) ** 0.5), round((area / aspect) ** 0.5)
        if w <= width and h <= height:
            break
    else:
        w, h = width, height
    left, top = rng.randint(0, width - w), rng.randint(0, height - h)
    crop = photo.crop((left, top, left + w, top + h))
    if rng.random() < 0.5:
        crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    crop = ImageEnhance.Brightness(crop).enhance(rng.uniform(0.8, 1.2))
    return ImageEnhance.Color(crop).enhance(rng.uniform(0.8, 1.2))


def jpeg(img: Image.Image) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def crops(seed: int, per_photo: int) -> list[tuple[bytes, str]]:
    rng = random.Random(seed)
    photos = {name: Image.fromarray(sample_array(name)) for name in CLASSES}
    return [(jpeg(random_crop(photo, rng)), CLASSES[name]) for name, photo in photos.items() for _ in range(per_photo)]


def preprocess_flags(spec: PreprocessSpec) -> list[str]:
    """The flags that give a model file ``spec``: what its user must pass."""
    flags = {"--resize-size": spec.resize_size, "--crop-size": spec.crop_size, "--interpolation": spec.interpolation}
    flags |= {"--mean": ",".join(map(str, spec.mean)), "--std": ",".join(map(str, spec.std))}
    return [str(part) for pair in flags.items() for part in pair]


def make_finetuned(folder: Path) -> FineTuned:
    """Train the head, check it on the held-back crops in eager PyTorch, and write the user's files."""
    entry = get_model_entry("efficientnet-lite0")
    model = load_model(entry, "imagenet").module.eval()
    preprocess = PilPreprocessor(entry.preprocess, "cpu", num_threads=1)
    features: list[torch.Tensor] = []
    hook = model._fc.register_forward_hook(lambda _module, inputs, _output: features.append(inputs[0]))

    def pooled(items: list[tuple[bytes, str]]) -> tuple[torch.Tensor, torch.Tensor]:
        features.clear()
        with torch.inference_mode():
            model(preprocess([data for data, _ in items]).images.float())
        targets = torch.tensor([LABELS.index(label) for _, label in items])
        return features[0].clone(), targets

    train_x, train_y = pooled(crops(seed=0, per_photo=TRAIN_CROPS_PER_PHOTO))
    hook.remove()
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(train_x.shape[1], len(LABELS))
    torch.nn.init.normal_(head.weight, std=0.01, generator=generator)
    torch.nn.init.zeros_(head.bias)
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2, weight_decay=1e-4)
    for _ in range(TRAIN_STEPS):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(head(train_x), train_y).backward()
        optimizer.step()
    model._fc = head.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)

    held_back = crops(seed=1, per_photo=HELD_BACK_CROPS_PER_PHOTO)
    with torch.inference_mode():
        logits = model(preprocess([data for data, _ in held_back]).images.float())
    predicted = [LABELS[i] for i in logits.argmax(1).tolist()]
    assert predicted == [label for _, label in held_back], f"the fine-tuned head misses held-back crops: {predicted}"

    folder.mkdir(parents=True, exist_ok=True)
    files = FineTuned(
        weights=folder / "finetuned.pt",
        labels=folder / "labels.txt",
        onnx=folder / "finetuned.onnx",
        program=folder / "finetuned.pt2",
        held_back=held_back,
        preprocess_flags=preprocess_flags(entry.preprocess),
    )
    torch.save(model.state_dict(), files.weights)
    files.labels.write_text("\n".join(LABELS) + "\n")
    example = torch.randn(2, 3, entry.preprocess.crop_size, entry.preprocess.crop_size)
    batch = torch.export.Dim("batch", min=1, max=EXPORT_BATCH_MAX)
    program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    torch.export.save(program, files.program)
    torch.onnx.export(model, (example,), str(files.onnx), dynamo=True, dynamic_shapes=({0: batch},), verbose=False)
    return files
