"""What the connection leaves in each request's ASGI scope for the routes that serve it.

Set by the connection guard (service/http/connection/guard.py), read by the HTTP process's request path
(service/http/): both import this module, which imports nothing of either, so no import runs back up
from the bridge to the routes.

- ``DEPARTURE``: the request's ``Departure``. A client that disconnects (its own timeout, a closed tab,
  a proxy giving up) no longer wants the answer, but nothing in ASGI interrupts the request's task:
  uvicorn only marks the cycle disconnected. So the connection puts a ``Departure`` in each request's
  scope and calls ``leave`` when it is lost before the response is complete; the request pipeline
  (service/http/pipeline/) listens while it waits, answers the images 499 at once and tells their
  workers to drop them unrun. A gRPC client that cancels its call leaves by cancellation instead: the
  pipeline's wait is cancelled, with the same effect.
- ``BODY_CUT_OFF``: set when the guard cut a request's body off (the body's deadline, a body framed to
  cost too much): ``(status, detail)``, which ``read_body`` (service/http/base/limits.py) raises as the
  request's answer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

# The scope key of a request's ``Departure``.
DEPARTURE = "vision_serve.departure"
# The scope key of why the guard cut a request's body off: ``(status, detail)``.
BODY_CUT_OFF = "vision_serve.body_cut_off"


class Departure:
    """Whether the client of one request is gone, and whom to tell when it goes."""

    __slots__ = ("gone", "listener")

    def __init__(self) -> None:
        self.gone = False
        self.listener: Callable[[], None] | None = None

    def leave(self) -> None:
        """The client is gone: tell the listener, once."""
        if self.gone:
            return
        self.gone = True
        listener, self.listener = self.listener, None
        if listener is not None:
            listener()


def departure_of(scope: Mapping[str, Any]) -> Departure | None:
    """The request's ``Departure``; ``None`` where the server does not track its connections."""
    return scope.get(DEPARTURE)
