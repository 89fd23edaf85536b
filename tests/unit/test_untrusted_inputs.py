"""The loaders' guards for untrusted model files and folders (issue 60, docs/security.md), each alone:
weights-only unpickling, ONNX external data kept in the model's folder, timm names from timm's own
registry, no folder with its own code, malformed folder values refused in one line; and the flags
that had no bound. The crafted .pt2 archives and the commands end to end: tests/integration/
test_untrusted_models.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from compile.model_files import read_model_file
from compile.model_request import ModelRequest
from compile.model_source import resolve_model
from compile.settings_errors import SettingsError, one_line
from tests.crafted_models import RunsCode


def onnx_reading(tmp_path: Path, location: str) -> Path:
    """A classifier [N,3,16,16] -> [N,5] whose weight is external data at ``location`` (relative to it)."""
    import numpy as np
    from onnx import TensorProto, helper

    folder = tmp_path / "model"
    (tmp_path / "outside").mkdir(exist_ok=True)
    folder.mkdir(exist_ok=True)
    (tmp_path / "outside" / "secret.bin").write_bytes(np.ones((3, 5), np.float32).tobytes())
    (folder / "weights.bin").write_bytes(np.ones((3, 5), np.float32).tobytes())
    weight = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[3, 5], data_location=TensorProto.EXTERNAL)
    entry = weight.external_data.add()
    entry.key, entry.value = "location", location
    graph = helper.make_graph(
        [helper.make_node("ReduceMean", ["x"], ["pooled"], axes=[2, 3], keepdims=0), helper.make_node(
            "MatMul", ["pooled", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])],
        [weight],
    )  # fmt: skip
    path = folder / "model.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    return path


# ---- pickles: weights-only everywhere -----------------------------------------------------------


def test_a_weights_file_that_runs_code_is_refused(tmp_path) -> None:
    """--weights FILE (a .bin or .pt state_dict) is read by the weights-only unpickler."""
    import torch

    from compile.catalog import get_model_entry
    from compile.weights import WeightsError, load_model

    marker, bomb = tmp_path / "code-ran", tmp_path / "pytorch_model.bin"
    torch.save(RunsCode(marker, "{}"), bomb)
    with pytest.raises(WeightsError, match=r"Could not read .*pytorch_model\.bin as a PyTorch state_dict"):
        load_model(get_model_entry("resnet18"), str(bomb))
    assert not marker.exists()


def test_a_folders_pickled_weights_that_run_code_are_refused(tmp_path) -> None:
    import torch

    from compile.pretrained_folders import read_state_dict

    marker, bomb = tmp_path / "code-ran", tmp_path / "pytorch_model.bin"
    torch.save(RunsCode(marker, "{}"), bomb)
    with pytest.raises(SettingsError, match=r"Could not read .*pytorch_model\.bin"):
        read_state_dict(bomb)
    assert not marker.exists()


def test_untrusted_load_sets_the_guards_for_the_load_only(monkeypatch) -> None:
    import os

    from compile.offline_loads import OFFLINE_ENV, untrusted_load

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with untrusted_load():
        assert all(os.environ[name] == value for name, value in OFFLINE_ENV.items())
        assert "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD" not in os.environ
    assert "HF_HUB_OFFLINE" not in os.environ and os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] == "1"


# ---- ONNX external data -------------------------------------------------------------------------


@pytest.mark.parametrize("location", ["../outside/secret.bin", "/etc/passwd", "missing.bin", "*/_ORT_MEM_ADDR_/*"])
def test_onnx_external_data_outside_the_models_folder_is_refused(tmp_path, location) -> None:
    path = onnx_reading(tmp_path, location)
    with pytest.raises(SettingsError, match="which is not a file inside") as caught:
        read_model_file(str(path))
    assert caught.value.flag == "--model" and str(path) in str(caught.value)


def test_onnx_external_data_through_a_link_out_is_refused(tmp_path) -> None:
    path = onnx_reading(tmp_path, "link.bin")
    (path.parent / "link.bin").symlink_to(tmp_path / "outside" / "secret.bin")
    with pytest.raises(SettingsError, match=r"'link\.bin', which is not a file inside"):
        read_model_file(str(path))


def test_onnx_external_data_beside_the_model_is_read(tmp_path) -> None:
    facts = read_model_file(str(onnx_reading(tmp_path, "weights.bin")))
    assert facts.classes == 5


def test_an_onnx_artifact_pointing_outside_is_refused(tmp_path) -> None:
    from compile.compat import check_artifact_files

    path = onnx_reading(tmp_path, "../outside/secret.bin")

    class Manifest:
        backend, engine_file, model_family, model = "onnx", path.name, "onnx", str(path)

    with pytest.raises(SettingsError, match="which is not a file inside") as caught:
        check_artifact_files(Manifest(), path.parent)  # type: ignore[arg-type]
    assert caught.value.flag == "--artifact"


# ---- timm names ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("architecture", "expected"),
    [
        ("hf-hub:someone/model", "names the timm architecture 'hf-hub:someone/model': a source"),
        ("local-dir:/no/such/folder", "names the timm architecture 'local-dir:/no/such/folder'"),
        ("resnet19", "timm has no model 'resnet19'. Did you mean resnet18"),
    ],
)
def test_a_timm_folder_names_one_of_timms_own_architectures(tmp_path, architecture, expected) -> None:
    pytest.importorskip("timm")
    folder = timm_folder(tmp_path, architecture=architecture)
    with pytest.raises(SettingsError, match=expected.replace("(", r"\(")) as caught:
        resolve_model(ModelRequest(model=str(folder)))
    assert str(folder / "config.json") in str(caught.value)


def test_timm_names_with_a_source_are_refused_for_timm_models_too() -> None:
    pytest.importorskip("timm")
    with pytest.raises(SettingsError, match="names the timm architecture 'hf-hub:someone/model'"):
        resolve_model(ModelRequest(model="timm:hf-hub:someone/model"))


# ---- folders with their own code ----------------------------------------------------------------


def test_a_transformers_folder_with_an_auto_map_is_refused(tmp_path) -> None:
    pytest.importorskip("transformers")
    from tests.crafted_models import remote_code_folder

    marker = tmp_path / "code-ran"
    folder = remote_code_folder(tmp_path / "evil", marker)
    with pytest.raises(SettingsError, match="has an auto_map: the model is code shipped in the folder"):
        resolve_model(ModelRequest(model=str(folder)))
    assert not marker.exists()


def test_a_folder_is_loaded_without_remote_code(monkeypatch, tmp_path) -> None:
    """Past the auto_map refusal, from_pretrained is still told: no remote code, no download, weights only."""
    pytest.importorskip("transformers")
    import transformers

    from compile.catalog import ModelEntry
    from compile.pretrained_folders import load_folder_model
    from preprocessing.spec import PreprocessSpec

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "convnext", "id2label": {"0": "a"}}))
    (folder / "pytorch_model.bin").write_bytes(b"x")
    asked = {}

    def from_pretrained(path, **kwargs):
        asked.update(kwargs)
        raise OSError("stop here")

    monkeypatch.setattr(transformers.AutoModelForImageClassification, "from_pretrained", from_pretrained)
    entry = ModelEntry("m", "transformers", PreprocessSpec(73, 64, (0.5,) * 3, (0.5,) * 3), ("a",), "", str(folder))
    with pytest.raises(SettingsError, match="did not load"):
        load_folder_model(entry)
    assert asked == {"local_files_only": True, "trust_remote_code": False, "weights_only": True}


# ---- malformed folders: one line, no traceback --------------------------------------------------


def timm_folder(tmp_path: Path, architecture: str = "resnet18", **cfg) -> Path:
    folder = tmp_path / "timm"
    folder.mkdir(exist_ok=True)
    pretrained = {"input_size": [3, 224, 224], "interpolation": "bicubic", "crop_pct": 0.95,
                  "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], **cfg}  # fmt: skip
    config = {"architecture": architecture, "label_names": ["a", "b"], "pretrained_cfg": pretrained}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def transformers_folder(tmp_path: Path, **processor) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir(exist_ok=True)
    config = {"architectures": ["ConvNextForImageClassification"], "model_type": "convnext", "id2label": {"0": "a"}}
    (folder / "config.json").write_text(json.dumps(config))
    settings = {"image_processor_type": "ConvNextImageProcessor", "size": {"shortest_edge": 64}, "crop_pct": 0.875,
                "resample": 2, **processor}  # fmt: skip
    (folder / "preprocessor_config.json").write_text(json.dumps(settings))
    return folder


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p: transformers_folder(p, crop_pct=0), "its crop_pct is 0; it must be a number in (0, 1]"),
        (lambda p: transformers_folder(p, image_mean=5), "its image_mean is 5; it must be three numbers"),
        (lambda p: transformers_folder(p, image_std=[0.5, 0, 0.5]), "its image_std is [0.5, 0, 0.5]; it must be three"),
        (lambda p: transformers_folder(p, size={"shortest_edge": "x"}), "preprocessing config cannot be read"),
        (lambda p: timm_folder(p, mean=5), "its mean is 5; it must be three numbers"),
        (lambda p: timm_folder(p, crop_pct=-1), "its crop_pct is -1; it must be a number > 0"),
        (lambda p: timm_folder(p, input_size=224), "its input_size is 224; it must be [3, height, width]"),
    ],
    ids=["crop_pct-0", "image_mean-5", "image_std-0", "size-text", "timm-mean-5", "timm-crop_pct", "timm-input_size"],
)  # fmt: skip
def test_malformed_folder_values_are_refused_naming_the_file(tmp_path, make, expected) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("timm")
    folder = make(tmp_path)
    with pytest.raises(SettingsError) as caught:
        resolve_model(ModelRequest(model=str(folder)))
    message = str(caught.value)
    assert expected in message and str(folder) in message and "--resize-size" in message, message
    assert one_line(message) == message


def test_an_unknown_transformers_model_type_is_refused(tmp_path) -> None:
    pytest.importorskip("transformers")
    folder = transformers_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text()) | {"model_type": "no-such-model"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SettingsError, match="its model_type 'no-such-model' is not an image classifier"):
        resolve_model(ModelRequest(model=str(folder)))


@pytest.mark.parametrize(
    ("content", "expected"), [(b"", "is empty"), (b"\x08" + b"\0" * 7 + b"{}", "not a safetensors")]
)
def test_a_broken_weights_file_is_refused_when_the_folder_is_read(tmp_path, content, expected) -> None:
    pytest.importorskip("timm")
    folder = timm_folder(tmp_path)
    (folder / "model.safetensors").write_bytes(content)
    with pytest.raises(SettingsError, match=expected):
        resolve_model(ModelRequest(model=str(folder)))


# ---- flags with a bound -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--engine-threads", "100000"], "share the cores among the workers; at most 1024, got 100000"),
        (["--workers-per-device", "100000"], "at most 256, got 100000"),
        (["--api-servers", "100000"], "at most 256, got 100000"),
        (["--batch-timeout-ms", "nan"], "--batch-timeout-ms must be a number >= 0, got nan."),
        (["--batch-timeout-ms", "inf"], "--batch-timeout-ms must be a number >= 0, got inf."),
    ],
)  # fmt: skip
def test_vision_serve_bounds_its_flags(argv, expected, capsys) -> None:
    from service.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and expected in err, err


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("name", ["workspace_gib", "gate_max_rel_error"])
def test_compile_trt_refuses_non_finite_numbers(name, value) -> None:
    from compile.settings import CompileSettings

    with pytest.raises(SettingsError, match=f"--{name.replace('_', '-')} must be a number"):
        CompileSettings(device="cpu", **{name: value})
