"""timm's eval transform in every crop mode, served as timm serves it: vision-serve's path in process
(the model's entry -> ``entry.preprocess`` -> the Pillow preprocessor -> the served model) against
timm's own (``create_transform(**resolve_data_config(model=model))`` on the upright RGB photo, then
the model), for a ``timm:<name>`` model and a timm folder, on real photos, an EXIF-rotated JPEG, a
very wide strip and a tiny image. The JPEG draft (a serving speed-up that decodes big photos at a
reduced scale) is off, so that both sides start from the same decoded pixels."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import pytest
import torch
from PIL import Image, ImageOps

from compile.model_request import ModelRequest
from compile.sample_photos import sample_photo, sample_photo_file
from preprocessing.pil_backend import PilPreprocessor
from service.worker.engine import load_eager
from tests.conftest import encode

timm = pytest.importorskip("timm")  # an optional extra
pytest.importorskip("timm.data")  # and with it, timm.data

LABELS = ("cat", "coffee", "rocket")
# Pillow under both, so the pixels agree to float rounding (in uint8 levels), but for where Pillow
# resamples only the crop's region (``resize(box=...)``, as the Pillow backend does) rather than the
# whole image and then crops: an upscale by a fractional ratio (the strip's height) leaves a few
# values (0.1% of the strip's) one level apart.
PIXEL_LEVELS = 1 + 1e-3
PIXEL_SHARE_OFF = 5e-3  # the share of values more than float rounding apart, per image
PROBABILITY_TOLERANCE = 5e-3
# The head's logits scaled up, so that a random model's probabilities are far from uniform and move
# with its input: a crop a pixel off changes them by more than the tolerance.
HEAD_SCALE = 40.0
# Each crop mode with a crop_pct other than timm's default 0.875 (and one over 1, volo's, which pads).
CASES = {
    "center-square": {"input_size": (3, 160, 160), "crop_pct": 0.95, "crop_mode": "center"},
    "center-non-square": {"input_size": (3, 128, 192), "crop_pct": 0.9, "crop_mode": "center"},
    "center-padded": {"input_size": (3, 144, 144), "crop_pct": 1.15, "crop_mode": "center"},
    "squash": {"input_size": (3, 160, 128), "crop_pct": 0.95, "crop_mode": "squash", "interpolation": "bilinear"},
    "border": {
        "input_size": (3, 128, 176),
        "crop_pct": 0.8,
        "crop_mode": "border",
        "mean": (0.5, 0.4, 0.3),  # a border colour of its own: round(255 * mean) = (128, 102, 76)
        "std": (0.25, 0.25, 0.25),
    },
}
BASE_CFG = {"interpolation": "bicubic", "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}


def photos() -> list[tuple[str, bytes]]:
    """The sample photos, the cat stored on its side with EXIF orientation 6 (displayed upright), a
    900x120 strip and a 7x5 image."""
    files = [(name, sample_photo_file(name)) for name in ("chelsea", "coffee", "astronaut", "rocket")]
    exif = Image.Exif()
    exif[0x0112] = 6
    stored = Image.fromarray(sample_photo("chelsea")).transpose(Image.Transpose.ROTATE_90)
    files.append(("exif-rotated", encode(stored, quality=95, exif=exif)))
    files.append(("wide", encode(Image.fromarray(sample_photo("astronaut")).resize((900, 120)), quality=95)))
    files.append(("tiny", encode(Image.fromarray(sample_photo("coffee")).resize((7, 5)), "PNG")))
    return files


PHOTOS = photos()


def discriminative(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        model.get_classifier().weight.mul_(HEAD_SCALE)
    return model.eval()


def timms_own(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """timm's pixels and probabilities for ``PHOTOS``, with the model's own data config."""
    transform = timm.data.create_transform(**timm.data.resolve_data_config(model=model))
    upright = [ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB") for _, data in PHOTOS]
    pixels = torch.stack([transform(image) for image in upright])
    with torch.no_grad():
        return pixels, model(pixels).softmax(-1)


def ours(request: ModelRequest, weights: str) -> tuple[torch.Tensor, torch.Tensor, object]:
    """vision-serve's pixels and probabilities for ``PHOTOS``, and the preprocessing it chose."""
    served = load_eager(request, weights, torch.device("cpu"))
    spec = served.entry.preprocess
    prepared = PilPreprocessor(spec, "cpu", num_threads=1, use_jpeg_draft=False)([data for _, data in PHOTOS])
    assert prepared.errors == [None] * len(PHOTOS), prepared.errors
    pixels = prepared.images.float().contiguous()
    with torch.no_grad():
        return pixels, served(pixels).softmax(-1), spec


def assert_same(mine: tuple, theirs: tuple, cfg: dict) -> None:
    (my_pixels, my_probabilities, spec), (their_pixels, their_probabilities) = mine, theirs
    height, width = cfg["input_size"][1:]
    assert spec.input_size == (height, width) and my_pixels.shape == their_pixels.shape, (spec, my_pixels.shape)
    std = torch.tensor(spec.std).view(1, 3, 1, 1)
    levels = (my_pixels - their_pixels).abs() * std * 255
    worst, share = levels.amax(dim=(1, 2, 3)), (levels > 1e-3).float().mean(dim=(1, 2, 3))
    names = [name for name, _ in PHOTOS]
    assert worst.max().item() < PIXEL_LEVELS, dict(zip(names, worst.tolist(), strict=True))
    assert share.max().item() < PIXEL_SHARE_OFF, dict(zip(names, share.tolist(), strict=True))
    assert torch.equal(my_probabilities.argmax(-1), their_probabilities.argmax(-1))
    gap = (my_probabilities - their_probabilities).abs().amax(-1)
    assert gap.max().item() < PROBABILITY_TOLERANCE, dict(zip(names, gap.tolist(), strict=True))
    # Discriminative: the model tells the photos apart, so its probabilities measure what it is shown.
    spread = (their_probabilities.amax(0) - their_probabilities.amin(0)).max().item()
    assert spread > 0.05, their_probabilities


