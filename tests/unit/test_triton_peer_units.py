"""The Triton peer (benchmarks.peers.triton_peer, benchmarks.peers.triton_model) and its place in the experiments.

The pure parts run everywhere: its configuration and command line (read back with the peer's own
parser), the KServe v2 request and answer, Triton's batch counters, the (g) table and the targets.
The inference callable runs here too, in vision-serve's environment, without Triton. The real peer
runs in tests/e2e/test_triton_peer_live.py.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import experiments
from benchmarks.experiments import TRITON_LABEL, triton_markdown, triton_targets
from benchmarks.peers import triton_env
from benchmarks.peers.triton_peer import (
    JSON_HEADER_LENGTH,
    TritonPeerConfig,
    TritonPorts,
    encode_request,
    parse_batch_counters,
    parse_response,
    probe_jpeg,
    server_command,
)
from service.tune.loadgen import _Sender, raw_image
from tests.unit.test_benchmarks_units import _records

CAT_CLASSES = {"tabby", "tiger cat", "Persian cat", "Siamese cat", "Egyptian cat"}
PORTS = TritonPorts(http=18000, grpc=18001, metrics=18002)

# ---- configuration and command line ----------------------------------------------------------------


def test_config_rejects_nonsense() -> None:
    for kwargs in ({"max_batch_size": 0}, {"max_queue_delay_us": -1}, {"threads": 0}):
        with pytest.raises(ValueError):
            TritonPeerConfig("resnet152", Path("w.pt"), **kwargs)


def test_the_command_line_is_what_the_peer_parses() -> None:
    from benchmarks.peers.triton_model import parse_args

    config = TritonPeerConfig("resnet152", Path("/work/resnet152 weights.pt"), threads=3, channels_last=False)
    command = server_command(Path("/venv/bin/python"), config, PORTS)

    assert command[:3] == ["/venv/bin/python", "-m", "benchmarks.peers.triton_model"]
    args = parse_args(command[3:])
    assert (args.model, args.weights) == ("resnet152", "/work/resnet152 weights.pt")
    assert (args.port, args.grpc_port, args.metrics_port) == (18000, 18001, 18002)
    assert (args.max_batch_size, args.max_queue_delay_us, args.threads) == (8, 0, 3)
    assert args.channels_last is False


def test_default_threads_are_every_core_and_recorded(monkeypatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    record = TritonPeerConfig("resnet152", Path("/w.pt")).as_record()
    assert record["threads"] == 2 and record["weights_file"] == "/w.pt" and record["channels_last"] is True
    json.dumps(record)  # goes into triton.json as it is


# ---- the request and the answer ----------------------------------------------------------------------


def test_the_request_carries_the_image_as_one_bytes_element() -> None:
    image = probe_jpeg()
    body, headers = encode_request(image)

    length = int(headers[JSON_HEADER_LENGTH])
    header, tensor = json.loads(body[:length]), body[length:]
    (only,) = header["inputs"]
    assert (only["name"], only["datatype"], only["shape"]) == ("image", "BYTES", [1, 1])
    assert only["parameters"]["binary_data_size"] == len(tensor)
    # Triton's BYTES layout: a little-endian 4-byte length, then the element.
    assert struct.unpack_from("<I", tensor)[0] == len(image) and tensor[4:] == image
    assert [o["name"] for o in header["outputs"]] == ["labels", "probabilities"]
    assert all(o["parameters"]["binary_data"] is False for o in header["outputs"])  # a JSON answer
    assert headers["Content-Type"] == "application/octet-stream"


def test_the_request_shape_does_not_depend_on_the_image_size() -> None:
    """Triton's dynamic batcher merges only requests of one shape: photos of any length must batch."""
    shapes = {json.dumps(json.loads(body[: int(h[JSON_HEADER_LENGTH])])["inputs"][0]["shape"])
              for body, h in map(encode_request, (b"\xff\xd8" * 10, b"\xff\xd8" * 5000))}  # fmt: skip
    assert shapes == {"[1, 1]"}


