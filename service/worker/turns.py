"""Fair sharing of one worker process among the models it holds: ``ModelTurns`` lets one model's
batch run at a time, in the order the models asked.

A shared worker process (service/worker/host.py) runs a loop per model, each in a thread of its own,
with its own queue and its own batches. Left to themselves, the loops would run their batches at
once and split the cores between them, and a hot model, whose loop always has work, would take the
lock again before a cold model's loop woke up. So each batch takes a turn: a ticket, first come,
first served. A model that just ran waits behind every model already waiting, so a model with a
batch ready waits for at most one batch of each other model with work, whatever their traffic.
Batches stay single-model: the engines are different.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator


class ModelTurns:
    """A first-come, first-served lock over the batches of the models of one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: collections.deque[threading.Event] = collections.deque()
        self._held = False

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the process's turn for one batch; wait behind the models that asked first."""
        with self._lock:
            if not self._held and not self._waiting:
                self._held = True
                ticket = None
            else:
                ticket = threading.Event()
                self._waiting.append(ticket)
        if ticket is not None:
            ticket.wait()  # set by the holder that hands the turn over: ours from then on
        try:
            yield
        finally:
            with self._lock:
                if self._waiting:
                    self._waiting.popleft().set()  # handed over: still held, by the next in line
                else:
                    self._held = False

    @property
    def waiting(self) -> int:
        """How many models wait for their turn now."""
        with self._lock:
            return len(self._waiting)


class NoTurns:
    """A process that serves one model: every batch runs at once."""

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        yield