@pytest.fixture(scope="module")
def registered() -> Iterator[dict[str, str]]:
    """One timm architecture per case (resnet18 with the case's pretrained_cfg), registered in timm's
    registry as ``timm:<name>`` needs; removed again afterwards."""
    from timm.models import _registry
    from timm.models.resnet import resnet18

    names = {}
    for case, cfg in CASES.items():
        overlay = {**BASE_CFG, **cfg}

        def entrypoint(pretrained: bool = False, _overlay: dict = overlay, **kwargs) -> torch.nn.Module:
            kwargs["pretrained_cfg_overlay"] = _overlay
            return resnet18(pretrained=False, **kwargs)

        entrypoint.__name__ = names[case] = f"vs_parity_{case.replace('-', '_')}"
        _registry.register_model(entrypoint)
    yield names
    for name in names.values():
        _registry._clear_model_entries(name)
        _registry._model_entrypoints.pop(name, None)


@pytest.mark.parametrize("case", CASES)
def test_a_timm_model_is_preprocessed_as_timm_does(case: str, registered: dict[str, str], tmp_path) -> None:
    name = registered[case]
    torch.manual_seed(0)
    model = discriminative(timm.create_model(name, pretrained=False))
    weights = tmp_path / "weights.pt"
    torch.save(model.state_dict(), weights)
    mine = ours(ModelRequest(model=f"timm:{name}"), str(weights))
    assert_same(mine, timms_own(model), CASES[case])


def save_folder(folder, cfg: dict, drop: tuple[str, ...] = ()):
    """A discriminative resnet18 saved the timm way, its config.json's pretrained_cfg ``cfg`` less ``drop``."""
    from timm.models._hub import save_for_hf

    torch.manual_seed(1)
    model = timm.create_model("resnet18", pretrained=False, num_classes=len(LABELS), pretrained_cfg_overlay=cfg)
    save_for_hf(discriminative(model), folder, model_config={"label_names": list(LABELS)}, safe_serialization=True)
    config = json.loads((folder / "config.json").read_text())
    for key in drop:
        del config["pretrained_cfg"][key]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


FOLDER_CASES = {
    **{case: (cfg, ()) for case, cfg in CASES.items()},
    # Nothing but the input size: timm's defaults (bicubic, crop_pct 0.875, center, ImageNet's mean/std).
    "defaults": ({"input_size": (3, 128, 160)}, ("interpolation", "crop_pct", "crop_mode", "mean", "std")),
}


@pytest.mark.parametrize("case", FOLDER_CASES)
def test_a_timm_folder_is_preprocessed_as_timm_reads_it(case: str, tmp_path) -> None:
    """timm's own reader of a folder (``local-dir:``) is the reference: the cfg it builds from config.json."""
    cfg, drop = FOLDER_CASES[case]
    folder = save_folder(tmp_path / case, {**BASE_CFG, **cfg}, drop)
    model = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    assert_same(ours(ModelRequest(model=str(folder)), "imagenet"), timms_own(model), cfg)


ONNX_CASES = [
    pytest.param({"input_size": (3, 128, 128), "crop_pct": 0.9, "crop_mode": "border"}, id="border-square"),
    pytest.param(
        {"input_size": (3, 112, 160), "crop_pct": 0.9, "crop_mode": "center"},
        id="center-non-square",
    ),
]


@pytest.mark.parametrize("cfg", ONNX_CASES)
def test_a_timm_folder_compiles_to_onnx_and_answers_as_eager(cfg: dict, tmp_path) -> None:
    """compile-trt --backend onnx on a timm folder: the gate passes, and the artifact's answers on the
    photos are eager's within the fp32 gate."""
    pytest.importorskip("onnxruntime")
    from compile import _defaults
    from compile.build import compile_artifact
    from compile.gate import compare_logits, threshold_failures
    from compile.settings import CompileSettings
    from service.worker.engine import load_artifact

    folder = save_folder(tmp_path / "folder", {**BASE_CFG, **cfg})
    settings = CompileSettings(
        model=str(folder), device="cpu", backend="onnx", batch=(1, 4, 8), output=str(tmp_path / "artifact")
    )
    result = compile_artifact(settings)
    assert result.manifest.validation["passed"] and result.manifest.preprocess.input_size == cfg["input_size"][1:]
    compiled = load_artifact(result.directory, torch.device("cpu"))
    eager = load_eager(ModelRequest(model=str(folder)), "imagenet", torch.device("cpu"))
    assert compiled.entry.preprocess == eager.entry.preprocess  # the manifest carries every field
    mine, reference = answers(compiled), answers(eager)
    assert threshold_failures(compare_logits(mine, reference), _defaults.GATE_THRESHOLDS["fp32"]) == []
    assert torch.equal(mine.argmax(-1), reference.argmax(-1))


def answers(served) -> torch.Tensor:
    """``served``'s logits for ``PHOTOS``, preprocessed as its own entry says."""
    prepare = PilPreprocessor(served.entry.preprocess, "cpu", num_threads=1, use_jpeg_draft=False)
    with torch.no_grad():
        return served(prepare([data for _, data in PHOTOS]).images.float().contiguous())
