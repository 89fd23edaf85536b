"""``POST /predict``: its parse and its rendering around the request pipeline
(service/http/pipeline/), which routes, checks, looks up the cache, admits, submits and waits.

The workers' compact answers become JSON here (service/http/predict/render.py). The deadline covers running
work: a request in a batch that runs for minutes still gets its 504 on time. A request of several
images answers ``{"results": [...]}``, each image with its own outcome.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response

from service.errors import InvalidInput, ServiceError, error_of_status
from service.http.base.deadlines import header_deadline
from service.http.base.request_scope import departure_of
from service.http.pipeline.ask import Ask, Outcome
from service.http.pipeline.pipeline import RequestPipeline
from service.http.predict.parsing import PredictRequest, read_predict_request
from service.http.predict.render import error_response, render, render_many
from service.metrics import metrics
from service.tracing import stage_span
from service.wire import Answer

# X-Cache (with --response-cache-mb): whether the cache answered every image that ran.
X_CACHE = {True: (b"x-cache", b"hit"), False: (b"x-cache", b"miss")}
MAX_NAME_CHARS = 128  # model names are at most 128 characters (service/repository/layout.py)

# For /docs: the endpoint reads the body itself (to bound it), so FastAPI cannot infer this.
OPENAPI_EXTRA = {
    "parameters": [
        {"name": "top_k", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1, "default": 5}},
        {
            "name": "logits",
            "in": "query",
            "required": False,
            "description": "true: each answer also holds the model's whole output before its activation",
            "schema": {"type": "boolean", "default": False},
        },
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


def alone_fails_whole(parsed: PredictRequest, refused: list[Answer | None]) -> None:
    """``/predict``'s rule for an image refused by its checks: sent alone, its error is the request's;
    among several (``many``), it is answered its own error and the others run."""
    refusal = refused[0]
    if not parsed.many and refusal is not None:
        raise error_of_status(refusal.status_code, refusal.detail, retry_after_s=refusal.retry_after_s)


class PredictEndpoint:
    """Also a plain ASGI app (``__call__``), which the server mounts ahead of FastAPI's stack
    (service/http/fast_routes.py ``add_fast_route``); ``check_auth`` then does what the route's
    dependency would.
    """

    def __init__(self, pipeline: RequestPipeline, check_auth: Callable[[Request], None] | None = None) -> None:
        self.pipeline = pipeline
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
        deadline = header_deadline(request.scope["headers"])
        outcome = await self.pipeline.run(
            Ask(model, version, departure_of(request.scope), on_refused=alone_fails_whole, deadline=deadline),
            lambda: read_predict_request(request, self.pipeline.limits),
        )
        return self.answer_one(outcome) if not outcome.parsed.many else self.answer_many(outcome)

    @staticmethod
    def answer_one(outcome: Outcome[PredictRequest]) -> Response:
        (answer,) = outcome.answers
        with stage_span("answer"):  # traced requests (service/tracing/)
            response = render(answer, outcome.timings_ms(), outcome.route.version)
        if outcome.cache_on:
            response.raw_headers.append(X_CACHE[outcome.from_cache])
        # The worker's stages and the rendering, recorded here to keep that work off its loop.
        metrics().observe_stages(answer.timings_ms)
        return response

    @staticmethod
    def answer_many(outcome: Outcome[PredictRequest]) -> Response:
        for index in outcome.ran:
            metrics().observe_stages(outcome.answers[index].timings_ms)
        with stage_span("answer"):
            response = render_many(outcome.answers, outcome.timings_ms(), outcome.route.version)
        if outcome.cache_on:  # a hit only if every image that ran was one
            response.raw_headers.append(X_CACHE[outcome.from_cache])
        return response
