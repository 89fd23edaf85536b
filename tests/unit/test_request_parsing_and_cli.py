"""Request parsing (HTTP process side) and settings / CLI mapping, without a model."""

from __future__ import annotations

import base64
import multiprocessing
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from service import _defaults
from service.cli import build_parser, main, settings_from_args
from service.errors import ServiceError
from service.http.base.limits import RequestLimits
from service.http.predict.parsing import decode_base64_image, predict_top_k, read_predict_request
from service.http.predict.render import handle_service_error
from service.settings import ServeSettings, env_overrides, resolve_api_servers, resolve_pipeline_depth
from service.supervisor.planning.planner import resolve_device
from service.worker.engine import bind_worker_device

SMALL_LIMIT = 1000


def echo_app(limits: RequestLimits) -> TestClient:
    """A bare FastAPI app that answers with what read_predict_request parsed (its errors as the
    server's routes answer them)."""
    app = FastAPI()
    app.add_exception_handler(ServiceError, handle_service_error)

    @app.post("/predict")
    async def predict(request: Request) -> dict:
        parsed = await read_predict_request(request, limits)
        return {"n_bytes": len(parsed.images[0]), "head": parsed.images[0][:4].decode("latin-1"), "top_k": parsed.top_k}

    return TestClient(app)


@pytest.fixture(scope="module")
def echo_client() -> TestClient:
    return echo_app(RequestLimits())


@pytest.fixture(scope="module")
def small_limit_client() -> TestClient:
    return echo_app(RequestLimits(max_body_bytes=SMALL_LIMIT))


def test_raw_body(echo_client) -> None:
    r = echo_client.post("/predict?top_k=3", content=b"\xff\xd8\xff\xe0rest", headers={"Content-Type": "image/jpeg"})
    assert r.json() == {"n_bytes": 8, "head": "\xff\xd8\xff\xe0", "top_k": 3}


def test_raw_body_without_content_type_defaults_top_k(echo_client) -> None:
    r = echo_client.post("/predict", content=b"abcd")
    assert r.json()["top_k"] == _defaults.TOP_K and r.json()["n_bytes"] == 4


def test_multipart_field_and_top_k(echo_client) -> None:
    r = echo_client.post("/predict", files={"image": ("cat.jpg", b"JPEGDATA", "image/jpeg")}, data={"top_k": "2"})
    assert r.json() == {"n_bytes": 8, "head": "JPEG", "top_k": 2}


def test_multipart_large_file_is_not_cut(echo_client) -> None:
    big = b"x" * (3 * 1024 * 1024)  # above Starlette's 1 MiB in-memory part limit
    r = echo_client.post("/predict", files={"image": ("big.jpg", big, "image/jpeg")})
    assert r.status_code == 200 and r.json()["n_bytes"] == len(big)


def test_multipart_without_image_field(echo_client) -> None:
    r = echo_client.post("/predict", files={"file": ("cat.jpg", b"x", "image/jpeg")})
    assert r.status_code == 400 and 'field named "image"' in r.json()["detail"]


def test_json_base64_and_data_url(echo_client) -> None:
    payload = base64.b64encode(b"PNGDATA").decode()
    assert echo_client.post("/predict", json={"image": payload, "top_k": 7}).json()["top_k"] == 7
    data_url = "data:image/png;base64," + payload
    assert echo_client.post("/predict", json={"image": data_url}).json()["head"] == "PNGD"


