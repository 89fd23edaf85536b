"""``POST /predict``: parse and check in the HTTP process, then classify through ``ImageDispatcher``
(admit or shed, send to the workers, answer by the deadline).

The workers' compact answers become JSON here (service/http/predict/render.py). The deadline covers running
work: a request in a batch that runs for minutes still gets its 504 on time. A request of several
images answers ``{"results": [...]}``, each image with its own outcome.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response

from service.errors import InvalidInput, ServiceError
from service.http.base.dispatch import ImageDispatcher, check_header, header_error
from service.http.base.limits import RequestLimits
from service.http.cache.front import from_cache
from service.http.predict.parsing import read_predict_request
from service.http.predict.render import error_response, render, render_many
from service.metrics import metrics
from service.request_scope import departure_of
from service.tracing import stage_span
from service.wire import Answer

# X-Cache (with --response-cache-mb): whether the cache answered, by from_cache().
X_CACHE = {True: (b"x-cache", b"hit"), False: (b"x-cache", b"miss")}
MAX_NAME_CHARS = 128  # model names are at most 128 characters (service/repository/layout.py)

# For /docs: the endpoint reads the body itself (to bound it), so FastAPI cannot infer this.
OPENAPI_EXTRA = {
    "parameters": [
        {"name": "top_k", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1, "default": 5}}
    ],
    "requestBody": {
        "required": True,
        "content": {
            "image/*": {"schema": {"type": "string", "format": "binary"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "image": {
                            "description": "the image file; repeat the field to send several",
                            "type": "string",
                            "format": "binary",
                        },
                        "top_k": {"type": "integer"},
                    },
                    "required": ["image"],
                }
            },
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "image": {"type": "string", "description": "base64 of the file, or a data: URL"},
                        "images": {
                            "type": "array",
                            "items": {"type": "string"},
                            "description": 'several images instead of "image"; answered {"results": [...]}',
                        },
                        "top_k": {"type": "integer"},
                    },
                }
            },
        },
    },
}


def model_in_query(request: Request) -> tuple[str | None, str | None]:
    """``?model=NAME&version=V`` (both optional; the query string is parsed only when there is one)."""
    if not request.scope.get("query_string"):
        return None, None
    query = request.query_params
    model, version = query.get("model"), query.get("version")
    for name, value in (("model", model), ("version", version)):
        if value is not None and len(value) > MAX_NAME_CHARS:
            raise InvalidInput(f"?{name}= is longer than {MAX_NAME_CHARS} characters.")
    return model, version


class PredictEndpoint:
    """Also a plain ASGI app (``__call__``), which the server mounts ahead of FastAPI's stack
    (service/litserve_bridge.py ``add_fast_route``); ``check_auth`` then does what the route's
    dependency would.
    """

    def __init__(
        self,
        dispatcher: ImageDispatcher,
        limits: RequestLimits,
        check_auth: Callable[[Request], None] | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.limits = limits
        self.check_auth = check_auth

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        request = Request(scope, receive)
        try:
            if self.check_auth is not None:
                self.check_auth(request)
            response = await self.handle(request)
        except ServiceError as exc:
            response = error_response(exc)
        await response(scope, receive, send)

    async def handle(self, request: Request) -> Response:
        model, version = model_in_query(request)
        self.dispatcher.route(model, version)  # a model not served is a 404 before the upload
        with stage_span("parse"):
            parsed = await read_predict_request(request, self.limits)
        # Again once the body is in: a swap during a slow upload may have retired the version's
        # workers (the dispatcher checks it once more after a cache lookup that waited).
        route = self.dispatcher.route(model, version)
        departure = departure_of(request.scope)
        pinned = bool(version)
        if not parsed.many:
            image = parsed.images[0]
            check_header(image, self.limits.max_image_pixels)
            (answer,), total_ms, route = await self.dispatcher.classify(
                [image], parsed.top_k, route, departure, pinned=pinned
            )
            with stage_span("answer"):
                response = render(answer, total_ms, route.version)
            if self.dispatcher.cache is not None:
                response.raw_headers.append(X_CACHE[from_cache(answer)])
            # The worker's stages and the rendering, recorded here to keep that work off its loop.
            metrics().observe_stages(answer.timings_ms)
            return response
        answers = [self._checked(item) for item in parsed.images]
        to_run = [i for i, item in enumerate(answers) if isinstance(item, bytes)]
        total_ms = 0.0
        if to_run:
            ran, total_ms, route = await self.dispatcher.classify(
                [answers[i] for i in to_run], parsed.top_k, route, departure, pinned=pinned
            )
            for i, answer in zip(to_run, ran, strict=True):
                answers[i] = answer
                metrics().observe_stages(answer.timings_ms)
        with stage_span("answer"):
            response = render_many(answers, total_ms, route.version)
        if self.dispatcher.cache is not None:  # a hit only if every image that ran was one
            response.raw_headers.append(X_CACHE[bool(to_run) and all(from_cache(answers[i]) for i in to_run)])
        return response

    def _checked(self, item: bytes | Answer) -> bytes | Answer:
        """The image, or its own error if its header is bad: one bad image never spoils the others."""
        if isinstance(item, Answer):
            return item
        return header_error(item, self.limits.max_image_pixels) or item
