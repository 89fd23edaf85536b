"""How far each preprocessing backend's output is from Pillow's (the reference), on real photos.

    python -m benchmarks.preprocess_parity --device cuda
    python -m benchmarks.preprocess_parity --device cpu --output /tmp/parity

For every backend usable on the device and every interpolation, the maximum and mean absolute
difference of the normalized tensors (what the model sees), also in uint8 levels (one level is
1 / (255 * min(std)) in normalized units). The tests' tolerances come from these numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import logging
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from benchmarks.harness.common import machine_record, results_dir, write_results
from benchmarks.harness.suite import markdown_table
from compile import SAMPLE_PHOTO_JPEG_QUALITY, get_model_entry, sample_photo
from preprocessing import PreprocessSpec, backend_problem, create_preprocessor

logger = logging.getLogger(__name__)

DEVICE_BACKENDS = ("dali", "cvcuda", "torch")
RESNET = get_model_entry("resnet152").preprocess
SPECS = {
    "bilinear (resnet152)": RESNET,
    "bilinear (efficientnet-lite0)": get_model_entry("efficientnet-lite0").preprocess,
    "bicubic": dataclasses.replace(RESNET, resize_size=232, interpolation="bicubic"),
    "nearest": dataclasses.replace(RESNET, resize_size=232, interpolation="nearest"),
}


def photos() -> dict[str, bytes]:
    """scikit-image's sample photos as JPEGs (quality 92) in the shapes the tests use."""
    arrays = {
        "landscape": sample_photo("chelsea"),
        "square": sample_photo("astronaut"),
        "portrait": sample_photo("coffee")[:, :220],
        "small": sample_photo("rocket")[:90, :120],
    }
    encoded = {}
    for name, array in arrays.items():
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(array)).save(buffer, format="JPEG", quality=SAMPLE_PHOTO_JPEG_QUALITY)
        encoded[name] = buffer.getvalue()
    return encoded


def one_level(spec: PreprocessSpec) -> float:
    return 1.0 / (255.0 * min(spec.std))


def measure(device: torch.device, backends: list[str]) -> dict[str, dict[str, dict[str, float]]]:
    """``{backend: {spec label: {max, mean, max_levels, mean_levels}}}`` against Pillow on the CPU."""
    images = list(photos().values())
    found: dict[str, dict[str, dict[str, float]]] = {}
    for label, spec in SPECS.items():
        reference = create_preprocessor("pil", spec, "cpu")(images)
        for name in backends:
            batch = create_preprocessor(name, spec, device, max_batch_size=len(images))(images)
            if any(error is not None for error in batch.errors):
                raise RuntimeError(f"{name} failed on a sample photo: {batch.errors}")
            diff = (batch.images.float().cpu() - reference.images).abs()
            level = one_level(spec)
            found.setdefault(name, {})[label] = {
                "max": diff.max().item(),
                "mean": diff.mean().item(),
                "max_levels": diff.max().item() / level,
                "mean_levels": diff.mean().item() / level,
            }
    return found


def report(device: torch.device, found: dict[str, dict[str, dict[str, float]]], skipped: dict[str, str]) -> str:
    rows = [
        [name, label, f"{d['max']:.4f}", f"{d['max_levels']:.1f}", f"{d['mean']:.5f}", f"{d['mean_levels']:.2f}"]
        for name, by_spec in found.items()
        for label, d in by_spec.items()
    ]
    header = ["backend", "interpolation", "max abs", "max (levels)", "mean abs", "mean (levels)"]
    text = f"# Preprocessing parity with Pillow on {device}\n\n" + markdown_table(header, rows)
    if skipped:
        text += "\n\nNot measured: " + "; ".join(f"{name} ({why})" for name, why in skipped.items())
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--output", type=Path, default=None, help="results folder (default: benchmarks/results/...)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = torch.device(args.device)
    skipped = {name: problem for name in DEVICE_BACKENDS if (problem := backend_problem(name, device))}
    backends = [name for name in DEVICE_BACKENDS if name not in skipped]
    found = measure(device, backends)
    text = report(device, found, skipped)
    out = results_dir(args.output, device)
    record = {"machine": machine_record(device), "parity": found, "skipped": skipped}
    write_results(out, f"preprocess_parity-{device.type}", record, text, text_suffix=".md")
    print(text)


if __name__ == "__main__":
    main()
