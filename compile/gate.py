"""The accuracy gate: a compiled engine must agree with the eager fp32 model before it is saved.

Inputs are real photos (scikit-image's samples, or a folder given with --gate-images) plus seeded
random tensors, run through the engine at the artifact's MIN, OPT and MAX batch sizes so that the
dynamic batch dimension is exercised too. Measures are relative (see _defaults.GATE_THRESHOLDS).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from compile import _defaults
from compile.catalog import ModelEntry
from compile.engine import EngineCallable, use_exact_fp32
from compile.sample_photos import sample_photo_files
from compile.settings_errors import SettingsError
from preprocessing.pil_backend import PilPreprocessor

logger = logging.getLogger(__name__)

# Bounds how long the gate takes with a big --gate-images folder.
MAX_GATE_IMAGES = 64
HIGHER_IS_BETTER = {
    "top1_agreement": True,
    "top5_overlap": True,
    "top5_agreement": True,
    "mean_prob_drop": False,
    "cosine": True,
    "max_rel_error": False,
}


@dataclass
class GateInputs:
    images: torch.Tensor  # float32 NCHW, normalized, on the CPU
    names: list[str]  # one per row: an image name, or "random-<i>"
    real_count: int


@dataclass
class GateReport:
    metrics: dict[str, float]
    thresholds: dict[str, float]
    failures: list[str]
    real_images: list[dict[str, Any]] = field(default_factory=list)  # per photo: reference vs compiled top-1
    samples: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}

    def summary(self) -> str:
        lines = []
        for name, value in self.metrics.items():
            threshold = self.thresholds.get(name)
            if threshold is None:
                lines.append(f"  {name:<22} {value:.6g}" + ("  (not gated)" if name in HIGHER_IS_BETTER else ""))
                continue
            relation = ">=" if HIGHER_IS_BETTER[name] else "<="
            verdict = "FAIL" if any(f.startswith(name) for f in self.failures) else "ok"
            lines.append(f"  {name:<22} {value:.6g}  (needs {relation} {threshold:g})  {verdict}")
        lines.extend(photo_lines(self.real_images))
        return "\n".join(lines)


# Up to this many photos the gate's report lists each; beyond, the ones whose class changed.
LISTED_PHOTOS = 8


def photo_lines(real_images: list[dict[str, Any]]) -> list[str]:
    """The report's lines on the photos: each one, or for a large set the ones whose top-1 changed."""
    changed = [item for item in real_images if item["reference"] != item["compiled"]]
    shown = real_images if len(real_images) <= LISTED_PHOTOS else changed
    lines = [f"  {item['name']:<22} eager: {item['reference']!r}  compiled: {item['compiled']!r}" for item in shown]
    if len(real_images) > LISTED_PHOTOS:
        lines.insert(0, f"  photos whose top-1 changed: {len(changed)} of {len(real_images)}")
    return lines


def gate_photos(folder: str = "", quantized: bool = False) -> list[tuple[str, bytes]]:
    """(name, encoded bytes) of the gate's real photos: ``folder``'s images, else the sample photos;
    empty if neither is available. A quantized engine's gate needs more: ``folder``'s images (up to
    MAX_EVAL_IMAGES), else the sample photos and their seeded augmentations."""
    if quantized:
        return evaluation_photos(folder)
    if folder:
        root = Path(folder).expanduser()
        if not root.is_dir():
            raise SettingsError(
                "--gate-images",
                folder,
                f"--gate-images {folder!r} is not a directory of images.",
                "Give a folder of images like the served ones, or leave it out for the sample photos.",
            )
        paths = sorted(p for p in root.iterdir() if p.suffix.lower() in _defaults.IMAGE_SUFFIXES)[:MAX_GATE_IMAGES]
        if not paths:
            raise SettingsError(
                "--gate-images",
                folder,
                f"--gate-images {folder!r} holds no images ({', '.join(_defaults.IMAGE_SUFFIXES)}).",
                "Put images like the served ones in it, or leave it out for the sample photos.",
            )
        return [(p.name, p.read_bytes()) for p in paths]
    try:
        return sample_photo_files("PNG")  # lossless: the gate compares on the photos themselves
    except ImportError:
        logger.warning(
            "scikit-image is not installed, so the accuracy gate uses random inputs only. "
            "Install vision-serve[demo] or pass --gate-images DIR for real photos."
        )
        return []


def evaluation_photos(folder: str) -> list[tuple[str, bytes]]:
    """The quantized gate's evaluation set: ``folder`` (--eval), else the augmented sample photos."""
    from compile.quantization.datasets import augmented_photos, read_image_folder

    if folder:
        return list(read_image_folder(folder, "--eval", _defaults.MAX_EVAL_IMAGES).files)
    try:
        photos = sample_photo_files("PNG")
    except ImportError:
        raise SettingsError(
            "--eval",
            None,
            "A quantized engine is gated on real photos, and the built-in sample photos need scikit-image.",
            "Pass --eval DIR (images like the served ones, not in --calibration), or install vision-serve[offline].",
        ) from None
    return augmented_photos(photos, _defaults.EVAL_AUGMENTATIONS_PER_PHOTO)


