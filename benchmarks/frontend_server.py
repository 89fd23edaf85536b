"""vision-serve with its decoder and model replaced by no-ops: what the front end alone can carry.

    python -m benchmarks.frontend_server --port 8200 --api-servers 2 [any vision-serve flag]

Everything else is the production path: body parsing and limits, the header probe, admission,
deadlines, the worker watch, the batch loop, top-k on 1,000 logits, JSON answers, metrics and the
access log. The decoder answers a batch of 1x1 images without reading the bytes, and the model
returns zero logits, so the rate measured is what a GPU fast enough to cost nothing would leave.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Sequence

import torch

from preprocessing.base import PreparedBatch, Preprocessor
from service.worker.classifier import ClassifierAPI

logger = logging.getLogger(__name__)

ENGINE_NOOP = "no-op"


class NoopPreprocessor(Preprocessor):
    """Every image "decodes" to one 1x1 pixel, without reading its bytes."""

    name = "no-op"

    def __call__(self, images: Sequence[bytes]) -> PreparedBatch:
        return PreparedBatch(torch.zeros((len(images), 3, 1, 1)), [None] * len(images))


class NoopClassifierAPI(ClassifierAPI):
    """ClassifierAPI whose setup loads the real model (for its labels), then swaps in the no-ops."""

    def setup(self, device: str) -> None:
        super().setup(device)
        num_classes = self.served.entry.num_classes

        def zero_logits(images: torch.Tensor) -> torch.Tensor:
            return torch.zeros((len(images), num_classes))

        self.served = dataclasses.replace(self.served, engine_name=ENGINE_NOOP, run=zero_logits)
        self.preprocessor = NoopPreprocessor(self.served.entry.preprocess, torch.device("cpu"))
        # The no-op stands in for a GPU, where softmax and top-k are kernel launches; on a CPU
        # thread pool they would spin on cores the front end needs (most of the worker's profile
        # with 2 threads).
        torch.set_num_threads(1)
        logger.info("Front-end benchmark: decoding and the model are no-ops")


def main(argv: Sequence[str] | None = None) -> int:
    from service.cli import build_parser, settings_from_args
    from service.logs import adopt_library_loggers, configure_logging
    from service.supervisor.server import build_server, serve

    parser = build_parser()
    parser.prog = "python -m benchmarks.frontend_server"
    try:
        settings = settings_from_args(parser.parse_args(argv))
    except ValueError as exc:
        parser.error(str(exc))
    if settings.artifact:
        parser.error("--artifact: the front-end benchmark serves no engine; drop it.")
    configure_logging(settings.log_level, settings.log_format)
    adopt_library_loggers()
    # Imported by module name, not as __main__: the spawned workers unpickle it from there.
    from benchmarks.frontend_server import NoopClassifierAPI as Api

    return serve(settings, build_server(settings, Api(settings)))


if __name__ == "__main__":
    sys.exit(main())
