"""Every device backend on every geometry a ``PreprocessSpec`` describes, against the Pillow path.

A grid of specs (each resize mode, crops non-square, larger than the resize or none, padding, both
crop roundings, antialiasing off, BGR without normalization, nearest) times a batch of images (the
sample photos, one photo under all 8 EXIF orientations, a very wide one, a tiny one, a PNG that goes
to Pillow), for ``torch`` and ``dali`` on the CPU (and on a GPU, with ``cvcuda``, where there is
one), compared with ``pil`` at the tolerances of tests/unit/test_preprocessing_backends.py. Also the
Triton DALI graph, which computes the same plans in DALI arithmetic, and the host side of the
cvcuda backend (cvcuda cannot load without a GPU: torch ops stand in for its two operators there).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from compile.sample_photos import sample_photo_file
from compile.settings_errors import SettingsError
from preprocessing import PreprocessSpec, create_preprocessor
from preprocessing.base import Preprocessor, value_affine
from preprocessing.geometry import CropPlan, orient, plan_crop, stored_plan
from preprocessing.probe import probe_image
from tests.conftest import encode, sample_array
from tests.unit.test_preprocessing_backends import ONE_LEVEL, RESNET, STORED_AS, tolerance

MEAN, STD = RESNET.mean, RESNET.std


def box_spec(mode: str, height: int, width: int, crop_size: int = 0, **fields: object) -> PreprocessSpec:
    return PreprocessSpec(0, crop_size, MEAN, STD, resize_mode=mode, resize_height=height, resize_width=width, **fields)


SPECS = {
    "exact-no-crop": box_spec("exact", 200, 260),
    # (243 - 224) / 2 = 9.5: floor 9, round 10 (half to even), so a rounding mix-up shows.
    "exact-crop-floor": box_spec("exact", 243, 250, crop_size=224, crop_rounding="floor"),
    "cover-non-square-crop": box_spec("cover", 240, 300, crop_height=224, crop_width=280),
    # timm's "border" mode: bicubic, padded with round(255 * mean).
    "contain-pad-fill": box_spec("contain", 224, 224, crop_size=224, pad_fill=(124, 116, 104), interpolation="bicubic"),
    "shorter-crop-past-resize": PreprocessSpec(200, 224, MEAN, STD),  # pads 0 around, as transformers does
    "no-antialias-bilinear": dataclasses.replace(RESNET, antialias=False),
    "no-antialias-bicubic": PreprocessSpec(232, 224, MEAN, STD, interpolation="bicubic", antialias=False),
    # MobileViT's processor: BGR, 0..255 values; the crop is wider than a portrait's resize: padded
    # with a colour whose channels differ, so a fill put in the wrong channel order shows.
    "bgr-values": box_spec(
        "cover",
        230,
        230,
        crop_height=200,
        crop_width=240,
        pad_fill=(200, 30, 90),
        channel_order="BGR",
        normalize=False,
        rescale_factor=1.0,
    ),
    "nearest-exact": box_spec("exact", 200, 260, interpolation="nearest"),
    # transformers' nearest (F.interpolate's nearest-exact, no antialias): MobileNetV1's processor.
    "nearest-no-antialias": PreprocessSpec(200, 180, MEAN, STD, interpolation="nearest", antialias=False),
    # BGR with per-channel mean and std: they are the model's channels', i.e. after the flip.
    "bgr-normalized": dataclasses.replace(RESNET, channel_order="BGR", mean=(0.406, 0.456, 0.485)),
}
# Measured with DALI 2.4: its plain (not antialiased) cubic is Catmull-Rom (a = -0.5), not the a = -0.75
# of F.interpolate that the spec means; the dali backend refuses that spec rather than approximate it.
DALI_REFUSES = ("no-antialias-bicubic",)

# DALI's antialiasing filter handles the image border unlike Pillow's (which drops the taps past the
# image and renormalizes the rest; torch does the same): the output rows and columns at a border the
# window shares with the image differ by up to 10 uint8 levels (measured: the astronaut shrunk 2.6x),
# everything inside them stays within the ordinary tolerance. Only where the window touches the image
# border while shrinking: exact resizes, contain, the short side of cover, a crop past the resize.
DALI_EDGE_WIDTH = {"bilinear": 1, "bicubic": 2}
DALI_EDGE_LEVELS = 12

# 450x281, an odd margin every way: a window mapped to the wrong side of a rotated photo shows.
UPRIGHT = Image.fromarray(sample_array("chelsea")[:281, :450])


def tagged(orientation: int) -> bytes:
    """``UPRIGHT`` stored as a camera stores it under EXIF ``orientation`` (1: as it is)."""
    if orientation == 1:
        return encode(UPRIGHT, quality=92)
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(UPRIGHT.transpose(STORED_AS[orientation]), quality=92, exif=exif)


@functools.cache
def batch_images() -> tuple[tuple[str, bytes], ...]:
    photos = [(name, sample_photo_file(name)) for name in ("chelsea", "coffee", "astronaut", "rocket")]
    portrait = np.ascontiguousarray(sample_array("coffee")[:, 150:400])  # 250x400
    oriented = [(f"orientation-{k}", tagged(k)) for k in range(1, 9)]
    wide = np.ascontiguousarray(np.tile(sample_array("coffee")[140:260], (1, 2, 1))[:, :900])  # 900x120
    tiny = np.ascontiguousarray(sample_array("rocket")[200:205, 300:307])  # 7x5
    png = encode(sample_array("astronaut")[100:400, 50:450], "PNG")  # decoded by Pillow on every backend
    return (
        *photos,
        ("portrait", encode(portrait, quality=92)),
        *oriented,
        ("wide", encode(wide, quality=92)),
        ("tiny", encode(tiny, quality=95)),
        ("png", png),
    )


@functools.cache
def backend(name: str, device: str, spec_name: str) -> Preprocessor:
    return create_preprocessor(name, SPECS[spec_name], device, max_batch_size=32)


@functools.cache
def pillow_reference(spec_name: str) -> torch.Tensor:
    batch = backend("pil", "cpu", spec_name)([data for _, data in batch_images()])
    assert all(error is None for error in batch.errors)
    return batch.images


def displayed_size(data: bytes) -> tuple[int, int]:
    probe = probe_image(data)
    return probe.width, probe.height


def uint8_level(spec: PreprocessSpec) -> float:
    """What one uint8 level of the input is worth in the model input (the largest over channels)."""
    scale, _ = value_affine(spec)
    return max(abs(s) for s in scale)


def edge_frame(plan: CropPlan, width: int) -> torch.Tensor:
    """H x W mask of the model input's rows and columns (``width`` deep) at the image borders that
    ``plan``'s window shares with the resized image."""
    out_width, out_height = plan.output_size
    mask = torch.zeros(out_height, out_width, dtype=torch.bool)
    x, y = plan.inner_offset
    inner_width, inner_height = plan.inner_size
    left, top, right, bottom = plan.inner
    if left == 0:
        mask[y : y + inner_height, x : x + width] = True
    if top == 0:
        mask[y : y + width, x : x + inner_width] = True
    if right == plan.resized[0]:
        mask[y : y + inner_height, x + inner_width - width : x + inner_width] = True
    if bottom == plan.resized[1]:
        mask[y + inner_height - width : y + inner_height, x : x + inner_width] = True
    return mask


