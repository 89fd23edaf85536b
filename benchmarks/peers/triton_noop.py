"""NVIDIA Triton (through PyTriton) with a no-op Python model: the front-end benchmark's Triton peer.

    <pytriton virtualenv>/bin/python benchmarks/peers/triton_noop.py --port 8400

The real tritonserver binary, its HTTP front end and dynamic batcher (batches up to 64, no delay:
Triton's default), and a Python model that answers five zero scores per image. Clients send the
encoded image as a UINT8 tensor in the KServe v2 binary extension (benchmarks.frontend builds it).
PyTriton's Python stub runs with Python 3.13 here, not 3.11/3.12 (measured), so this runs in a
virtualenv of its own (benchmarks.peers.triton_env) and imports nothing of vision-serve.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

MODEL_NAME = "noop"
MAX_BATCH = 64
TOP_K = 5


@batch
def infer(image: np.ndarray) -> dict[str, np.ndarray]:
    return {"scores": np.zeros((len(image), TOP_K), dtype=np.float32)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="HTTP port")
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    args = parser.parse_args()
    config = TritonConfig(http_port=args.port, grpc_port=args.grpc_port, metrics_port=args.metrics_port)
    with Triton(config=config) as triton:
        triton.bind(
            model_name=MODEL_NAME,
            infer_func=infer,
            inputs=[Tensor(name="image", dtype=np.uint8, shape=(-1,))],
            outputs=[Tensor(name="scores", dtype=np.float32, shape=(TOP_K,))],
            config=ModelConfig(max_batch_size=MAX_BATCH, batcher=DynamicBatcher()),
        )
        triton.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
