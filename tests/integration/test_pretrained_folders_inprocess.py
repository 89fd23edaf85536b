"""Folders saved by transformers and timm, served eagerly and compiled: the answers are the library's
own (transformers: the model on its AutoImageProcessor's pixel values) on real photos."""

from __future__ import annotations

import pytest
import torch

from compile.model_request import ModelRequest
from preprocessing.pil_backend import PilPreprocessor
from service.worker.engine import load_eager
from tests.conftest import encode, sample_array
from tests.hf_folders import LABELS, save_timm, save_transformers

pytest.importorskip("transformers")
PHOTOS = ("chelsea", "coffee", "astronaut", "rocket")
# Probabilities: transformers resizes with torchvision, vision-serve with Pillow: a few uint8 levels apart.
PROBABILITY_TOLERANCE = 0.02


def ours(request: ModelRequest) -> torch.Tensor:
    served = load_eager(request, "imagenet", torch.device("cpu"))
    assert served.entry.labels == LABELS
    prepare = PilPreprocessor(served.entry.preprocess, "cpu", num_threads=1, use_jpeg_draft=False)
    images = prepare([encode(sample_array(p), "PNG") for p in PHOTOS]).images
    with torch.no_grad():
        return served(images.float().contiguous()).softmax(-1)


def theirs_transformers(folder) -> torch.Tensor:
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    processor = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    model = AutoModelForImageClassification.from_pretrained(folder, local_files_only=True).eval()
    pixels = processor(images=[Image.fromarray(sample_array(p)) for p in PHOTOS], return_tensors="pt").pixel_values
    with torch.no_grad():
        return model(pixel_values=pixels).logits.softmax(-1)


def assert_same_answers(mine: torch.Tensor, reference: torch.Tensor) -> None:
    assert torch.equal(mine.argmax(-1), reference.argmax(-1)), (mine, reference)
    assert (mine - reference).abs().max().item() < PROBABILITY_TOLERANCE, (mine, reference)


@pytest.mark.parametrize("kind", ["convnext", "resnet", "vit"])
def test_a_transformers_folder_answers_as_transformers_does(tmp_path, kind) -> None:
    """ViT's too: its exact resize is served as its processor does (every class: test_processor_parity.py)."""
    folder = save_transformers(kind, tmp_path / kind)
    assert_same_answers(ours(ModelRequest(model=str(folder))), theirs_transformers(folder))


def test_a_timm_folder_answers_as_timm_does(tmp_path) -> None:
    import timm
    import timm.data
    from PIL import Image

    folder = save_timm(tmp_path / "timm")
    model = timm.create_model("resnet18", pretrained=False, num_classes=3)
    from compile.pretrained_folders import read_state_dict

    model.load_state_dict(read_state_dict(folder / "model.safetensors"))
    transform = timm.data.create_transform(**timm.data.resolve_model_data_config(model))
    pixels = torch.stack([transform(Image.fromarray(sample_array(p))) for p in PHOTOS])
    with torch.no_grad():
        reference = model.eval()(pixels).softmax(-1)
    assert_same_answers(ours(ModelRequest(model=str(folder))), reference)


def test_weights_flag_is_refused_for_a_folder(tmp_path) -> None:
    from compile.weights import WeightsError

    folder = save_transformers("resnet", tmp_path / "resnet")
    with pytest.raises(WeightsError, match="the folder holds its weights"):
        load_eager(ModelRequest(model=str(folder)), "random", torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnx", "inductor"])
def test_a_folder_compiles_through_the_gate_and_serves_the_same_answers(tmp_path, backend) -> None:
    """compile-trt --model FOLDER: the gate passes, and the artifact answers as transformers does."""
    pytest.importorskip("onnxruntime") if backend == "onnx" else None
    from compile.build import compile_artifact
    from compile.settings import CompileSettings
    from service.worker.engine import load_artifact

    folder = save_transformers("convnext", tmp_path / "convnext")
    settings = CompileSettings(
        model=str(folder), device="cpu", backend=backend, batch=(1, 4, 4), output=str(tmp_path / "artifact")
    )
    result = compile_artifact(settings)
    assert result.manifest.validation["passed"] and result.manifest.labels == LABELS
    served = load_artifact(result.directory, torch.device("cpu"))
    prepare = PilPreprocessor(served.entry.preprocess, "cpu", num_threads=1, use_jpeg_draft=False)
    images = prepare([encode(sample_array(p), "PNG") for p in PHOTOS]).images
    with torch.no_grad():
        mine = served(images.float().contiguous()).softmax(-1)
    assert_same_answers(mine, theirs_transformers(folder))


def test_an_export_failure_names_the_architecture_and_backend(tmp_path) -> None:
    from compile.backends import BackendUnavailable
    from compile.build import folder_export_failed
    from compile.model_source import resolve_model

    entry = resolve_model(ModelRequest(model=str(save_transformers("resnet", tmp_path / "resnet"))))
    error = folder_export_failed(entry, "onnx", RuntimeError("unsupported op aten::foo\nmore"))
    assert isinstance(error, BackendUnavailable)
    assert "--backend onnx cannot export ResNetForImageClassification" in str(error)
    assert "RuntimeError: unsupported op aten::foo." in str(error) and "--model" in str(error)
