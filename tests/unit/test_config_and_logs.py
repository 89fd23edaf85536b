"""Settings from flags, VISION_SERVE_* env vars and a TOML config file; --print-config; JSON logs and
request ids (the middleware driven over ASGI with a real Starlette app)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from service.cli import build_parser, main, resolve_from_args
from service.http.base.observer import HttpObserver, request_id_from
from service.logs import REQUEST_ID, configure_logging
from service.metrics import metrics
from service.settings import CONFIG_ENV, ServeSettings, read_config_file, render_config, resolve_settings


def resolve(argv: list[str], environ: dict[str, str] | None = None):
    return resolve_from_args(build_parser().parse_args(argv), environ or {})


def test_flags_beat_env_beat_config_file_beat_defaults(tmp_path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text('max_batch_size = 8\nport = 9100\nmodel = "efficientnet-lite0"\nrequest-timeout-s = 12\n')
    resolved = resolve(["--config", str(config), "--port", "9300"], {"VISION_SERVE_MAX_BATCH_SIZE": "16"})
    settings = resolved.settings
    assert (settings.max_batch_size, settings.port, settings.model) == (16, 9300, "efficientnet-lite0")
    assert settings.request_timeout_s == 12.0 and settings.max_queue == ServeSettings().max_queue
    assert resolved.sources["max_batch_size"] == "env VISION_SERVE_MAX_BATCH_SIZE"
    assert resolved.sources["port"] == "flag --port"
    assert resolved.sources["model"] == f"config file {config}"
    assert resolved.sources["max_queue"] == "default"


def test_the_config_file_can_come_from_the_environment(tmp_path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text('log_format = "json"\n')
    assert resolve([], {CONFIG_ENV: str(config)}).settings.log_format == "json"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_batchsize = 8\n", "Did you mean max_batch_size?"),
        ('port = "9000"\n', "port must be an integer (e.g. port = 8000), got '9000'"),
        ("max_batch_size = 8.5\n", "max_batch_size must be an integer"),
        ("log-format = 1\n", 'log-format must be a string (e.g. log_format = "text")'),
        ("port = \n", "not a readable TOML file"),
        # The settings' own checks still apply, and say where the value came from.
        ("max_batch_size = 0\n", "got 0. (values set by: config file"),
    ],
)
def test_config_file_mistakes_are_explained(tmp_path, text: str, message: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_settings({}, {}, str(config))


def test_a_missing_config_file_names_where_its_path_came_from(tmp_path) -> None:
    with pytest.raises(ValueError, match=f"no such file \\(from --config or {CONFIG_ENV}\\)"):
        read_config_file(tmp_path / "absent.toml")


def test_print_config_shows_sources_round_trips_and_hides_the_key(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("VISION_SERVE_API_KEY", "s3cret-key")
    monkeypatch.setenv("VISION_SERVE_WORKERS_PER_DEVICE", "2")
    monkeypatch.delenv("VISION_SERVE_WORKER_HEARTBEAT_TIMEOUT_S", raising=False)  # the suite's (tests/conftest.py)
    assert main(["--print-config", "--max-batch-size", "8", "--log-format", "json"]) == 0
    printed = capsys.readouterr().out
    assert "s3cret-key" not in printed
    assert re.search(r"^max_batch_size = 8 +# flag --max-batch-size$", printed, re.M)
    assert re.search(r"^workers_per_device = 2 +# env VISION_SERVE_WORKERS_PER_DEVICE$", printed, re.M)
    assert re.search(r"^# api_key = \.\.\. \(set; never printed\) +# env VISION_SERVE_API_KEY$", printed, re.M)
    # The output is a config file: read back (with no env), it gives the same settings, key aside.
    config = tmp_path / "printed.toml"
    config.write_text(printed)
    again = resolve_settings({}, {}, str(config)).settings
    assert again == ServeSettings(max_batch_size=8, log_format="json", workers_per_device=2)
    assert render_config(resolve_settings({}, {}, str(config))).count("# config file") == len(
        [line for line in printed.splitlines() if line and not line.startswith("#")]
    )


def test_print_config_rejects_bad_values_like_the_server(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--print-config", "--log-format", "xml"])
    assert exited.value.code == 2 and "invalid choice: 'xml'" in capsys.readouterr().err


# --- logs ---------------------------------------------------------------------------------------


def capture_json_logs(run) -> list[dict]:
    stream = io.StringIO()
    configure_logging("info", "json", stream)
    try:
        run()
    finally:
        configure_logging("warning", "text")
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_logs_carry_level_logger_request_id_extras_and_exceptions() -> None:
    def run() -> None:
        log = logging.getLogger("service.example")
        token = REQUEST_ID.set("req-42")
        log.info("classified %d images", 3, extra={"batch_size": 3})
        REQUEST_ID.reset(token)
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("failed")
        logging.getLogger("litserve.server").warning("from the library")  # routed through our handler

    first, second, third = capture_json_logs(run)
    assert first["message"] == "classified 3 images" and first["level"] == "info"
    assert first["request_id"] == "req-42" and first["batch_size"] == 3 and first["logger"] == "service.example"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["time"])
    assert "request_id" not in second and "RuntimeError: boom" in second["exception"]
    assert third["logger"] == "litserve.server" and third["level"] == "warning"


@pytest.mark.parametrize(
    ("sent", "kept"),
    [("abc-123", True), ("trace.id:7_x", True), ("has space", False), ("x" * 129, False), ("", False)],
)
def test_client_request_ids_are_kept_only_when_safe(sent: str, kept: bool) -> None:
    chosen = request_id_from([(b"x-request-id", sent.encode())])
    assert (chosen == sent) is kept
    assert re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", chosen)


def count(code: str) -> float:
    return metrics().registry.get_sample_value("vision_serve_requests_total", {"code": code}) or 0.0


def test_middleware_returns_the_id_logs_the_request_and_counts_only_the_predict_route() -> None:
    async def predict(request):
        if request.query_params.get("crash"):
            raise RuntimeError("a bug")
        return JSONResponse({"detail": "nope"}, status_code=415)

    async def other(request):
        return PlainTextResponse("ok")

    # As in the server: our middleware inside Starlette's outermost error layer.
    app = Starlette(
        routes=[Route("/predict", predict, methods=["POST"]), Route("/x", other)],
        middleware=[Middleware(HttpObserver, counted_paths=["/predict"])],
    )
    before = {code: count(code) for code in ("415", "500")}

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, client=("10.0.0.7", 5555), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [
                await client.post("/predict", headers={"X-Request-ID": "mine-1"}),
                await client.get("/x"),
                await client.post("/predict?crash=1", headers={"X-Request-ID": "crash-1"}),
            ]

    responses: list[httpx.Response] = []
    logs = capture_json_logs(lambda: responses.extend(asyncio.run(go())))
    predict_response, other_response, crashed = responses
    assert predict_response.status_code == 415 and predict_response.headers["X-Request-ID"] == "mine-1"
    assert re.fullmatch(r"[0-9a-f]{32}", other_response.headers["X-Request-ID"])
    # A bug still answers JSON with the id, for the user to quote.
    assert crashed.status_code == 500 and crashed.headers["X-Request-ID"] == "crash-1"
    assert "crash-1" in crashed.json()["detail"]
    assert count("415") == before["415"] + 1 and count("500") == before["500"] + 1  # /x is not counted
    access = [entry for entry in logs if entry["logger"] == "service.access"]
    assert [(e["path"], e["status"], e["request_id"]) for e in access] == [
        ("/predict", 415, "mine-1"),
        ("/x", 200, other_response.headers["X-Request-ID"]),
        ("/predict", 500, "crash-1"),
    ]
    assert access[0]["client"] == "10.0.0.7:5555" and access[0]["duration_ms"] >= 0


def test_a_request_cancelled_before_its_answer_is_counted_as_499() -> None:
    async def never_answers(scope, receive, send):
        await asyncio.sleep(3600)

    observer = HttpObserver(never_answers, ["/predict"])
    before = count("499")

    async def go() -> None:
        scope = {"type": "http", "method": "POST", "path": "/predict", "headers": []}
        task = asyncio.create_task(observer(scope, None, None))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert count("499") == before + 1
