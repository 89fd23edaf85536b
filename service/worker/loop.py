"""The inference worker's loop: takes batches from its request channel, runs them, answers them.

Each worker process runs ``GreedyBatchedLoop.serve`` once the model is loaded (service/worker/
process.py); it serves
until the worker's version is retired and everything it was sent is answered. Its pieces:

- service/worker/collector.py: ``BatchCollector`` takes a batch (greedy, then the optional
  ``--batch-timeout-ms`` window) and answers 504 to the requests whose deadline passed while queued;
- service/worker/runner.py: ``BatchRunner`` prepares and runs a batch and answers it (500 when the
  model fails, 503 and ``DeviceUnusable`` when the device broke);
- service/worker/pipeline.py: ``PipelinedRunner`` prepares the next batches in a thread while one
  runs (``--pipeline-depth`` 2 and more);
- service/worker/contract.py: what the loop is given, the model (``BatchedModel``, implemented by
  service/worker/classifier.py) and the batching flags (``BatchPolicy``).

While it serves, a thread of the worker beats on its heartbeat (service/transport/heartbeats.py),
whatever the loop does, and the runner shows there the batch it holds: the main process tells from
them a stopped or hung worker from a busy one (service/supervisor/pool/hangs.py).

The loop also serves ``--max-batch-size 1`` (a batch of one), so there is one request path.

When a batch broke the device (a sticky CUDA error: every later call would fail too), its 503s
are sent and the process exits with ``EXIT_DEVICE_UNUSABLE``, so the main process starts a new
worker with a new CUDA context (service/supervisor/pool/restarts.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, MutableSequence

from preprocessing.errors import DeviceUnusable
from service.transport.channels import ChannelConfig, WorkerChannel
from service.transport.heartbeats import Heartbeat, HeartbeatBoard
from service.worker.collector import BatchCollector
from service.worker.contract import BatchedModel, BatchPolicy
from service.worker.pipeline import PipelinedRunner
from service.worker.runner import EXIT_DEVICE_UNUSABLE, BatchRunner
from service.worker.turns import ModelTurns

logger = logging.getLogger(__name__)

# How long a worker that exits gives its last answers to leave.
EXIT_ANSWER_LINGER_MS = 2000


class GreedyBatchedLoop:
    """One worker's loop: opens its channel, serves from it with a ``BatchCollector`` and a
    ``BatchRunner`` (through a ``PipelinedRunner`` at pipeline depth 2 and more), and ends the
    process when the device broke.

    ``running``: a shared array, per worker the size of the batch it runs now (0 when idle), from
    which the HTTP processes compute the queue depth. ``exit_process``: how the worker process ends
    when its device broke. ``heartbeats``: the shared heartbeat board's array (None: no heartbeat).
    """

    def __init__(
        self,
        channels: ChannelConfig,
        policy: BatchPolicy,
        running: MutableSequence[int] | None = None,
        exit_process: Callable[[int], object] = os._exit,
        heartbeats: MutableSequence[float] | None = None,
    ) -> None:
        self.channels = channels
        self.policy = policy
        self.running = running
        self.exit_process = exit_process
        self.heartbeats = heartbeats

    def serve(
        self,
        model: BatchedModel,
        worker_id: int,
        stop: threading.Event | None = None,
        turns: ModelTurns | None = None,
    ) -> None:
        """Answer requests from this worker's channel until it is drained (or ``stop`` is set: the
        main process stopped this model in a shared process); ``turns``: the process's, when it holds
        other models too (service/worker/turns.py)."""
        stop = stop or threading.Event()
        channel = WorkerChannel(self.channels, worker_id)
        collector = BatchCollector(channel, self.policy)
        heartbeat = None if self.heartbeats is None else Heartbeat(HeartbeatBoard(self.heartbeats), worker_id)
        runner = BatchRunner(model, channel, worker_id, self.running, heartbeat, turns)
        watch = getattr(model, "watch_other_workers", None)  # optional: service/worker/contract.py
        if watch is not None:
            watch(runner.others_idle)
        if heartbeat is not None:
            heartbeat.start()
        try:
            if self.policy.pipeline_depth > 1:
                PipelinedRunner(collector, runner, self.policy.pipeline_depth - 1).serve(stop)
            else:
                while not channel.drained and not stop.is_set():
                    batch = collector.get_batch()
                    if batch:
                        runner.run_batch(batch, collector.top_up)
            # Its version was replaced or unloaded, and every request it got is answered (or the main
            # process stopped it): its loop ends here, and the process frees it (service/worker/host.py).
            if channel.drained:
                logger.info("Inference worker %d answered everything it was sent; exiting.", worker_id)
            else:
                logger.info("Inference worker %d stopped by the main process.", worker_id)
            channel.close(EXIT_ANSWER_LINGER_MS)
        except DeviceUnusable:
            channel.close(EXIT_ANSWER_LINGER_MS)  # the failed batch's 503s are queued: let them leave
            for handler in logging.getLogger().handlers:
                with contextlib.suppress(Exception):  # a closed or broken stream must not stop the exit
                    handler.flush()
            # os._exit, not an exception up through run_worker: interpreter shutdown would run CUDA
            # teardown on the broken context, and the prepare thread may be inside a CUDA call.
            self.exit_process(EXIT_DEVICE_UNUSABLE)
        finally:
            if heartbeat is not None:
                heartbeat.stop()
            channel.close()