@pytest.mark.parametrize(
    ("kwargs", "status", "words"),
    [
        ({"content": b"{not json", "headers": {"Content-Type": "application/json"}}, 400, "not valid JSON"),
        ({"json": {"picture": "abc"}}, 400, 'field "image"'),
        ({"json": {"image": "@@@not base64@@@"}}, 400, "not valid base64"),
        ({"json": {"image": 12}}, 400, "base64 string"),
        ({"content": b"", "headers": {"Content-Type": "image/jpeg"}}, 400, "no image"),
        ({"content": b"abc", "params": {"top_k": "0"}}, 422, "top_k"),
        ({"content": b"abc", "params": {"top_k": "1001"}}, 422, "top_k"),
        ({"content": b"abc", "params": {"top_k": "five"}}, 422, "top_k"),
        ({"json": {"image": "YWJj", "top_k": True}}, 422, "top_k"),
        ({"content": b'{"image": "YWJj", "top_k": ' + b"9" * 5000 + b"}",
          "headers": {"Content-Type": "application/json"}}, 400, "not valid JSON"),  # int too long to parse
        ({"content": b"[" * 100_000 + b"]" * 100_000, "headers": {"Content-Type": "application/json"}}, 400,
         "not valid JSON"),  # nesting past the recursion limit
    ],
    ids=["bad-json", "no-image-field", "bad-base64", "image-not-string", "empty-body", "top-k-0", "top-k-1001",
         "top-k-word", "top-k-bool", "huge-int", "deep-nesting"],
)  # fmt: skip
def test_malformed_requests_get_a_clear_4xx(echo_client, kwargs, status, words) -> None:
    r = echo_client.post("/predict", **kwargs)
    assert r.status_code == status
    assert words in r.json()["detail"]


def test_oversized_body_is_413(small_limit_client) -> None:
    r = small_limit_client.post("/predict", content=b"x" * (SMALL_LIMIT + 1))
    assert r.status_code == 413 and "1,000" in r.json()["detail"] and "--max-body-bytes" in r.json()["detail"]
    r = small_limit_client.post("/predict", files={"image": ("big.jpg", b"x" * (SMALL_LIMIT + 1), "image/jpeg")})
    assert r.status_code == 413
    ok = small_limit_client.post("/predict", files={"image": ("ok.jpg", b"x" * 100, "image/jpeg")})
    assert ok.status_code == 200 and ok.json()["n_bytes"] == 100


@pytest.mark.parametrize("multipart", [False, True], ids=["raw", "multipart"])
def test_chunked_upload_is_cut_off_at_the_limit(small_limit_client, multipart) -> None:
    head, tail = b"", b""
    if multipart:
        head = b'--B\r\nContent-Disposition: form-data; name="image"; filename="a.jpg"\r\n\r\n'
        tail = b"\r\n--B--\r\n"

    def chunks():  # a generator body goes out chunked, without Content-Length
        yield head
        for _ in range(1000):
            yield b"x" * 100
        yield tail

    headers = {"Content-Type": "multipart/form-data; boundary=B"} if multipart else {}
    r = small_limit_client.post("/predict", content=chunks(), headers=headers)
    assert r.status_code == 413
    ok = small_limit_client.post("/predict", content=(b"x" * 100 for _ in range(10)))
    assert ok.status_code == 200 and ok.json()["n_bytes"] == 1000


def test_multipart_with_two_files_or_garbage_is_400(echo_client) -> None:
    two = {"image": ("a.jpg", b"x", "image/jpeg"), "other": ("b.jpg", b"y", "image/jpeg")}
    assert echo_client.post("/predict", files=two).status_code == 400
    r = echo_client.post("/predict", content=b"no boundary here", headers={"Content-Type": "multipart/form-data"})
    assert r.status_code == 400 and "detail" in r.json()


def test_base64_with_line_breaks_is_accepted(echo_client) -> None:
    wrapped = base64.encodebytes(b"\x89PNG" + bytes(200)).decode()  # 76-column lines, like `base64`
    assert "\n" in wrapped
    assert echo_client.post("/predict", json={"image": wrapped}).json()["n_bytes"] == 204


def test_top_k_parsing_edges() -> None:
    assert predict_top_k("1") == 1 and predict_top_k(1000) == 1000 and predict_top_k(5.0) == 5
    for not_a_top_k in ("1_0", "\u0665", "5.0", "", "9" * 5000, "0\x1f", None, [5], float("inf"), float("nan")):
        with pytest.raises(ServiceError) as caught:
            predict_top_k(not_a_top_k)
        assert caught.value.status == 422 and len(caught.value.message) < 200
    with pytest.raises(ServiceError):
        predict_top_k(2.5)
    with pytest.raises(ServiceError):
        decode_base64_image("data:image/png;base64")


