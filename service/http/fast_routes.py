"""Plain ASGI handlers for the request path, ahead of FastAPI's middleware, routing and dependency
stack, the largest cost of a request in an HTTP process; every other request takes FastAPI's path.

Relies on one LitServe behaviour (its contract test is in tests/unit/test_litserve_bridge.py):
``LitServer`` builds the app and hands each HTTP process a shallow copy of it (``_start_server``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI


class _AppWithFastRoutes(FastAPI):
    """A FastAPI app that answers a few (method, path) pairs with plain ASGI handlers, ahead of its
    own middleware, routing and dependency stack, the largest cost of a request in the HTTP process.
    Every other request takes FastAPI's path."""

    fast_routes: dict[tuple[str, str], Callable[..., Any]]
    fast_patterns: list[tuple[str, Callable[[str], bool], Callable[..., Any]]]

    async def __call__(self, scope: dict, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] == "http":
            method, path = scope["method"], scope["path"]
            handler = self.fast_routes.get((method, path))
            if handler is None:
                handler = next((h for m, matches, h in self.fast_patterns if m == method and matches(path)), None)
            if handler is not None:
                await handler(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def add_fast_route(app: FastAPI, method: str, path: str, handler: Callable[..., Any]) -> None:
    """Answer ``method path`` with the ASGI ``handler`` before FastAPI sees the request.

    LitServe builds the app (``LitServer.app``) and hands each HTTP process a shallow copy of it
    (``_start_server``); turning the instance into a subclass keeps both its routes and that copy.
    """
    _with_fast_routes(app).fast_routes[(method, path)] = handler


def add_fast_pattern_route(
    app: FastAPI, method: str, matches: Callable[[str], bool], handler: Callable[..., Any]
) -> None:
    """``add_fast_route`` for every path ``matches`` accepts (the OIP infer path of any model name)."""
    _with_fast_routes(app).fast_patterns.append((method, matches, handler))


def _with_fast_routes(app: FastAPI) -> _AppWithFastRoutes:
    if not isinstance(app, _AppWithFastRoutes):
        app.__class__ = _AppWithFastRoutes
        app.fast_routes = {}
        app.fast_patterns = []
    return app
