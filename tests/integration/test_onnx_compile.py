"""compile-trt --backend onnx end to end on CPU with a real pretrained model: the artifact, its gate and
cache, serving it over HTTP, and the Triton model repository it exports, whose ONNX model and
DALI preprocessing run here and are compared with the artifact. Triton itself (with its onnxruntime
and DALI backends) is not installable here: the configs are checked against Triton's protobuf
schema, and each model file is run by the library Triton would run it with."""

from __future__ import annotations

import subprocess
import sys

import httpx
import numpy as np
import psutil
import pytest
import torch
from PIL import Image

from compile import _defaults
from compile.build import compile_artifact
from compile.gate import compare_logits, threshold_failures
from compile.manifest import read_manifest, sha256_file
from compile.sample_photos import sample_photo_files
from compile.settings import CompileSettings
from compile.triton_repository import RepositoryModels, parse_model_config
from preprocessing.spec import PreprocessSpec
from service.client.launcher import ServerProcess
from service.client.vision_client import VisionClient
from service.settings import ServeSettings
from service.transport.control_channel import READY
from service.worker.contract import BatchPolicy
from service.worker.engine import load_artifact
from service.worker.host import SlotSpec
from tests.conftest import CAT_LABELS, encode, sample_array
from tests.worker_hold import wait_until
from tests.worker_hosts import main_process_end, place

ort = pytest.importorskip("onnxruntime")
LITE = ["--model", "efficientnet-lite0", "--device", "cpu", "--backend", "onnx"]
FP32 = _defaults.GATE_THRESHOLDS["fp32"]


