"""The user's own model in process: the bad cases, each refused by compile-trt before any work with
exit code 2 and a message that names the problem and the fix; and model files and timm models
loaded for serving without compiling. Real (tiny) model files, exported here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from compile.cli import main as compile_trt

PREPROCESS = ["--resize-size", "40", "--crop-size", "32", "--mean", "0.5,0.5,0.5", "--std", "0.5,0.5,0.5"]


class Tiny(nn.Module):
    """A classifier of ``classes`` classes; ``flatten=False`` leaves its logits [N, classes, 1, 1]."""

    def __init__(self, classes: int = 3, flatten: bool = True) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Conv2d(4, classes, 1)
        self.flatten = flatten

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.features(images))
        return logits.flatten(1) if self.flatten else logits


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("own-models")
    example = torch.randn(2, 3, 32, 32)
    dynamic = ({0: torch.export.Dim("batch", min=1, max=16)},)
    made = {
        "labels3": folder / "labels3.txt",
        "labels5": folder / "labels5.txt",
        "onnx": folder / "tiny.onnx",
        "onnx_static": folder / "static.onnx",
        "onnx_4d": folder / "fourd.onnx",
        "pt2": folder / "tiny.pt2",
        "pt2_static": folder / "static.pt2",
        "garbage_onnx": folder / "garbage.onnx",
        "garbage_pt2": folder / "garbage.pt2",
        "weights5": folder / "resnet18-5.pt",
    }
    made["labels3"].write_text("cat\ndog\nbird\n")
    made["labels5"].write_text("a\nb\nc\nd\ne\n")
    with torch.no_grad():
        model = Tiny().eval()
        torch.onnx.export(model, (example,), str(made["onnx"]), dynamo=True, dynamic_shapes=dynamic, verbose=False)
        torch.onnx.export(model, (example,), str(made["onnx_static"]), dynamo=True, verbose=False)
        torch.onnx.export(
            Tiny(flatten=False).eval(),
            (example,),
            str(made["onnx_4d"]),
            dynamo=True,
            dynamic_shapes=dynamic,
            verbose=False,
        )
        torch.export.save(torch.export.export(model, (example,), dynamic_shapes=dynamic), made["pt2"])
        torch.export.save(torch.export.export(model, (example,)), made["pt2_static"])
    made["garbage_onnx"].write_bytes(b"\x00not a model" * 100)
    made["garbage_pt2"].write_bytes(b"PK\x03\x04 not a zip either")
    from torchvision.models import resnet18

    torch.save(resnet18(num_classes=5).state_dict(), made["weights5"])
    return made


def refused(capsys, *args: str) -> str:
    """compile-trt's exit code must be 2 (a usage error: the message says what to change)."""
    with pytest.raises(SystemExit) as caught:
        compile_trt(["--device", "cpu", *args])
    assert caught.value.code == 2
    return capsys.readouterr().err


def test_weights_whose_head_does_not_fit_the_labels_name_both_counts(files, capsys, tmp_path) -> None:
    err = refused(
        capsys, "--model", "resnet18", "--weights", str(files["weights5"]), "--labels", str(files["labels3"]),
        "--output", str(tmp_path / "out"),
    )  # fmt: skip
    assert "Expected 3 classes from file:" in err and "have 5" in err and "--labels FILE, 5 lines" in err
    assert not (tmp_path / "out").exists()


def test_imagenet_weights_with_other_labels_are_refused(files, capsys) -> None:
    err = refused(capsys, "--model", "resnet18", "--labels", str(files["labels3"]))
    assert "ImageNet's 1000-class head" in err and "3 labels" in err


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("onnx_static", "fixed at 2"),
        ("pt2_static", "fixed at 2"),
        ("onnx_4d", "[N, classes]"),
        ("garbage_onnx", "Could not read"),
        ("garbage_pt2", "Could not read"),
    ],
)
def test_model_files_that_cannot_be_served_are_refused_with_the_reason(files, capsys, key, expected) -> None:
    err = refused(capsys, "--model", str(files[key]), "--labels", str(files["labels3"]), *PREPROCESS)
    assert expected in err, err


def test_a_model_file_needs_its_preprocessing_given(files, capsys) -> None:
    err = refused(capsys, "--model", str(files["onnx"]), "--labels", str(files["labels3"]), "--crop-size", "32")
    assert "--resize-size --mean --std missing" in err and "does not assume ImageNet's" in err


def test_a_model_file_needs_labels_as_many_as_its_outputs(files, capsys) -> None:
    assert "needs --labels" in refused(capsys, "--model", str(files["pt2"]), *PREPROCESS)
    err = refused(capsys, "--model", str(files["onnx"]), "--labels", str(files["labels5"]), *PREPROCESS)
    assert "has 5 labels" in err and "outputs 3 classes" in err


def test_a_crop_size_other_than_the_files_fixed_size_is_refused(files, capsys) -> None:
    args = ["--model", str(files["onnx"]), "--labels", str(files["labels3"]), *PREPROCESS, "--crop-size", "24"]
    assert "takes 32x32 images" in refused(capsys, *args)


def test_an_onnx_file_is_not_recompiled_by_other_backends(files, capsys) -> None:
    args = ["--model", str(files["onnx"]), "--labels", str(files["labels3"]), *PREPROCESS, "--backend", "inductor"]
    assert "served as it is" in refused(capsys, *args)


def test_a_batch_range_beyond_the_programs_is_refused(files, capsys) -> None:
    args = ["--model", str(files["pt2"]), "--labels", str(files["labels3"]), *PREPROCESS, "--batch", "1,8,32"]
    assert "accepts batches of 1..16" in refused(capsys, *args)


def test_timm_without_downloadable_weights_says_how_to_bring_them(capsys) -> None:
    pytest.importorskip("timm")
    err = refused(capsys, "--model", "timm:mobilenetv3_small_100")
    assert "Hugging Face Hub" in err and "--weights mobilenetv3_small_100.pt" in err
    assert "Did you mean" in refused(capsys, "--model", "timm:mobilenetv3_smal_100")


# --- and served without compiling (vision-serve --model), in process ---


@pytest.mark.parametrize("key", ["pt2", "onnx"])
def test_a_model_file_is_served_eagerly_with_its_labels_and_name(files, key) -> None:
    from compile.model_request import ModelRequest
    from service.worker.engine import load_eager

    request = ModelRequest(str(files[key]), labels=str(files["labels3"]), name="tiny", **EAGER_PREPROCESS)
    served = load_eager(request, "imagenet", torch.device("cpu"))
    assert served.entry.name == "tiny" and served.entry.labels == ("cat", "dog", "bird")
    assert served(torch.randn(5, 3, 32, 32)).shape == (5, 3)
    assert served.engine_name == ("onnxruntime-fp32" if key == "onnx" else "torch-eager-fp32")


def test_a_timm_model_is_served_eagerly_with_a_head_of_its_labels(files) -> None:
    from compile.model_request import ModelRequest
    from service.worker.engine import load_eager

    request = ModelRequest("timm:mobilenetv3_small_100", labels=str(files["labels5"]))
    served = load_eager(request, "random", torch.device("cpu"))
    assert served(torch.randn(2, 3, 224, 224)).shape == (2, 5)
    assert served.entry.name == "mobilenetv3_small_100" and served.entry.preprocess.interpolation == "bicubic"


EAGER_PREPROCESS = {"resize_size": 40, "crop_size": 32, "mean": "0.5,0.5,0.5", "std": "0.5,0.5,0.5"}