def assert_rows_close(got: torch.Tensor, reference: torch.Tensor, name: str, device: str, spec_name: str) -> None:
    """Each row within the parity tolerances (scaled to this spec's values), one row at a time so a
    failure names the image."""
    spec = SPECS[spec_name]
    scale = uint8_level(spec) / ONE_LEVEL  # the parity tolerances are stated for ImageNet's std
    limits = {key: value * scale for key, value in tolerance(device, spec).items()}
    edge = name == "dali" and spec.antialias and spec.interpolation != "nearest"
    for row, (label, data) in enumerate(batch_images()):
        diff = (got[row].cpu() - reference[row].cpu()).abs().amax(dim=0)
        if edge and label != "png":
            frame = edge_frame(plan_crop(*displayed_size(data), spec), DALI_EDGE_WIDTH[spec.interpolation])
            edge_max = diff[frame].max().item() if frame.any() else 0.0
            assert edge_max <= DALI_EDGE_LEVELS * uint8_level(spec), f"{label}: border max {edge_max:.4f}"
            diff = diff[~frame]
        assert diff.max().item() <= limits["max"], f"{label}: max abs diff {diff.max().item():.4f}"
        assert diff.mean().item() <= limits["mean"], f"{label}: mean abs diff {diff.mean().item():.4f}"


