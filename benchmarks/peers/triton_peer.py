"""NVIDIA Triton as a peer in our benchmarks: the same model, weights file, photos and load as vision-serve.

PyTriton 0.7 runs the real tritonserver binary (its HTTP front end and dynamic batcher) and hands each
batch to a Python callable (benchmarks.peers.triton_model, in the PyTriton virtualenv of benchmarks.peers.triton_env):
Pillow + torchvision preprocessing with the catalog's spec, the eager fp32 model loaded from the
same state_dict file, softmax and top-5. This module is the host side, in vision-serve's environment:
the server's command line, the request the load generator sends (KServe v2 with the binary tensor
extension), reading Triton's batch counters, and running a load sweep against it.

    python -m benchmarks.peers.triton_peer --smoke --model efficientnet-lite0   # start, classify a cat, stop

What Triton does with the defaults used here (PyTriton 0.7's ``ModelConfig``/``DynamicBatcher``):
one model instance (one batch at a time, as vision-serve's one worker per device), a dynamic batcher
with no queue delay (Triton's default: it takes what is queued when the instance is free, up to
``max_batch_size``), no queue limit, no response cache.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from service.client.launcher import free_port
from service.tune.loadgen import LoadSpec, format_summary, oip_images, run_load

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
MODEL_MODULE = "benchmarks.peers.triton_model"
DEFAULT_MAX_BATCH = 8  # the serving batch of every CPU experiment (benchmarks.harness.suite.CPU_MAX_BATCH)
INPUT_NAME = "image"
OUTPUT_NAMES = ("labels", "probabilities")
JSON_HEADER_LENGTH = "Inference-Header-Content-Length"


@dataclass(frozen=True)
class TritonPeerConfig:
    model_name: str
    weights_file: Path  # a state_dict file: the one vision-serve and TorchServe serve
    max_batch_size: int = DEFAULT_MAX_BATCH
    max_queue_delay_us: int = 0  # Triton's default
    threads: int | None = None  # torch (and decode) threads; None = every core, as vision-serve's one worker
    channels_last: bool = True  # as vision-serve's eager engine: the comparison is of serving, not of layouts

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, not {self.max_batch_size}")
        if self.max_queue_delay_us < 0:
            raise ValueError(f"max_queue_delay_us must be 0 or more, not {self.max_queue_delay_us}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1 or None, not {self.threads}")

    @property
    def torch_threads(self) -> int:
        return self.threads or os.cpu_count() or 1

    def as_record(self) -> dict:
        return {**dataclasses.asdict(self), "weights_file": str(self.weights_file), "threads": self.torch_threads}


@dataclass(frozen=True)
class TritonPorts:
    http: int
    grpc: int
    metrics: int

    @classmethod
    def free(cls) -> TritonPorts:
        return cls(http=free_port(), grpc=free_port(), metrics=free_port())


def server_command(python: Path, config: TritonPeerConfig, ports: TritonPorts) -> list[str]:
    """The peer's command line; it runs with the repository as its working directory (``-m``)."""
    command = [
        *(str(python), "-m", MODEL_MODULE, "--model", config.model_name, "--weights", str(config.weights_file)),
        *("--port", str(ports.http), "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics)),
        *("--max-batch-size", str(config.max_batch_size), "--max-queue-delay-us", str(config.max_queue_delay_us)),
        *("--threads", str(config.torch_threads)),
    ]
    return command if config.channels_last else [*command, "--no-channels-last"]


def infer_path(model_name: str) -> str:
    return f"/v2/models/{model_name}/infer"


# ---- the request and the answer -------------------------------------------------------------------


def encode_request(image: bytes) -> tuple[bytes, dict[str, str]]:
    """A KServe v2 inference request for one encoded image, with Triton's binary tensor extension.

    The body is a JSON header, then the ``image`` input as a BYTES tensor of shape [1, 1] in Triton's
    binary layout (a 4-byte little-endian length, then the bytes); ``Inference-Header-Content-Length``
    says where the JSON ends. The outputs are asked for as JSON, so the answer is plain JSON as
    vision-serve's is. The same work per request as the other servers' clients: one copy of the image.
    """
    return oip_images(image, input_name=INPUT_NAME, output_names=OUTPUT_NAMES, shape=(1, 1), binary_outputs=False)


def parse_response(payload: dict) -> list[tuple[str, float]]:
    """Triton's JSON answer for one image -> ``[(label, probability), ...]``, best first."""
    outputs = {output["name"]: output["data"] for output in payload["outputs"]}
    missing = set(OUTPUT_NAMES) - set(outputs)
    if missing:
        raise ValueError(f"Triton's answer has no {sorted(missing)} output: {payload}")
    labels, probabilities = (outputs[name] for name in OUTPUT_NAMES)
    return [(str(label), float(p)) for label, p in zip(labels, probabilities, strict=True)]


def parse_batch_counters(metrics: str, model_name: str) -> tuple[float, float]:
    """``(inferences, executions)`` of ``model_name`` from Triton's Prometheus metrics text.

    Their ratio over a run is the mean batch size: Triton counts every request's inference and every
    batch the model instance ran (``nv_inference_count``, ``nv_inference_exec_count``).
    """
    counters = {}
    for name in ("nv_inference_count", "nv_inference_exec_count"):
        pattern = rf'^{name}\{{[^}}]*model="{re.escape(model_name)}"[^}}]*\}}\s+(\S+)$'
        values = [float(m[1]) for m in re.finditer(pattern, metrics, re.M)]
        if not values:
            raise ValueError(f"Triton's metrics have no {name} for model {model_name!r}")
        counters[name] = sum(values)  # one line per model version
    return counters["nv_inference_count"], counters["nv_inference_exec_count"]


# ---- the server -----------------------------------------------------------------------------------


@dataclass
class TritonPeer:
    """Where a started peer answers (see :func:`running_peer`)."""

    config: TritonPeerConfig
    ports: TritonPorts

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports.http}"

    @property
    def infer_url(self) -> str:
        return self.url + infer_path(self.config.model_name)

    def batch_counters(self) -> tuple[float, float]:
        response = httpx.get(f"http://127.0.0.1:{self.ports.metrics}/metrics", timeout=10.0)
        response.raise_for_status()
        return parse_batch_counters(response.text, self.config.model_name)


