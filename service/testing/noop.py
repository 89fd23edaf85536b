"""The no-op model (``NOOP_MODEL``, served by benchmarks/frontend_server.py): the real classifier with
its decoder and model swapped for no-ops after loading (loaded for its labels). Runs in the inference
workers only."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from preprocessing.base import PreparedBatch, Preprocessor
from service.settings import ServeSettings
from service.worker.classifier import Classifier

logger = logging.getLogger(__name__)

ENGINE_NOOP = "no-op"


class NoopPreprocessor(Preprocessor):
    """Every image "decodes" to one 1x1 pixel, without reading its bytes."""

    name = "no-op"

    def __call__(self, images: Sequence[bytes]) -> PreparedBatch:
        return PreparedBatch(torch.zeros((len(images), 3, 1, 1)), [None] * len(images))


class NoopClassifier(Classifier):
    """The classifier, loaded for its labels, with zero logits and no decoding."""

    @classmethod
    def load(cls, settings: ServeSettings, device: str) -> Classifier:
        classifier = super().load(settings, device)
        num_classes = classifier.served.entry.num_classes

        def zero_logits(images: torch.Tensor) -> torch.Tensor:
            return torch.zeros((len(images), num_classes))

        classifier.served = dataclasses.replace(
            classifier.served, engine_name=ENGINE_NOOP, run=zero_logits, lone_run=None
        )
        classifier.preprocessor = NoopPreprocessor(classifier.served.entry.preprocess, torch.device("cpu"))
        # The no-op stands in for a GPU, where softmax and top-k are kernel launches; on a CPU
        # thread pool they would spin on cores the front end needs (most of the worker's profile
        # with 2 threads).
        torch.set_num_threads(1)
        logger.info("Front-end benchmark: decoding and the model are no-ops")
        return classifier
