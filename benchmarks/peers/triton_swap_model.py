"""The Triton Python-backend model of ``benchmarks.triton_swap``: copied as ``model.py`` into each version.

Triton's Python backend runs it in a stub process (PyTriton's ``triton_python_backend_stub`` for Python
3.13, which embeds the interpreter of the PyTriton virtualenv: benchmarks.peers.triton_env) and calls
``TritonPythonModel.initialize`` once per loaded version, ``execute`` with the requests its dynamic
batcher merged. The work per batch is the Triton peer's (``benchmarks.peers.triton_model.Classifier``):
Pillow + torchvision preprocessing with the catalog's spec, the eager fp32 efficientnet-lite0 from a
state_dict file, softmax, top-5.

Each version folder holds its own weights, ``model.pt`` beside this file, as a version of a real model
would: a corrupt version (a truncated ``model.pt``) fails in ``initialize``, when torch reads it.

The model config's parameter ``repo`` names vision-serve's checkout: ``benchmarks.peers.triton_model`` and the
model catalog (``compile``) are imported from there, as the Triton peer imports them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

WEIGHTS_FILE = "model.pt"
MODEL_PARAMETER = "catalog_model"
REPO_PARAMETER = "repo"


def _parameter(config: dict, key: str) -> str:
    return config.get("parameters", {})[key]["string_value"]


class TritonPythonModel:
    """One loaded version: ``initialize`` builds the classifier, ``execute`` answers a batch of requests."""

    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        repo = _parameter(config, REPO_PARAMETER)
        if repo not in sys.path:
            sys.path.insert(0, repo)
        import torch

        from benchmarks.peers.triton_model import Classifier
        from compile import get_model_entry

        threads = os.cpu_count() or 1  # one instance runs one batch at a time on every core, as the peer
        torch.set_num_threads(threads)
        weights = Path(args["model_repository"]) / args["model_version"] / WEIGHTS_FILE
        self.classifier = Classifier(get_model_entry(_parameter(config, MODEL_PARAMETER)), str(weights), threads, True)
        self.version = args["model_version"]

    def execute(self, requests: list[Any]) -> list[Any]:
        import numpy as np
        import triton_python_backend_utils as pb_utils

        images = [pb_utils.get_input_tensor_by_name(request, "image").as_numpy() for request in requests]
        sizes = [len(image) for image in images]
        outputs = self.classifier(np.concatenate(images))
        responses, start = [], 0
        for size in sizes:
            end = start + size
            tensors = [
                pb_utils.Tensor("labels", outputs["labels"][start:end]),
                pb_utils.Tensor("probabilities", outputs["probabilities"][start:end]),
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            start = end
        return responses
