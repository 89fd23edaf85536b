"""The model's activation and its whole output (issue 61, parts 4 and 5) without a server: where the
activation comes from (a transformers folder's problem_type, the manifest, --activation), what the
worker answers with it, the logits only for a request that asked, and the cache's checks of raw
scores."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from compile.catalog import entry_from_manifest, get_model_entry
from compile.manifest import Manifest
from compile.settings_errors import SettingsError
from service.http.cache import codec
from service.model_info import ModelInfo, resolve_activation
from service.settings import ServeSettings
from service.wire import LOGITS_DTYPE, Answer, ImageRequest

# Two images' logits, as the stand-in engine returns them (efficientnet-lite0's 1,000 classes).
LOGITS = torch.linspace(-6.0, 6.0, 2000).reshape(2, 1000)


def classifier_with(activation: str, model_activation: str = "softmax"):
    """The real Classifier, its engine a stand-in that returns ``LOGITS``' first rows."""
    from preprocessing.pil_backend import PilPreprocessor
    from service.worker.classifier import Classifier
    from service.worker.engine import ServedModel

    entry = dataclasses.replace(get_model_entry("efficientnet-lite0"), activation=model_activation)
    served = ServedModel(entry, "stand-in", run=lambda images: LOGITS[: len(images)].clone())
    settings = ServeSettings(model=entry.name, activation=activation)
    return Classifier(settings, served, PilPreprocessor(entry.preprocess, "cpu"), torch.device("cpu"))


def answers_of(classifier, chelsea_jpeg: bytes, logits: tuple[bool, bool] = (False, False)) -> list[Answer]:
    requests = [ImageRequest(chelsea_jpeg, top_k=3, logits=wanted) for wanted in logits]
    return classifier.run(classifier.prepare(requests))


@pytest.mark.parametrize(
    ("flag", "model", "expected"),
    [
        ("auto", "softmax", LOGITS.softmax(dim=1)),
        ("auto", "sigmoid", torch.sigmoid(LOGITS)),
        ("sigmoid", "softmax", torch.sigmoid(LOGITS)),
        ("none", "sigmoid", LOGITS),
        ("softmax", "sigmoid", LOGITS.softmax(dim=1)),
    ],
)
def test_the_worker_answers_the_activation_the_flag_or_the_model_names(flag, model, expected, chelsea_jpeg) -> None:
    answers = answers_of(classifier_with(flag, model), chelsea_jpeg)
    best = expected.topk(3, dim=1)
    for row, answer in enumerate(answers):
        assert [index for index, _, _ in answer.predictions] == best.indices[row].tolist()
        assert [score for _, _, score in answer.predictions] == pytest.approx(best.values[row].tolist(), rel=1e-6)


def test_the_logits_travel_only_for_the_request_that_asked(chelsea_jpeg) -> None:
    plain, asked = answers_of(classifier_with("auto"), chelsea_jpeg, logits=(False, True))
    assert plain.logits is None, "the default path carries no whole output"
    assert np.array_equal(np.frombuffer(asked.logits, LOGITS_DTYPE), LOGITS[1].numpy())
    assert all(answer.logits is None for answer in answers_of(classifier_with("auto"), chelsea_jpeg))


def test_a_folders_problem_type_sets_its_activation(tmp_path) -> None:
    pytest.importorskip("transformers")
    from compile.pretrained_folders import folder_activation

    assert folder_activation(tmp_path, {}) == "softmax"
    assert folder_activation(tmp_path, {"problem_type": "single_label_classification"}) == "softmax"
    assert folder_activation(tmp_path, {"problem_type": "multi_label_classification"}) == "sigmoid"
    assert folder_activation(tmp_path, {"problem_type": "regression"}) == "none"
    with pytest.raises(SettingsError, match="problem_type 'ranking'"):
        folder_activation(tmp_path, {"problem_type": "ranking"})


def manifest_data() -> dict:
    from compile._defaults import MANIFEST_FORMAT_VERSION
    from preprocessing.spec import PreprocessSpec

    text = dict.fromkeys(
        ("model", "model_family", "weights_source", "weights_sha256", "weights_sha256_of", "labels_source"), "x"
    )
    text |= dict.fromkeys(("backend", "precision", "device_type", "device_name", "device_capability"), "x")
    text |= dict.fromkeys(("device_isa", "engine_sha256", "compiled_at", "cache_key"), "x")
    return {
        **text,
        "format_version": MANIFEST_FORMAT_VERSION,
        "preprocess": PreprocessSpec(256, 224, (0.5,) * 3, (0.5,) * 3).to_dict(),
        "labels": ["a", "b"],
        "batch_min": 1,
        "batch_opt": 1,
        "batch_max": 1,
        "engine_file": "model.onnx",
        "versions": {},
        "compile_seconds": 0.0,
        "compile_settings": {},
        "validation": {},
    }


def test_the_manifest_records_the_activation_and_an_older_one_reads_as_softmax() -> None:
    data = manifest_data()
    assert Manifest.from_dict(data).activation == "softmax"
    data["activation"] = "sigmoid"
    assert entry_from_manifest(Manifest.from_dict(json.loads(json.dumps(data)))).activation == "sigmoid"
    data["activation"] = "relu"
    with pytest.raises(ValueError, match="activation 'relu'"):
        Manifest.from_dict(data)


def test_the_flag_takes_auto_or_an_activation() -> None:
    assert resolve_activation("auto", "sigmoid") == "sigmoid" and resolve_activation("none", "sigmoid") == "none"
    with pytest.raises(SettingsError, match="--activation"):
        ServeSettings(activation="relu")


def test_the_cache_keeps_raw_scores_only_for_a_model_answering_them() -> None:
    """Logits (``none``) may be negative or past 1: cached and read back; for probabilities they are refused."""
    raw = Answer(predictions=((1, "b", 3.5), (0, "a", -2.0)))
    info = ModelInfo("m", "w", "e", "pil", "", {}, "", "cpu", 8, 0.0, labels=("a", "b"))
    assert codec.decode(codec.encode(raw), info, 2) is None
    back = codec.decode(codec.encode(raw), dataclasses.replace(info, activation="none"), 2)
    assert back is not None and back.predictions == raw.predictions


def test_predict_answers_the_logits_only_when_asked() -> None:
    from service.errors import ServiceError
    from service.http.predict.parsing import logits_flag
    from service.http.predict.render import answer_content

    flags = [logits_flag(v) for v in (None, "true", "1", "false", "0", "True")]
    assert flags == [False, True, True, False, False, True]
    with pytest.raises(ServiceError, match="logits must be true or false"):
        logits_flag("yes please")
    row = np.array([0.5, -1.25], dtype=LOGITS_DTYPE)
    answer = Answer(predictions=((0, "a", 0.5),), model="m")
    assert "logits" not in answer_content(answer)
    assert answer_content(dataclasses.replace(answer, logits=row.tobytes()))["logits"] == [0.5, -1.25]