def test_flags_beat_env_vars_beat_defaults() -> None:
    env = {"VISION_SERVE_PORT": "9001", "VISION_SERVE_MODEL": "resnet50", "VISION_SERVE_BATCH_TIMEOUT_MS": "2.5"}
    args = build_parser().parse_args(["--model", "efficientnet-lite0", "--max-batch-size", "8"])
    settings = settings_from_args(args, env)
    assert settings.model == "efficientnet-lite0"  # flag
    assert settings.port == 9001 and settings.batch_timeout_ms == 2.5  # env
    assert settings.max_batch_size == 8 and settings.workers_per_device == _defaults.WORKERS_PER_DEVICE


def test_every_setting_has_a_flag_and_an_env_var() -> None:
    help_text = build_parser().format_help()
    for name in ServeSettings.__dataclass_fields__:
        assert "--" + name.replace("_", "-") in help_text
        assert "VISION_SERVE_" + name.upper() in help_text


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"VISION_SERVE_PORT": "eighty"}, "VISION_SERVE_PORT='eighty' is not a valid int"),
        # LitServe's max_payload_size given as a string makes every request fail with 500; here
        # the server does not start, and says why.
        ({"VISION_SERVE_MAX_BODY_BYTES": "32MB"}, "VISION_SERVE_MAX_BODY_BYTES='32MB' is not a valid int"),
        ({"VISION_SERVE_REQUEST_TIMEOUT_S": "30s"}, "VISION_SERVE_REQUEST_TIMEOUT_S='30s' is not a valid float"),
    ],
)
def test_bad_env_value_is_named(env, words) -> None:
    with pytest.raises(ValueError, match=words):
        env_overrides(env)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--max-batch-size", "0"], "max-batch-size must be >= 1"),
        (["--host", "10.1.2.3"], "--host must be one of"),
        (["--port", "80"], "--port must be in 1024..65535"),
        (["--model", "resnet125"], "Did you mean"),
        (["--weights", "/no/such/file.pt"], "no such file"),
        (["--device", "cuda"], "asks for a GPU, but torch sees none"),
        (["--max-queue", "0"], "--max-queue must be >= 1"),
        (["--max-body-bytes", "-5"], "--max-body-bytes must be >= 1"),
        (["--max-image-pixels", "0"], "--max-image-pixels must be >= 1"),
        (["--request-timeout-s", "0"], "must be a number > 0"),
        (["--request-timeout-s", "nan"], "must be a number > 0"),
        (["--api-key", "cl\u00e9"], "printable ASCII"),
        (["--request-timeout-s", "0.004", "--batch-timeout-ms", "5"], "must be longer than --batch-timeout-ms"),
        (["--api-key", " padded"], "without spaces at its ends"),
        (["--api-servers", "-1"], "--api-servers must be >= 1, or 0"),
        (["--pipeline-depth", "-1"], "--pipeline-depth must be 1 (no overlap)"),
    ],
)
def test_cli_rejects_bad_settings_with_a_fix(argv, words, capsys, monkeypatch) -> None:
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)  # the same answer on a GPU machine
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert words in capsys.readouterr().err


def test_api_servers_fit_the_device_and_cores() -> None:
    assert resolve_api_servers(3, "cuda", 1, 16) == 3  # asked for: as asked
    assert resolve_api_servers(0, "cpu", 2, 2) == 2  # a CPU: one per worker, the model wants the cores
    assert resolve_api_servers(0, "cuda", 1, 16) == 4  # a GPU: a quarter of the cores
    assert resolve_api_servers(0, "cuda", 8, 16) == 8  # and never fewer than the workers
    assert resolve_api_servers(0, "cuda", 1, 2) == 1


def test_pipeline_depth_fits_the_device() -> None:
    assert resolve_pipeline_depth(0, "cpu") == 1 and resolve_pipeline_depth(0, "cuda") == 2
    assert resolve_pipeline_depth(3, "cpu") == 3


