"""The model's activation and its whole output on real servers (issue 61, parts 4 and 5): a tiny
multi-label transformers folder (problem_type multi_label_classification) served eagerly answers
sigmoid probabilities; LOGITS over HTTP JSON, the binary extension and gRPC (tritonclient) equal the
model's own logits in this process; Triton's classification strings on LOGITS parse back; /predict
gives the whole vector on ?logits=true, never from the response cache; --activation overrides the
model's; an unknown output is still a 400 that lists the outputs."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from service.client.launcher import ServerProcess, free_port
from tests.conftest import encode, sample_array
from tests.hf_folders import LABELS, save_transformers

pytest.importorskip("transformers")
PHOTOS = ("chelsea", "coffee")
NAME = "multi"
LOGITS_RTOL, LOGITS_ATOL = 1e-4, 1e-5  # eager fp32 here and there, batches of other sizes
SIGMOID_TOLERANCE = 5e-3


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_transformers("resnet", tmp_path_factory.mktemp("hf") / NAME, problem_type="multi_label_classification")


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    return [encode(sample_array(name), "PNG") for name in PHOTOS]  # PNG: no JPEG draft decoding to match


@pytest.fixture(scope="module")
def own_logits(folder, photos) -> np.ndarray:
    """The model's own logits in this process, on the pixels the server's PIL backend makes."""
    from transformers import AutoModelForImageClassification

    from compile.model_request import ModelRequest
    from compile.model_source import resolve_model
    from preprocessing.pil_backend import PilPreprocessor

    entry = resolve_model(ModelRequest(model=str(folder)))
    pixels = PilPreprocessor(entry.preprocess, "cpu").__call__(photos).images.float()
    model = AutoModelForImageClassification.from_pretrained(folder, local_files_only=True).eval()
    with torch.no_grad():
        return model(pixel_values=pixels.contiguous()).logits.numpy()


def serve(folder, tmp_path_factory, *extra: str):
    grpc_port = free_port()
    args = ["--model", str(folder), "--name", NAME, "--api-servers", "1", "--workers-per-device", "1"]
    args += ["--grpc-port", str(grpc_port), "--response-cache-mb", "8", *extra]
    server = ServerProcess(args, log_path=tmp_path_factory.mktemp("server") / "server.log")
    server.grpc_url = f"127.0.0.1:{grpc_port}"
    server.http_url = f"127.0.0.1:{server.port}"
    return server


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    with serve(folder, tmp_path_factory) as running:
        yield running


@pytest.fixture(scope="module")
def raw_server(folder, tmp_path_factory):
    """The same folder with --activation none: the scores are the logits."""
    with serve(folder, tmp_path_factory, "--activation", "none") as running:
        yield running


def image_input(module, photos: list[bytes], binary: bool = True):
    tensor = module.InferInput("IMAGE", [len(photos)], "BYTES")
    if module is triton_http:
        tensor.set_data_from_numpy(np.array(photos, dtype=np.object_), binary_data=binary)
    else:
        tensor.set_data_from_numpy(np.array(photos, dtype=np.object_))
    return tensor


def assert_logits(values: np.ndarray, own: np.ndarray) -> None:
    assert values.dtype == np.float32 and values.shape == own.shape == (len(PHOTOS), len(LABELS))
    np.testing.assert_allclose(values, own, rtol=LOGITS_RTOL, atol=LOGITS_ATOL)


def parse_classification(strings: np.ndarray) -> list[list[tuple[float, int, str]]]:
    """Triton's "value:index:label" elements, as a tritonclient user splits them."""
    rows = []
    for row in strings:
        parsed = []
        for element in row:
            value, index, label = (element.decode() if isinstance(element, bytes) else element).split(":", 2)
            parsed.append((float(value), int(index), label))
        rows.append(parsed)
    return rows


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_logits_over_http_equal_the_models_own(server, photos, own_logits, binary) -> None:
    client = triton_http.InferenceServerClient(server.http_url)
    outputs = [triton_http.InferRequestedOutput("LOGITS", binary_data=binary)]
    result = client.infer(NAME, [image_input(triton_http, photos)], outputs=outputs)
    (output,) = result.get_response()["outputs"]
    assert ("data" in output) is not binary
    assert_logits(result.as_numpy("LOGITS"), own_logits)


def test_logits_over_grpc_and_classification_strings(server, photos, own_logits) -> None:
    client = triton_grpc.InferenceServerClient(server.grpc_url)
    outputs = [triton_grpc.InferRequestedOutput("LOGITS")]
    result = client.infer(NAME, [image_input(triton_grpc, photos)], outputs=outputs)
    assert_logits(result.as_numpy("LOGITS"), own_logits)
    classified = client.infer(
        NAME, [image_input(triton_grpc, photos)], outputs=[triton_grpc.InferRequestedOutput("LOGITS", class_count=2)]
    )
    http_classified = triton_http.InferenceServerClient(server.http_url).infer(
        NAME,
        [image_input(triton_http, photos)],
        outputs=[triton_http.InferRequestedOutput("LOGITS", binary_data=False, class_count=2)],
    )
    for strings in (classified.as_numpy("LOGITS"), http_classified.as_numpy("LOGITS")):
        assert strings.shape == (len(PHOTOS), 2)
        for row, own in zip(parse_classification(strings), own_logits, strict=True):
            best = np.argsort(-own)[:2]
            assert [index for _, index, _ in row] == best.tolist()
            assert [label for _, _, label in row] == [LABELS[i] for i in best]
            np.testing.assert_allclose([value for value, _, _ in row], own[best], atol=2e-6)  # printed as %f