@pytest.fixture(scope="module")
def onnx_export(tmp_path_factory):
    """The artifact and a Triton repository, compiled once through the console entry point."""
    root = tmp_path_factory.mktemp("onnx")
    output, repository = root / "lite0-onnx", root / "triton"
    command = [sys.executable, "-m", "compile.cli", *LITE, "--output", str(output)]
    done = subprocess.run(
        [*command, "--triton-repository", str(repository)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "accuracy gate passed" in done.stdout and f"Triton model repository: {repository}" in done.stdout
    return output, repository


def test_onnx_artifact_records_what_was_built_and_passed_its_gate(onnx_export) -> None:
    output, _ = onnx_export
    manifest = read_manifest(output)
    assert (manifest.backend, manifest.engine_name, manifest.engine_file) == ("onnx", "onnxruntime-fp32", "model.onnx")
    assert sha256_file(output / "model.onnx") == manifest.engine_sha256
    assert manifest.versions["onnxruntime"] == ort.__version__ and "onnx" in manifest.versions
    config = manifest.backend_config
    assert config["providers"] == [["CPUExecutionProvider", {}]]
    assert config["export"]["opset_version"] == _defaults.ONNX_OPSET and config["export"]["dynamo"]
    assert config["session"]["config_entries"]["session.intra_op.allow_spinning"] == "0"
    validation = manifest.validation
    assert validation["passed"] and validation["samples"]["batch_sizes"] == [1, 8, 32]
    assert (
        validation["metrics"]["top1_agreement"] == 1.0
        and validation["metrics"]["max_rel_error"] <= FP32["max_rel_error"]
    )
    chelsea = next(item for item in validation["real_images"] if item["name"] == "chelsea")
    assert chelsea["compiled"] in CAT_LABELS


def test_the_same_compile_is_a_cache_hit_and_rewrites_the_repository(onnx_export, tmp_path) -> None:
    output, _ = onnx_export
    before = read_manifest(output)
    settings = CompileSettings(
        model="efficientnet-lite0", backend="onnx", device="cpu", output=str(output), triton_repository=str(tmp_path)
    )
    result = compile_artifact(settings)
    assert result.cached and result.manifest.cache_key == before.cache_key
    assert (
        result.triton_repository == tmp_path and (tmp_path / "efficientnet-lite0-onnx" / "1" / "model.onnx").is_file()
    )


def test_served_onnx_artifact_answers_with_its_engine_name(onnx_export, chelsea_jpeg, coffee_jpeg, tmp_path) -> None:
    output, _ = onnx_export
    with ServerProcess(["--artifact", str(output)], log_path=tmp_path / "server.log") as server:
        with VisionClient(server.url) as client:
            cat, coffee = client.classify(chelsea_jpeg), client.classify(coffee_jpeg)
            many = client.classify_many([chelsea_jpeg] * 3)  # one request, several batch items
        info = httpx.get(f"{server.url}/info").json()["model"]
    assert cat.top1.label in CAT_LABELS and coffee.top1.label == "espresso"
    assert cat.engine == coffee.engine == info["engine"] == "onnxruntime-fp32"
    assert [r.top1.label for r in many] == [cat.top1.label] * 3
    assert info["artifact"]["backend"] == "onnx"
    assert info["artifact"]["backend_config"]["providers"][0][0] == "CPUExecutionProvider"


def test_triton_repository_files_parse_and_hold_the_artifacts_model(onnx_export) -> None:
    output, repository = onnx_export
    manifest = read_manifest(output)
    names = RepositoryModels.for_model(manifest.model)
    assert sorted(p.name for p in repository.iterdir()) == sorted([names.ensemble, names.preprocess, names.classifier])
    configs = {
        name: parse_model_config((repository / name / "config.pbtxt").read_text()) for name in names.__dict__.values()
    }
    classifier = configs[names.classifier]
    model_file = repository / names.classifier / "1" / "model.onnx"
    assert sha256_file(model_file) == manifest.engine_sha256  # the gated file, byte for byte
    assert (repository / names.ensemble / "1").is_dir() and (
        repository / names.preprocess / "1" / "model.dali"
    ).is_file()
    for model in (names.ensemble, names.classifier):
        assert (repository / model / "labels.txt").read_text().splitlines() == list(manifest.labels)
    # What Triton's onnxruntime backend checks at load: the config's tensors are the model's.
    session = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    (model_input,), (model_output,) = session.get_inputs(), session.get_outputs()
    assert (model_input.name, model_output.name) == (classifier.input[0].name, classifier.output[0].name)
    assert model_input.shape[1:] == list(classifier.input[0].dims) and model_output.shape[1:] == list(
        classifier.output[0].dims
    )
    assert isinstance(model_input.shape[0], str)  # a dynamic batch dimension, which max_batch_size needs
    assert classifier.max_batch_size == manifest.batch_max


def run_triton_preprocessing(repository, names: RepositoryModels, photos: list[bytes]) -> torch.Tensor:
    """The repository's model.dali, deserialized and run on the CPU as Triton's DALI backend runs it."""
    import nvidia.dali as dali

    path = repository / names.preprocess / "1" / "model.dali"
    pipe = dali.Pipeline.deserialize(filename=str(path), device_id=None, batch_size=len(photos), num_threads=2)
    pipe.build()
    pipe.feed_input("IMAGE", [np.frombuffer(data, dtype=np.uint8) for data in photos])
    (crops,) = pipe.run()
    return torch.from_numpy(np.stack([np.array(crop) for crop in crops]))


def exif_rotated() -> bytes:
    """The cat stored on its side (turned 90 degrees counter-clockwise), with EXIF orientation 6, which
    displays it turned back clockwise: upright."""
    upright = Image.fromarray(sample_array("chelsea"))
    exif = Image.Exif()
    exif[0x0112] = 6
    return encode(upright.transpose(Image.Transpose.ROTATE_90), quality=95, exif=exif)


def test_triton_pieces_run_here_and_match_the_artifact(onnx_export) -> None:
    pytest.importorskip("nvidia.dali")
    from preprocessing.dali_backend import DaliPreprocessor

    output, repository = onnx_export
    manifest = read_manifest(output)
    names = RepositoryModels.for_model(manifest.model)
    photos = [data for _, data in sample_photo_files("JPEG")] + [exif_rotated()]
    triton_images = run_triton_preprocessing(repository, names, photos)
    # A client batching images into one UINT8 [N, L] tensor pads them with zeros to the longest.
    longest = max(map(len, photos))
    padded = [data + bytes(longest - len(data)) for data in photos]
    torch.testing.assert_close(run_triton_preprocessing(repository, names, padded), triton_images, rtol=0, atol=0)
    # Our served DALI preprocessing (crop box from the host) gives the same pixels as the in-graph box.
    served_images = DaliPreprocessor(manifest.preprocess, "cpu")(photos).images.float()
    torch.testing.assert_close(triton_images[:-1], served_images[:-1], rtol=0, atol=1e-5)
    # The rotated photo: Triton's graph resamples the upright image, ours the stored one and turns the
    # crop afterwards; the same box, with a few values one 8-bit level apart from the rounding.
    one_level = 1 / (255 * min(manifest.preprocess.std))
    rotated_difference = (triton_images[-1] - served_images[-1]).abs()
    assert rotated_difference.max() <= one_level + 1e-5
    assert (rotated_difference > 1e-5).float().mean() < 1e-3
    # The repository's model on those inputs agrees with the artifact as its gate demands of an engine.
    session = ort.InferenceSession(
        str(repository / names.classifier / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    triton_logits = torch.from_numpy(session.run(None, {"images": triton_images.numpy()})[0])
    artifact = load_artifact(output, torch.device("cpu"))
    random_inputs = torch.randn(8, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        artifact_logits = artifact(torch.cat([served_images, random_inputs]))
    triton_random = torch.from_numpy(session.run(None, {"images": random_inputs.numpy()})[0])
    metrics = compare_logits(torch.cat([triton_logits, triton_random]), artifact_logits)
    assert threshold_failures(metrics, FP32) == [], metrics
    labels = [manifest.labels[int(i)] for i in triton_logits.argmax(1)]
    assert labels[0] in CAT_LABELS and labels[1] == "espresso" and labels[-1] in CAT_LABELS  # the rotated cat too


def test_triton_preprocessing_follows_the_manifest_spec(onnx_export, tmp_path) -> None:
    """A model with another crop (EfficientNet-Lite0 is 256 -> 224; here 288 -> 256, bicubic) exports
    a DALI graph that follows it, and matches the served DALI backend for that spec."""
    pytest.importorskip("nvidia.dali")
    import dataclasses

    from compile.triton_repository import serialize_preprocessing
    from preprocessing.dali_backend import DaliPreprocessor

    output, _ = onnx_export
    spec = PreprocessSpec(288, 256, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), "bicubic")
    manifest = dataclasses.replace(read_manifest(output), preprocess=spec)
    names = RepositoryModels.for_model(manifest.model)
    (tmp_path / names.preprocess / "1").mkdir(parents=True)
    serialize_preprocessing(manifest, tmp_path / names.preprocess / "1" / "model.dali")
    photos = [data for _, data in sample_photo_files("JPEG")]
    triton_images = run_triton_preprocessing(tmp_path, names, photos)
    assert triton_images.shape == (len(photos), 3, 256, 256)
    torch.testing.assert_close(triton_images, DaliPreprocessor(spec, "cpu")(photos).images.float(), rtol=0, atol=1e-5)


@pytest.mark.slow  # four real loads in a spawned worker: ~30 s
def test_a_worker_process_gives_back_what_each_stopped_model_held(onnx_export, tmp_path) -> None:
    """A shared worker process loads and stops models for weeks (loading on demand, swaps): each
    stopped slot's engine must go, or every cycle grows the process by an engine. Real slots in a real
    spawned worker process, each loop started and stopped by the main process's commands; before
    ``Classifier.release`` a frozen reference cycle kept every engine."""
    output, _ = onnx_export
    settings = ServeSettings(artifact=str(output), preprocess="pil", worker_isolation="shared")
    spec = SlotSpec(settings, BatchPolicy(max_batch_size=8), "service.worker.classifier:Classifier")
    resident, after_stop = [], []
    with main_process_end(tmp_path) as (states, hosts):
        for worker_id in range(4):
            slot = place(states, hosts, worker_id, spec)
            wait_until(lambda i=worker_id: states.get(i) == READY, f"worker {worker_id} is ready", timeout=120)
            process = psutil.Process(slot.pid)
            resident.append(process.memory_info().rss)
            slot.terminate()
            slot.join(30)
            assert not slot.is_alive() and slot.exitcode == 0 and slot.host.alive(), (
                "the slot ends, its process serves on"
            )
            after_stop.append(process.memory_info().rss)
    engine = resident[0] - after_stop[0]  # what one resident model holds, as this process measures it
    per_cycle = (after_stop[-1] - after_stop[0]) / (len(after_stop) - 1)
    assert engine > 8 << 20, f"a loaded model should hold its engine: {engine / 2**20:.0f} MiB"
    assert per_cycle < engine / 4, (
        f"each load-and-stop grew the process by {per_cycle / 2**20:.1f} MiB (a model holds {engine / 2**20:.0f})"
    )