def expected_on_device(spec: PreprocessSpec) -> int:
    """How many of the batch's images the device decoder takes: JPEGs, but not a long strip (whose
    resize would exceed MAX_RESIZED_AREA_FACTOR x resize_target**2: Pillow resamples only its crop)."""
    from preprocessing import _defaults

    count = 0
    for _, data in batch_images():
        if not probe_image(data).decodes_on_device:
            continue
        width, height = plan_crop(*displayed_size(data), spec).resized
        count += width * height <= _defaults.MAX_RESIZED_AREA_FACTOR * spec.resize_target**2
    return count


GRID_BACKENDS = [
    pytest.param("torch", "cpu", id="torch-cpu"),
    pytest.param("dali", "cpu", id="dali-cpu"),
    *(pytest.param(name, "cuda", id=f"{name}-cuda", marks=pytest.mark.gpu) for name in ("torch", "dali", "cvcuda")),
]


@pytest.mark.parametrize(("name", "device"), GRID_BACKENDS)
@pytest.mark.parametrize("spec_name", SPECS)
def test_every_geometry_matches_pil(name: str, device: str, spec_name: str) -> None:
    spec = SPECS[spec_name]
    if name == "dali" and spec_name in DALI_REFUSES:
        pytest.skip("refused by the dali backend: test_dali_refuses_what_it_cannot_reproduce")
    images = [data for _, data in batch_images()]
    preprocessor = backend(name, device, spec_name)
    before = dataclasses.replace(preprocessor.counts)
    batch = preprocessor(images)
    assert all(error is None for error in batch.errors)
    assert batch.images.shape == (len(images), 3, *spec.input_size)
    assert batch.images.dtype == torch.float32 and batch.images.device.type == device
    assert_rows_close(batch.images, pillow_reference(spec_name), name, device, spec_name)
    # The device answered every JPEG it was meant to: a device failure falls back to Pillow, which gets
    # it right too, so parity alone would not see a backend that fails on a geometry.
    after = preprocessor.counts
    on_device = expected_on_device(spec)
    assert 0 < on_device < len(images)
    assert after.device - before.device == on_device
    # ... nor one that fails the whole batch (split and retried, each image then succeeding alone).
    assert (after.device_failed, after.split_retries) == (before.device_failed, before.split_retries)
    assert preprocessor([]).images.shape == (0, 3, *spec.input_size)


def test_dali_refuses_what_it_cannot_reproduce() -> None:
    for spec_name in DALI_REFUSES:
        with pytest.raises(ValueError, match=r"PreprocessSpec\.antialias=false with interpolation 'bicubic'.*torch"):
            create_preprocessor("dali", SPECS[spec_name], "cpu")


# Sizes with every rounding case: offsets that round half to even both ways, portrait and landscape,
# square, crop-sized, strips both ways, a tiny one, cover/contain sides that round .5.
PLAN_SIZES = [(640, 480), (480, 640), (500, 375), (333, 500), (512, 512), (224, 224), (1000, 747), (301, 227),
              (7, 5), (900, 120), (3, 400), (341, 343), (451, 300), (450, 281)]  # fmt: skip


def test_the_padding_step_is_in_every_graph_that_can_pad() -> None:
    from preprocessing.dali_backend import may_pad

    for spec_name, spec in SPECS.items():
        pads = [plan_crop(width, height, spec).pads for width, height in PLAN_SIZES]
        assert may_pad(spec) == any(pads), spec_name  # no step spent where nothing pads


def run_triton_graph(spec: PreprocessSpec, images: list[bytes], outputs) -> list:
    """The Triton DALI graph's ``outputs(encoded, spec)`` nodes for ``images``, run on the CPU."""
    from nvidia.dali import fn, pipeline_def, types

    from preprocessing.dali_triton import TRITON_DALI_INPUT

    @pipeline_def(batch_size=len(images), num_threads=1, device_id=None)
    def graph():
        encoded = fn.external_source(name=TRITON_DALI_INPUT, dtype=types.UINT8, ndim=1)
        return tuple(outputs(encoded, spec))

    pipe = graph()
    pipe.build()
    pipe.feed_input(TRITON_DALI_INPUT, [np.frombuffer(data, dtype=np.uint8) for data in images])
    return pipe.run()


