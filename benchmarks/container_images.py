"""The images' numbers: build time and size of each, and the CPU image's first start (compile) vs second
start (cache hit) and graceful stop, measured with podman from a clean checkout.

    python -m benchmarks.container_images            # builds as they stand (layer cache, if any, used)
    python -m benchmarks.container_images --cold     # removes the images and the base first

Writes container-images.json and .md to benchmarks/results/<machine>-<date>/.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.harness.common import machine_record, results_dir, write_results
from benchmarks.harness.podman import build, clean_checkout, image_size, podman, run_container

logger = logging.getLogger(__name__)

LOCAL_BASE = "localhost/debian-python:bookworm"  # deploy/podman/image.sh makes it under this name


def remove_images() -> None:
    """The project's images and base, so that the next build starts from nothing but the registry."""
    listed = podman("images", "--format", "{{.Repository}}:{{.Tag}}").split()
    ours = [ref for ref in listed if ref.startswith(("localhost/vision-serve-", "localhost/ngc-pytorch-standin"))]
    for reference in [*ours, LOCAL_BASE]:
        podman("rmi", "--force", reference, check=False, timeout=600)
    podman("image", "prune", "--force", check=False, timeout=600)


def starts(reference: str) -> dict:
    """First start on an empty volume (compile), second start (cache hit), and `podman stop` of each."""
    run = uuid.uuid4().hex[:8]
    volume = f"vs-bench-{run}"
    podman("volume", "create", volume)
    record: dict = {}
    try:
        for which in ("first_start", "second_start"):
            container = run_container(reference, f"vs-bench-{run}-{which}", volume)
            try:
                record[f"{which}_to_ready_s"] = round(container.wait_answering("/ready", 900), 1)
                record[f"{which}_stop_s"] = round(container.stop(), 1)
                record[f"{which}_exit_code"] = container.exit_code()
            finally:
                container.remove()
    finally:
        podman("volume", "rm", "--force", volume, check=False)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cold", action="store_true", help="remove the images and the base first")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: results/<machine>-<date>)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    if args.cold:
        remove_images()
    record: dict = {"machine": machine_record(), "cold": args.cold, "images": {}}
    with tempfile.TemporaryDirectory() as folder:
        checkout = clean_checkout(Path(folder))
        for kind, command in (("cpu", ["make", "--no-print-directory", "image"]),
                              ("gpu-standin", ["bash", "deploy/podman/image.sh", "gpu"])):  # fmt: skip
            logger.info("building the %s image", kind)
            started = time.monotonic()
            built = build(command, cwd=checkout)
            record["images"][kind] = {
                "reference": built.reference,
                "build_s": round(time.monotonic() - started, 1),
                "size_bytes": image_size(built.reference),
                "steps": [line for line in built.log.splitlines() if line.startswith("image: ")],
            }
    record["images"]["cpu"].update(starts(record["images"]["cpu"]["reference"]))

    lines = [
        "# Container images (podman, 2 cores)",
        "",
        f"{'Cold' if args.cold else 'Warm'} builds from a clean checkout: `python -m benchmarks.container_images"
        f"{' --cold' if args.cold else ''}`.",
        "",
        "| image | build (s) | size (GB) |",
        "| --- | ---: | ---: |",
    ]
    for kind, image in record["images"].items():
        lines.append(f"| {kind} `{image['reference']}` | {image['build_s']} | {image['size_bytes'] / 1e9:.2f} |")
    cpu = record["images"]["cpu"]
    lines += [
        "",
        "CPU image, default model (efficientnet-lite0 on ONNX Runtime), one volume:",
        "",
        f"- first start to /ready (compile + gate + load): {cpu['first_start_to_ready_s']} s;"
        f" podman stop {cpu['first_start_stop_s']} s, exit {cpu['first_start_exit_code']}",
        f"- second start to /ready (cache hit): {cpu['second_start_to_ready_s']} s;"
        f" podman stop {cpu['second_start_stop_s']} s, exit {cpu['second_start_exit_code']}",
        "",
        "Build steps as the script logged them:",
        "",
        *[f"- {kind}: {step}" for kind, image in record["images"].items() for step in image["steps"]],
    ]
    text = "\n".join(lines)
    print(text)
    write_results(results_dir(args.out), "container-images", record, text, ".md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
