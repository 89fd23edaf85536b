"""When to leave a failing Redis alone: a circuit breaker measured in seconds."""

from __future__ import annotations

import time
from collections.abc import Callable


class Breaker:
    """Closed, every call goes through. A failure opens it: for ``retry_after_s`` no call is allowed at
    all, so a dead or stalled Redis costs a request nothing. Then one call, a trial, is allowed (and the
    wait starts again meanwhile, so concurrent requests do not all try): its success closes the breaker,
    its failure keeps it open another ``retry_after_s``."""

    def __init__(self, retry_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {retry_after_s}.")
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._open_until: float | None = None  # None: closed

    @property
    def closed(self) -> bool:
        return self._open_until is None

    def allows(self) -> bool:
        """Whether a call may be made now; ``True`` once per ``retry_after_s`` while open (the trial)."""
        if self._open_until is None:
            return True
        now = self._clock()
        if now < self._open_until:
            return False
        self._open_until = now + self.retry_after_s
        return True

    def failed(self) -> bool:
        """Open it (again) from now; ``True`` when it was closed: the first failure of an outage."""
        opened = self._open_until is None
        self._open_until = self._clock() + self.retry_after_s
        return opened

    def succeeded(self) -> bool:
        """Close it; ``True`` when it was open: the outage is over."""
        recovered = self._open_until is not None
        self._open_until = None
        return recovered