def test_the_load_generator_sends_what_the_encoder_builds() -> None:
    images = [probe_jpeg(), b"\x89PNG\r\n\x1a\n"]
    assert _Sender(None, "http://127.0.0.1:1/", images, 0.0, encode_request).bodies == list(map(encode_request, images))
    assert _Sender(None, "http://127.0.0.1:1/", images, 0.0).bodies[1] == (images[1], {"Content-Type": "image/png"})
    assert raw_image(images[0])[1] == {"Content-Type": "image/jpeg"}


def test_parse_response_reads_labels_and_probabilities() -> None:
    payload = {
        "model_name": "resnet152",
        "model_version": "1",
        "outputs": [
            {"name": "labels", "datatype": "BYTES", "shape": [1, 2], "data": ["tabby", "tiger cat"]},
            {"name": "probabilities", "datatype": "FP32", "shape": [1, 2], "data": [0.75, 0.25]},
        ],
    }
    assert parse_response(payload) == [("tabby", 0.75), ("tiger cat", 0.25)]
    payload["outputs"].pop()
    with pytest.raises(ValueError, match="probabilities"):
        parse_response(payload)


METRICS = """\
# HELP nv_inference_count Number of inferences performed (does not include cached requests)
# TYPE nv_inference_count counter
nv_inference_count{model="resnet152",version="1"} 136
nv_inference_count{model="resnet152-other",version="1"} 7
# HELP nv_inference_exec_count Number of model executions performed (does not include cached requests)
# TYPE nv_inference_exec_count counter
nv_inference_exec_count{model="resnet152",version="1"} 18
nv_inference_exec_count{model="resnet152-other",version="1"} 7
"""


def test_batch_counters_are_read_per_model() -> None:
    assert parse_batch_counters(METRICS, "resnet152") == (136.0, 18.0)
    assert parse_batch_counters(METRICS, "resnet152-other") == (7.0, 7.0)
    with pytest.raises(ValueError, match="nv_inference_count"):
        parse_batch_counters(METRICS, "efficientnet-lite0")


# ---- the inference callable, without Triton ------------------------------------------------------------


def test_the_callable_classifies_a_cat_and_preprocesses_as_vision_serve() -> None:
    import torch

    from benchmarks.peers.triton_model import Classifier, eval_transform
    from compile.catalog import get_model_entry
    from preprocessing.pil_backend import PilPreprocessor

    entry = get_model_entry("efficientnet-lite0")  # real weights shipped in a package: real labels
    classifier = Classifier(entry, "imagenet", threads=2, channels_last=True)
    photo = probe_jpeg()
    outputs = classifier(np.array([[photo], [photo]], dtype=np.object_))  # a batch of two, as @batch passes it

    assert outputs["labels"].shape == (2, 5) and outputs["probabilities"].shape == (2, 5)
    assert outputs["labels"][0, 0].decode() in CAT_CLASSES
    assert np.all(np.diff(outputs["probabilities"][0]) <= 0)  # best first
    # The peer's torchvision transforms and vision-serve's Pillow backend: the same pixels.
    ours = PilPreprocessor(entry.preprocess, "cpu")([photo]).images[0]
    theirs = classifier.preprocess(photo)
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert eval_transform(entry.preprocess).transforms[0].size == entry.preprocess.resize_size


# ---- the peers' torchvision transforms for any spec (benchmarks/harness/eval_transform.py) -------------

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _spec(**fields):
    from preprocessing.spec import PreprocessSpec

    return PreprocessSpec(**{"resize_size": 0, "crop_size": 0, "mean": MEAN, "std": STD, **fields})


EXPRESSIBLE = {
    "shorter-bilinear": {"resize_size": 64, "crop_size": 56},
    "shorter-bicubic-wide-crop": {"resize_size": 64, "crop_height": 48, "crop_width": 60, "interpolation": "bicubic"},
    "exact-non-square": {"resize_mode": "exact", "resize_height": 48, "resize_width": 64},
    "exact-then-crop": {
        "resize_mode": "exact",
        "resize_height": 60,
        "resize_width": 80,
        "crop_height": 48,
        "crop_width": 64,
        "interpolation": "nearest",
    },
    "bgr-rescaled-unnormalized": {
        "resize_mode": "exact",
        "resize_height": 48,
        "resize_width": 64,
        "channel_order": "BGR",
        "rescale_factor": 1 / 127.5,
        "normalize": False,
    },
    # mean and std are per channel of the model's input: here B, G, R.
    "bgr-normalized": {"resize_mode": "exact", "resize_height": 48, "resize_width": 64, "channel_order": "BGR"},
    # transformers' floor rounding and a pad fill change nothing where there is no crop to round or pad.
    "floor-without-crop": {
        "resize_mode": "exact",
        "resize_height": 40,
        "resize_width": 30,
        "crop_rounding": "floor",
        "pad_fill": (124, 116, 104),
    },
}


