"""The main job, offline on a fresh machine: compile the model (compile-trt), serve the artifact
(vision-serve --artifact), classify sample images, print their top-5, stop the server.

ResNet-152 (the default model) is used when its ImageNet weights are in torchvision's cache or can
be downloaded; otherwise the demo says so and serves `efficientnet-lite0`, whose pretrained
ImageNet weights ship in a Python package. The artifact goes where compile-trt puts it by default
(artifacts/<model>-<backend>-<precision>-<device>), so a second run is a cache hit.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
import urllib.error
from collections.abc import Sequence
from pathlib import Path

from compile.catalog import get_model_entry
from compile.sample_photos import sample_photo_files
from compile.weights import torchvision_cache_file
from service.client.cli import classify_all, print_outcomes
from service.client.launcher import ServerProcess, ServerStartError

logger = logging.getLogger(__name__)

FALLBACK_MODEL = "efficientnet-lite0"


def write_sample_images(directory: Path) -> list[Path]:
    """The sample photos as JPEG files in ``directory``: the demo classifies files, as a user would."""
    paths = []
    for name, jpeg in sample_photo_files():
        path = directory / f"{name}.jpg"
        path.write_bytes(jpeg)
        paths.append(path)
    return paths


def pick_model(requested: str) -> tuple[str, str]:
    """(model, why). For `auto`: ResNet-152 if its ImageNet weights can be had, else the fallback."""
    if requested != "auto":
        return requested, "chosen with --model"
    entry = get_model_entry("resnet152")
    cache_file = torchvision_cache_file(entry)
    if cache_file.exists():
        return "resnet152", f"ImageNet weights found in torchvision's cache ({cache_file})"
    from torchvision.models import ResNet152_Weights

    print("Fetching ResNet-152 ImageNet weights into torchvision's cache ...", flush=True)
    try:
        ResNet152_Weights.DEFAULT.get_state_dict(progress=True)
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return FALLBACK_MODEL, (
            f"ResNet-152 ImageNet weights are not available here ({reason}), so the demo serves "
            f"{FALLBACK_MODEL}, a pretrained ImageNet classifier whose weights ship in a Python package"
        )
    return "resnet152", "ImageNet weights downloaded into torchvision's cache"


def compile_for_demo(model: str) -> Path | None:
    """compile-trt with its defaults, as the user would: ``--backend auto`` picks the engine for this
    machine (docs/compiling.md#which-engine; ONNX Runtime at fp32 on a CPU)."""
    from compile.backends import BackendUnavailable
    from compile.build import GateFailed, compile_artifact
    from compile.progress import Progress
    from compile.settings import CompileSettings
    from compile.torch_logging import adopt_torch_logger

    adopt_torch_logger()
    # torch's CUDA builds warn "No CUDA runtime is found" on every machine without a GPU: true, and
    # no news to someone running the demo there.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    print(f"Compiling {model} with compile-trt (seconds to a minute or two; cached afterwards) ...", flush=True)
    try:
        result = compile_artifact(CompileSettings(model=model), Progress())
    except (GateFailed, BackendUnavailable, ValueError) as exc:
        print(f"compile-trt failed ({exc}); the demo serves the eager model instead.", flush=True)
        return None
    manifest = result.manifest
    metrics = manifest.validation["metrics"]
    state = "cache hit" if result.cached else f"compiled in {manifest.compile_seconds:.0f} s"
    print(
        f"Artifact {result.directory}: {manifest.engine_name} on {manifest.device_type}, {state}; accuracy gate "
        f"vs eager fp32: top-1 agreement {metrics['top1_agreement']:.0%}, cosine {metrics['cosine']:.6f}.",
        flush=True,
    )
    return result.directory


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="auto", help="auto (ResNet-152 if its weights are available) or a name")
    parser.add_argument(
        "--engine", choices=("compiled", "eager"), default="compiled", help="serve a compile-trt artifact or eager"
    )
    parser.add_argument("images", nargs="*", type=Path, help="images to classify (default: scikit-image samples)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    model, why = pick_model(args.model)
    print(f"Model: {model} ({why}).", flush=True)
    artifact = compile_for_demo(model) if args.engine == "compiled" else None
    server_args = ["--artifact", str(artifact)] if artifact else ["--model", model]
    with tempfile.TemporaryDirectory(prefix="vision-serve-demo-") as tmp:
        images = args.images or write_sample_images(Path(tmp))
        server = ServerProcess(server_args, log_path=Path(tmp) / "server.log")
        started = time.perf_counter()
        try:
            server.start()
        except ServerStartError as exc:
            print(f"The server did not start: {exc}", file=sys.stderr)
            return 1
        try:
            print(f"vision-serve is ready at {server.url} after {time.perf_counter() - started:.1f} s.\n", flush=True)
            outcomes = asyncio.run(classify_all(images, server.url, top_k=5, concurrency=len(images), timeout=120))
            failures = print_outcomes([p.name for p in images], outcomes)
        finally:
            code = server.stop()
        print(f"Server stopped (exit code {code}).")
    return 1 if failures or code != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
