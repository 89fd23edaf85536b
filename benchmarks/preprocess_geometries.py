"""What each preprocessing geometry costs per image in the Pillow path, next to torchvision's
shorter-side resize + center crop (the geometry every model had before issue 61).

    python -m benchmarks.preprocess_geometries
    python -m benchmarks.preprocess_geometries --repeats 9 --batch 32 --sizes imagenet,12mp

Each geometry is one published model family's eval transform (bilinear, so that only the geometry
differs; a bicubic baseline row shows what the filter alone costs), all ending in a 224x224 input so
that they do the same work after the resize (a non-square 224x256 input is timed too, reported per
image and per output pixel): ViT's exact resize, DeiT's exact resize + crop (transformers' floor
offsets), timm's ``center`` with a box (``cover``), timm's ``border`` (``contain`` + padding),
MobileViT's BGR without normalization, and a plain (not antialiased) resize. The inputs are the
benchmark photos of ``benchmarks.preprocess_throughput`` (ImageNet-sized and 12 MP JPEGs).

Each timed call is ``PilPreprocessor(list of JPEG bytes)`` with one decode thread, so the time is
the CPU cost per image; geometries take turns within each repeat (round-robin) so that a shared
machine's drift hits all of them alike, and the report gives the median ms per image and the ratio
to the baseline from the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.harness.common import machine_record, results_dir, write_results
from preprocessing import PilPreprocessor, PreprocessSpec
from service.tune.images import photo_jpegs

SIZES = {"imagenet": (500, 375), "12mp": (4000, 3000)}  # width x height
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
HALF = (0.5, 0.5, 0.5)
BASELINE = "shorter-256-crop-224"


def geometries() -> dict[str, PreprocessSpec]:
    """Name -> spec; the baseline first."""
    box = {"resize_size": 0, "resize_height": 256, "resize_width": 256}
    return {
        BASELINE: PreprocessSpec(256, 224, IMAGENET_MEAN, IMAGENET_STD),
        "exact-224 (ViT)": PreprocessSpec(0, 0, HALF, HALF, resize_mode="exact", resize_height=224, resize_width=224),
        "exact-256-crop-224-floor (DeiT)": PreprocessSpec(
            crop_size=224, mean=IMAGENET_MEAN, std=IMAGENET_STD, resize_mode="exact", crop_rounding="floor", **box
        ),
        "cover-256-crop-224 (timm center)": PreprocessSpec(
            crop_size=224, mean=IMAGENET_MEAN, std=IMAGENET_STD, resize_mode="cover", **box
        ),
        "contain-256-crop-224-pad (timm border)": PreprocessSpec(
            crop_size=224, mean=IMAGENET_MEAN, std=IMAGENET_STD, resize_mode="contain", pad_fill=(124, 116, 104),
            **box,
        ),
        "shorter-256-crop-224-bgr-raw (MobileViT)": PreprocessSpec(
            256, 224, (0.0,) * 3, (1.0,) * 3, normalize=False, channel_order="BGR", crop_rounding="floor"
        ),
        "shorter-256-crop-224-bicubic": PreprocessSpec(256, 224, IMAGENET_MEAN, IMAGENET_STD, "bicubic"),
        "shorter-256-crop-224-no-antialias": PreprocessSpec(256, 224, IMAGENET_MEAN, IMAGENET_STD, antialias=False),
        "cover-256x292-crop-224x256 (non-square)": PreprocessSpec(
            0, 0, IMAGENET_MEAN, IMAGENET_STD, resize_mode="cover", resize_height=256, resize_width=292,
            crop_height=224, crop_width=256,
        ),
    }  # fmt: skip


def run(sizes: list[str], batch: int, repeats: int) -> tuple[dict, str]:
    specs = geometries()
    rows: dict[str, dict[str, dict[str, float]]] = {}
    for size in sizes:
        width, height = SIZES[size]
        photos = photo_jpegs(width, height) + photo_jpegs(height, width)  # landscape and portrait
        images = [photos[i % len(photos)] for i in range(batch)]
        preprocessors = {name: PilPreprocessor(spec, "cpu", num_threads=1) for name, spec in specs.items()}
        for preprocessor in preprocessors.values():  # warm-up: imports, the allocator, the Normalizer
            preprocessor(images[:2])
        times: dict[str, list[float]] = {name: [] for name in specs}
        for _ in range(repeats):
            for name, preprocessor in preprocessors.items():
                started = time.perf_counter()
                prepared = preprocessor(images)
                times[name].append((time.perf_counter() - started) / batch)
                assert all(error is None for error in prepared.errors), prepared.errors
        base = statistics.median(times[BASELINE])
        rows[size] = {}
        for name, spec in specs.items():
            median = statistics.median(times[name])
            out_height, out_width = spec.input_size
            rows[size][name] = {
                "ms_per_image": round(median * 1e3, 3),
                "ratio_to_baseline": round(median / base, 3),
                "ratio_per_output_pixel": round(median / base * 224 * 224 / (out_height * out_width), 3),
                "spec": spec.describe(),
            }
    lines = [f"Pillow path, 1 decode thread, batch {batch}, median of {repeats} round-robin repeats", ""]
    for size, by_name in rows.items():
        lines.append(f"{size} JPEGs ({'x'.join(map(str, SIZES[size]))} and portrait)")
        lines.append(f"  {'geometry':44s} {'ms/image':>9s} {'vs base':>8s} {'per px':>7s}")
        for name, row in by_name.items():
            lines.append(
                f"  {name:44s} {row['ms_per_image']:9.2f} {row['ratio_to_baseline']:8.3f} "
                f"{row['ratio_per_output_pixel']:7.3f}"
            )
        lines.append("")
    record = {"machine": machine_record(), "batch": batch, "repeats": repeats, "results": rows}
    return record, "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="imagenet,12mp", help="comma-separated: imagenet, 12mp")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown --sizes {unknown}; choose from {list(SIZES)}")
    record, text = run(sizes, args.batch, args.repeats)
    print(text)
    write_results(results_dir() / "preprocess-geometries", "preprocess_geometries", record, text)


if __name__ == "__main__":
    main()
