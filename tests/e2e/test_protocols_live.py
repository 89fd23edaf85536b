"""A live server speaking the Open Inference Protocol to tritonclient (HTTP and gRPC, sync and async),
and /predict taking many images per request. Real model (EfficientNet-Lite0), real photos, loopback.

tritonclient is Triton's own client, written by nobody here: if it classifies the photos, a Triton
user's code does too.
"""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.grpc.aio as triton_grpc_aio
import tritonclient.http as triton_http
import tritonclient.http.aio as triton_http_aio
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from service.client.cli import main as classify_main
from service.client.launcher import ServerProcess, free_port
from tests.conftest import CAT_LABELS

MODEL = "efficientnet-lite0"
KEY = "test-key-1"
MAX_BATCH = 8
MAX_IMAGES = 32
MAX_QUEUE = 24


def auth() -> dict[str, str]:
    """A new dict each call: tritonclient.http adds its Inference-Header-Content-Length to the one it gets."""
    return {"x-api-key": KEY}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    grpc_port = free_port()
    args = ["--model", MODEL, "--max-batch-size", str(MAX_BATCH), "--grpc-port", str(grpc_port)]
    args += ["--max-images-per-request", str(MAX_IMAGES), "--max-queue", str(MAX_QUEUE)]
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with ServerProcess(args, log_path=log_path, env={"VISION_SERVE_API_KEY": KEY}) as running:
        running.grpc_url = f"127.0.0.1:{grpc_port}"
        running.http_url = f"127.0.0.1:{running.port}"
        yield running


@pytest.fixture(scope="module")
def photos(chelsea_jpeg, coffee_jpeg) -> list[bytes]:
    return [chelsea_jpeg, coffee_jpeg]


def bytes_input(module, files: list[bytes], binary: bool = True):
    tensor = module.InferInput("IMAGE", [len(files)], "BYTES")
    values = files if binary else [base64.b64encode(f) for f in files]
    if module is triton_http:
        tensor.set_data_from_numpy(np.array(values, dtype=np.object_), binary_data=binary)
    else:
        tensor.set_data_from_numpy(np.array(values, dtype=np.object_))
    return tensor


def text(value: bytes | str) -> str:
    """tritonclient gives BYTES as bytes from binary data, as str from JSON."""
    return value.decode() if isinstance(value, bytes) else value


def assert_cat_and_espresso(labels: np.ndarray) -> None:
    assert labels.shape == (2, 5)
    assert text(labels[0, 0]) in CAT_LABELS and text(labels[1, 0]) == "espresso"


# --- tritonclient.http ---


def test_http_health_and_metadata(server) -> None:
    client = triton_http.InferenceServerClient(server.http_url)
    assert client.is_server_live() and client.is_server_ready()  # probes need no key
    assert client.is_model_ready(MODEL) and not client.is_model_ready("resnet50")
    metadata = client.get_model_metadata(MODEL, headers=auth())
    assert metadata["inputs"] == [{"name": "IMAGE", "datatype": "BYTES", "shape": [-1]}]
    assert [o["name"] for o in metadata["outputs"]] == ["LABELS", "PROBABILITIES", "CLASS_INDICES", "LOGITS"]
    assert metadata["outputs"][3] == {"name": "LOGITS", "datatype": "FP32", "shape": [-1, 1000]}
    assert "classification" in client.get_server_metadata(headers=auth())["extensions"]


def test_http_binary_bytes_classifies_the_photos(server, photos) -> None:
    client = triton_http.InferenceServerClient(server.http_url)
    result = client.infer(MODEL, [bytes_input(triton_http, photos)], headers=auth())
    assert_cat_and_espresso(result.as_numpy("LABELS"))
    probabilities = result.as_numpy("PROBABILITIES")
    assert probabilities.dtype == np.float32 and np.all(np.diff(probabilities, axis=1) <= 0)  # best first
    assert result.as_numpy("CLASS_INDICES")[1, 0] == 967  # espresso's ImageNet index