def test_a_multi_label_folder_answers_sigmoid_probabilities(server, photos, own_logits) -> None:
    assert httpx.get(f"{server.url}/info", timeout=10).json()["model"]["activation"] == "sigmoid"
    client = triton_http.InferenceServerClient(server.http_url)
    outputs = [triton_http.InferRequestedOutput(name) for name in ("PROBABILITIES", "CLASS_INDICES")]
    result = client.infer(NAME, [image_input(triton_http, photos)], outputs=outputs, parameters={"top_k": 3})
    expected = torch.sigmoid(torch.from_numpy(own_logits)).numpy()
    indices = result.as_numpy("CLASS_INDICES")
    np.testing.assert_allclose(
        result.as_numpy("PROBABILITIES"), np.take_along_axis(expected, indices, 1), atol=SIGMOID_TOLERANCE
    )
    assert not np.allclose(expected.sum(axis=1), 1.0, atol=1e-3), "sigmoid scores need not add up to 1"
    answer = httpx.post(f"{server.url}/predict", content=photos[0], timeout=30).json()
    by_index = {p["index"]: p["probability"] for p in answer["predictions"]}
    assert by_index == pytest.approx({i: float(expected[0, i]) for i in by_index}, abs=SIGMOID_TOLERANCE)


def test_predict_gives_the_whole_vector_on_request_never_from_the_cache(server, photos, own_logits) -> None:
    url = f"{server.url}/predict"
    plain = httpx.post(url, content=photos[1], timeout=30)
    again = httpx.post(url, content=photos[1], timeout=30)
    assert "logits" not in plain.json() and again.headers["x-cache"] == "hit"
    asked = httpx.post(url, params={"logits": "true"}, content=photos[1], timeout=30)
    assert asked.status_code == 200 and asked.headers["x-cache"] == "miss", "a cached top-k never answers it"
    np.testing.assert_allclose(asked.json()["logits"], own_logits[1], rtol=LOGITS_RTOL, atol=LOGITS_ATOL)
    assert asked.json()["predictions"] == again.json()["predictions"]
    many = httpx.post(url, params={"logits": "1"}, files=[("image", p) for p in photos], timeout=30).json()
    for result, own in zip(many["results"], own_logits, strict=True):
        np.testing.assert_allclose(result["logits"], own, rtol=LOGITS_RTOL, atol=LOGITS_ATOL)
    assert httpx.post(url, params={"logits": "maybe"}, content=photos[0], timeout=30).status_code == 422


def test_the_python_client_asks_for_the_whole_vector(server, photos, own_logits) -> None:
    from service.client.vision_client import AsyncVisionClient, VisionClient

    with VisionClient(server.url) as client:
        assert client.classify(photos[0]).logits is None  # only when asked
        one = client.classify(photos[0], logits=True)
        many = client.classify_many(photos, top_k=2, logits=True)
    np.testing.assert_allclose(one.logits, own_logits[0], rtol=LOGITS_RTOL, atol=LOGITS_ATOL)
    assert [len(result.predictions) for result in many] == [2, 2]
    for result, own in zip(many, own_logits, strict=True):
        np.testing.assert_allclose(result.logits, own, rtol=LOGITS_RTOL, atol=LOGITS_ATOL)

    async def asked_async():
        async with AsyncVisionClient(server.url) as client:
            return await client.classify(photos[1], logits=True)

    import asyncio

    np.testing.assert_allclose(asyncio.run(asked_async()).logits, own_logits[1], rtol=LOGITS_RTOL, atol=LOGITS_ATOL)


def test_an_unknown_output_is_still_a_400_listing_the_outputs(server, photos) -> None:
    body = {
        "inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": ["eA=="]}],
        "outputs": [{"name": "SCORES"}],
    }
    response = httpx.post(f"{server.url}/v2/models/{NAME}/infer", json=body, timeout=30)
    assert response.status_code == 400
    assert "LABELS, PROBABILITIES, CLASS_INDICES, LOGITS" in response.json()["error"]
    client = triton_grpc.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException, match="Unknown output 'SCORES'"):
        client.infer(NAME, [image_input(triton_grpc, photos)], outputs=[triton_grpc.InferRequestedOutput("SCORES")])


def test_the_activation_flag_overrides_the_models(raw_server, photos, own_logits) -> None:
    assert httpx.get(f"{raw_server.url}/info", timeout=10).json()["model"]["activation"] == "none"
    client = triton_grpc.InferenceServerClient(raw_server.grpc_url)
    outputs = [triton_grpc.InferRequestedOutput(name) for name in ("PROBABILITIES", "CLASS_INDICES")]
    result = client.infer(NAME, [image_input(triton_grpc, photos)], outputs=outputs, parameters={"top_k": 3})
    indices = result.as_numpy("CLASS_INDICES")
    np.testing.assert_allclose(
        result.as_numpy("PROBABILITIES"),
        np.take_along_axis(own_logits, indices, 1),
        rtol=LOGITS_RTOL,
        atol=LOGITS_ATOL,
    )
