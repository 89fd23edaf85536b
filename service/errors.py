"""The one error model of the request path: what the server refuses or cannot do, named by domain.

Parsing, the header checks, the request pipeline, the API-key check and the Open Inference Protocol's call
raise a kind of ``ServiceError`` (``InvalidInput``, ``NotFound``, ``Overloaded``, ...), never a bare
HTTP number. Each kind carries its HTTP status as a class attribute: that is the HTTP mapping, here
and only here. Each protocol turns an error into its own form in one place: ``/predict``'s JSON
``{"detail": ...}`` (service/http/predict/render.py), OIP's ``{"error": ...}`` (service/http/oip/routes.py)
and a gRPC status, from its own table keyed by kind (service/http/grpc/service.py; this module does
not import grpc). One image's outcome among others travels as an ``Answer`` (service/wire.py), which
carries the same three things.
"""

from __future__ import annotations

from service._defaults import MAX_ERROR_MESSAGE_CHARS, RETRY_AFTER_S

# nginx's "client closed request": the client left before its request was read or answered. Not a
# server error: counted as such in vision_serve_requests_total, never logged with a traceback.
CLIENT_CLOSED_REQUEST = 499
_CUT_SHORT = " ... (cut short)"


class ServiceError(Exception):
    """The base of every kind below: raise a kind, catch ``ServiceError``.

    ``status``: the HTTP status of the kind (gRPC maps the kind to its codes); ``message``: what the
    client reads, with the fix where there is one; ``retry_after_s``: set when the same request may
    succeed later (overload, no worker ready), sent as ``Retry-After``.

    A status that arrives as a number from outside the request path (a worker's ``Answer``, the
    image probe, the main process's reply) becomes its kind through ``error_of_status``, so that every
    protocol maps it as if raised by name.

    A message may quote what the client sent (a model name, a shape): it is cut to
    ``MAX_ERROR_MESSAGE_CHARS``, so that no client can make an error outgrow a header (gRPC sends it
    as metadata, which clients refuse past 8 KiB) or a log line."""

    status: int = 500

    def __init__(self, status: int, message: str, *, retry_after_s: int | None = None) -> None:
        if len(message) > MAX_ERROR_MESSAGE_CHARS:
            message = message[: MAX_ERROR_MESSAGE_CHARS - len(_CUT_SHORT)] + _CUT_SHORT
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status}, {self.message!r})"


class _Kind(ServiceError):
    """A kind: raised with its message alone, its status is its class's."""

    def __init__(self, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(self.status, message, retry_after_s=retry_after_s)


class InvalidInput(_Kind):
    """400: the request is malformed or asks for what the model cannot take; the message says the fix."""

    status = 400


class Unauthorized(_Kind):
    """401: the API key (or admin key) is missing or wrong; answered with ``WWW-Authenticate``."""

    status = 401


class NotFound(_Kind):
    """404: the model or version asked for is not loaded."""

    status = 404


class RequestTimeout(_Kind):
    """408: the request's body did not arrive in time (--body-timeout-s)."""

    status = 408


class PayloadTooLarge(_Kind):
    """413: more bytes, images or pixels than the server's limits take; retrying the same will not help."""

    status = 413


class UnsupportedMediaType(_Kind):
    """415: an encoding or image format the server cannot read."""

    status = 415


class UnprocessableContent(_Kind):
    """422: ``/predict``'s ``top_k`` out of range, the status FastAPI gives a failed validation (OIP says 400)."""

    status = 422


class ClientClosed(_Kind):
    """499: the client closed the connection before sending its whole request."""

    status = CLIENT_CLOSED_REQUEST

    def __init__(
        self,
        message: str = "The client closed the connection before sending its whole request.",
        *,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message, retry_after_s=retry_after_s)


class Internal(_Kind):
    """500: the server failed (the model raised on a batch)."""

    status = 500


class Unavailable(_Kind):
    """503: the server cannot take the request now (starting, no worker ready, a worker died); the
    client should retry after ``Retry-After`` seconds."""

    status = 503

    def __init__(self, message: str, *, retry_after_s: int | None = RETRY_AFTER_S) -> None:
        super().__init__(message, retry_after_s=retry_after_s)


class Overloaded(Unavailable):
    """503 with ``Retry-After``: the server is at its limit of queued work (--max-queue, a full pipe)."""


class DeadlineExceeded(_Kind):
    """504: no answer within the request deadline (--request-timeout-s)."""

    status = 504


# The kind of a status number: Unavailable, not Overloaded, for a 503 (the general one).
_KIND_OF_STATUS: dict[int, type[ServiceError]] = {
    kind.status: kind
    for kind in (
        InvalidInput,
        Unauthorized,
        NotFound,
        RequestTimeout,
        PayloadTooLarge,
        UnsupportedMediaType,
        UnprocessableContent,
        ClientClosed,
        Internal,
        Unavailable,
        DeadlineExceeded,
    )
}


def error_of_status(status: int, message: str, *, retry_after_s: int | None = None) -> ServiceError:
    """The error of a status that arrives as a number (a worker's answer, the main process's reply):
    its kind, or a plain ``ServiceError`` keeping a number no kind names (UNKNOWN over gRPC)."""
    kind = _KIND_OF_STATUS.get(status)
    if kind is None:
        return ServiceError(status, message, retry_after_s=retry_after_s)
    return kind(message, retry_after_s=retry_after_s)


def http_headers(status: int, retry_after_s: int | None) -> dict[str, str]:
    """The HTTP headers an error carries in every HTTP protocol: ``Retry-After`` when retrying may
    help, ``WWW-Authenticate`` with a 401 (RFC 9110)."""
    headers = {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(retry_after_s)
    if status == Unauthorized.status:
        headers["WWW-Authenticate"] = "Bearer"
    return headers
