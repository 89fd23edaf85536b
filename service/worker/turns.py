"""Fair sharing of one worker process among the models it holds: ``ModelTurns`` lets one model's
batch run at a time, in the order the models asked.

A shared worker process (service/worker/host.py) runs a loop per model, each in a thread of its own,
with its own queue and its own batches. Left to themselves, the loops would run their batches at
once and split the cores between them, and a hot model, whose loop always has work, would take the
lock again before a cold model's loop woke up. So each batch takes a turn: a ticket, first come,
first served. A model that just ran waits behind every model already waiting, so a model with a
batch ready waits for at most one batch of each other model with work, whatever their traffic.
Batches stay single-model: the engines are different. A batch that waited for its turn is topped up
with the model's requests that queued meanwhile (service/worker/collector.py, ``top_up``): with
traffic spread over many models each one's queue is short when its loop takes it, and batches of one
would cost every model the per-batch work of a batch per image.

One batch of a busy model can still be long: on a CPU a batch of 8 images takes 8 images' time, and a
light model's request that arrives just after it began waits for all of it. So while the process
serves more than one model (the turn passed from one model to another in the last
``CONTENDED_FOR_S``), a batch that runs its prepare in its turn (pipeline depth 1, a CPU's default)
runs in slices of about ``TURN_SLICE_S`` each, a turn each: between two slices a waiting model goes
first. A CPU's engines cost about as much per image in a batch of 2 as in one of 8, so the slices
cost little; a GPU's batches are short, and at depth 2 its prepares run outside the turn, whole.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterator

# How long one slice of a batch holds the process while other models have work: what a light model's
# request may wait behind a busy one's batch, beside its own run.
TURN_SLICE_S = 0.03
# The process serves several models while the turn passed between them this recently: long enough to
# span the gaps of a light model's traffic (slicing a batch costs a CPU little meanwhile).
CONTENDED_FOR_S = 10.0


class ModelTurns:
    """A first-come, first-served lock over the batches of the models of one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: collections.deque[threading.Event] = collections.deque()
        self._held = False
        # Which model (its runner's id) had the last turn, and when the turn last passed to another.
        self._last_holder: int | None = None
        self._passed_at = float("-inf")

    @contextlib.contextmanager
    def turn(self, holder: int = 0) -> Iterator[bool]:
        """Hold the process's turn for one batch (``holder``: the model's runner, by ``id``); wait
        behind the models that asked first. Yields whether it waited: requests may have queued
        meanwhile, to top the batch up with."""
        with self._lock:
            if not self._held and not self._waiting:
                self._held = True
                ticket = None
            else:
                ticket = threading.Event()
                self._waiting.append(ticket)
        if ticket is not None:
            ticket.wait()  # set by the holder that hands the turn over: ours from then on
        if holder != self._last_holder:  # only the holder writes these
            if self._last_holder is not None:
                self._passed_at = time.monotonic()
            self._last_holder = holder
        try:
            yield ticket is not None
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

    def contended(self) -> bool:
        """Whether other models share the process's turns now: one waits, or the turn passed from one
        model to another in the last ``CONTENDED_FOR_S`` (asked by the holder)."""
        return bool(self._waiting) or time.monotonic() - self._passed_at < CONTENDED_FOR_S


class NoTurns:
    """A process that serves one model: every batch runs at once."""

    @contextlib.contextmanager
    def turn(self, holder: int = 0) -> Iterator[bool]:
        yield False

    def contended(self) -> bool:
        return False
