"""The one error type of the request path: what the server refuses or cannot do, protocol-neutral.

Parsing, the header checks, the dispatcher, the API-key check and the Open Inference Protocol's call
raise ``ServiceError``; each protocol turns it into its own form in one place: ``/predict``'s JSON
``{"detail": ...}`` (service/rest/render.py), OIP's ``{"error": ...}`` (service/oip/rest.py) and a
gRPC status (service/oip/grpc_service.py). One image's outcome among others travels as an ``Answer``
(service/wire.py), which carries the same three things.
"""

from __future__ import annotations

from service._defaults import RETRY_AFTER_S


class ServiceError(Exception):
    """``status``: the HTTP status the outcome has (gRPC maps it to its codes); ``message``: what the
    client reads, with the fix where there is one; ``retry_after_s``: set when the same request may
    succeed later (overload, no worker ready), sent as ``Retry-After``."""

    def __init__(self, status: int, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s

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