def _odd_photos() -> dict[str, bytes]:
    from PIL import Image

    from compile.sample_photos import sample_photo_file
    from tests.conftest import encode, sample_array

    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: the peer must turn it upright as vision-serve does
    sideways = Image.fromarray(sample_array("astronaut")).transpose(Image.Transpose.ROTATE_90)
    return {
        "chelsea": sample_photo_file("chelsea"),
        "sideways": encode(sideways, quality=95, exif=exif),
        "wide": encode(Image.fromarray(sample_array("rocket")).resize((900, 120)), "PNG"),
        "tiny": encode(Image.fromarray(sample_array("coffee")).resize((7, 5)), "PNG"),
    }


@pytest.mark.parametrize("name", sorted(EXPRESSIBLE))
def test_the_peers_torchvision_transform_is_vision_serves_pillow_preprocessing(name: str) -> None:
    import io

    import torch
    from PIL import Image

    from benchmarks.harness.eval_transform import eval_transform, upright_rgb
    from preprocessing.pil_backend import PilPreprocessor

    spec = _spec(**EXPRESSIBLE[name])
    transform = eval_transform(spec)
    reference = PilPreprocessor(spec, "cpu", num_threads=1, use_jpeg_draft=False)
    for photo, data in _odd_photos().items():
        with Image.open(io.BytesIO(data)) as image:
            theirs = transform(upright_rgb(image))
        ours = reference([data]).images[0]
        assert theirs.shape == ours.shape == (3, *spec.input_size), (name, photo)
        # The same pixels: what differs is float rounding (ToTensor then Normalize vs one multiply-add).
        torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5, msg=f"{name} {photo}")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (
            {"resize_mode": "cover", "resize_height": 48, "resize_width": 64, "crop_height": 48, "crop_width": 64},
            "resize_mode 'cover'",
        ),
        (
            {"resize_mode": "contain", "resize_height": 48, "resize_width": 64, "crop_height": 48, "crop_width": 64},
            "resize_mode 'contain'",
        ),
        ({"resize_size": 64, "crop_size": 56, "antialias": False}, "antialias=False"),
        ({"resize_size": 64, "crop_size": 56, "crop_rounding": "floor"}, "crop_rounding 'floor'"),
        ({"resize_size": 64, "crop_size": 72, "pad_fill": (124, 116, 104)}, "pad_fill (124, 116, 104)"),
    ],
)
def test_a_spec_torchvision_cannot_express_is_refused_naming_the_field(fields: dict, named: str) -> None:
    from benchmarks.harness.eval_transform import eval_transform

    with pytest.raises(ValueError, match="nearest") as refused:
        eval_transform(_spec(**fields))
    assert named in str(refused.value) and "\n" not in str(refused.value)


# ---- the experiment: table and targets -----------------------------------------------------------------


def _run(rps: float, p99: float) -> dict:
    return {
        "throughput_rps": rps,
        "latency_ms": {"p50": p99 / 2, "p95": p99 * 0.9, "p99": p99},
        "batch_size_mean": 7.5,
        "server_ms_median": {},
        "errors": 0,
    }


def _triton_record(triton_rps: float, triton_p99: float) -> dict:
    runs = {
        TRITON_LABEL: {1: _run(5.0, 210.0), 32: _run(triton_rps, triton_p99)},
        "vision-serve eager fp32": {1: _run(5.0, 200.0), 32: _run(8.0, 4000.0)},
        "vision-serve inductor fp32": {1: _run(5.0, 190.0), 32: _run(9.0, 3600.0)},
        "vision-serve inductor bf16": {1: _run(5.0, 100.0), 32: _run(20.0, 1600.0)},  # not fp32: not judged
    }
    config = TritonPeerConfig("resnet152", Path("/w.pt"), threads=2).as_record()
    return {"runs": runs, "triton_config": config}


