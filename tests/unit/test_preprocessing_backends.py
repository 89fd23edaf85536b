"""Every device-decoding backend against the Pillow reference: parity, formats, EXIF, bad items.

On this CPU-only CI the ``dali`` graph runs with ``device_id=None`` (DALI's CPU operators) and the
``torch`` backend decodes with libjpeg-turbo; the same tests run on a GPU (``gpu`` marker) for
dali, cvcuda and torch, where the decoders are nvJPEG / nvImageCodec.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
from PIL import Image

from compile.catalog import get_model_entry
from compile.weights import load_model
from preprocessing import PreprocessSpec, create_preprocessor, resolve_preprocess_backend
from preprocessing.device_base import DeviceDecodePreprocessor
from preprocessing.geometry import orient, plan_crop, stored_plan
from preprocessing.probe import probe_image
from preprocessing.registry import backend_problem
from tests.conftest import CAT_LABELS, encode, sample_array

RESNET = get_model_entry("resnet152").preprocess
LITE = get_model_entry("efficientnet-lite0").preprocess
BICUBIC = PreprocessSpec(resize_size=232, crop_size=224, mean=RESNET.mean, std=RESNET.std, interpolation="bicubic")
NEAREST = dataclasses.replace(BICUBIC, interpolation="nearest")

# Stated tolerances against `pil`, in normalized units (what the model sees). One uint8 level is
# 1 / (255 * min(std)) = 0.0175 for ImageNet's std.
ONE_LEVEL = 1.0 / (255.0 * min(RESNET.std))
# On the CPU every backend decodes with libjpeg-turbo, like Pillow; only resampling differs.
# Bilinear: rounding only, at most one level anywhere (measured: 0.0175 dali, 0.0173 torch).
CPU_TOLERANCE = {"max": ONE_LEVEL + 1e-4, "mean": 0.01}
# Bicubic: torch's and DALI's antialiased cubic differ from Pillow's at sharp edges (measured max
# 0.103, 6 levels; mean 0.005).
CPU_BICUBIC_TOLERANCE = {"max": 8 * ONE_LEVEL, "mean": 0.01}
# Nearest: identical pixels, except where a sample point falls exactly between two source pixels
# and the tie goes the other way (measured: a few pixels, max 2.6, mean <= 0.008). Only the mean
# means something here.
CPU_NEAREST_TOLERANCE = {"max": float("inf"), "mean": 0.01}
# nvJPEG (torch's decode_jpeg, DALI's mixed decoder) rounds its IDCT and chroma upsampling unlike
# libjpeg-turbo: measured on an H100 (benchmarks/results/nvidia-h100-80gb-hbm3-2026-11-22), max 26
# levels (bicubic; 23.5 bilinear) and mean 0.66 levels (0.0116). nvImageCodec in the cvcuda backend
# matched libjpeg-turbo there (1 level). Nearest keeps its tie caveat: only the mean means something.
GPU_TOLERANCE = {"max": 30 * ONE_LEVEL, "mean": 0.02}
GPU_NEAREST_TOLERANCE = {"max": float("inf"), "mean": 0.02}

CPU_BACKENDS = [pytest.param("dali", "cpu", id="dali-cpu"), pytest.param("torch", "cpu", id="torch-cpu")]
GPU_BACKENDS = [
    pytest.param(name, "cuda", id=f"{name}-cuda", marks=pytest.mark.gpu) for name in ("dali", "cvcuda", "torch")
]
DEVICE_BACKENDS = CPU_BACKENDS + GPU_BACKENDS


@functools.cache
def preprocessor(name: str, device: str, spec: PreprocessSpec = RESNET, max_batch_size: int = 8):
    return create_preprocessor(name, spec, device, max_batch_size=max_batch_size)


def tolerance(device: str, spec: PreprocessSpec) -> dict[str, float]:
    if device == "cuda":
        return GPU_NEAREST_TOLERANCE if spec.interpolation == "nearest" else GPU_TOLERANCE
    return {"bicubic": CPU_BICUBIC_TOLERANCE, "nearest": CPU_NEAREST_TOLERANCE}.get(spec.interpolation, CPU_TOLERANCE)


def assert_close_to_pil(
    images: torch.Tensor, reference: torch.Tensor, device: str, spec: PreprocessSpec = RESNET
) -> None:
    diff = (images.cpu() - reference.cpu()).abs()
    limits = tolerance(device, spec)
    assert diff.max().item() <= limits["max"], f"max abs diff {diff.max().item():.4f}"
    assert diff.mean().item() <= limits["mean"], f"mean abs diff {diff.mean().item():.4f}"


def statuses(batch) -> list[int]:
    return [200 if error is None else error.status_code for error in batch.errors]


def corrupt_huffman_table(jpeg: bytes) -> bytes:
    """A JPEG whose header parses (the probe lets it through) but whose decode fails in every decoder."""
    assert jpeg.startswith(b"\xff\xd8")
    at = jpeg.index(b"\xff\xc4")  # DHT marker
    data = bytearray(jpeg)
    data[at + 5 : at + 21] = b"\xff" * 16  # code counts that no valid Huffman table has
    return bytes(data)


PHOTOS = {
    "landscape": encode(sample_array("chelsea"), quality=92),
    "square": encode(sample_array("astronaut"), quality=92),
    "portrait": encode(sample_array("coffee")[:, :220], quality=92),
    "small": encode(sample_array("rocket")[:90, :120], quality=92),
    "strip": encode(np.ascontiguousarray(sample_array("chelsea")[:40]), quality=92),  # 451x40, beyond 4:1
}


@pytest.mark.parametrize(("name", "device"), DEVICE_BACKENDS)
@pytest.mark.parametrize(
    "spec", [RESNET, LITE, BICUBIC, NEAREST], ids=["resnet152", "efficientnet-lite0", "bicubic", "nearest"]
)
def test_parity_with_pil_on_photos(name: str, device: str, spec: PreprocessSpec) -> None:
    images = list(PHOTOS.values())
    before = dataclasses.replace(preprocessor(name, device, spec).counts)
    batch = preprocessor(name, device, spec)(images)
    reference = preprocessor("pil", "cpu", spec)(images)
    assert statuses(batch) == [200] * len(images)
    assert batch.images.shape == (len(images), 3, *spec.input_size)
    assert batch.images.dtype == torch.float32 and batch.images.device.type == device
    assert_close_to_pil(batch.images, reference.images, device, spec)
    after = preprocessor(name, device, spec).counts
    # The long strip goes to Pillow, which resamples only its crop region; the rest to the device.
    assert (after.device - before.device, after.pillow - before.pillow) == (len(images) - 1, 1)


@functools.cache
def lite0() -> torch.nn.Module:
    return load_model(get_model_entry("efficientnet-lite0"), "imagenet").module.eval()


@pytest.mark.parametrize(("name", "device"), DEVICE_BACKENDS)
def test_same_top1_as_pil_with_efficientnet_lite0(name: str, device: str) -> None:
    photos = [encode(sample_array(photo), quality=90) for photo in ("chelsea", "coffee", "astronaut", "rocket")]
    with torch.inference_mode():
        expected = lite0()(preprocessor("pil", "cpu", LITE)(photos).images).argmax(dim=1)
        got = lite0()(preprocessor(name, device, LITE)(photos).images.cpu()).argmax(dim=1)
    assert got.tolist() == expected.tolist()
    labels = get_model_entry("efficientnet-lite0").labels
    assert labels[got[0]] in CAT_LABELS and labels[got[1]] == "espresso"


def transparent_png() -> bytes:
    rgba = Image.fromarray(sample_array("chelsea")).convert("RGBA")
    alpha = np.zeros(rgba.size[::-1], dtype=np.uint8)
    alpha[:, : rgba.size[0] // 2] = 255  # right half fully transparent: composited onto white
    rgba.putalpha(Image.fromarray(alpha))
    return encode(rgba, "PNG")


FORMATS = {
    "jpeg-baseline": lambda: encode(sample_array("chelsea"), quality=90),
    "jpeg-progressive": lambda: encode(sample_array("chelsea"), quality=90, progressive=True),
    "jpeg-grayscale": lambda: encode(Image.fromarray(sample_array("chelsea")).convert("L"), quality=90),
    "jpeg-cmyk": lambda: encode(Image.fromarray(sample_array("chelsea")).convert("CMYK"), quality=90),
    "png-rgb": lambda: encode(sample_array("chelsea"), "PNG"),
    "png-alpha": transparent_png,
    "png-16bit": lambda: encode(Image.fromarray(sample_array("camera")[:, :, 0].astype(np.uint16) * 257), "PNG"),
    "webp": lambda: encode(sample_array("chelsea"), "WEBP", quality=90),
    "gif": lambda: encode(Image.fromarray(sample_array("chelsea")).convert("P"), "GIF"),
    "bmp": lambda: encode(sample_array("chelsea"), "BMP"),
    "tiff": lambda: encode(sample_array("chelsea"), "TIFF"),
}
ON_DEVICE = ("jpeg-baseline", "jpeg-progressive", "jpeg-grayscale")  # the rest are decoded by Pillow


@pytest.mark.parametrize(("name", "device"), DEVICE_BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_is_served_and_matches_pil(name: str, device: str, fmt: str) -> None:
    data = FORMATS[fmt]()
    assert probe_image(data).decodes_on_device == (fmt in ON_DEVICE)
    batch = preprocessor(name, device)([data])
    assert statuses(batch) == [200]
    assert_close_to_pil(batch.images, preprocessor("pil", "cpu")([data]).images, device)


# To store an upright photo under EXIF orientation k, apply the inverse of k's display transform.
STORED_AS = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_90,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_270,
}


@pytest.mark.parametrize(("name", "device"), DEVICE_BACKENDS)
@pytest.mark.parametrize("orientation", STORED_AS)
def test_exif_orientation_matches_pil(name: str, device: str, orientation: int) -> None:
    upright = Image.fromarray(sample_array("chelsea"))  # landscape: a missed rotation changes the crop
    exif = Image.Exif()
    exif[0x0112] = orientation
    tagged = encode(upright.transpose(STORED_AS[orientation]), quality=95, exif=exif)
    upright_reference = preprocessor("pil", "cpu")([encode(upright, quality=95)]).images
    reference = preprocessor("pil", "cpu")([tagged]).images
    assert (reference - upright_reference).abs().mean().item() < 0.03  # Pillow turns it upright
    before = dataclasses.replace(preprocessor(name, device).counts)
    assert_close_to_pil(preprocessor(name, device)([tagged]).images, reference, device)
    # The device path answered: a device failure falls back to Pillow, which also gets it right, so
    # parity alone would not see a backend that cannot rotate (DALI's orientation 5, once).
    assert preprocessor(name, device).counts == dataclasses.replace(before, device=before.device + 1)


@pytest.mark.parametrize(("name", "device"), DEVICE_BACKENDS)
def test_bad_items_fail_alone_and_good_rows_are_unchanged(name: str, device: str) -> None:
    good = [PHOTOS["landscape"], PHOTOS["square"], PHOTOS["portrait"]]
    bad = {
        "huffman": corrupt_huffman_table(PHOTOS["landscape"]),  # passes the probe, fails the device batch
        "truncated": PHOTOS["square"][: len(PHOTOS["square"]) // 2],  # no end marker: routed to Pillow
        "garbage": b"not an image at all",
        "empty": b"",
    }
    batch_items = [good[0], bad["huffman"], good[1], bad["truncated"], bad["garbage"], good[2], bad["empty"]]
    backend = create_preprocessor(name, RESNET, device, max_batch_size=8)
    batch = backend(batch_items)
    reference = preprocessor("pil", "cpu")(batch_items)
    assert statuses(batch) == statuses(reference) == [200, 400, 200, 400, 415, 200, 400]
    assert [e.detail for e in batch.errors if e] == [e.detail for e in reference.errors if e]
    alone = preprocessor(name, device)(good).images
    torch.testing.assert_close(batch.images, alone, atol=1e-5, rtol=0)
    assert backend.counts.device_failed == 1  # the Huffman-corrupt one: found alone, then given to Pillow
    if name != "cvcuda":  # nvImageCodec names failed items itself; the batched decoders need splitting
        assert backend.counts.split_retries > 0

    # The decoder is still usable after the failed batch, with the same results.
    again = backend(good)
    assert statuses(again) == [200, 200, 200]
    torch.testing.assert_close(again.images, alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("name", "device"), DEVICE_BACKENDS)
def test_batches_larger_than_the_device_batch_are_chunked(name: str, device: str) -> None:
    images = list(PHOTOS.values())
    small = create_preprocessor(name, RESNET, device, max_batch_size=2)
    batch = small(images)
    torch.testing.assert_close(batch.images, preprocessor(name, device)(images).images, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("name", "device"), DEVICE_BACKENDS)
def test_all_bad_and_empty_batches(name: str, device: str) -> None:
    backend = preprocessor(name, device)
    nothing = backend([])
    assert len(nothing) == 0 and nothing.images.shape == (0, 3, 224, 224)
    broken = backend([b"", corrupt_huffman_table(PHOTOS["square"])])
    assert statuses(broken) == [400, 400] and broken.images.shape[0] == 0


def test_auto_picks_pil_on_cpu_and_the_fastest_measured_gpu_backend() -> None:
    assert resolve_preprocess_backend("auto", "cpu")[0] == "pil"
    # torch's batched nvJPEG did the most images per second and per CPU core on an H100 (2026-11-22),
    # and needs nothing beyond torch: auto picks it on every GPU (resolution only; nothing runs).
    on_gpu, reason = resolve_preprocess_backend("auto", "cuda")
    assert on_gpu == "torch" and reason.startswith("auto on cuda: first usable of torch, cvcuda, dali")


def test_explicit_backends_that_cannot_run_say_why() -> None:
    with pytest.raises(ValueError, match="cvcuda needs a CUDA device"):
        resolve_preprocess_backend("cvcuda", "cpu")
    with pytest.raises(ValueError, match="Unknown preprocessing backend 'opencv'"):
        resolve_preprocess_backend("opencv", "cpu")
    assert resolve_preprocess_backend("dali", "cpu") == ("dali", "chosen explicitly")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where CV-CUDA cannot load")
def test_cvcuda_problem_names_the_missing_driver_without_a_gpu() -> None:
    problem = backend_problem("cvcuda", "cuda")
    assert problem is not None and "vision-serve[gpu]" in problem


def test_device_backends_share_the_frame() -> None:
    for name in ("dali", "torch"):
        assert isinstance(preprocessor(name, "cpu"), DeviceDecodePreprocessor)


def with_raw_orientation(jpeg_upright: Image.Image, tag_type: int, value: bytes) -> bytes:
    """A JPEG whose EXIF orientation entry has a raw TIFF type and value (as odd cameras write)."""
    import struct

    ifd = struct.pack("<H", 1) + struct.pack("<HHI", 0x0112, tag_type, 1) + value.ljust(4, b"\0") + b"\0\0\0\0"
    tiff = b"II*\0" + struct.pack("<I", 8) + ifd
    return encode(jpeg_upright, quality=95, exif=b"Exif\0\0" + tiff)


STORED_PLAN_SPECS = {
    "square-crop": RESNET,
    "non-square-crop": PreprocessSpec(
        0,
        0,
        RESNET.mean,
        RESNET.std,
        resize_mode="cover",
        resize_height=240,
        resize_width=300,
        crop_height=224,
        crop_width=280,
    ),
    "padded": PreprocessSpec(
        0, 224, RESNET.mean, RESNET.std, resize_mode="contain", resize_height=224, resize_width=224
    ),
    "no-crop": PreprocessSpec(0, 0, RESNET.mean, RESNET.std, resize_mode="exact", resize_height=200, resize_width=260),
}


@pytest.mark.parametrize("spec_name", STORED_PLAN_SPECS)
@pytest.mark.parametrize("orientation", range(1, 9))
def test_cropping_the_stored_image_then_orienting_equals_cropping_the_displayed_one(
    orientation: int, spec_name: str
) -> None:
    """The geometry the dali and cvcuda backends use (cvcuda runs only on a GPU), checked with torch
    ops: resize the stored image to ``stored_plan``'s size, cut its window (padding past the image),
    orient the cut, and get the displayed image's resize + crop."""
    spec = STORED_PLAN_SPECS[spec_name]
    # 450x281 resizes to 371x232: an odd margin, so a crop box mapped to the wrong side shows.
    displayed = torch.from_numpy(sample_array("chelsea")[:281, :450].copy()).permute(2, 0, 1).float()
    undo = {6: 8, 8: 6}.get(orientation, orientation)  # the others are their own inverse
    stored = orient(displayed, undo)
    assert torch.equal(orient(stored, orientation), displayed)
    width, height = displayed.shape[2], displayed.shape[1]
    plan = plan_crop(width, height, spec)

    def resize(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        return torch.nn.functional.interpolate(image[None], size=size[::-1], mode="bilinear", antialias=True)[0]

    def window(image: torch.Tensor, box: tuple[int, int, int, int]) -> torch.Tensor:
        left, top, right, bottom = box
        canvas = torch.full((3, bottom - top, right - left), -1.0)  # -1: no pixel has it
        x0, y0 = max(left, 0), max(top, 0)
        x1, y1 = min(right, image.shape[2]), min(bottom, image.shape[1])
        canvas[:, y0 - top : y1 - top, x0 - left : x1 - left] = image[:, y0:y1, x0:x1]
        return canvas

    expected = window(resize(displayed, plan.resized), plan.box)
    stored_at = stored_plan(plan, orientation, width, height)
    cut = window(resize(stored, stored_at.resized), stored_at.box)
    assert cut.shape[1:] == stored_at.output_size[::-1]
    got = orient(cut, orientation)
    assert got.shape == expected.shape == (3, *spec.input_size)
    assert torch.allclose(got, expected, atol=1e-2)  # float rounding of the resampling: ~2e-3 of 255
    # The source region, mapped the same way, is where the stored image holds the window's pixels.
    left, top, right, bottom = stored_at.source_box
    region = orient(stored[:, round(top) : round(bottom), round(left) : round(right)], orientation)
    sl, st, sr, sb = (round(v) for v in plan.source_box)
    assert torch.equal(region, displayed[:, st:sb, sl:sr])


@pytest.mark.parametrize(("name", "device"), DEVICE_BACKENDS)
def test_malformed_exif_orientation_is_read_like_pillow_and_harms_no_one(name: str, device: str) -> None:
    landscape = Image.fromarray(sample_array("chelsea"))
    odd = [
        with_raw_orientation(landscape, 1, b"\x06"),  # BYTE 6: Pillow gives bytes, ignores it
        with_raw_orientation(landscape, 2, b"6\0"),  # ASCII "6": ignored
        with_raw_orientation(landscape, 3, struct_short(6)),  # SHORT 6, the normal case: rotated
    ]
    batch = [PHOTOS["square"], *odd, PHOTOS["portrait"]]
    got = preprocessor(name, device)(batch)
    reference = preprocessor("pil", "cpu")(batch)
    assert statuses(got) == statuses(reference) == [200] * len(batch)
    assert_close_to_pil(got.images, reference.images, device)


def struct_short(value: int) -> bytes:
    import struct

    return struct.pack("<H", value)


class PerItemFailingDecoder(DeviceDecodePreprocessor):
    """Reports failures per item the way nvImageCodec does (``DeviceItemsFailed``), decoding with
    the torch backend one image at a time. A stand-in for cvcuda's decoder, which cannot load here."""

    name = "per-item-fake"

    def __init__(self, spec: PreprocessSpec) -> None:
        super().__init__(spec, "cpu", max_batch_size=4)
        self._one = create_preprocessor("torch", spec, "cpu", max_batch_size=1)

    def decode_on_device(self, items):
        from preprocessing.device_base import DeviceItemsFailed

        rows, failed = [], []
        for position, item in enumerate(items):
            try:
                rows.append(self._one.decode_on_device([item]))
            except RuntimeError:
                failed.append(position)
        if failed:
            raise DeviceItemsFailed(failed)
        return torch.cat(rows)


def test_decoders_that_report_failures_per_item_keep_the_good_rows_in_order() -> None:
    bad = corrupt_huffman_table(PHOTOS["landscape"])
    images = [bad, PHOTOS["landscape"], PHOTOS["square"], bad, PHOTOS["portrait"], PHOTOS["small"], bad]
    fake = PerItemFailingDecoder(RESNET)
    got = fake(images)
    reference = preprocessor("pil", "cpu")(images)
    assert statuses(got) == statuses(reference) == [400, 200, 200, 400, 200, 200, 400]
    assert fake.counts.device_failed == 3 and fake.counts.split_retries == 0  # no splitting needed
    assert_close_to_pil(got.images, reference.images, "cpu")


def test_very_large_images_go_to_pillow(monkeypatch: pytest.MonkeyPatch) -> None:
    from preprocessing import _defaults

    monkeypatch.setattr(_defaults, "DEVICE_MAX_IMAGE_PIXELS", 300 * 300)  # chelsea is 451x300
    backend = create_preprocessor("dali", RESNET, "cpu", max_batch_size=4)
    batch = backend([PHOTOS["landscape"], PHOTOS["small"]])
    assert statuses(batch) == [200, 200]
    assert (backend.counts.device, backend.counts.pillow) == (1, 1)


class FailingDecoder(DeviceDecodePreprocessor):
    """A device decoder whose every call fails, as every call does after a sticky CUDA error."""

    name = "always-failing"

    def decode_on_device(self, items):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_failure_that_broke_the_device_is_raised_not_blamed_on_the_images_injected(monkeypatch) -> None:
    """The device's state is injected (a CPU cannot break a CUDA context): broken, the failure is the
    worker's to handle (service/worker/loop.py exits it), with no split retries and no Pillow fallback,
    whose upload to that device would fail too. Healthy, the same error is the images'."""
    from preprocessing import device_base
    from preprocessing.device_base import DecodeCounts
    from preprocessing.device_health import DeviceUnusable

    images = [PHOTOS["landscape"], PHOTOS["square"], PHOTOS["portrait"]]
    decoder = FailingDecoder(RESNET, "cpu", max_batch_size=4)
    monkeypatch.setattr(device_base, "unusable_device", lambda device: "cuda:0: CUDA error: an illegal memory access")
    with pytest.raises(DeviceUnusable, match="illegal memory access"):
        decoder(images)
    assert decoder.counts == DecodeCounts()
    monkeypatch.setattr(device_base, "unusable_device", lambda device: None)
    assert statuses(decoder(images)) == [200, 200, 200]
    assert (decoder.counts.device_failed, decoder.counts.split_retries) == (3, 4)


def test_unusable_device_is_none_on_a_cpu_and_reports_a_cuda_context_that_fails_injected(monkeypatch) -> None:
    from preprocessing.device_health import unusable_device

    assert unusable_device("cpu") is None

    def sticky(device=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be ...")

    monkeypatch.setattr(torch.cuda, "synchronize", sticky)  # the CUDA boundary: no GPU here
    assert unusable_device("cuda:1") == "cuda:1: CUDA error: an illegal memory access was encountered"
