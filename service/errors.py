"""The one error type of the request path: what the server refuses or cannot do, protocol-neutral.

Parsing, the header checks, the dispatcher, the API-key check and the Open Inference Protocol's call
raise ``ServiceError``; each protocol turns it into its own form in one place: ``/predict``'s JSON
``{"detail": ...}`` (service/http/predict/render.py), OIP's ``{"error": ...}`` (service/http/oip/routes.py) and a
gRPC status (service/http/grpc/service.py). One image's outcome among others travels as an ``Answer``
(service/wire.py), which carries the same three things.
"""

from __future__ import annotations

from service._defaults import MAX_ERROR_MESSAGE_CHARS, RETRY_AFTER_S

# nginx's "client closed request": the client left before its request was read or answered. Not a
# server error: counted as such in vision_serve_requests_total, never logged with a traceback.
CLIENT_CLOSED_REQUEST = 499
_CUT_SHORT = " ... (cut short)"


class ServiceError(Exception):
    """``status``: the HTTP status the outcome has (gRPC maps it to its codes); ``message``: what the
    client reads, with the fix where there is one; ``retry_after_s``: set when the same request may
    succeed later (overload, no worker ready), sent as ``Retry-After``.

    A message may quote what the client sent (a model name, a shape): it is cut to
    ``MAX_ERROR_MESSAGE_CHARS``, so that no client can make an error outgrow a header (gRPC sends it
    as metadata, which clients refuse past 8 KiB) or a log line."""

    def __init__(self, status: int, message: str, *, retry_after_s: int | None = None) -> None:
        if len(message) > MAX_ERROR_MESSAGE_CHARS:
            message = message[: MAX_ERROR_MESSAGE_CHARS - len(_CUT_SHORT)] + _CUT_SHORT
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s

    @classmethod
    def client_closed(cls) -> ServiceError:
        """499: the client closed the connection before its request body arrived."""
        return cls(CLIENT_CLOSED_REQUEST, "The client closed the connection before sending its whole request.")

    @classmethod
    def retry_later(cls, message: str) -> ServiceError:
        """503: the server cannot take the request now; the client should retry after a second."""
        return cls(503, message, retry_after_s=RETRY_AFTER_S)

    def __repr__(self) -> str:
        return f"ServiceError({self.status}, {self.message!r})"


def http_headers(status: int, retry_after_s: int | None) -> dict[str, str]:
    """The HTTP headers an error carries in every HTTP protocol: ``Retry-After`` when retrying may
    help, ``WWW-Authenticate`` with a 401 (RFC 9110)."""
    headers = {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(retry_after_s)
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return headers
