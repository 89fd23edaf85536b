"""Pipeline depth 2 and more: the inference worker prepares the next batches while one runs.

A thread of its own takes and prepares the next batches (on a GPU on a CUDA stream of its own:
service/worker/classifier.py) while the calling thread runs the model, with at most
``pipeline_depth - 1`` prepared batches waiting, so throughput approaches 1 / max(prepare, run)
instead of 1 / (prepare + run).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time

from service.worker.collector import IDLE_WAIT_S, BatchCollector
from service.worker.runner import BatchRunner

logger = logging.getLogger(__name__)

# How long a pipelined loop that stops waits for its prepare thread (which waits IDLE_WAIT_S at most
# for requests, then finishes the batch it prepares).
PREPARE_STOP_TIMEOUT_S = 5.0


class PipelinedRunner:
    """Takes and prepares batches from ``collector`` in a thread; runs and answers them with ``runner``
    in the thread that calls ``serve``. ``ahead``: how many prepared batches may wait (>= 1)."""

    def __init__(self, collector: BatchCollector, runner: BatchRunner, ahead: int) -> None:
        self.collector = collector
        self.runner = runner
        self.ahead = ahead

    def serve(self, stop: threading.Event) -> None:
        """Prepare in a thread, run here, until ``stop`` is set or the channel is drained (and what
        was prepared is answered)."""
        collector, runner, channel = self.collector, self.runner, self.collector.channel
        prepared: queue.Queue = queue.Queue(maxsize=self.ahead)
        all_prepared = threading.Event()

        def prepare_batches() -> None:
            while not stop.is_set() and not channel.drained:
                try:
                    batch = collector.get_batch()
                    if batch:
                        prepared.put((batch, runner.prepare(batch)))  # waits while the queue is full
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
                runner.finish(batch, ready)
        finally:
            # Also when finish raised (a broken device): the thread must be done with the channel
            # before it is closed. Bounded: it may be stuck in a call on that device.
            stop.set()
            gives_up_at = time.monotonic() + PREPARE_STOP_TIMEOUT_S
            while thread.is_alive() and time.monotonic() < gives_up_at:
                with contextlib.suppress(queue.Empty):
                    prepared.get_nowait()  # frees a put that waits on a full queue
                thread.join(0.05)