def test_http_json_base64_and_classification_extension(server, photos) -> None:
    client = triton_http.InferenceServerClient(server.http_url)
    outputs = [
        triton_http.InferRequestedOutput("LABELS", binary_data=False),
        triton_http.InferRequestedOutput("PROBABILITIES", binary_data=False, class_count=2),
    ]
    result = client.infer(MODEL, [bytes_input(triton_http, photos, binary=False)], outputs=outputs, headers=auth())
    response = result.get_response()
    assert all("data" in output for output in response["outputs"])  # JSON, as asked
    assert_cat_and_espresso(result.as_numpy("LABELS"))
    strings = result.as_numpy("PROBABILITIES")
    assert strings.shape == (2, 2)
    probability, index, label = text(strings[1, 0]).split(":")
    assert (index, label) == ("967", "espresso") and 0.5 < float(probability) <= 1.0


def test_http_uint8_file_bytes_as_tritons_dali_examples_send(server, photos) -> None:
    client = triton_http.InferenceServerClient(server.http_url)
    tensor = triton_http.InferInput("IMAGE", [1, len(photos[1])], "UINT8")
    tensor.set_data_from_numpy(np.frombuffer(photos[1], dtype=np.uint8)[None])
    assert client.infer(MODEL, [tensor], headers=auth()).as_numpy("LABELS")[0, 0] == b"espresso"


def test_http_bad_item_fails_the_request_naming_it(server, photos) -> None:
    client = triton_http.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException) as caught:
        client.infer(MODEL, [bytes_input(triton_http, [photos[0], b"not an image"])], headers=auth())
    assert caught.value.status() == "400" and "Image(s) 1 " in caught.value.message()


def test_http_key_unknown_model_and_too_many_images(server, photos) -> None:
    client = triton_http.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException) as caught:
        client.infer(MODEL, [bytes_input(triton_http, photos)])
    assert caught.value.status() == "401"
    with pytest.raises(InferenceServerException) as caught:
        client.infer("resnet50", [bytes_input(triton_http, photos)], headers=auth())
    assert caught.value.status() == "404"
    with pytest.raises(InferenceServerException) as caught:
        client.infer(MODEL, [bytes_input(triton_http, [photos[1]] * (MAX_IMAGES + 1))], headers=auth())
    assert caught.value.status() == "413" and "--max-images-per-request" in caught.value.message()


def test_http_errors_are_oip_json(server) -> None:
    response = httpx.post(f"{server.url}/v2/models/{MODEL}/infer", content=b"{", headers=auth())
    assert response.status_code == 400 and set(response.json()) == {"error"}


def test_http_async_client(server, photos) -> None:
    async def run() -> np.ndarray:
        async with triton_http_aio.InferenceServerClient(server.http_url) as client:
            assert await client.is_server_ready()
            tensor = triton_http_aio.InferInput("IMAGE", [2], "BYTES")
            tensor.set_data_from_numpy(np.array(photos, dtype=np.object_))
            return (await client.infer(MODEL, [tensor], headers=auth())).as_numpy("LABELS")

    assert_cat_and_espresso(asyncio.run(run()))


# --- tritonclient.grpc ---


def test_grpc_health_metadata_and_infer(server, photos) -> None:
    client = triton_grpc.InferenceServerClient(server.grpc_url)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
    metadata = client.get_model_metadata(MODEL, headers=auth())
    assert metadata.inputs[0].name == "IMAGE" and [o.name for o in metadata.outputs] == [
        "LABELS",
        "PROBABILITIES",
        "CLASS_INDICES",
        "LOGITS",
    ]
    assert list(metadata.outputs[3].shape) == [-1, 1000]
    outputs = [
        triton_grpc.InferRequestedOutput("LABELS"),
        triton_grpc.InferRequestedOutput("PROBABILITIES", class_count=3),
    ]
    result = client.infer(MODEL, [bytes_input(triton_grpc, photos)], outputs=outputs, headers=auth())
    assert_cat_and_espresso(result.as_numpy("LABELS"))
    assert result.as_numpy("PROBABILITIES").shape == (2, 3)
    assert result.as_numpy("PROBABILITIES")[1, 0].decode().endswith(":967:espresso")


def test_grpc_errors_carry_status_codes(server, photos) -> None:
    client = triton_grpc.InferenceServerClient(server.grpc_url)
    cases = [
        ({}, [photos[0]], MODEL, "StatusCode.UNAUTHENTICATED"),
        (auth(), [photos[0], b"not an image"], MODEL, "StatusCode.INVALID_ARGUMENT"),
        (auth(), [photos[0]], "resnet50", "StatusCode.NOT_FOUND"),
    ]
    for headers, files, model, status in cases:
        with pytest.raises(InferenceServerException) as caught:
            client.infer(model, [bytes_input(triton_grpc, files)], headers=headers)
        assert caught.value.status() == status, caught.value.message()


