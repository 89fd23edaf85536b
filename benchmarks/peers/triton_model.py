"""NVIDIA Triton (through PyTriton) serving a catalog model from its Python callable: the model peer.

    cd <repo> && <pytriton virtualenv>/bin/python -m benchmarks.peers.triton_model \\
        --model resnet152 --weights /tmp/vision-serve-bench/resnet152-random-v2.pt \\
        --port 8400 --grpc-port 8401 --metrics-port 8402

Runs in the PyTriton virtualenv (Python 3.13, torch, torchvision, Pillow: ``python -m benchmarks.peers.triton_env
--model``), started by benchmarks.peers.triton_peer. The real tritonserver binary takes the HTTP requests and
batches them with its dynamic batcher; PyTriton hands each batch to ``infer`` in this process, which does
what a Triton Python model for an image classifier does:

* input ``image``: one BYTES element per request (the encoded file). BYTES, not a UINT8 tensor of the
  file's bytes: the dynamic batcher only merges requests of the same shape, and JPEGs differ in length.
* Pillow decode, EXIF orientation and RGB as vision-serve's, then torchvision's ``Resize``
  (antialiased), ``CenterCrop``, ``ToTensor`` and ``Normalize`` with the model's catalog spec (for
  ResNet-152, its torchvision weights' own: resize 232, crop 224, ImageNet mean/std, bilinear): the
  transforms the torchvision weights document, as TorchServe's image handler runs them, built for
  any spec by benchmarks/harness/eval_transform.py. The images of a batch are decoded on a thread
  pool (Pillow releases the GIL).
* The eager fp32 model from the same weights file and loader as vision-serve's eager path
  (``compile.weights.load_model``), channels_last as vision-serve's eager engine, ``inference_mode``.
* Softmax and top-5 on the batch; outputs ``labels`` (BYTES) and ``probabilities`` (FP32), 5 per image.

Imports vision-serve's model catalog and loader only (``compile``): they need torch and torchvision,
nothing of the server. PyTriton is imported only to serve, so the callable and the command line can
be tested in vision-serve's own environment.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image

from benchmarks.harness.eval_transform import eval_transform, upright_rgb
from compile import ModelEntry, get_model_entry, load_model

logger = logging.getLogger("triton_model")

TOP_K = 5
DEFAULT_MAX_BATCH = 8


class Classifier:
    """The inference callable: encoded images in, top-k labels and probabilities out."""

    def __init__(self, entry: ModelEntry, weights: str, threads: int, channels_last: bool) -> None:
        self.labels = np.array([label.encode() for label in entry.labels], dtype=np.object_)
        self.transform = eval_transform(entry.preprocess)
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.model = load_model(entry, weights).module.eval().to(memory_format=self.memory_format)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="decode")

    def preprocess(self, data: bytes) -> torch.Tensor:
        with Image.open(io.BytesIO(data)) as image:
            return self.transform(upright_rgb(image))

    def __call__(self, image: np.ndarray) -> dict[str, np.ndarray]:
        # ``image``: [batch, 1] object array of bytes, the requests the dynamic batcher merged.
        tensors = list(self.pool.map(self.preprocess, (row[0] for row in image)))
        batch_tensor = torch.stack(tensors).contiguous(memory_format=self.memory_format)
        with torch.inference_mode():
            probabilities, indices = self.model(batch_tensor).float().softmax(dim=1).topk(TOP_K, dim=1)
        return {"labels": self.labels[indices.numpy()], "probabilities": probabilities.numpy()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="catalog name, e.g. resnet152")
    parser.add_argument("--weights", required=True, help="the state_dict file the other contenders serve")
    parser.add_argument("--port", type=int, required=True, help="HTTP port")
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=DEFAULT_MAX_BATCH)
    parser.add_argument("--max-queue-delay-us", type=int, default=0, help="dynamic batcher delay (Triton's default 0)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads and decode threads")
    parser.add_argument("--no-channels-last", dest="channels_last", action="store_false")
    return parser.parse_args(argv)


def serve(args: argparse.Namespace, classifier: Classifier) -> None:
    """Bind ``classifier`` to tritonserver as ``args.model`` and serve until SIGINT/SIGTERM."""
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    config = TritonConfig(http_port=args.port, grpc_port=args.grpc_port, metrics_port=args.metrics_port)
    with Triton(config=config) as triton:
        triton.bind(
            model_name=args.model,
            infer_func=batch(classifier),
            inputs=[Tensor(name="image", dtype=np.bytes_, shape=(1,))],
            outputs=[
                Tensor(name="labels", dtype=np.bytes_, shape=(TOP_K,)),
                Tensor(name="probabilities", dtype=np.float32, shape=(TOP_K,)),
            ],
            config=ModelConfig(
                max_batch_size=args.max_batch_size,
                batcher=DynamicBatcher(max_queue_delay_microseconds=args.max_queue_delay_us),
            ),
        )
        triton.serve()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # One model instance runs one batch at a time on every core, as vision-serve's one worker does.
    torch.set_num_threads(args.threads)
    classifier = Classifier(get_model_entry(args.model), args.weights, args.threads, args.channels_last)
    logger.info(
        "%s from %s, %d torch threads, max batch %d", args.model, args.weights, args.threads, args.max_batch_size
    )
    serve(args, classifier)
    return 0


if __name__ == "__main__":
    sys.exit(main())
