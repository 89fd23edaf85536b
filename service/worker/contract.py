"""What the inference worker's batching loop is given: the model it serves (``BatchedModel``) and how
it forms batches (``BatchPolicy``); and what the worker process runs once the model is loaded
(``WorkerLoop``). The loop's pieces (service/worker/loop.py) share these.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol, TypeVar

from service import _defaults
from service.wire import Answer, ImageRequest
from service.worker.turns import ModelTurns

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

    # Optional: ``watch_other_workers(others_idle)``, called once by the loop with a function that says
    # whether every other worker is idle (the Classifier then runs a lone image on their cores too).


class WorkerLoop(Protocol):
    """What serves the loaded model in its worker process (service/worker/loop.py: ``GreedyBatchedLoop``)."""

    def serve(
        self, model: BatchedModel, worker_id: int, stop: threading.Event | None = None, turns: ModelTurns | None = None
    ) -> None:
        """Answer requests until the worker's version is retired or ``stop`` is set (returns), or the
        process ends; ``turns``: shared with the other models of the process."""
        ...


@dataclass(frozen=True)
class BatchPolicy:
    """How the loop forms batches (service/settings.py has the flags)."""

    max_batch_size: int = _defaults.MAX_BATCH_SIZE
    batch_timeout_s: float = _defaults.BATCH_TIMEOUT_MS / 1000
    pipeline_depth: int = 1  # batches in flight: 1 runs each start to end, 2+ prepare ahead

    def __post_init__(self) -> None:
        if self.pipeline_depth < 1:
            raise ValueError(f"pipeline_depth must be >= 1 (1: no overlap), got {self.pipeline_depth}.")