def test_resolve_device() -> None:
    assert resolve_device("auto", 0) == ("cpu", "auto", {})
    assert resolve_device("auto", 2) == ("cuda", 2, {})
    assert resolve_device("cuda:1", 2) == ("cuda", 1, {"CUDA_VISIBLE_DEVICES": "1"})
    # Already restricted to GPUs 2 and 3: torch's cuda:1 is physical GPU 3.
    assert resolve_device("cuda:1", 2, "2,3") == ("cuda", 1, {"CUDA_VISIBLE_DEVICES": "3"})
    assert resolve_device("cuda:0", 2, "GPU-8a1f, GPU-77c2") == ("cuda", 1, {"CUDA_VISIBLE_DEVICES": "GPU-8a1f"})
    with pytest.raises(ValueError, match=r"cuda:0 \.\. cuda:1"):
        resolve_device("cuda:2", 2)


def test_api_key_stays_out_of_repr_and_as_dict() -> None:
    settings = ServeSettings(api_key="hunter2-secret")
    assert "hunter2" not in repr(settings) and "hunter2" not in str(settings.as_dict())
    assert settings.as_dict()["api_key"] == "(set)" and ServeSettings().as_dict()["api_key"] == ""


def test_info_lists_devices_flat() -> None:
    """LitServe keeps one device group per worker ([["cuda:0"]] on an H100); /info lists names."""
    from service.supervisor.server import device_names

    assert device_names([["cuda:0"]]) == ["cuda:0"]
    assert device_names([["cuda:0"], ["cuda:1"], ["cuda:0"]]) == ["cuda:0", "cuda:1"]
    assert device_names(["cpu"]) == ["cpu"]


def many_echo_app(limits: RequestLimits) -> TestClient:
    """A bare FastAPI app that answers with each parsed image's size, or its own error."""
    app = FastAPI()
    app.add_exception_handler(ServiceError, handle_service_error)

    @app.post("/predict")
    async def predict(request: Request) -> dict:
        parsed = await read_predict_request(request, limits)
        items = [len(i) if isinstance(i, bytes) else [i.status_code, i.detail] for i in parsed.images]
        return {"many": parsed.many, "items": items, "top_k": parsed.top_k}

    return TestClient(app)


@pytest.fixture(scope="module")
def many_client() -> TestClient:
    return many_echo_app(RequestLimits(max_images_per_request=3))


def test_repeated_multipart_image_fields_are_many_images(many_client) -> None:
    files = [("image", ("a.jpg", b"aa", "image/jpeg")), ("image", ("b.jpg", b"", "image/jpeg"))]
    body = many_client.post("/predict", files=files, data={"top_k": "2"}).json()
    assert body["many"] and body["top_k"] == 2
    assert body["items"][0] == 2 and body["items"][1][0] == 400  # the empty one gets its own error
    one = many_client.post("/predict", files=[("image", ("a.jpg", b"aa", "image/jpeg"))]).json()
    assert one == {"many": False, "items": [2], "top_k": _defaults.TOP_K}  # one image: the single form


def test_json_images_list_with_a_bad_item(many_client) -> None:
    body = many_client.post("/predict", json={"images": [base64.b64encode(b"abc").decode(), "@@"], "top_k": 4}).json()
    assert body["many"] and body["top_k"] == 4 and body["items"][0] == 3
    assert body["items"][1][0] == 400 and 'Item 1 of JSON field "images"' in body["items"][1][1]


@pytest.mark.parametrize(
    ("payload", "status", "words"),
    [
        ({"images": []}, 400, "non-empty list"),
        ({"images": "abc"}, 400, "non-empty list"),
        ({"images": ["eA=="], "image": "eA=="}, 400, "not both"),
        ({"images": ["eA=="] * 4}, 413, "--max-images-per-request"),
    ],
)
def test_json_images_request_errors(many_client, payload, status, words) -> None:
    response = many_client.post("/predict", json=payload)
    assert response.status_code == status and words in response.json()["detail"]


def test_too_many_multipart_images_is_413(many_client) -> None:
    files = [("image", (f"{i}.jpg", b"x", "image/jpeg")) for i in range(4)]
    response = many_client.post("/predict", files=files)
    assert response.status_code == 413 and "--max-images-per-request" in response.json()["detail"]


