"""What one engine holds by itself: its weights (the artifact's engine file) and its workspace (what a
batch of the largest size adds to the process at its peak), measured in a fresh process.

    python -m benchmarks.harness.engine_footprint ARTIFACT_DIR      # prints one JSON object

The yardstick for "a model costs its engine": issue 62 asks that an added model cost at most 1.5x
its weights + workspace. Measured on the CPU: the process's RSS after importing torch, after
loading the engine, and its peak (``ru_maxrss``) over two batches of the artifact's largest batch
size, so workspace = peak - loaded. A separate process so that nothing the caller loaded counts.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

MIB = 2**20


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def measure(artifact: Path) -> dict:
    import torch

    from compile import read_manifest
    from service.testing import load_artifact

    torch.set_num_threads(1)  # as a worker on a shared CPU; the workspace barely depends on it
    base = rss_bytes()
    manifest = read_manifest(artifact)
    model = load_artifact(artifact, torch.device("cpu"))
    loaded = rss_bytes()
    batch = manifest.batch_max or 8
    height, width = manifest.preprocess.input_size
    images = torch.zeros(batch, 3, height, width)
    with torch.inference_mode():
        for _ in range(2):
            model(images)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    weights = (artifact / manifest.engine_file).stat().st_size
    return {
        "artifact": str(artifact),
        "engine": manifest.engine_name,
        "batch": batch,
        "weights_mib": weights / MIB,
        "loaded_mib": (loaded - base) / MIB,
        "workspace_mib": max(0, peak - loaded) / MIB,
        "process_base_mib": base / MIB,
    }


def engine_footprint(artifact: Path) -> dict:
    """:func:`measure` in a fresh interpreter (this module's CLI)."""
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.harness.engine_footprint", str(artifact)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path, help="a compile-trt artifact folder")
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.artifact)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
