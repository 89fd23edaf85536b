"""API-key check for ``/predict`` and ``/info``: ``X-API-Key: KEY`` or ``Authorization: Bearer KEY``.

LitServe's own key (``LIT_SERVER_API_KEY``) also locks ``/health``, which orchestrators must be able
to probe without secrets, and compares with ``!=``; this check is attached only where it belongs and
compares in constant time.
"""

# No `from __future__ import annotations`: FastAPI reads this callable instance's annotations, and
# some versions cannot resolve string annotations on an instance (it has no __globals__).
import hmac
from collections.abc import Mapping

from starlette.requests import Request

from service.errors import Unauthorized


class ApiKeyAuth:
    """A FastAPI dependency: passes when the request carries the key, raises ``ServiceError`` 401 otherwise."""

    def __init__(self, api_key: str, what: str = "API key") -> None:
        """``what``: the key's name in the 401's message."""
        if not api_key:
            raise ValueError("ApiKeyAuth needs a non-empty key; leave the dependency out to serve without one.")
        self._key = api_key.encode()
        self._what = what

    @staticmethod
    def supplied_key(headers: "Mapping[str, str]") -> "str | None":
        """``X-API-Key``, else the token of ``Authorization: Bearer``. ``headers``: Starlette's, or gRPC
        call metadata as a dict (its names are lower case)."""
        key = headers.get("x-api-key")
        if key is not None:
            return key
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return token.strip() if scheme.lower() == "bearer" else None

    def matches(self, supplied: "str | None") -> bool:
        # compare_digest takes as long for a near miss as for a far one: the key cannot be guessed
        # byte by byte from response times.
        return supplied is not None and hmac.compare_digest(supplied.encode(), self._key)

    def __call__(self, request: Request) -> None:
        if not self.matches(self.supplied_key(request.headers)):
            # A 401 carries WWW-Authenticate: Bearer in every HTTP protocol (service/errors.py).
            raise Unauthorized(
                f"Missing or wrong {self._what}. Send it as 'X-API-Key: <key>' or 'Authorization: Bearer <key>'."
            )
