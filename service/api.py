"""The LitServe API: a batch of encoded images -> top-k labels, with per-item errors.

LitServe 0.2.19 answers *every* request of a batch with the same error if ``decode_request``,
``batch`` or ``predict`` raises, so nothing here raises for one bad item: decode failures travel
through the batch as ``ImageError`` values and become that request's own 4xx in
``encode_response``. Only a failure of the model itself (a real server error) fails the batch.
"""

# No `from __future__ import annotations` here: LitServe reads decode_request's annotation object
# to build the FastAPI endpoint, and a string annotation would not resolve in its module.

import io
import logging
import os
import signal
import time
import warnings
from dataclasses import dataclass, field
from typing import Annotated

import litserve as ls
import numpy as np
import torch
from fastapi import Depends
from fastapi.responses import JSONResponse
from PIL import Image

from compile.catalog import ModelEntry, get_model_entry
from compile.weights import load_model
from preprocessing import ImageError, PreparedBatch, create_preprocessor
from service.request_parsing import ImageRequest, read_image_request
from service.settings import ServeSettings

logger = logging.getLogger(__name__)

ENGINE_EAGER = "torch-eager-fp32"


@dataclass
class ClassifyBatch:
    """What ``batch`` hands to ``predict``: the device tensor plus what each request asked for."""

    prepared: PreparedBatch
    top_k: list[int]
    preprocess_ms: float


@dataclass
class ItemResult:
    """One request's answer, carried from ``predict`` to ``encode_response``."""

    batch_size: int
    timings_ms: dict[str, float] = field(default_factory=dict)
    predictions: list[tuple[int, float]] | None = None
    error: ImageError | None = None


def warmup_jpeg(width: int = 640, height: int = 480) -> bytes:
    """A small synthetic photo-sized JPEG, to run the whole decode path once before serving."""
    gradient = np.linspace(0, 255, width * height * 3, dtype=np.float32).reshape(height, width, 3)
    buf = io.BytesIO()
    Image.fromarray(gradient.astype(np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


class ClassifierAPI(ls.LitAPI):
    def __init__(self, settings: ServeSettings) -> None:
        with warnings.catch_warnings():
            # With --max-batch-size 1 LitServe warns that batch/unbatch are overridden; predict()
            # handles both paths on purpose.
            warnings.filterwarnings("ignore", message="The LitServer has both batch and unbatch")
            super().__init__(max_batch_size=settings.max_batch_size, batch_timeout=settings.batch_timeout_ms / 1000.0)
        self.settings = settings
        self.engine = ENGINE_EAGER
        self.model_entry: ModelEntry | None = None

    def setup(self, device: str) -> None:
        # Ctrl-C in a terminal reaches the whole process group; the main process stops the server
        # in order (HTTP first, so in-flight requests get answers), so workers must not die first.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        torch_device = torch.device(device)
        if torch_device.type == "cpu":
            # Workers of one machine share its cores; oversubscribing them only adds contention.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.settings.workers_per_device))
        self.model_entry = get_model_entry(self.settings.model)
        loaded = load_model(self.model_entry, self.settings.weights)
        self.model = loaded.module.to(torch_device).to(memory_format=torch.channels_last)
        self.torch_device = torch_device
        self.preprocessor = create_preprocessor(self.settings.preprocess, self.model_entry.preprocess, torch_device)
        logger.info(
            "Model loaded: model=%s weights=%s device=%s engine=%s; warming up",
            self.model_entry.name,
            loaded.weights_source,
            torch_device,
            self.engine,
        )
        self._warm_up()

    def _warm_up(self) -> None:
        """Run the full path at batch 1 and the largest batch, so first requests are not slow."""
        started = time.perf_counter()
        sample = warmup_jpeg()
        for size in sorted({1, self.settings.max_batch_size}):
            results = self._classify(self.batch([ImageRequest(sample)] * size))
            if any(r.error for r in results):
                raise RuntimeError(f"Warm-up failed: {results[0].error}")
        logger.info("Warm-up done in %.1f s", time.perf_counter() - started)

    def decode_request(self, request: Annotated[ImageRequest, Depends(read_image_request)]) -> ImageRequest:
        # Parsing already happened in the HTTP process (read_image_request); the worker gets bytes.
        return request

    def batch(self, inputs: list[ImageRequest]) -> ClassifyBatch:
        started = time.perf_counter()
        prepared = self.preprocessor([item.image for item in inputs])
        return ClassifyBatch(prepared, [item.top_k for item in inputs], (time.perf_counter() - started) * 1e3)

    def predict(self, x: ClassifyBatch | ImageRequest) -> list[ItemResult] | ItemResult:
        if isinstance(x, ImageRequest):  # max_batch_size=1: LitServe's single loop skips batch/unbatch
            return self._classify(self.batch([x]))[0]
        return self._classify(x)

    def unbatch(self, output: list[ItemResult]) -> list[ItemResult]:
        return output

    def _classify(self, batch: ClassifyBatch) -> list[ItemResult]:
        prepared = batch.prepared
        timings = {"preprocess": batch.preprocess_ms}
        results = [ItemResult(len(prepared), timings, error=error) for error in prepared.errors]
        ok = prepared.ok_indices
        if not ok:
            return results
        started = time.perf_counter()
        k = min(max(batch.top_k[i] for i in ok), self.model_entry.num_classes)
        with torch.inference_mode():
            logits = self.model(prepared.images)
            # Softmax and top-k on the device: only k values per image cross back to the host.
            probabilities, indices = logits.float().softmax(dim=1).topk(k, dim=1)
            probabilities, indices = probabilities.cpu().tolist(), indices.cpu().tolist()
        timings["inference"] = (time.perf_counter() - started) * 1e3
        for row, i in enumerate(ok):
            results[i].predictions = list(zip(indices[row], probabilities[row], strict=True))[: batch.top_k[i]]
        return results

    def encode_response(self, output: ItemResult) -> JSONResponse:
        headers = {
            "X-Batch-Size": str(output.batch_size),
            "Server-Timing": ", ".join(f"{name};dur={ms:.2f}" for name, ms in output.timings_ms.items()),
        }
        if output.error is not None:
            return JSONResponse({"detail": output.error.detail}, status_code=output.error.status_code, headers=headers)
        labels = self.model_entry.labels
        body = {
            "predictions": [
                {"index": index, "label": labels[index], "probability": probability}
                for index, probability in output.predictions
            ],
            "model": self.model_entry.name,
            "engine": self.engine,
        }
        return JSONResponse(body, headers=headers)
