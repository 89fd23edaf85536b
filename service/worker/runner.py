"""How the inference worker runs a batch on its model and answers it.

Each batch is framed on the worker's heartbeat (service/transport/heartbeats.py): the main process
sees which batch it holds and since when, and so tells a busy worker from a hung one.

A batch that fails answers 500 and the worker goes on, unless the failure broke the device itself
(a sticky CUDA error: every later call would fail too). Then the batch is answered 503 (retry-safe)
and ``finish`` raises ``DeviceUnusable``: the loop (service/worker/loop.py) ends the process with
``EXIT_DEVICE_UNUSABLE``, and the main process starts a new worker with a new CUDA context.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, MutableSequence
from typing import Generic

from preprocessing.errors import DeviceUnusable
from service.errors import Internal, Unavailable
from service.transport.channels import WorkerChannel
from service.transport.heartbeats import Heartbeat
from service.wire import QueuedRequest, answer_for
from service.worker.contract import BatchedModel, Prepared
from service.worker.turns import TURN_SLICE_S, ModelTurns, NoTurns

logger = logging.getLogger(__name__)

MODEL_FAILED = "The model failed on the batch this request was in; see the server log. Retrying may work."
DEVICE_FAILED = (
    "The inference worker's device failed on the batch this request was in and the worker is being "
    "restarted. The request was not completed; retrying it is safe."
)
# A worker's exit code when its device broke (sysexits' EX_SOFTWARE); the main process restarts it.
EXIT_DEVICE_UNUSABLE = 70


class BatchRunner(Generic[Prepared]):
    """Runs ``model`` on the batches taken from ``channel`` and answers them there.

    ``running``: a shared array, per worker the size of the batch it runs now (0 when idle), from
    which the HTTP processes compute the queue depth; this worker writes its slot. ``heartbeat``:
    where the batch it holds is shown (from its prepare at pipeline depth 1, from its run at 2+).
    ``turns``: the process's turns when it holds other models too (service/worker/turns.py): at depth 1
    a batch takes its turn for its prepare and run, at 2+ for its run (its prepare overlaps others').
    """

    def __init__(
        self,
        model: BatchedModel[Prepared],
        channel: WorkerChannel,
        worker_id: int,
        running: MutableSequence[int] | None = None,
        heartbeat: Heartbeat | None = None,
        turns: ModelTurns | NoTurns | None = None,
    ) -> None:
        self.model = model
        self.turns = turns or NoTurns()
        self.channel = channel
        self.running = running
        self.heartbeat = heartbeat
        self._slot = worker_id % len(running) if running is not None else 0
        self._holding = False  # a batch is on the heartbeat (set and cleared by the running thread)
        self.seconds_per_image: float | None = None  # of its last batch (or slice): how much fits a turn

    def others_idle(self) -> bool:
        """Whether no other worker of the server is running a batch now (a lone image may then use
        their cores: service/worker/engine.py, ``with_lone_engine``)."""
        running, slot = self.running, self._slot
        if running is None:
            return False
        return not (any(running[:slot]) or any(running[slot + 1 :]))  # slices: C speed over 1,024 slots

    def run_batch(
        self, batch: list[QueuedRequest], top_up: Callable[[list[QueuedRequest]], list[QueuedRequest]] | None = None
    ) -> None:
        """Prepare and run one batch, and answer it (pipeline depth 1). ``top_up``: adds what queued
        while the batch waited for the process's turn; while other models share the process, the batch
        runs in slices, a turn each (service/worker/turns.py)."""
        with self.turns.turn(id(self)) as waited:
            if waited and top_up is not None:
                batch = top_up(batch)  # [] if every client of it left while it waited
            rest = self._run_slice(batch)
        while rest:
            with self.turns.turn(id(self)):
                rest = self._run_slice(rest)

    def _run_slice(self, batch: list[QueuedRequest]) -> list[QueuedRequest]:
        """Prepare, run and answer the head of ``batch`` that fits one turn; returns the rest."""
        if not batch:
            return batch
        size = len(batch)
        if self.seconds_per_image is not None and self.turns.contended():
            size = max(1, min(size, int(TURN_SLICE_S / self.seconds_per_image)))
        head = batch[:size]
        started = time.monotonic()
        self._hold()
        self._finish(head, self.prepare(head))  # prepare never raises: finish releases the batch
        self.seconds_per_image = (time.monotonic() - started) / size
        return batch[size:]

    def prepare(self, batch: list[QueuedRequest]) -> Prepared | PrepareFailed:
        """``model.prepare`` of the requests, or the exception it raised (``finish`` answers it)."""
        try:
            return self.model.prepare([queued.request for queued in batch])
        except Exception as exc:
            return PrepareFailed(exc)

    def finish(self, batch: list[QueuedRequest], ready: Prepared | PrepareFailed) -> None:
        """Run the prepared batch and answer it; raises ``DeviceUnusable`` (after answering) if the
        failure broke the device."""
        with self.turns.turn(id(self)):
            self._finish(batch, ready)

    def _finish(self, batch: list[QueuedRequest], ready: Prepared | PrepareFailed) -> None:
        model, running = self.model, self.running
        if not self._holding:
            self._hold()
        if running is not None:
            running[self._slot] = len(batch)
        unusable = None
        try:
            if isinstance(ready, PrepareFailed):
                raise ready.error
            answers = model.run(ready)
            if len(answers) != len(batch):
                raise RuntimeError(f"the model gave {len(answers)} answers for {len(batch)} requests")
        except Exception:
            unusable = model.unusable_device()
            if unusable is None:
                logger.exception("The model failed on a batch of %d request(s); answering each with 500.", len(batch))
                answers = [answer_for(Internal(MODEL_FAILED))] * len(batch)
            else:
                logger.critical(
                    "The device failed on a batch of %d request(s) and no longer runs work (%s). Answering them "
                    "with 503 and exiting (code %d) so that a new worker starts with a new device context.",
                    len(batch),
                    unusable,
                    EXIT_DEVICE_UNUSABLE,
                    exc_info=True,
                )
                answers = [answer_for(Unavailable(DEVICE_FAILED))] * len(batch)
        finally:
            if running is not None:
                running[self._slot] = 0
            self._release()
        self.channel.answer_many(list(zip(batch, answers, strict=True)))
        if unusable is not None:
            raise DeviceUnusable(unusable)

    def _hold(self) -> None:
        self._holding = True
        if self.heartbeat is not None:
            self.heartbeat.batch_started()

    def _release(self) -> None:
        self._holding = False
        if self.heartbeat is not None:
            self.heartbeat.batch_finished()


class PrepareFailed:
    """What ``prepare`` raised, carried to ``finish`` (maybe on the other thread) to be answered."""

    def __init__(self, error: Exception) -> None:
        self.error = error
