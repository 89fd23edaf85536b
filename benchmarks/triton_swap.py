"""NVIDIA Triton's model swaps under load: what its explicit model control does to requests in flight.

    python -m benchmarks.triton_swap            # the full procedure: 5 x (v1 -> v2 -> v1), a corrupt v3
    python -m benchmarks.triton_swap --quick    # 1 cycle, shorter steady periods: for trying things out
    python -m benchmarks.triton_swap --load-protocol grpc   # the same, load calls over gRPC

The procedure of ``benchmarks.harness.swap_load`` (the one ``benchmarks.model_swap`` runs against vision-serve:
same cores, 32 connections, photos, plan), against the real ``tritonserver`` binary (2.51) that the
``nvidia-pytriton`` 0.7 package ships, run directly rather than through PyTriton's ``Triton`` class:

* ``tritonserver --model-repository=<tmp> --model-control-mode=explicit --load-model=classifier``, with
  PyTriton's Python backend as ``--backend-directory`` and its Python 3.13 stub
  (``triton_python_backend_stub``) copied into it, the environment PyTriton gives the server
  (``LD_LIBRARY_PATH`` += ``nvidia_pytriton.libs``, the virtualenv's ``bin`` first on ``PATH``: the stub
  embeds the virtualenv's interpreter, so the model imports torch from there). The virtualenv is
  benchmarks.peers.triton_env's (``python -m benchmarks.peers.triton_env --model``; made if missing).
* the model ``classifier``: a Python-backend model (``benchmarks.peers.triton_swap_model`` as ``model.py``)
  doing the Triton peer's work (benchmarks.peers.triton_model: Pillow + torchvision preprocessing, eager fp32
  efficientnet-lite0, softmax, top-5), one instance, ``max_batch_size`` 8, dynamic batcher with
  Triton's default zero queue delay. Versions 1 and 2 hold the same weights file (``model.pt``);
  version 3 a truncated one, so its ``initialize`` fails. ``config.pbtxt`` serves version 1 only.
* inference: ``POST /v2/models/classifier/infer`` (no version: Triton picks the highest ready one),
  KServe v2 binary request as the Triton peer's (input ``image`` BYTES [1, 1], outputs as JSON);
  ``model_version`` of the answer says which version answered.
* loads: tritonclient's asyncio HTTP ``load_model("classifier", config=...)``, i.e. ``POST
  /v2/repository/models/classifier/load`` with ``{"parameters": {"config": "<json>"}}``. The JSON is the
  model's whole config (as ``GET /v2/models/classifier/config`` gives it at the start) with
  ``version_policy`` set to ``{"specific": {"versions": [V]}}``: Triton takes a load's config as the
  model's entire config, not as a patch of config.pbtxt. A config holding only ``version_policy``
  (probed once before the run, recorded as ``config_override_probe``) fails at once with 400: Triton
  auto-completes the rest, guesses the PyTorch backend from the ``model.pt`` file and finds no such
  backend; the served version stays.

After the run, with no other traffic, ``requests_during_loads_probe`` (``swap_load.requests_during_loads``):
one swap per case and a single request sent 0-3 s into the load call, to the model or pinned to the
version served until then (``/v2/models/classifier/versions/N/infer``): when it is answered, by which
version.

What it measured (2 cores, 2026-11-25, benchmarks/results/vm-2cpu-2026-11-25/triton-swap*.json): no
request failed and no version other than 1 and 2 answered, but **while an HTTP load call ran, Triton
answered no HTTP inference at all**: 0 answers came back during each of the 11 load calls (5.3-7.5 s
each, the failed one included), and the same in two ``--quick`` runs (3 of 3 loads each); the held
requests came back together when the call returned. It is not certain to happen: in trials by hand
against a separate server the stall came in 8 of 14 HTTP loads (whether tritonclient or plain httpx
sent the load; ``--http-thread-count=64`` did not prevent it), and in none of 13 loads sent over gRPC.

With gRPC loads (``--load-protocol grpc``) the old version answered throughout (longest stretch
without an answer 1.5 s, 1.2 s outside loads; no probe request held); those loads took 12-21 s
instead of 5-7.5 s, since the new stub's torch import and model build share the 2 cores with serving.

In the probes of two of three HTTP runs, single requests sent 0-2 s into a load were held until it
returned and then answered by the *new* version; one sent 3 s in was answered at once by the old one;
requests pinned to the old version were answered at once (in two trials by hand, a pinned request
sent at the load's start was held for the whole load, then answered 503 "version N is not at ready
state").

The send-time p99 ratio does not show the stall (1.09): in a closed loop the held requests were sent
just *before* each load. The in-flight ratio does: 3.65 (with gRPC loads 1.79; 2.36 in an earlier
gRPC run: CPU contention).

Results: ``triton-swap.json`` (plan, summary, every load call and answer, the server's version and the
probes) and ``triton-swap.png`` in the results folder (``triton-swap-grpc.*`` for gRPC loads), the
server's log beside them as ``triton-swap-server.log``. If Triton cannot start here, the JSON says why
(``error``) and nothing is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import logging
import os
import shutil
import sys
import tempfile
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import httpx

from benchmarks.harness import swap_load
from benchmarks.harness.common import machine_record, results_dir
from service.client.launcher import free_port
from service.tune.loadgen import oip_images

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
MODEL_NAME = "classifier"
CATALOG_MODEL = "efficientnet-lite0"
MODEL_FILE = Path(__file__).resolve().parent / "peers" / "triton_swap_model.py"
INPUT_NAME = "image"
OUTPUT_NAMES = ("labels", "probabilities")
MAX_BATCH = 8  # the serving batch of every CPU experiment, as the Triton peer's
LOAD_CALL_TIMEOUT_S = 600.0
LOAD_PROTOCOLS = ("http", "grpc")
# How Triton's HTTP front end answers what its gRPC front end says with these codes.
GRPC_TO_HTTP = {"INVALID_ARGUMENT": 400, "NOT_FOUND": 404, "UNAVAILABLE": 503, "INTERNAL": 500, "UNKNOWN": 500}
EXIT_TIMEOUT_S = 10  # tritonserver's wait for in-flight work at SIGTERM (its default: 30 s)
RESULT_STEM = "triton-swap"

CONFIG_PBTXT = f"""name: "{MODEL_NAME}"
backend: "python"
max_batch_size: {MAX_BATCH}
input [ {{ name: "{INPUT_NAME}" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [
  {{ name: "labels" data_type: TYPE_STRING dims: [ 5 ] }},
  {{ name: "probabilities" data_type: TYPE_FP32 dims: [ 5 ] }}
]
dynamic_batching {{ }}
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
version_policy: {{ specific: {{ versions: [ 1 ] }} }}
parameters: {{ key: "repo" value: {{ string_value: "{{repo}}" }} }}
parameters: {{ key: "catalog_model" value: {{ string_value: "{CATALOG_MODEL}" }} }}
"""


# ---- PyTriton's tritonserver ----------------------------------------------------------------------


@dataclass(frozen=True)
class TritonInstall:
    """Where PyTriton's files are in its virtualenv."""

    venv_python: Path

    @property
    def venv(self) -> Path:
        return self.venv_python.parent.parent

    @property
    def site_packages(self) -> Path:
        found = sorted(self.venv.glob("lib/python3.*/site-packages/pytriton"))
        if not found:
            raise FileNotFoundError(f"no pytriton package in {self.venv}")
        return found[-1].parent

    @property
    def dist(self) -> Path:
        return self.site_packages / "pytriton" / "tritonserver"

    @property
    def binary(self) -> Path:
        return self.dist / "bin" / "tritonserver"

    @property
    def libs(self) -> Path:
        return self.site_packages / "nvidia_pytriton.libs"

    def stub(self, python_version: str = "3.13") -> Path:
        return self.dist / "python_backend_stubs" / python_version / "triton_python_backend_stub"

    def server_env(self) -> dict[str, str]:
        """What PyTriton's ``TritonServer._get_env`` adds: its bundled libraries, the virtualenv's bin first."""
        library_path = os.environ.get("LD_LIBRARY_PATH")
        return {
            "LD_LIBRARY_PATH": f"{library_path}:{self.libs}" if library_path else str(self.libs),
            "PATH": f"{self.venv / 'bin'}:{os.environ.get('PATH', '')}",
        }


def make_backends(install: TritonInstall, directory: Path) -> Path:
    """A ``--backend-directory``: PyTriton's Python backend with its Python 3.13 stub copied in, as
    PyTriton's ``Triton._prepare_triton_inference_server`` lays it out."""
    python_backend = directory / "python"
    shutil.copytree(install.dist / "backends" / "python", python_backend, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(install.stub(), python_backend / "triton_python_backend_stub")
    return directory


def make_repository(directory: Path, weights_file: Path) -> Path:
    """``directory/classifier``: config.pbtxt (version 1 served), versions 1 and 2 with the model and
    the same weights, version 3 with a truncated weights file."""
    model_dir = directory / MODEL_NAME
    for version in (1, 2, 3):
        version_dir = model_dir / str(version)
        version_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(MODEL_FILE, version_dir / "model.py")
        if version == swap_load.CORRUPT_VERSION:
            data = weights_file.read_bytes()
            (version_dir / "model.pt").write_bytes(data[: len(data) // 2])
        else:
            shutil.copy2(weights_file, version_dir / "model.pt")
    (model_dir / "config.pbtxt").write_text(CONFIG_PBTXT.replace("{repo}", str(REPO)))
    return directory


@dataclass
class TritonProcess:
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def command(self, install: TritonInstall, repository: Path, backends: Path, caches: Path) -> list[str]:
        return [
            str(install.binary),
            f"--model-repository={repository}",
            "--model-control-mode=explicit",
            f"--load-model={MODEL_NAME}",
            f"--backend-directory={backends}",
            f"--cache-directory={caches}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
            "--log-verbose=0",
        ]


@contextlib.contextmanager
def running_triton(install: TritonInstall, workdir: Path, log_path: Path) -> Iterator[TritonProcess]:
    """tritonserver serving ``classifier`` version 1, ready; stopped with its stub processes afterwards
    (``benchmarks.frontend.running``: its own process group, SIGTERM, then SIGKILL to the group)."""
    from benchmarks.frontend import Request, Target, running

    server = TritonProcess()
    repository = workdir / "repository"
    backends = make_backends(install, workdir / "backends")
    caches = install.dist / "caches"
    target = Target(
        name="tritonserver",
        port=server.http_port,
        command=server.command(install, repository, backends, caches),
        ready_path=f"/v2/models/{MODEL_NAME}/ready",
        request=Request("", b"", {}),
        env=install.server_env(),
    )
    logger.info("Starting: %s", " ".join(target.command))
    with running(target, server.url, log_path):
        yield server


# ---- the target -----------------------------------------------------------------------------------


class TritonSwapTarget:
    """Triton's KServe v2 infer route, and its repository API through tritonclient's asyncio client:
    HTTP (``load_protocol="http"``, the procedure) or gRPC (``ModelRepositoryService/RepositoryModelLoad``
    on ``grpc_port``; its status codes are told as the HTTP statuses Triton's HTTP front end gives them)."""

    def __init__(self, url: str, model_config: dict, load_protocol: str = "http", grpc_port: int | None = None) -> None:
        if load_protocol not in LOAD_PROTOCOLS or (load_protocol == "grpc" and grpc_port is None):
            raise ValueError(f"load_protocol must be one of {LOAD_PROTOCOLS} (grpc needs grpc_port)")
        self.url = url
        self.model_config = model_config  # the served config: each load sends it whole, version policy changed
        self.load_protocol = load_protocol
        self.grpc_port = grpc_port
        self._client = None
        self._client_module()
        importlib.import_module("tritonclient.utils")

    @property
    def infer_url(self) -> str:
        return f"{self.url}/v2/models/{MODEL_NAME}/infer"

    def encode(self, image: bytes) -> tuple[bytes, dict[str, str]]:
        return oip_images(image, input_name=INPUT_NAME, output_names=OUTPUT_NAMES, shape=(1, 1), binary_outputs=False)

    def version_of(self, response: httpx.Response) -> str | None:
        return swap_load.oip_model_version(response)

    def load_config(self, version: int) -> str:
        return json.dumps({**self.model_config, "version_policy": {"specific": {"versions": [version]}}})

    def _client_module(self) -> ModuleType:
        """tritonclient's asyncio module for the load protocol. Imported when the target is made, outside
        the event loop: a first import inside it would hold the 32 clients for a few hundred ms."""
        return importlib.import_module(f"tritonclient.{self.load_protocol}.aio")

    def _make_client(self) -> object:
        module = self._client_module()
        if self.load_protocol == "grpc":
            return module.InferenceServerClient(f"127.0.0.1:{self.grpc_port}")
        return module.InferenceServerClient(self.url.removeprefix("http://"), conn_timeout=LOAD_CALL_TIMEOUT_S)

    async def _load_model(self, config: str) -> tuple[int | None, str]:
        from tritonclient.utils import InferenceServerException

        if self._client is None:  # made in the running event loop (aiohttp and grpc.aio bind to it)
            self._client = self._make_client()
        try:
            await self._client.load_model(MODEL_NAME, config=config)
        except InferenceServerException as exc:
            status = str(exc.status() or "")
            if status.isdigit():
                return int(status), exc.message() or str(exc)
            code = status.removeprefix("StatusCode.")
            return GRPC_TO_HTTP.get(code), f"[{code}] {exc.message() or exc}"
        return 200, ""

    async def load(self, version: int) -> tuple[int | None, str]:
        return await self._load_model(self.load_config(version))

    async def load_corrupt(self) -> tuple[int | None, str]:
        return await self.load(swap_load.CORRUPT_VERSION)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


def probe_config_override(url: str) -> dict:
    """A load whose config holds only ``version_policy`` (version 1, the one served): what Triton says,
    and which version serves afterwards."""

    async def call() -> tuple[int | None, str]:
        target = TritonSwapTarget(url, {})
        try:
            return await target._load_model(swap_load.version_policy_config(1))
        finally:
            await target.close()

    status, text = asyncio.run(call())
    index = httpx.post(f"{url}/v2/repository/index", json={}, timeout=30.0).json()
    return {"config": swap_load.version_policy_config(1), "status": status, "error": text, "index_after": index}


def probe_requests_during_loads(target: TritonSwapTarget, image: bytes, served: int) -> list[dict]:
    """``swap_load.requests_during_loads`` with Triton's versioned infer route; closes the load client."""

    async def probe() -> list[dict]:
        try:
            return await swap_load.requests_during_loads(
                target, image, served, lambda v: f"{target.url}/v2/models/{MODEL_NAME}/versions/{v}/infer"
            )
        finally:
            await target.close()

    return asyncio.run(probe())


def check_first_answer(target: TritonSwapTarget, image: bytes) -> None:
    body, headers = target.encode(image)
    response = httpx.post(target.infer_url, content=body, headers=headers, timeout=120.0)
    if response.status_code != 200 or target.version_of(response) != "1":
        raise RuntimeError(f"the first answer: {response.status_code} {response.text[:500]}")


async def _swap(target: TritonSwapTarget, images: Sequence[bytes], plan: swap_load.SwapPlan) -> swap_load.SwapRun:
    try:
        return await swap_load.run_swap_async(target, images, plan)
    finally:
        await target.close()


# ---- the run --------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    """Everything, into one record; a Triton that cannot start is a record with ``error``."""
    from benchmarks.peers.triton_env import ensure_venv
    from benchmarks.peers.triton_peer import write_weights_file

    plan = swap_load.QUICK_PLAN if args.quick else swap_load.SwapPlan()
    out_dir = results_dir(args.output_dir)
    stem = RESULT_STEM if args.load_protocol == "http" else f"{RESULT_STEM}-{args.load_protocol}"
    log_path = out_dir / f"{stem}-server.log"
    flags = (" --quick" if args.quick else "") + (
        f" --load-protocol {args.load_protocol}" if args.load_protocol != "http" else ""
    )
    record: dict = {
        "benchmark": "triton_swap",
        "server": "NVIDIA Triton (tritonserver from nvidia-pytriton 0.7), Python backend",
        "command": f"python -m benchmarks.triton_swap{flags}",
        "machine": machine_record(),
        "setup": {
            "model": f"{CATALOG_MODEL}, eager fp32, Pillow + torchvision preprocessing (benchmarks.peers.triton_model)",
            "max_batch_size": MAX_BATCH,
            "instances": 1,
            "dynamic_batching": "max_queue_delay_microseconds 0 (Triton's default)",
            "corrupt_version": "3 (model.pt truncated to half: initialize raises)",
            "load_call": f"tritonclient.{args.load_protocol}.aio load_model(name, config=<whole model config, "
            "version_policy specific [V]>)",
            "request": f"KServe v2 binary, input {INPUT_NAME} BYTES [1, 1], outputs {', '.join(OUTPUT_NAMES)} JSON",
        },
    }
    with tempfile.TemporaryDirectory(prefix="triton-swap-") as tmp_name:
        tmp = Path(tmp_name)
        try:
            install = TritonInstall(ensure_venv(model=True))
            weights = write_weights_file(CATALOG_MODEL, "imagenet", tmp / "weights.pt")
            make_repository(tmp / "repository", weights)
            images = swap_load.benchmark_images(args.images, tmp / "images")
            with running_triton(install, tmp, log_path) as server:
                record["triton"] = httpx.get(f"{server.url}/v2", timeout=10.0).json()
                model_config = httpx.get(f"{server.url}/v2/models/{MODEL_NAME}/config", timeout=10.0).json()
                target = TritonSwapTarget(server.url, model_config, args.load_protocol, server.grpc_port)
                check_first_answer(target, images[0])
                record["config_override_probe"] = probe_config_override(server.url)
                check_first_answer(target, images[0])
                result = asyncio.run(_swap(target, images, plan))
                served = int(swap_load.summarize(result)["per_load"][-1]["expected_after"]) if result.loads else 1
                record["requests_during_loads_probe"] = probe_requests_during_loads(target, images[0], served)
        except Exception as exc:  # the reason Triton could not run is the result
            logger.exception("Triton could not run")
            record["error"] = f"{type(exc).__name__}: {exc}"
            record["traceback"] = traceback.format_exc()
            (out_dir / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
            return record
    record.update(result.to_dict())
    (out_dir / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    title = (
        f"Triton {record['triton'].get('version', '')}: swaps under load, {plan.concurrency} connections, "
        f"loads over {args.load_protocol.upper()}"
    )
    swap_load.plot(result, title, out_dir / f"{stem}.png")
    logger.info("wrote %s", out_dir / f"{stem}.json")
    return record


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 swap cycle and shorter steady periods")
    parser.add_argument(
        "--load-protocol",
        choices=LOAD_PROTOCOLS,
        default="http",
        help="how the load calls go: HTTP (the procedure) or gRPC (results as triton-swap-grpc.*)",
    )
    parser.add_argument("--images", type=Path, help="a folder of images (default: service.tune.images' photos)")
    parser.add_argument("--output-dir", type=Path, help="results folder (default: benchmarks/results/<machine>-<date>)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    record = run(args)
    if "error" in record:
        print(f"Triton could not run: {record['error']}")
        return 1
    print(swap_load.format_summary(record["summary"]))
    return 0 if record["summary"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
