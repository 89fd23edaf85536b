"""What each inference worker process runs: set the process up, load the model, serve.

The main process pickles this object into every worker it spawns (service/worker/process.py), and
the HTTP processes are forked from the main process: it imports no tensor library. ``setup`` runs
in the worker and imports the model there (``model`` names it: service/worker/classifier.py unless
a benchmark swaps in its own); ``worker_loop`` (service/worker/loop.py) then serves it. It is an
``ls.LitAPI``, LitServe's model contract, which ``ls.LitServer`` takes for the server it runs.
"""

from __future__ import annotations

import importlib
import signal
import warnings

import litserve as ls

from service.heap import freeze_startup_objects
from service.logs import adopt_torch_logger, configure_logging
from service.metrics import metrics
from service.settings import ServeSettings
from service.tracing import configure_tracing, flush_on_terminate
from service.worker.contract import WorkerLoop

CLASSIFIER = "service.worker.classifier:Classifier"


class WorkerEntry(ls.LitAPI):
    """``model``: ``"module:Class"`` whose ``load(settings, device)`` returns the ``BatchedModel``."""

    def __init__(self, settings: ServeSettings, worker_loop: WorkerLoop, model: str = CLASSIFIER) -> None:
        """``worker_loop``: what serves the model once loaded (service/worker/loop.py)."""
        with warnings.catch_warnings():
            # LitServe warns about batch/unbatch overrides; its own loop never runs here.
            warnings.simplefilter("ignore")
            super().__init__(max_batch_size=settings.max_batch_size, batch_timeout=settings.batch_timeout_ms / 1000.0)
        self.settings = settings
        self.model_path = model
        self.worker_loop = worker_loop
        self.worker_id: int | None = None  # set in the worker, before setup (service/worker/process.py)
        self.model = None  # set by setup, in the worker

    def setup(self, device: str) -> None:
        """Set the process up and load the model (LitServe's contract: one model per process)."""
        self.setup_process()
        self.load_model(device)

    def setup_process(self) -> None:
        """What a worker process does once, before its first model: signals, logs, metrics, tracing."""
        # Ctrl-C in a terminal reaches the whole process group; the main process stops the server
        # in order (HTTP first, so in-flight requests get answers), so workers must not die first.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        configure_logging(self.settings.log_level, self.settings.log_format)  # a spawned process starts bare
        metrics()  # its series exist at 0 from the start, not from the first batch
        self._configure_tracing()

    def load_model(self, device: str) -> None:
        """Load this entry's model on ``device`` (``model``): each model of a shared process does."""
        module, _, name = self.model_path.partition(":")
        model_class = getattr(importlib.import_module(module), name)
        adopt_torch_logger()  # the model's module imported torch, whose logger has a format of its own
        self.model = model_class.load(self.settings, device)
        freeze_startup_objects()

    def release_model(self) -> None:
        """Drop the model (its loop ended): what it held goes back to the process, and to the
        machine where the allocator returns it (service/worker/host.py trims after)."""
        model, self.model = self.model, None
        release = getattr(model, "release", None)  # optional: service/worker/classifier.py
        if release is not None:
            release()

    def _configure_tracing(self) -> None:
        """Spans of the traced requests' stages here (service/tracing/), exported also when the
        main process stops this worker with SIGTERM."""
        worker_id = self.worker_id
        role = "worker" if worker_id is None else f"worker-{worker_id}"
        configure_tracing(self.settings.trace_sample_rate, self.settings.otlp_endpoint, role, worker_id=worker_id)
        flush_on_terminate()