def test_grpc_async_client(server, photos) -> None:
    async def run() -> np.ndarray:
        async with triton_grpc_aio.InferenceServerClient(server.grpc_url) as client:
            assert await client.is_server_ready()
            tensor = triton_grpc_aio.InferInput("IMAGE", [2], "BYTES")
            tensor.set_data_from_numpy(np.array(photos, dtype=np.object_))
            return (await client.infer(MODEL, [tensor], headers=auth())).as_numpy("LABELS")

    assert_cat_and_espresso(asyncio.run(run()))


# --- /predict with many images ---


def test_predict_multipart_images_each_with_its_own_outcome(server, photos) -> None:
    files = [("image", ("cat.jpg", photos[0])), ("image", ("junk.jpg", b"junk")), ("image", ("coffee.jpg", photos[1]))]
    response = httpx.post(f"{server.url}/predict", files=files, data={"top_k": "3"}, headers=auth(), timeout=60)
    assert response.status_code == 200
    results = response.json()["results"]
    assert [r["status_code"] for r in results] == [200, 415, 200]
    assert results[0]["predictions"][0]["label"] in CAT_LABELS and len(results[0]["predictions"]) == 3
    assert results[2]["predictions"][0]["label"] == "espresso" and "detail" in results[1]


def test_predict_json_images_with_a_bad_base64_item(server, photos) -> None:
    body = {"images": [base64.b64encode(photos[1]).decode(), "@@@"]}
    results = httpx.post(f"{server.url}/predict", json=body, headers=auth(), timeout=60).json()["results"]
    assert results[0]["predictions"][0]["label"] == "espresso"
    assert results[1]["status_code"] == 400 and "Item 1" in results[1]["detail"]


def test_predict_image_limits(server, photos) -> None:
    too_many = {"images": [base64.b64encode(photos[1]).decode()] * (MAX_IMAGES + 1)}
    response = httpx.post(f"{server.url}/predict", json=too_many, headers=auth(), timeout=60)
    assert response.status_code == 413 and "--max-images-per-request" in response.json()["detail"]
    over_queue = {"images": too_many["images"][: MAX_QUEUE + 1]}  # within the request limit, never admissible
    response = httpx.post(f"{server.url}/predict", json=over_queue, headers=auth(), timeout=60)
    assert response.status_code == 413 and "--max-queue" in response.json()["detail"]


def batch_metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vision_serve_images_total":
                values["images"] = sample.value
            elif sample.name == "vision_serve_batch_size_count":
                values["batches"] = sample.value
            elif sample.name == "vision_serve_batch_size_bucket" and sample.labels["le"] == str(float(MAX_BATCH)):
                values["batches_within_max"] = sample.value
    return values


def test_each_image_is_its_own_batch_item(server, photos) -> None:
    before = batch_metrics(server.url)
    images = [base64.b64encode(photos[i % 2]).decode() for i in range(2 * MAX_BATCH)]
    response = httpx.post(f"{server.url}/predict", json={"images": images}, headers=auth(), timeout=120)
    assert [r["status_code"] for r in response.json()["results"]] == [200] * len(images)
    after = batch_metrics(server.url)
    assert after["images"] - before["images"] == len(images)
    # Sixteen images, batches of at most eight: at least two batches, none above the maximum.
    assert after["batches"] - before["batches"] >= 2
    assert after["batches_within_max"] - before["batches_within_max"] == after["batches"] - before["batches"]


def test_vision_classify_sends_images_per_request(server, tmp_path, photos, capsys) -> None:
    paths = []
    for name, data in (("cat.jpg", photos[0]), ("junk.jpg", b"junk"), ("coffee.jpg", photos[1])):
        paths.append(tmp_path / name)
        paths[-1].write_bytes(data)
    code = classify_main([*map(str, paths), "--url", server.url, "--images-per-request", "2", "--api-key", KEY])
    out = capsys.readouterr().out
    assert code == 1  # one image failed
    assert "espresso" in out and "junk.jpg  ERROR: HTTP 415" in out
    assert any(label in out for label in CAT_LABELS)
