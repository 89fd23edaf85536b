"""How the inference worker takes batches from its request channel and answers them.

LitServe 0.2.19's batched loop polls: it asks its queue for one request with a 1 ms timeout, over
and over, until the batch window ends, and each ask is a round trip to a multiprocessing manager.
This loop blocks on the first request instead (service/transport/channels.py: a socket of its own),
then takes whatever else is already queued without waiting, and only then waits out the batch
window (``--batch-timeout-ms``) if the batch is not full. With the default window of 0 that is
greedy batching: an idle server runs a lone request at once, and under load batches fill from the
requests that queued while the model was busy.

Requests whose deadline passed while queued are answered 504 here, counted in
``vision_serve_requests_expired_total`` and logged as one summary line at most every few seconds.

The loop also serves ``--max-batch-size 1`` (a batch of one), so there is one request path. What it
needs of the model is ``BatchedModel`` (service/worker/classifier.py implements it).

A batch that fails answers 500 and the worker goes on, unless the failure broke the device itself
(a sticky CUDA error: every later call would fail too). Then the batch is answered 503 (retry-safe)
and the process exits with ``EXIT_DEVICE_UNUSABLE``, so the main process starts a new worker with a
new CUDA context (service/supervisor/models.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, MutableSequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from preprocessing.errors import DeviceUnusable
from service import _defaults
from service.litserve_bridge import WorkerLoop
from service.metrics import metrics
from service.transport.channels import ChannelConfig, WorkerChannel
from service.wire import Answer, ImageRequest, QueuedRequest, error_answer

logger = logging.getLogger(__name__)

# How long one blocking wait for the first request lasts before the loop goes round again; it
# wakes at once when a request arrives, so this only bounds idle wake-ups.
IDLE_WAIT_S = 1.0
EXPIRED_LOG_INTERVAL_S = 10.0
# How long a pipelined loop that stops waits for its prepare thread (which waits IDLE_WAIT_S at most
# for requests, then finishes the batch it prepares).
PREPARE_STOP_TIMEOUT_S = 5.0

MODEL_FAILED = "The model failed on the batch this request was in; see the server log. Retrying may work."
DEVICE_FAILED = (
    "The inference worker's device failed on the batch this request was in and the worker is being "
    "restarted. The request was not completed; retrying it is safe."
)
# A worker's exit code when its device broke (sysexits' EX_SOFTWARE); the main process restarts it.
EXIT_DEVICE_UNUSABLE = 70
# How long a worker that exits gives its last answers to leave.
EXIT_ANSWER_LINGER_MS = 2000


# What ``prepare`` hands to ``run``: the loop carries it between them and never looks inside.
Prepared = TypeVar("Prepared")


class BatchedModel(Protocol[Prepared]):
    """What the loop needs of the model it serves (service/worker/classifier.py: ``Classifier``,
    whose prepared batch is a ``ClassifyBatch``)."""

    def prepare(self, requests: list[ImageRequest]) -> Prepared:
        """Decode, resize and upload the batch's images (the loop may call it from another thread)."""
        ...

    def run(self, prepared: Prepared) -> list[Answer]:
        """The engine on a prepared batch: one ``Answer`` per request, in order."""
        ...

    def unusable_device(self) -> str | None:
        """After a failure: why the device can no longer run work (a sticky CUDA error), or None."""
        ...


@dataclass(frozen=True)
class BatchPolicy:
    """How the loop forms batches (service/settings.py has the flags)."""

    max_batch_size: int = _defaults.MAX_BATCH_SIZE
    batch_timeout_s: float = _defaults.BATCH_TIMEOUT_MS / 1000
    request_timeout_s: float = _defaults.REQUEST_TIMEOUT_S
    pipeline_depth: int = 1  # batches in flight: 1 runs each start to end, 2+ prepare ahead

    def __post_init__(self) -> None:
        if self.pipeline_depth < 1:
            raise ValueError(f"pipeline_depth must be >= 1 (1: no overlap), got {self.pipeline_depth}.")


