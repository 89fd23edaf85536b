"""The repository API's keys in the fast tier (the slow tier's live check is
tests/e2e/test_model_repository.py): index, load and unload over HTTP and gRPC refuse a call without
a key, with the inference key and with a wrong key, before anything reaches the main process, and
let the admin key through.

The routes and the gRPC service are the real ones, wired as an HTTP process wires them
(``register_routes`` on an app, ``HttpFrontEnd.start_grpc`` on loopback); only the main process,
where the calls would go, is replaced by a recorder of the calls that reach it.
"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
from fastapi import FastAPI
from tritonclient.grpc import service_pb2, service_pb2_grpc

from service.client.launcher import free_port
from service.http.process import HttpFrontEnd
from service.http.routes import register_routes
from service.settings import ServeSettings
from service.transport.channels import ChannelConfig

ADMIN_KEY = "admin-key-for-tests-0123"
API_KEY = "inference-key-for-tests-4567"
REFUSED = {
    "no key": {},
    "the inference key": {"x-api-key": API_KEY},
    "the inference key as a bearer token": {"authorization": f"Bearer {API_KEY}"},
    "a wrong key": {"x-api-key": ADMIN_KEY + "x"},
    "the admin key's prefix": {"authorization": f"Bearer {ADMIN_KEY[:-1]}"},
}
ADMITTED = {"x-api-key": ADMIN_KEY}, {"authorization": f"Bearer {ADMIN_KEY}"}
HTTP_CALLS = {
    "index": "/v2/repository/index",
    "load": "/v2/repository/models/lite/load",
    "unload": "/v2/repository/models/lite/unload",
}
# What each call hands the main process when it gets through.
REACHED = {"index": ("index", False), "load": ("load", "lite", "", []), "unload": ("unload", "lite")}


class MainProcessRecorder:
    """Stands in for the repository calls to the main process (the HTTP processes' one way to it)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def index(self, ready_only: bool = False) -> list[dict]:
        self.calls.append(("index", ready_only))
        return [{"name": "lite", "version": "1", "state": "READY", "reason": ""}]

    async def load(self, model: str, config: str = "", files: list[str] | None = None) -> None:
        self.calls.append(("load", model, config, list(files or [])))

    async def unload(self, model: str) -> None:
        self.calls.append(("unload", model))


@pytest.fixture
def frontend(tmp_path):
    """An HTTP process's front end with both keys, --model-control explicit and gRPC on loopback."""
    settings = ServeSettings(
        model_repository=str(tmp_path),
        model_control="explicit",
        api_key=API_KEY,
        admin_api_key=ADMIN_KEY,
        host="127.0.0.1",
        grpc_port=free_port(),
    )
    front = HttpFrontEnd(
        settings=settings,
        channels=ChannelConfig(directory=str(tmp_path), api_servers=1),
        running_batches=[0],
        table_acks=[0],
        server_version="test",
    )
    recorder = MainProcessRecorder()
    front.repository_calls = lambda: recorder  # the one seam: where the calls leave this process
    front.recorder = recorder
    return front


def http_client(frontend: HttpFrontEnd) -> httpx.AsyncClient:
    app = FastAPI()
    register_routes(app, frontend, "/predict", {})
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://vision-serve")


def test_http_repository_calls_refuse_every_key_but_the_admin_key(frontend) -> None:
    async def go() -> None:
        async with http_client(frontend) as client:
            # The inference key is the server's key: /info takes it (and refuses no key).
            assert (await client.get("/info", headers={"x-api-key": API_KEY})).status_code == 200
            assert (await client.get("/info")).status_code == 401
            for call, path in HTTP_CALLS.items():
                for sent, headers in REFUSED.items():
                    refused = await client.post(path, headers=headers)
                    assert refused.status_code == 401, (call, sent, refused.status_code, refused.text)
                    assert "admin key" in refused.json()["error"], (call, sent)
                    assert refused.headers["www-authenticate"].startswith("Bearer"), (call, sent)
                    assert frontend.recorder.calls == [], (call, sent)
            for headers in ADMITTED:
                for call, path in HTTP_CALLS.items():
                    admitted = await client.post(path, headers=headers)
                    assert admitted.status_code == 200, (call, headers, admitted.text)
                    assert frontend.recorder.calls.pop() == REACHED[call]
            # The index's answer is the main process's, passed on.
            index = await client.post(HTTP_CALLS["index"], headers=ADMITTED[0], json={"ready": True})
            assert index.json() == [{"name": "lite", "version": "1", "state": "READY", "reason": ""}]
            assert frontend.recorder.calls == [("index", True)]

    asyncio.run(go())


def grpc_requests() -> dict[str, tuple[str, object]]:
    return {
        "index": ("RepositoryIndex", service_pb2.RepositoryIndexRequest()),
        "load": ("RepositoryModelLoad", service_pb2.RepositoryModelLoadRequest(model_name="lite")),
        "unload": ("RepositoryModelUnload", service_pb2.RepositoryModelUnloadRequest(model_name="lite")),
    }


def test_grpc_repository_calls_refuse_every_key_but_the_admin_key(frontend) -> None:
    async def go() -> None:
        server = await frontend.start_grpc()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{frontend.settings.grpc_port}") as channel:
                stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
                # The inference key is the server's key: ServerMetadata takes it (and refuses no key).
                metadata = await stub.ServerMetadata(
                    service_pb2.ServerMetadataRequest(), metadata=(("x-api-key", API_KEY),), timeout=10
                )
                assert "model_repository" in metadata.extensions
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.ServerMetadata(service_pb2.ServerMetadataRequest(), timeout=10)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
                for call, (method, request) in grpc_requests().items():
                    for sent, headers in REFUSED.items():
                        with pytest.raises(grpc.aio.AioRpcError) as caught:
                            await getattr(stub, method)(request, metadata=tuple(headers.items()), timeout=10)
                        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, (call, sent, caught.value)
                        assert "admin key" in caught.value.details(), (call, sent)
                        assert frontend.recorder.calls == [], (call, sent)
                for headers in ADMITTED:
                    for call, (method, request) in grpc_requests().items():
                        await getattr(stub, method)(request, metadata=tuple(headers.items()), timeout=10)
                        assert frontend.recorder.calls.pop() == REACHED[call]
        finally:
            await server.stop(None)

    asyncio.run(go())