def test_triton_targets_judge_the_fastest_fp32_configuration() -> None:
    throughput, p99 = triton_targets(_triton_record(triton_rps=8.0, triton_p99=4000.0))
    assert throughput.name == "vs Triton at fp32" and throughput.goal == 1.1
    assert throughput.measured == pytest.approx(9.0 / 8.0) and throughput.met
    assert throughput.detail.startswith("vision-serve inductor fp32 9.00 img/s")
    assert p99.lower_is_better and p99.measured == pytest.approx(0.9) and p99.met

    throughput, p99 = triton_targets(_triton_record(triton_rps=8.5, triton_p99=3000.0))
    assert not throughput.met and not p99.met  # 1.06x; 1.2x Triton's p99


def test_targets_add_the_triton_rows_only_with_a_triton_record() -> None:
    without = {t.name for t in experiments.targets(*_records(10.6, 19.5, 7.0, 1.0, 56.0))}
    assert not any("Triton" in name for name in without)
    found = experiments.targets(*_records(10.6, 19.5, 7.0, 1.0, 56.0), _triton_record(8.0, 4000.0))
    assert [t.name for t in found][-2:] == ["vs Triton at fp32", "p99 vs Triton at fp32"]


def test_the_triton_table_compares_every_configuration_with_triton() -> None:
    md = triton_markdown(_triton_record(8.0, 4000.0), ["triton-throughput.png"])
    assert "| vision-serve inductor fp32 | 1.12x | 0.90x |" in md
    assert f"| {TRITON_LABEL} | 32 | 8.00 |" in md
    assert "dynamic batcher up to 8" in md and "2 torch threads" in md
    assert md.rstrip().endswith("![triton-throughput.png](triton-throughput.png)")


def test_triton_is_an_experiment_that_all_runs_and_targets_may_lack(tmp_path) -> None:
    assert "triton" in experiments.EXPERIMENTS and "triton" in experiments.RUN_ALL
    assert "all" not in experiments.RUN_ALL and "targets" not in experiments.RUN_ALL
    assert experiments._read_runs(tmp_path, "triton", required=False) is None  # a folder from before (g)
    (tmp_path / "triton.json").write_text(json.dumps(_triton_record(8.0, 4000.0)))
    record = experiments._read_runs(tmp_path, "triton", required=False)
    assert record["runs"][TRITON_LABEL][32]["throughput_rps"] == 8.0  # concurrency keys are ints again
    assert triton_targets(record)[0].met


# ---- the virtualenv --------------------------------------------------------------------------------------


def test_the_model_packages_are_installed_only_when_asked_for(tmp_path, monkeypatch) -> None:
    installed = {"pytriton"}
    calls: list[list[str]] = []

    def fake_run(command, **kwargs):
        calls.append(command)
        if command[1:3] == ["-m", "pip"]:
            installed.update({"torch"})
            return subprocess.CompletedProcess(command, 0)
        needs_torch = "torch" in command[-1]
        return subprocess.CompletedProcess(command, 1 if needs_torch and "torch" not in installed else 0)

    python = triton_env.venv_python(tmp_path)
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    monkeypatch.setattr(triton_env.subprocess, "run", fake_run)

    assert triton_env.ensure_venv(tmp_path) == python
    assert not any("pip" in command for command in calls)
    assert not triton_env.model_env_ready(tmp_path)

    assert triton_env.ensure_venv(tmp_path, model=True) == python
    (pip,) = [command for command in calls if "pip" in command]
    assert pip[-len(triton_env.MODEL_REQUIREMENTS) :] == list(triton_env.MODEL_REQUIREMENTS)
    assert "torch==2.14.*" in pip and "torchvision==0.29.*" in pip
    assert triton_env.model_env_ready(tmp_path)


# ---- the real peer -----------------------------------------------------------------------------------------
