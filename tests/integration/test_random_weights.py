"""Random weights: whole ResNet forward passes (fp16 and fp32, about 40 s on 2 cores), kept out of the unit
tier (tests/unit/test_catalog_weights.py holds the catalog's and weights' fast checks)."""

from __future__ import annotations

import pytest
import torch

from compile.catalog import get_model_entry
from compile.weights import load_model


@pytest.mark.parametrize("name", [pytest.param("resnet152", marks=pytest.mark.slow), "resnet18"])
def test_random_resnet_logits_fit_in_fp16(name: str) -> None:
    """Random weights are for speed tests, and those run in fp16 on a GPU: the fp16 model must give
    finite logits that agree with fp32 (a random ResNet-152 at PyTorch's default init overflowed
    fp16 to NaN and failed the gate on an H100; fp16 convolutions run on the CPU too, so this
    checks it here)."""
    model = load_model(get_model_entry(name), "random").module
    batch = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(batch)
        half = model.half()(batch.half()).float()
    assert torch.isfinite(half).all()
    assert torch.equal(half.argmax(1), reference.argmax(1))
    assert torch.nn.functional.cosine_similarity(half, reference).min() > 0.999


def test_random_resnet_152_runs_every_convolution_and_tells_photos_apart() -> None:
    """Random weights stand in for trained ones in speed runs: no residual branch may be zero (batch
    norm folds into its convolution, and a GPU runs all-zero weights faster than real ones), and
    different photos must get different answers, or a check of answers under load proves nothing."""
    from preprocessing.pil_backend import PilPreprocessor
    from service.tune.images import photo_jpegs

    entry = get_model_entry("resnet152")
    model = load_model(entry, "random").module.eval()
    norms = [m.weight for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert all(bool((weight != 0).all()) for weight in norms)
    photos = PilPreprocessor(entry.preprocess)(photo_jpegs(500, 375)).images
    with torch.no_grad():
        top1 = model(photos).softmax(1).max(1).values
    assert top1.min() > 0.01  # not the near-uniform 0.001 of PyTorch's default head
    assert len({round(p, 3) for p in top1.tolist()}) == len(top1)  # six photos, six answers
