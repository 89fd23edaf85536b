"""Every route of the HTTP processes, registered on LitServe's app in the main process before they fork.

- ``POST /predict`` (service/http/predict/routes.py) and the Open Inference Protocol's infer paths
  (service/http/oip/routes.py) answer from plain ASGI handlers ahead of FastAPI's stack; FastAPI routes of
  the same paths document them in /docs and answer the same way.
- ``/health`` (alive), ``/ready`` (every served model version loaded and warmed) and ``/metrics``
  (Prometheus) answer without a key; with ``--api-key``, ``/predict``, ``/info`` and the OIP
  metadata need it.
- ``/v2/repository/...`` (Triton's repository extension, service/http/oip/repository_routes.py) needs the admin key.
- ``GET /`` is the upload page.
"""

from __future__ import annotations

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse

from service.errors import ServiceError
from service.http.base.auth import ApiKeyAuth
from service.http.base.infer_paths import is_infer_path
from service.http.base.observer import HttpObserver
from service.http.fast_routes import add_fast_pattern_route, add_fast_route
from service.http.oip.repository_routes import add_repository_routes
from service.http.oip.routes import OipInferEndpoint, add_oip_routes
from service.http.predict.render import handle_service_error
from service.http.predict.routes import OPENAPI_EXTRA, PredictEndpoint
from service.http.predict.upload_page import upload_page
from service.http.process import HttpFrontEnd
from service.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from service.metrics import exposition


def register_routes(app: FastAPI, frontend: HttpFrontEnd, api_path: str, server_info: dict) -> None:
    """``server_info``: ``/info``'s ``server`` object, less what changes at run time (the queue)."""
    settings = frontend.settings
    check_auth = ApiKeyAuth(settings.api_key) if settings.api_key else None
    auth_dependencies = [Depends(check_auth)] if check_auth else []
    app.add_exception_handler(ServiceError, handle_service_error)

    @app.get("/", include_in_schema=False)
    async def index() -> HTMLResponse:
        """A page to try the model from a browser: pick or drop an image, see the top 5 and the latency."""
        return upload_page()

    @app.get("/health")
    async def health() -> dict:
        """Liveness: the HTTP server answers. Never needs the API key."""
        return {"status": "alive"}

    @app.get("/ready", responses={503: {"description": "a worker is starting or restarting"}})
    async def ready() -> JSONResponse:
        """Readiness: every served model version's workers have loaded it and finished warm-up."""
        is_ready = frontend.ready()
        return JSONResponse(
            {"ready": is_ready, "workers": frontend.worker_states()}, status_code=200 if is_ready else 503
        )

    @app.get("/metrics", include_in_schema=False)
    def prometheus_metrics() -> Response:
        """Prometheus text format; a plain def, so FastAPI runs the file reads in its thread pool."""
        return Response(exposition(frontend.live_metrics()), media_type=METRICS_CONTENT_TYPE)

    @app.get("/info", dependencies=auth_dependencies)
    async def info() -> dict:
        """The default model (``model``), every served model version (``models``), the server."""
        server = dict(server_info)
        server["queued"] = frontend.gate.admitted
        server["response_cache"] = frontend.response_cache()
        default = frontend.default_model()
        models = [
            {"name": route.name, "version": route.version, **route.model.to_dict()}
            for route in frontend.table().routes()
        ]
        return {"model": default.to_dict() if default else None, "models": models, "server": server}

    endpoint = PredictEndpoint(frontend.pipeline, check_auth)
    # POST /predict skips FastAPI's stack: the observer (request id, access log, counts) wraps it
    # directly. The FastAPI route below is what /docs shows, and answers the same way.
    add_fast_route(app, "POST", api_path, HttpObserver(endpoint, [api_path]))

    async def predict(request: Request) -> Response:
        return await endpoint.handle(request)

    app.add_api_route(
        api_path,
        predict,
        methods=["POST"],
        dependencies=auth_dependencies,
        openapi_extra=OPENAPI_EXTRA,
        summary="Classify one image, or several: their top-k ImageNet labels",
    )

    oip_endpoint = OipInferEndpoint(frontend.pipeline, check_auth)
    add_fast_pattern_route(app, "POST", is_infer_path, HttpObserver(oip_endpoint, [api_path]))
    add_oip_routes(
        app,
        oip_endpoint,
        server_version=frontend.server_version,
        ready=frontend.ready,
        model_ready=frontend.model_ready,
        table=frontend.table,
        repository=frontend.repository_calls() is not None,
    )
    add_repository_routes(app, frontend.repository_calls(), settings.admin_api_key)
    app.add_middleware(HttpObserver, counted_paths=[api_path])