def probe_jpeg() -> bytes:
    """A real photo for the readiness check and the smoke test: scikit-image's cat (Chelsea)."""
    from service.tune.images import IMAGENET_SIZE, photo_jpegs

    return photo_jpegs(*IMAGENET_SIZE, ("chelsea",))[0]


@contextlib.contextmanager
def running_peer(config: TritonPeerConfig, workdir: Path, python: Path | None = None) -> Iterator[TritonPeer]:
    """The Triton peer, ready and answering; stopped (with tritonserver) afterwards.

    Started and stopped as the front-end benchmark does its no-op Triton (``benchmarks.frontend.running``:
    its own process group, ready once ``/v2/models/<model>/ready`` answers 200), then one real prediction
    must succeed before anything is measured. ``python``: the PyTriton virtualenv's (made if None).
    """
    from benchmarks.frontend import Request, Target, check_answer, running
    from benchmarks.peers.triton_env import ensure_venv

    peer = TritonPeer(config, TritonPorts.free())
    body, headers = encode_request(probe_jpeg())
    target = Target(
        name=f"triton-{config.model_name}",
        port=peer.ports.http,
        command=server_command(python or ensure_venv(model=True), config, peer.ports),
        ready_path=f"/v2/models/{config.model_name}/ready",
        request=Request(infer_path(config.model_name), body, headers),
    )
    workdir.mkdir(parents=True, exist_ok=True)
    logger.info("Starting: %s", " ".join(target.command))
    with running(target, peer.url, workdir / f"{target.name}.log"):
        check_answer(peer.url, target.request)
        yield peer


def classify(peer: TritonPeer, image: bytes) -> list[tuple[str, float]]:
    body, headers = encode_request(image)
    response = httpx.post(peer.infer_url, content=body, headers=headers, timeout=120.0)
    response.raise_for_status()
    return parse_response(response.json())


# ---- the load sweep -------------------------------------------------------------------------------


def measure(peer: TritonPeer, images: Sequence[bytes], specs: Sequence[LoadSpec], label: str) -> list[dict]:
    """One run record per spec (as ``benchmarks.harness.suite.run_record``), with the mean batch from Triton's counters.

    Each spec's warm-up is sent as a run of its own before the counters are read, so that the mean batch
    covers the measured requests only (the measured run then opens its connections anew: on loopback,
    well under a millisecond each).
    """
    from benchmarks.harness.suite import run_record

    records = []
    for spec in specs:
        if spec.warmup_requests:
            warmup = LoadSpec(spec.warmup_requests, concurrency=spec.concurrency, max_seconds=spec.max_seconds)
            run_load(peer.infer_url, images, warmup, encode=encode_request)
        inferences, executions = peer.batch_counters()
        result = run_load(peer.infer_url, images, dataclasses.replace(spec, warmup_requests=0), encode=encode_request)
        inferences_after, executions_after = peer.batch_counters()
        logger.info("%s\n%s", label, format_summary(result.summary()))
        record = run_record(result)
        batches = executions_after - executions
        record["batch_size_mean"] = (inferences_after - inferences) / batches if batches else None
        records.append(record)
    return records


# ---- smoke test -----------------------------------------------------------------------------------


def write_weights_file(model_name: str, weights: str, path: Path) -> Path:
    """``weights`` ('imagenet', 'random' or a file) as a state_dict file: what the peer loads."""
    import torch

    from compile import get_model_entry, load_model

    if Path(weights).is_file():
        return Path(weights)
    torch.save(load_model(get_model_entry(model_name), weights).module.state_dict(), path)
    return path


def smoke(model_name: str, weights: str) -> int:
    """Start the peer, classify the cat photo, print the answer and Triton's batch counters, stop."""
    with tempfile.TemporaryDirectory(prefix="triton-peer-") as tmp:
        weights_file = write_weights_file(model_name, weights, Path(tmp) / f"{model_name}.pt")
        with running_peer(TritonPeerConfig(model_name, weights_file), Path(tmp)) as peer:
            predictions = classify(peer, probe_jpeg())
            counters = peer.batch_counters()
    for label, probability in predictions:
        print(f"  {label:<24} {probability * 100:6.2f} %")
    print(f"Triton counted {counters[0]:.0f} inferences in {counters[1]:.0f} executions")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="start the peer, classify a cat photo, stop")
    parser.add_argument("--model", default="efficientnet-lite0")
    parser.add_argument("--weights", default="imagenet", help="'imagenet', 'random' or a state_dict file")
    args = parser.parse_args(argv)
    if not args.smoke:
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return smoke(args.model, args.weights)


if __name__ == "__main__":
    sys.exit(main())
