"""Triton's model repository extension over HTTP, as ``tritonclient.http`` calls it:

- ``POST /v2/repository/index`` (body ``{"ready": true}`` optional): every model of the repository,
  ``[{"name", "version", "state", "reason"}]``;
- ``POST /v2/repository/models/{name}/load`` (body ``{"parameters": {"config": "<JSON>"}}``
  optional): load or reload the model's versions; 200 once they serve, 400 ``{"error"}`` if not;
- ``POST /v2/repository/models/{name}/unload``: 200 once the model's workers drained and stopped.

Only with ``--model-control explicit``, and only with the admin key (``--admin-api-key``, sent as
``X-API-Key`` or ``Authorization: Bearer``); the inference key never opens them.
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from service.errors import InvalidInput, ServiceError
from service.http.base.auth import ApiKeyAuth
from service.http.base.limits import read_body
from service.http.oip.routes import error_response
from service.repository.http_calls import MAX_CONFIG_CHARS, REPOSITORY_OFF, RepositoryCalls

TAG = "Model repository (Triton's extension)"
# A call's body is a small JSON object: a model config at most.
MAX_CALL_BODY_BYTES = 2 * MAX_CONFIG_CHARS


def add_repository_routes(app: FastAPI, calls: RepositoryCalls | None, admin_api_key: str) -> None:
    admin = ApiKeyAuth(admin_api_key, "admin key") if admin_api_key else None

    async def checked_body(request: Request) -> dict:
        if calls is None or admin is None:
            raise InvalidInput(REPOSITORY_OFF)
        admin(request)
        body = await read_body(request, MAX_CALL_BODY_BYTES)
        if not body.strip():
            return {}
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError):
            raise InvalidInput("The body must be a JSON object (or empty).") from None
        if not isinstance(parsed, dict):
            raise InvalidInput("The body must be a JSON object (or empty).")
        return parsed

    def parameters(body: dict) -> dict:
        value = body.get("parameters", {})
        if not isinstance(value, dict):
            raise InvalidInput('"parameters" must be a JSON object.')
        return value

    @app.post("/v2/repository/index", tags=[TAG])
    async def repository_index(request: Request) -> Response:
        """Every model in the repository: READY versions, and UNAVAILABLE models (unloaded)."""
        try:
            body = await checked_body(request)
            ready_only = body.get("ready", False)
            if not isinstance(ready_only, bool):
                raise InvalidInput('"ready" must be true or false.')
            return JSONResponse(await calls.index(ready_only))
        except ServiceError as exc:
            return error_response(exc)

    @app.post("/v2/repository/models/{name}/load", tags=[TAG])
    async def repository_load(request: Request, name: str) -> Response:
        """Load the model's versions (reload if loaded): the old ones serve until the new ones are warm."""
        try:
            params = parameters(await checked_body(request))
            config = params.get("config", "")
            if not isinstance(config, str):
                raise InvalidInput("parameters.config must be a string: the model config as JSON text.")
            await calls.load(name, config, [key for key in params if key.startswith("file:")])
            return Response(status_code=200)
        except ServiceError as exc:
            return error_response(exc)

    @app.post("/v2/repository/models/{name}/unload", tags=[TAG])
    async def repository_unload(request: Request, name: str) -> Response:
        """Stop new requests to the model (404), let its workers answer what they hold, then free them."""
        try:
            parameters(await checked_body(request))
            await calls.unload(name)
            return Response(status_code=200)
        except ServiceError as exc:
            return error_response(exc)
