"""Hooks into the server for code outside the product (benchmarks/), in the caller's process (a
benchmark's; the no-op model runs in the workers of the server it starts). Named here so that a
refactor of the worker, the transport or vision-tune moves a line of this table instead of breaking a
benchmark unseen (tests/unit/test_benchmark_surface.py).

- ``serve_model`` (serving.py): vision-serve as its command line runs it, its workers loading another
  model class; ``NOOP_MODEL`` (noop.py) answers zero logits without decoding: the front end alone.
- The internal units that micro-benchmarks measure by nature, each group with the benchmark that
  needs it. Nothing of the product imports this package (the top layer of tests/unit/test_layers.py).

The names load on first use (PEP 562), as ``preprocessing``'s do: the front-end benchmark's main
process asks for ``serve_model`` and stays torch-free, as vision-serve's own does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    # a server whose workers load another model (benchmarks/frontend_server.py)
    "NOOP_MODEL": "service.testing.serving",
    "serve_model": "service.testing.serving",
    # the worker's batch loop on a real request channel (benchmarks/pipeline.py)
    "BatchCollector": "service.worker.collector",
    "BatchPolicy": "service.worker.contract",
    "BatchRunner": "service.worker.runner",
    "BatchedModel": "service.worker.contract",
    "ChannelConfig": "service.transport.channels",
    "Classifier": "service.worker.classifier",
    "PipelinedRunner": "service.worker.pipeline",
    "WorkerChannel": "service.transport.channels",
    # the model as a worker loads and runs it (ceiling.py, compiled_throughput.py, defaults.py, experiments.py)
    "ServedModel": "service.worker.engine",
    "bind_worker_device": "service.worker.engine",
    "load_artifact": "service.worker.engine",
    "load_eager": "service.worker.engine",
    "set_worker_threads": "service.worker.engine",
    "usable_cores": "service.supervisor.planning.cores",
    # what observability costs per request (metrics_overhead.py)
    "HttpObserver": "service.http.base.observer",
    "configure_logging": "service.logs",
    "exposition": "service.metrics",
    "metrics": "service.metrics",
    "multiprocess_mode": "service.metrics",
    # vision-tune's engine builds (quantized.py) and its search, replayed from journals (tune_compare.py)
    "FAILED": "service.tune.engines",
    "OK": "service.tune.engines",
    "STATUS_BY_EXIT": "service.tune.engines",
    "gate_or_reason": "service.tune.engines",
    "FEASIBLE": "service.tune.search",
    "Objective": "service.tune.search",
    "Score": "service.tune.search",
    "SearchResult": "service.tune.search",
    "quick_limit": "service.tune.search",
    "quick_search": "service.tune.search",
    "Candidate": "service.tune.space",
    "SearchSpace": "service.tune.space",
    "LoadPlan": "service.tune.measure",
    "Measurement": "service.tune.measure",
    "PoissonPlan": "service.tune.measure",
    "measure": "service.tune.measure",
    "ConfirmRound": "service.tune.report",
    "confirm_ratios": "service.tune.report",
    "ratio": "service.tune.report",
    "images_digest": "service.tune.session",
    "load_images": "service.tune.session",
}
__all__ = [
    "FAILED",
    "FEASIBLE",
    "NOOP_MODEL",
    "OK",
    "STATUS_BY_EXIT",
    "BatchCollector",
    "BatchPolicy",
    "BatchRunner",
    "BatchedModel",
    "Candidate",
    "ChannelConfig",
    "Classifier",
    "ConfirmRound",
    "HttpObserver",
    "LoadPlan",
    "Measurement",
    "Objective",
    "PipelinedRunner",
    "PoissonPlan",
    "Score",
    "SearchResult",
    "SearchSpace",
    "ServedModel",
    "WorkerChannel",
    "bind_worker_device",
    "configure_logging",
    "confirm_ratios",
    "exposition",
    "gate_or_reason",
    "images_digest",
    "load_artifact",
    "load_eager",
    "load_images",
    "measure",
    "metrics",
    "multiprocess_mode",
    "quick_limit",
    "quick_search",
    "ratio",
    "serve_model",
    "set_worker_threads",
    "usable_cores",
]

if TYPE_CHECKING:
    from service.http.base.observer import HttpObserver
    from service.logs import configure_logging
    from service.metrics import exposition, metrics, multiprocess_mode
    from service.supervisor.planning.cores import usable_cores
    from service.testing.serving import NOOP_MODEL, serve_model
    from service.transport.channels import ChannelConfig, WorkerChannel
    from service.tune.engines import FAILED, OK, STATUS_BY_EXIT, gate_or_reason
    from service.tune.measure import LoadPlan, Measurement, PoissonPlan, measure
    from service.tune.report import ConfirmRound, confirm_ratios, ratio
    from service.tune.search import FEASIBLE, Objective, Score, SearchResult, quick_limit, quick_search
    from service.tune.session import images_digest, load_images
    from service.tune.space import Candidate, SearchSpace
    from service.worker.classifier import Classifier
    from service.worker.collector import BatchCollector
    from service.worker.contract import BatchedModel, BatchPolicy
    from service.worker.engine import ServedModel, bind_worker_device, load_artifact, load_eager, set_worker_threads
    from service.worker.pipeline import PipelinedRunner
    from service.worker.runner import BatchRunner


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'service.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
