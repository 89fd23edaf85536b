"""A transformers classifier really trained on crops of the sample photos, saved with save_pretrained.

No pretrained transformers weights are reachable offline: a small ResNet (transformers' own) learns
the four photos' custom classes from scratch on augmented crops (tests/finetuned.py's), and must
label held-back crops right in transformers before it is saved.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.finetuned import LABELS, crops

TRAIN_STEPS = 120
SIZE = 64


def make_hf_finetuned(folder: Path) -> tuple[Path, list[tuple[bytes, str]]]:
    """The saved folder and the held-back crops (JPEG bytes, expected label)."""
    import io

    import transformers as tf
    from PIL import Image

    id2label = dict(enumerate(LABELS))
    config = tf.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", id2label=id2label,
        label2id={v: k for k, v in id2label.items()},
    )  # fmt: skip
    processor = tf.ConvNextImageProcessor(size={"shortest_edge": SIZE}, crop_pct=0.875, resample=2)
    torch.manual_seed(0)
    model = tf.ResNetForImageClassification(config)

    def pixels(items):
        images = [Image.open(io.BytesIO(data)).convert("RGB") for data, _ in items]
        return processor(images=images, return_tensors="pt").pixel_values

    train = crops(seed=0, per_photo=24)
    x, y = pixels(train), torch.tensor([LABELS.index(label) for _, label in train])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    generator = torch.Generator().manual_seed(0)
    for _ in range(TRAIN_STEPS):
        batch = torch.randperm(len(y), generator=generator)[:32]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(pixel_values=x[batch]).logits, y[batch]).backward()
        optimizer.step()
    model.eval()
    held_back = crops(seed=1, per_photo=2)
    with torch.inference_mode():
        predicted = [LABELS[i] for i in model(pixel_values=pixels(held_back)).logits.argmax(1).tolist()]
    assert predicted == [label for _, label in held_back], f"the trained model misses held-back crops: {predicted}"
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder, held_back