def test_grpc_port_must_differ_from_the_http_port() -> None:
    assert ServeSettings(grpc_port=8001).grpc_port == 8001
    for port in (8000, 80, 70000):
        with pytest.raises(ValueError, match="--grpc-port"):
            ServeSettings(grpc_port=port)


def test_a_taken_grpc_port_is_refused_before_anything_starts(caplog) -> None:
    """SO_REUSEPORT would let the gRPC servers share a port with a stale server: serve() checks first."""
    import socket

    from service.supervisor.planning.planner import plan_serving
    from service.supervisor.server import build_server, check_port_free, serve

    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as a gRPC server binds it
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(OSError):
            check_port_free("127.0.0.1", port)
        server = build_server(plan_serving(ServeSettings(model="efficientnet-lite0", grpc_port=port)))
        assert serve(server) == 1
    assert f"--grpc-port {port} cannot be used" in caplog.text
    assert not Path(server.channels.directory).exists() and not multiprocessing.active_children(), "nothing started"
    check_port_free("127.0.0.1", port)  # free again once its holder closed


class DeviceBound(Exception):
    """Stops a worker's setup right after it bound its device: nothing else may touch CUDA first."""


def test_every_worker_binds_its_own_gpu_before_any_cuda_work_injected(monkeypatch) -> None:
    """Two GPUs, two workers each (no GPU here: ``torch.cuda.set_device`` is the boundary, recorded).
    LitServe hands worker i the device "cuda:(i % 2)"; its setup makes that the current device first,
    so libraries that use the current device (CV-CUDA, nvImageCodec) work on the worker's own GPU."""
    import torch

    from service.supervisor.planning.planner import plan_serving
    from service.supervisor.server import build_server
    from service.worker.classifier import Classifier

    settings = ServeSettings(model="efficientnet-lite0", preprocess="pil", workers_per_device=2)
    server = build_server(plan_serving(settings, cuda_count=2))
    server.channels.remove()  # never started: only its worker plan is read
    handed = server.device_slots(settings.workers_per_device)
    assert handed == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]

    bound: list[torch.device] = []

    def set_device(device: torch.device) -> None:
        bound.append(device)
        raise DeviceBound

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    for device in handed:
        with pytest.raises(DeviceBound):
            Classifier.load(settings, device)
    assert [d.index for d in bound] == [0, 1, 0, 1]
    bind_worker_device(torch.device("cpu"))  # a CPU worker binds nothing
    assert len(bound) == 4


def test_the_plan_crosses_the_pipe_without_the_api_key_and_comes_back_whole() -> None:
    """The main process gets its ServePlan from a child process that has torch (it must not), as
    JSON; the API key never travels, and is put back on this side."""
    from service.supervisor.planning.planner import plan_serving
    from service.supervisor.planning.plans import ServePlan

    settings = ServeSettings(model="efficientnet-lite0", api_key="s3cret-key-of-some-length")
    plan = plan_serving(settings, cuda_count=0, cores=1)
    text = plan.to_json()
    assert "s3cret" not in text
    back = ServePlan.from_json(text, ServeSettings(api_key="s3cret-key-of-some-length"))
    assert back.to_json() == text and back.settings == plan.settings
    assert (back.accelerator, back.devices, back.workers, back.model.engine) == ("cpu", "auto", 1, "torch-eager-fp32")


def test_the_planner_process_answers_a_plan_or_the_error_that_says_what_to_fix() -> None:
    from service.supervisor.planning.launch import start_planning

    [version] = start_planning(ServeSettings(model="efficientnet-lite0", api_key="k3y-of-some-length")).result()
    plan = version.serve_plan
    assert (version.name, version.version) == ("efficientnet-lite0", 1)  # a one-model repository
    assert plan.settings.api_key == "k3y-of-some-length" and plan.model.model == "efficientnet-lite0"
    with pytest.raises(ValueError, match="resnet15"):
        start_planning(ServeSettings(model="resnet15")).result()  # a typo: the catalog names the fix