@pytest.mark.parametrize("spec_name", SPECS)
def test_the_triton_dali_graph_plans_every_geometry_like_the_host(spec_name: str) -> None:
    pytest.importorskip("nvidia.dali")
    from preprocessing.dali_triton import plan_nodes

    spec = SPECS[spec_name]
    images = [encode(Image.new("RGB", size, (90, 120, 30))) for size in PLAN_SIZES]
    starts, ends, sizes, pad_starts = run_triton_graph(spec, images, plan_nodes)
    for i, (width, height) in enumerate(PLAN_SIZES):
        plan = plan_crop(width, height, spec)
        left, top, right, bottom = plan.source_box
        inner_width, inner_height = plan.inner_size
        x, y = plan.inner_offset
        label = f"{width}x{height}"
        np.testing.assert_allclose(np.array(starts[i]), [top, left], rtol=1e-6, atol=1e-4, err_msg=label)
        np.testing.assert_allclose(np.array(ends[i]), [bottom, right], rtol=1e-6, atol=1e-4, err_msg=label)
        assert np.array(sizes[i]).tolist() == [inner_height, inner_width], label
        assert np.array(pad_starts[i]).tolist() == [-y, -x], label


# One of each graph the served backend and Triton's share: no crop, a rounding, a non-square window,
# padding (bicubic), BGR values (the plans themselves are checked for every spec above).
TRITON_SPECS = ["exact-no-crop", "exact-crop-floor", "cover-non-square-crop", "contain-pad-fill", "bgr-normalized"]


@pytest.mark.parametrize("spec_name", TRITON_SPECS)
def test_the_triton_dali_graph_matches_the_served_dali_backend(spec_name: str) -> None:
    """The whole graph (decode, plan, resample, pad, values), on photos of every shape: the served
    dali backend's pixels (same resampling, plans from the host)."""
    pytest.importorskip("nvidia.dali")
    from preprocessing.dali_triton import TRITON_DALI_INPUT, build_triton_pipeline

    spec = SPECS[spec_name]
    labels = ("chelsea", "coffee", "tiny", "orientation-6", "orientation-1")
    images = [data for label, data in batch_images() if label in labels]
    pipe = build_triton_pipeline(spec, len(images), 1, None)  # what compile-trt serializes
    pipe.build()
    pipe.feed_input(TRITON_DALI_INPUT, [np.frombuffer(data, dtype=np.uint8) for data in images])
    (outputs,) = pipe.run()
    got = torch.stack([torch.from_numpy(np.array(outputs[i])) for i in range(len(images))])
    served = create_preprocessor("dali", spec, "cpu", max_batch_size=8)(images).images
    assert got.shape == served.shape == (len(images), 3, *spec.input_size)
    # One level at most, at a few pixels: the graph resamples the sideways photo upright (DALI's decoder
    # turns it), the served backend as stored; each rounds its two resampling passes in its own order.
    diff = (got - served).abs()
    assert diff.max().item() <= uint8_level(spec) + 1e-4 and diff.mean().item() < 1e-3 * uint8_level(spec)


def test_the_triton_graph_builds_for_a_non_square_spec_and_refuses_what_dali_cannot() -> None:
    pytest.importorskip("nvidia.dali")
    from preprocessing.dali_triton import build_triton_pipeline

    pipe = build_triton_pipeline(SPECS["cover-non-square-crop"], 4, 1, None)
    assert pipe.serialize()  # what compile-trt writes into model.dali
    with pytest.raises(ValueError, match=r"PreprocessSpec\.antialias=false"):
        build_triton_pipeline(SPECS["no-antialias-bicubic"], 4, 1, None)