def gate_inputs(entry: ModelEntry, photos: list[tuple[str, bytes]], random_count: int, seed: int) -> GateInputs:
    """The photos preprocessed exactly as the server will, followed by seeded random tensors."""
    height, width = entry.preprocess.input_size
    parts, names = [], []
    if photos:
        prepared = PilPreprocessor(entry.preprocess, "cpu", num_threads=1)([data for _, data in photos])
        bad = [photos[i][0] for i, error in enumerate(prepared.errors) if error is not None]
        if bad:
            raise SettingsError(
                "--gate-images",
                ", ".join(bad),
                f"Gate images that do not decode: {', '.join(bad)}.",
                "Remove them from --gate-images.",
            )
        parts.append(prepared.images.float().contiguous())
        names.extend(name for name, _ in photos)
    generator = torch.Generator().manual_seed(seed)
    parts.append(torch.randn(random_count, 3, height, width, generator=generator))
    names.extend(f"random-{i}" for i in range(random_count))
    return GateInputs(torch.cat(parts), names, len(photos))


def compare_logits(compiled: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """Agreement of two [N, classes] logit matrices; ``reference`` is the eager fp32 one."""
    compiled, reference = compiled.double(), reference.double()
    k = min(5, reference.shape[1])
    top_ref, top_out = reference.topk(k, dim=1).indices, compiled.topk(k, dim=1).indices
    overlap = [len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(top_ref, top_out, strict=True)]
    scale = reference.abs().amax(dim=1).clamp_min(1e-12)
    reference_top1 = reference.argmax(1, keepdim=True)
    probability_drop = reference.softmax(1).gather(1, reference_top1) - compiled.softmax(1).gather(1, reference_top1)
    return {
        "top1_agreement": (compiled.argmax(1) == reference.argmax(1)).double().mean().item(),
        "top5_overlap": sum(overlap) / len(overlap),
        "top5_agreement": (top_out == reference_top1).any(dim=1).double().mean().item(),
        "mean_prob_drop": probability_drop.mean().item(),
        "cosine": F.cosine_similarity(compiled, reference, dim=1).min().item(),
        "max_rel_error": ((compiled - reference).abs().amax(dim=1) / scale).max().item(),
    }


def threshold_failures(metrics: dict[str, float], thresholds: dict[str, float]) -> list[str]:
    failures = []
    for name, threshold in thresholds.items():
        value = metrics[name]
        ok = value >= threshold if HIGHER_IS_BETTER[name] else value <= threshold
        if not ok:
            relation = ">=" if HIGHER_IS_BETTER[name] else "<="
            failures.append(f"{name} = {value:.6g}, needs {relation} {threshold:g}")
    return failures


def gate_batch_sizes(batch: tuple[int, int, int]) -> list[int]:
    return sorted(set(batch))


def run_gate(
    engine: EngineCallable,
    reference: torch.nn.Module,
    inputs: GateInputs,
    batch: tuple[int, int, int],
    thresholds: dict[str, float],
    device: torch.device,
    labels: tuple[str, ...],
) -> GateReport:
    """Run every input through ``engine`` at each gate batch size and compare with ``reference``."""
    count = len(inputs.names)
    images = inputs.images.to(device).contiguous(memory_format=torch.channels_last)
    use_exact_fp32("fp32", device)  # the reference is IEEE fp32 on every GPU, whatever the engine's precision
    with torch.inference_mode():
        reference_logits = torch.cat([reference(images[i : i + 8]).float() for i in range(0, count, 8)]).cpu()
    compiled_rows, reference_rows = [], []
    real_top1: dict[int, int] = {}
    for size in gate_batch_sizes(batch):
        for start in range(0, count, size):
            # Wrap around so every batch is full: the engine must accept exactly this size.
            index = torch.arange(start, start + size) % count
            with torch.inference_mode():
                logits = engine(images[index.to(device)]).float().cpu()
            compiled_rows.append(logits)
            reference_rows.append(reference_logits[index])
            for row, i in enumerate(index.tolist()):
                if i < inputs.real_count:
                    real_top1.setdefault(i, int(logits[row].argmax()))
    metrics = compare_logits(torch.cat(compiled_rows), torch.cat(reference_rows))
    real_images = [
        {
            "name": inputs.names[i],
            "reference": labels[int(reference_logits[i].argmax())],
            "compiled": labels[real_top1[i]],
        }
        for i in range(inputs.real_count)
    ]
    if inputs.real_count:
        agree = sum(item["reference"] == item["compiled"] for item in real_images)
        metrics["real_top1_agreement"] = agree / inputs.real_count
    samples = {
        "real_images": inputs.real_count,
        "random_inputs": count - inputs.real_count,
        "batch_sizes": gate_batch_sizes(batch),
        "rows_compared": sum(len(r) for r in compiled_rows),
    }
    return GateReport(metrics, dict(thresholds), threshold_failures(metrics, thresholds), real_images, samples)
