"""Load shedding: a bound on images admitted and not yet answered, shared by every HTTP process.

LitServe's request queue has no bound: under overload every request waits longer and longer until
all of them time out. Past the bound, ``/predict`` answers 503 with ``Retry-After`` at once; the
bound frees itself as answers go out, so the server recovers without intervention.
"""

from __future__ import annotations

import multiprocessing

from service._defaults import RETRY_AFTER_S
from service.errors import Overloaded, PayloadTooLarge
from service.tracing import stage_span


class AdmissionGate:
    """A counter in shared memory: made before the HTTP processes fork, so they all see one count."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"The admission limit must be >= 1 (--max-queue), got {limit}.")
        self.limit = limit
        self._admitted = multiprocessing.Value("i", 0)  # with its own lock

    def admit(self, count: int) -> None:
        """Admit ``count`` images, one request's, or raise: ``PayloadTooLarge`` (413) if they could
        never fit under the limit (retrying would not help), ``Overloaded`` (503, ``Retry-After``) if
        they do not fit now. Each admitted image is ``release``d once answered."""
        if count > self.limit:
            raise PayloadTooLarge(
                f"The request has {count} images; the server admits at most {self.limit} at once "
                "(--max-queue). Send fewer images per request.",
            )
        with stage_span("admission"):  # traced requests (service/tracing/)
            if not self.try_admit(count):
                raise Overloaded(
                    f"The server is at its limit of {self.limit} queued images (--max-queue); retry after "
                    f"{RETRY_AFTER_S} s."
                )

    def try_admit(self, count: int = 1) -> bool:
        """Admit ``count`` images (a request of several takes a slot for each) if all fit under the limit."""
        with self._admitted.get_lock():
            if self._admitted.value + count > self.limit:
                return False
            self._admitted.value += count
            return True

    def release(self, count: int = 1) -> None:
        with self._admitted.get_lock():
            self._admitted.value -= count

    @property
    def admitted(self) -> int:
        """Images queued or in a batch right now, across the server."""
        return self._admitted.value