def test_compile_trt_triton_repository_refuses_a_spec_dali_cannot_reproduce(tmp_path: Path) -> None:
    pytest.importorskip("nvidia.dali")
    from compile.build import check_triton_export

    check_triton_export("onnx", (1, 8, 32), tmp_path / "repo", "m", SPECS["contain-pad-fill"])
    with pytest.raises(SettingsError) as refused:
        check_triton_export("onnx", (1, 8, 32), tmp_path / "repo", "m", SPECS["no-antialias-bicubic"])
    message = str(refused.value)
    assert refused.value.flag == "--triton-repository" and "\n" not in message
    assert "PreprocessSpec.antialias=false" in message and "interpolation 'bicubic'" in message


# The cvcuda backend's host side, with torch ops standing in for cvcuda (which cannot load here):
# hq_resize -> F.interpolate of the stored image to the stored plan's size, crop_flip_normalize_reformat
# -> its rect cut with a constant border and (pixel - base) * scale.


def cvcuda_stand_in(data: bytes, spec: PreprocessSpec) -> tuple[torch.Tensor, CropPlan]:
    """One image through cvcuda's host-side geometry and values, with torch as its operators."""
    from preprocessing.cvcuda_backend import rgb_affine, window_rect

    probe = probe_image(data)
    plan = plan_crop(probe.width, probe.height, spec)
    stored = stored_plan(plan, probe.orientation, probe.width, probe.height)
    pixels = torch.from_numpy(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).copy()).permute(2, 0, 1)
    width, height = stored.resized
    resized = torch.nn.functional.interpolate(
        pixels[None].float(), size=(height, width), mode=spec.interpolation, antialias=spec.antialias
    )[0].clamp(0, 255)
    x, y, rect_width, rect_height = window_rect(stored)
    canvas = torch.zeros(3, rect_height, rect_width)  # the operator's constant border (0)
    x0, y0, x1, y1 = max(x, 0), max(y, 0), min(x + rect_width, width), min(y + rect_height, height)
    canvas[:, y0 - y : y1 - y, x0 - x : x1 - x] = resized[:, y0:y1, x0:x1]
    base, scale = rgb_affine(spec)
    values = (canvas - torch.tensor(base).view(3, 1, 1)) * torch.tensor(scale).view(3, 1, 1)
    return orient(values, probe.orientation), plan


@pytest.mark.parametrize(
    "spec_name", ["cover-non-square-crop", "contain-pad-fill", "bgr-values", "bgr-normalized", "exact-no-crop"]
)
def test_the_cvcuda_host_side_matches_pil_with_torch_standing_in_for_cvcuda(spec_name: str) -> None:
    """A seam test: the per-sample rects, shape groups, channel order, values and padding that the
    cvcuda backend computes on the host, around torch stand-ins for its operators."""
    from preprocessing.base import Normalizer
    from preprocessing.cvcuda_backend import fill_padding, shape_groups

    spec = SPECS[spec_name]
    labels = [f"orientation-{k}" for k in range(1, 9)] + ["chelsea", "tiny"]
    images = [data for label, data in batch_images() if label in labels]
    rows, plans = zip(*(cvcuda_stand_in(data, spec) for data in images), strict=True)
    shapes = [tuple(row.shape[1:]) for row in rows]
    groups = shape_groups(shapes)
    assert sorted(itertools.chain(*groups.values())) == list(range(len(images)))
    assert all(shapes[p] == shape for shape, positions in groups.items() for p in positions)
    upright = torch.stack(rows)
    if spec.channel_order == "BGR":
        upright = upright.flip(1)
    fill = Normalizer(spec, torch.device("cpu")).nchw(torch.tensor(spec.pad_fill, dtype=torch.float32).view(1, 3, 1, 1))
    got = fill_padding(upright, plans, fill.view(3))
    reference = create_preprocessor("pil", spec, "cpu")(images).images
    assert got.shape == reference.shape == (len(images), 3, *spec.input_size)
    limits = {key: value * uint8_level(spec) / ONE_LEVEL for key, value in tolerance("cpu", spec).items()}
    diff = (got - reference).abs()
    assert diff.max().item() <= limits["max"] and diff.mean().item() <= limits["mean"], diff.max().item()


def test_cvcuda_shape_groups_keep_first_seen_order_without_cvcuda() -> None:
    from preprocessing.cvcuda_backend import shape_groups

    assert shape_groups([(224, 280), (280, 224), (224, 280), (280, 224), (224, 280)]) == {
        (224, 280): [0, 2, 4],
        (280, 224): [1, 3],
    }