class GreedyBatchedLoop(WorkerLoop):
    """``running``: a shared array, per worker the size of the batch it runs now (0 when idle), from
    which the HTTP processes compute the queue depth.

    Pipeline depth 1 runs each batch start to end: take requests, ``prepare`` (decode, resize,
    upload), ``run``, answer. With 2 or more, a thread of its own takes and prepares the next
    batches while this one runs (on a GPU on a CUDA stream of its own: service/worker/classifier.py),
    with at most ``pipeline_depth - 1`` prepared batches waiting, so throughput approaches
    1 / max(prepare, run) instead of 1 / (prepare + run).
    """

    def __init__(
        self,
        channels: ChannelConfig,
        policy: BatchPolicy,
        running: MutableSequence[int] | None = None,
        exit_process: Callable[[int], object] = os._exit,
    ) -> None:
        """``exit_process``: how the worker process ends when its device broke."""
        super().__init__()
        self.channels = channels
        self.policy = policy
        self.running = running
        self.exit_process = exit_process
        self._expired_unlogged = 0
        self._expired_logged_at = 0.0

    def serve(self, model: BatchedModel, worker_id: int) -> None:
        """Answer requests from this worker's channel until the process ends."""
        channel = WorkerChannel(self.channels, worker_id)
        try:
            if self.policy.pipeline_depth > 1:
                self.serve_pipelined(model, channel, worker_id, threading.Event())
            else:
                while not channel.drained:
                    batch = self.get_batch(channel)
                    if batch:
                        self.run_batch(model, channel, worker_id, batch)
            # Its version was replaced or unloaded, and every request it got is answered: the process
            # ends here (LitServe's worker returns), and the main process frees its slot.
            logger.info("Inference worker %d answered everything it was sent; exiting.", worker_id)
            channel.close(EXIT_ANSWER_LINGER_MS)
        except DeviceUnusable:
            channel.close(EXIT_ANSWER_LINGER_MS)  # the failed batch's 503s are queued: let them leave
            for handler in logging.getLogger().handlers:
                with contextlib.suppress(Exception):  # a closed or broken stream must not stop the exit
                    handler.flush()
            # os._exit, not an exception up through LitServe: interpreter shutdown would run CUDA
            # teardown on the broken context, and the prepare thread may be inside a CUDA call.
            self.exit_process(EXIT_DEVICE_UNUSABLE)
        finally:
            channel.close()

    def serve_pipelined(
        self, model: BatchedModel, channel: WorkerChannel, worker_id: int, stop: threading.Event
    ) -> None:
        """Prepare in a thread, run here, until ``stop`` is set or the channel is drained (and what
        was prepared is answered)."""
        prepared: queue.Queue = queue.Queue(maxsize=self.policy.pipeline_depth - 1)
        all_prepared = threading.Event()

        def prepare_batches() -> None:
            while not stop.is_set() and not channel.drained:
                try:
                    batch = self.get_batch(channel)
                    if batch:
                        prepared.put((batch, self.prepare(model, batch)))  # waits while the queue is full
                except Exception:  # keep preparing: a dead thread would leave every later request unanswered
                    logger.exception("Taking or preparing a batch failed; going on.")
            all_prepared.set()

        thread = threading.Thread(target=prepare_batches, name="vision-serve-prepare", daemon=True)
        thread.start()
        try:
            while not (stop.is_set() or all_prepared.is_set()) or not prepared.empty():
                try:
                    batch, ready = prepared.get(timeout=IDLE_WAIT_S)
                except queue.Empty:
                    continue
                self.finish(model, channel, worker_id, batch, ready)
        finally:
            # Also when finish raised (a broken device): the thread must be done with the channel
            # before it is closed. Bounded: it may be stuck in a call on that device.
            stop.set()
            gives_up_at = time.monotonic() + PREPARE_STOP_TIMEOUT_S
            while thread.is_alive() and time.monotonic() < gives_up_at:
                with contextlib.suppress(queue.Empty):
                    prepared.get_nowait()  # frees a put that waits on a full queue
                thread.join(0.05)

    def get_batch(self, channel: WorkerChannel) -> list[QueuedRequest]:
        """Up to ``max_batch_size`` requests; ``[]`` after ``IDLE_WAIT_S`` with none.

        Expired requests are answered 504 here and left out.
        """
        policy = self.policy
        batch: list[QueuedRequest] = []
        expired = 0
        first_taken = window_ends = None
        while len(batch) < policy.max_batch_size:
            if first_taken is None:
                queued = channel.receive(IDLE_WAIT_S)
            elif window_ends is None:
                queued = channel.receive(0)
            else:
                remaining = window_ends - time.monotonic()
                queued = channel.receive(remaining) if remaining > 0 else None
                if queued is None:
                    break
            if queued is None:
                if first_taken is None:
                    break  # idle: the caller loops and comes back
                if window_ends is None and policy.batch_timeout_s > 0:
                    window_ends = first_taken + policy.batch_timeout_s  # queue drained: now wait out the window
                    continue
                break
            first_taken = first_taken or time.monotonic()
            queued_at = queued.request.queued_at
            if queued_at is not None and time.monotonic() - queued_at > policy.request_timeout_s:
                # Its client already got a 504 from the HTTP process: do not run it.
                channel.answer(queued, error_answer(504, "Request timed out"))
                expired += 1
            else:
                batch.append(queued)
        if expired:
            self._note_expired(expired)
        return batch

    def run_batch(
        self, model: BatchedModel, channel: WorkerChannel, worker_id: int, batch: list[QueuedRequest]
    ) -> None:
        """Prepare and run one batch, and answer it (pipeline depth 1)."""
        self.finish(model, channel, worker_id, batch, self.prepare(model, batch))

    @staticmethod
    def prepare(model: BatchedModel[Prepared], batch: list[QueuedRequest]) -> Prepared | PrepareFailed:
        """``model.prepare`` of the requests, or the exception it raised (``finish`` answers it)."""
        try:
            return model.prepare([queued.request for queued in batch])
        except Exception as exc:
            return PrepareFailed(exc)

    def finish(
        self,
        model: BatchedModel[Prepared],
        channel: WorkerChannel,
        worker_id: int,
        batch: list[QueuedRequest],
        ready: Prepared | PrepareFailed,
    ) -> None:
        """Run the prepared batch and answer it; raises ``DeviceUnusable`` (after answering) if the
        failure broke the device."""
        slot = worker_id % len(self.running) if self.running is not None else 0
        if self.running is not None:
            self.running[slot] = len(batch)
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
                answers = [error_answer(500, MODEL_FAILED)] * len(batch)
            else:
                logger.critical(
                    "The device failed on a batch of %d request(s) and no longer runs work (%s). Answering them "
                    "with 503 and exiting (code %d) so that a new worker starts with a new device context.",
                    len(batch),
                    unusable,
                    EXIT_DEVICE_UNUSABLE,
                    exc_info=True,
                )
                answers = [error_answer(503, DEVICE_FAILED, retry_after_s=_defaults.RETRY_AFTER_S)] * len(batch)
        finally:
            if self.running is not None:
                self.running[slot] = 0
        channel.answer_many(list(zip(batch, answers, strict=True)))
        if unusable is not None:
            raise DeviceUnusable(unusable)

    def _note_expired(self, count: int) -> None:  # from either thread: a few ints
        metrics().requests_expired.inc(count)
        self._expired_unlogged += count
        now = time.monotonic()
        if now - self._expired_logged_at >= EXPIRED_LOG_INTERVAL_S:
            logger.warning(
                "Dropped %d request(s) that waited longer than the %g s deadline (--request-timeout-s) before "
                "running: the server is overloaded. Counted in vision_serve_requests_expired_total.",
                self._expired_unlogged,
                self.policy.request_timeout_s,
            )
            self._expired_unlogged = 0
            self._expired_logged_at = now


class PrepareFailed:
    def __init__(self, error: Exception) -> None:
        self.error = error
