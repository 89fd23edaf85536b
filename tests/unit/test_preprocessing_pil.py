"""The Pillow backend: parity with torchvision, EXIF, colour modes, formats, JPEG draft, errors."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.v2 as T2
from PIL import Image

from compile.catalog import get_model_entry
from preprocessing import PreprocessSpec, create_preprocessor
from preprocessing.geometry import plan_crop, resized_size
from preprocessing.pil_backend import PilPreprocessor
from tests.conftest import encode, sample_array

RESNET = get_model_entry("resnet152").preprocess
LITE = get_model_entry("efficientnet-lite0").preprocess
BICUBIC = PreprocessSpec(resize_size=232, crop_size=224, mean=RESNET.mean, std=RESNET.std, interpolation="bicubic")

# Stated tolerances, in normalized units (what the model sees):
# - against torchvision's classic PIL pipeline the ops are the same, only float rounding differs;
PIL_PIPELINE_TOLERANCE = 1e-5
# - against torchvision's tensor pipeline (v2 on uint8 tensors) resizing differs by rounding, at
#   most one uint8 level: 1 / (255 * min(std)) = 0.0175 for ImageNet's std.
ONE_LEVEL = 1.0 / (255.0 * min(RESNET.std)) + 1e-6


def torchvision_reference(spec: PreprocessSpec, data: bytes) -> torch.Tensor:
    mode = T.InterpolationMode(spec.interpolation)
    pipeline = T.Compose(
        [T.Resize(spec.resize_size, interpolation=mode), T.CenterCrop(spec.crop_size), T.ToTensor(),
         T.Normalize(spec.mean, spec.std)]
    )  # fmt: skip
    return pipeline(Image.open(io.BytesIO(data)).convert("RGB"))


def run(spec: PreprocessSpec, *images: bytes, **kwargs: object):
    return PilPreprocessor(spec, use_jpeg_draft=False, **kwargs)(list(images))


@pytest.mark.parametrize("spec", [RESNET, LITE, BICUBIC], ids=["resnet152", "efficientnet-lite0", "bicubic"])
@pytest.mark.parametrize(
    "image",
    [
        sample_array("chelsea"),  # landscape 451x300
        sample_array("astronaut"),  # square 512x512
        sample_array("coffee")[:, :220],  # portrait 220x400
        sample_array("rocket")[:90, :120],  # smaller than the crop: upscaled
    ],
    ids=["landscape", "square", "portrait", "small"],
)
def test_matches_torchvision_pil_pipeline(spec: PreprocessSpec, image: np.ndarray) -> None:
    data = encode(image, quality=92)
    batch = run(spec, data)
    expected = torchvision_reference(spec, data)
    assert batch.images.shape == (1, 3, spec.crop_size, spec.crop_size)
    assert batch.images.dtype == torch.float32
    assert (batch.images[0] - expected).abs().max().item() <= PIL_PIPELINE_TOLERANCE


def test_within_one_uint8_level_of_torchvision_tensor_pipeline() -> None:
    data = encode(sample_array("chelsea"), quality=92)
    pipeline = T2.Compose(
        [T2.PILToTensor(), T2.Resize(RESNET.resize_size, antialias=True), T2.CenterCrop(RESNET.crop_size),
         T2.ToDtype(torch.float32, scale=True), T2.Normalize(RESNET.mean, RESNET.std)]
    )  # fmt: skip
    expected = pipeline(Image.open(io.BytesIO(data)).convert("RGB"))
    diff = (run(RESNET, data).images[0] - expected).abs()
    assert diff.max().item() <= ONE_LEVEL
    assert diff.mean().item() < 1e-3


def test_geometry_helpers_follow_torchvision_rounding() -> None:
    assert resized_size(451, 300, 256) == (384, 256)  # int(256 * 451 / 300) = 384
    assert resized_size(300, 451, 256) == (256, 384)
    assert plan_crop(384, 256, PreprocessSpec(256, 224, (0, 0, 0), (1, 1, 1))).box == (80, 16, 304, 240)


def test_exif_orientation_is_applied() -> None:
    upright = sample_array("chelsea")
    # Stored sideways, with EXIF Orientation=6 ("rotate 90 degrees clockwise to display"), as phones do.
    stored = Image.fromarray(upright).transpose(Image.Transpose.ROTATE_90)
    exif = Image.Exif()
    exif[0x0112] = 6
    tagged = encode(stored, quality=95, exif=exif)
    untagged_sideways = encode(stored, quality=95)

    reference = run(RESNET, encode(upright, quality=95)).images[0]
    assert (run(RESNET, tagged).images[0] - reference).abs().mean().item() < 0.03
    # Without honouring the tag the picture would be sideways: far from the reference.
    assert (run(RESNET, untagged_sideways).images[0] - reference).abs().mean().item() > 0.3


def normalized(spec: PreprocessSpec, rgb: tuple[int, int, int]) -> torch.Tensor:
    return (torch.tensor(rgb, dtype=torch.float32) / 255 - torch.tensor(spec.mean)) / torch.tensor(spec.std)


def pixel(batch, y: int = 112, x: int = 112) -> torch.Tensor:
    return batch.images[0, :, y, x]


@pytest.mark.parametrize("mode", ["L", "P", "CMYK", "1", "LA", "RGBA", "I;16", "I", "F", "YCbCr"])
def test_every_mode_becomes_rgb(mode: str) -> None:
    img = Image.fromarray(sample_array("chelsea")).convert(mode if mode not in ("I;16", "I", "F") else "L")
    if mode in ("I;16", "I", "F"):
        img = img.convert(mode)
    fmt = {"CMYK": "JPEG", "YCbCr": "JPEG", "F": "TIFF", "I": "TIFF"}.get(mode, "PNG")
    batch = run(RESNET, encode(img, fmt))
    assert batch.errors == [None]
    assert batch.images.shape == (1, 3, 224, 224)
    assert torch.isfinite(batch.images).all()


def test_grayscale_gives_three_equal_channels() -> None:
    gray = Image.fromarray(sample_array("chelsea")).convert("L")
    x = run(RESNET, encode(gray, "PNG")).images[0]
    # Equal in 0..255 space: undo the per-channel normalization.
    raw = x * torch.tensor(RESNET.std).view(3, 1, 1) + torch.tensor(RESNET.mean).view(3, 1, 1)
    assert torch.allclose(raw[0], raw[1], atol=1e-6) and torch.allclose(raw[1], raw[2], atol=1e-6)


def test_transparent_pixels_become_white_background() -> None:
    rgba = np.zeros((300, 300, 4), dtype=np.uint8)  # fully transparent black
    rgba[:, :150] = (255, 0, 0, 255)  # opaque red left half
    batch = run(RESNET, encode(rgba, "PNG"))
    assert torch.allclose(pixel(batch, x=200), normalized(RESNET, (255, 255, 255)), atol=1e-5)
    assert torch.allclose(pixel(batch, x=20), normalized(RESNET, (255, 0, 0)), atol=1e-5)


def test_palette_transparency_becomes_white_background() -> None:
    img = Image.new("P", (300, 300), 0)
    img.putpalette([0, 0, 0, 0, 255, 0] + [0] * 762)
    img.paste(1, (0, 0, 150, 300))
    batch = run(RESNET, encode(img, "GIF", transparency=0))
    assert torch.allclose(pixel(batch, x=200), normalized(RESNET, (255, 255, 255)), atol=1e-5)
    assert torch.allclose(pixel(batch, x=20), normalized(RESNET, (0, 255, 0)), atol=1e-5)


def test_sixteen_bit_is_scaled_not_clipped() -> None:
    # Pillow's own I;16 -> L conversion clips: 32768 would come out as 255 (white), not mid-grey.
    grey16 = Image.fromarray(np.full((300, 300), 32768, dtype=np.uint16))
    batch = run(RESNET, encode(grey16, "PNG"))
    assert torch.allclose(pixel(batch), normalized(RESNET, (128, 128, 128)), atol=1e-5)


def test_cmyk_jpeg_colours() -> None:
    rgb = np.zeros((300, 300, 3), dtype=np.uint8)
    rgb[:] = (200, 40, 40)
    cmyk = Image.fromarray(rgb).convert("CMYK")
    batch = run(RESNET, encode(cmyk, "JPEG", quality=100))
    expected = normalized(RESNET, (200, 40, 40))
    assert (pixel(batch) - expected).abs().max().item() < 5 * ONE_LEVEL


@pytest.mark.parametrize(
    ("fmt", "kwargs", "tolerance"),
    [
        ("PNG", {}, 1e-6),
        ("BMP", {}, 1e-6),
        ("TIFF", {}, 1e-6),
        ("WEBP", {"lossless": True}, 1e-6),
        ("WEBP", {"quality": 90}, 0.08),
        ("GIF", {}, 0.25),  # 256-colour palette
        ("JPEG", {"quality": 92, "progressive": True}, 0.06),
    ],
    ids=["png", "bmp", "tiff", "webp-lossless", "webp", "gif", "progressive-jpeg"],
)
def test_formats_decode_like_the_png_reference(fmt: str, kwargs: dict, tolerance: float) -> None:
    image = sample_array("coffee")
    reference = run(RESNET, encode(image, "PNG")).images[0]
    x = run(RESNET, encode(image, fmt, **kwargs)).images[0]
    assert (x - reference).abs().mean().item() <= tolerance


def big_jpeg(megapixels: float = 12.0) -> bytes:
    img = Image.fromarray(sample_array("chelsea"))
    scale = (megapixels * 1e6 / (img.width * img.height)) ** 0.5
    return encode(img.resize((int(img.width * scale), int(img.height * scale)), Image.Resampling.BICUBIC), quality=90)


def test_jpeg_draft_changes_big_photos_only_slightly() -> None:
    """Measured on 12 MP photos: draft decode is ~6x faster; the model input moves by a mean of
    0.001-0.008 and at most ~0.2 normalized units (a few uint8 levels around sharp edges)."""
    data = big_jpeg()
    exact = PilPreprocessor(RESNET, use_jpeg_draft=False)([data]).images
    drafted = PilPreprocessor(RESNET, use_jpeg_draft=True)([data]).images
    diff = (drafted - exact).abs()
    assert diff.max().item() > 0  # the draft path really ran
    assert diff.mean().item() < 0.02
    assert diff.max().item() < 0.5


def test_jpeg_draft_is_not_used_for_images_near_the_target_size() -> None:
    data = encode(sample_array("astronaut"), quality=92)  # 512 px: under 2 x 2 x 256
    exact = PilPreprocessor(RESNET, use_jpeg_draft=False)([data]).images
    assert torch.equal(PilPreprocessor(RESNET, use_jpeg_draft=True)([data]).images, exact)


def png_claiming_size(width: int, height: int) -> bytes:
    """A PNG header that claims a huge size, with almost no data behind it."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize(
    ("payload", "status", "words"),
    [
        (b"", 400, "empty"),
        (b"hello, this is text", 415, "not an image"),
        (b"<html><body>nope</body></html>", 415, "not an image"),
        (b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n1 0 obj", 415, "not an image"),
        (png_claiming_size(11000, 10000), 413, "more than the limit of 100,000,000"),  # our own check
        (png_claiming_size(60000, 60000), 413, "Downscale it"),  # beyond Pillow's hard bomb limit too
        (encode(sample_array("coffee")[:64, :64], "PPM"), 415, "not an image"),  # Pillow reads it; we do not
        (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", 415, "not an image"),  # never to Ghostscript
        (b"\x89PNG\r\n\x1a\n", 400, "PNG image is corrupt"),
        (b"\xff\xd8\xff\xe0\x00\x10JFIF\x00garbage after a JPEG header", 400, "corrupt"),
    ],
    ids=[
        "empty",
        "text",
        "html",
        "pdf",
        "png-110mp-header",
        "png-3600mp-header",
        "ppm",
        "eps",
        "png-signature-only",
        "jpeg-header-then-garbage",
    ],
)
def test_bad_inputs_get_an_error_not_an_exception(payload: bytes, status: int, words: str) -> None:
    batch = run(RESNET, payload)
    assert batch.images.shape == (0, 3, 224, 224)
    assert batch.errors[0].status_code == status
    assert words in batch.errors[0].detail


def test_truncated_jpeg_is_a_400(truncated_jpeg: bytes) -> None:
    error = run(RESNET, truncated_jpeg).errors[0]
    assert error.status_code == 400
    assert "truncated" in error.detail


def test_bad_item_does_not_disturb_the_good_ones(
    chelsea_jpeg: bytes, coffee_jpeg: bytes, truncated_jpeg: bytes
) -> None:
    mixed = run(RESNET, chelsea_jpeg, truncated_jpeg, b"garbage", coffee_jpeg, num_threads=2)
    assert [e is None for e in mixed.errors] == [True, False, False, True]
    assert mixed.ok_indices == [0, 3]
    alone = run(RESNET, chelsea_jpeg, coffee_jpeg, num_threads=1)
    assert torch.equal(mixed.images, alone.images)


def test_output_is_channels_last_nchw(chelsea_jpeg: bytes) -> None:
    images = run(RESNET, chelsea_jpeg, chelsea_jpeg).images
    assert images.shape == (2, 3, 224, 224)
    assert images.is_contiguous(memory_format=torch.channels_last)


def test_registry_picks_pil_on_cpu_and_rejects_unknown_names() -> None:
    assert create_preprocessor("auto", RESNET, "cpu").name == "pil"
    with pytest.raises(ValueError, match="Unknown preprocessing backend 'nvjpeg'"):
        create_preprocessor("nvjpeg", RESNET, "cpu")


def test_spec_rejects_bad_values_with_a_fix() -> None:
    with pytest.raises(ValueError, match="resize_size=256, crop_size=224"):
        PreprocessSpec(resize_size=0, crop_size=224, mean=(0, 0, 0), std=(1, 1, 1))
    with pytest.raises(ValueError, match="needs a crop"):
        PreprocessSpec(resize_size=256, crop_size=0, mean=(0, 0, 0), std=(1, 1, 1))
    with pytest.raises(ValueError, match="resize_height and resize_width"):
        PreprocessSpec(0, 0, (0, 0, 0), (1, 1, 1), resize_mode="exact", resize_height=224)
    with pytest.raises(ValueError, match="disagree"):
        PreprocessSpec(256, 224, (0, 0, 0), (1, 1, 1), crop_height=200)
    with pytest.raises(ValueError, match="unknown preprocessing field"):
        PreprocessSpec.from_dict({**RESNET.to_dict(), "crop_mode": "center"})
    with pytest.raises(ValueError, match="interpolation"):
        PreprocessSpec(resize_size=256, crop_size=224, mean=(0, 0, 0), std=(1, 1, 1), interpolation="lanczos")
    assert PreprocessSpec.from_dict(RESNET.to_dict()) == RESNET


def test_long_strips_resample_only_the_crop_region() -> None:
    """A 1 x 30000 PNG is ~200 bytes; resized the plain way it would take ~6.4 GB."""
    import resource

    strip = np.tile(np.arange(256, dtype=np.uint8), 30000 // 256 + 1)[:30000].reshape(30000, 1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    batch = run(RESNET, encode(strip, "PNG"))
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert batch.errors == [None] and batch.images.shape == (1, 3, 224, 224)
    assert grown_mib < 500


def test_a_plain_resize_of_a_long_strip_computes_only_the_window() -> None:
    """Without antialiasing a strip is interpolated tap by tap over the window; the axes go in the
    order that keeps the intermediate small, whichever way the strip lies (a 1 x 50000 JPEG's rows
    first would hold 224 x 50000 floats per tap: half a gigabyte). In a fresh process, so that the
    peak memory is this test's own."""
    import subprocess
    import sys

    code = """
import io, resource, numpy as np
from PIL import Image
from preprocessing import PilPreprocessor, PreprocessSpec
line = np.tile(np.arange(256, dtype=np.uint8), 200)[:50000]
files = []
for pixels, fmt in ((line.reshape(50000, 1), "PNG"), (line.reshape(1, 50000), "JPEG")):
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert("RGB").save(buffer, fmt)
    files.append(buffer.getvalue())
spec = PreprocessSpec(256, 224, (0.5,) * 3, (0.5,) * 3, "bicubic", antialias=False)
preprocessor = PilPreprocessor(spec, num_threads=1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
batch = preprocessor(files)
assert batch.errors == [None, None] and tuple(batch.images.shape) == (2, 3, 224, 224), batch.errors
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert float(done.stdout.strip().splitlines()[-1]) < 100, done.stdout


def test_crop_region_resampling_stays_within_two_levels_of_the_exact_path() -> None:
    strip = sample_array("rocket")[:400, :60]  # 6.7:1, past the 4:1 switch
    exact = torchvision_reference(RESNET, encode(strip, "PNG"))
    assert (run(RESNET, encode(strip, "PNG")).images[0] - exact).abs().max().item() <= 2 * ONE_LEVEL


def test_multi_picture_jpeg_from_phones_uses_the_first_picture_and_draft() -> None:
    big = Image.open(io.BytesIO(big_jpeg()))
    second = Image.new("RGB", big.size, "blue")
    buf = io.BytesIO()
    big.save(buf, "MPO", save_all=True, append_images=[second], quality=90)
    mpo = buf.getvalue()
    assert Image.open(io.BytesIO(mpo)).format == "MPO"
    exact = PilPreprocessor(RESNET, use_jpeg_draft=False)([mpo])
    drafted = PilPreprocessor(RESNET, use_jpeg_draft=True)([mpo])
    assert exact.errors == [None] and drafted.errors == [None]
    reference = run(RESNET, encode(big, quality=90)).images
    assert (exact.images - reference).abs().max().item() < 1e-5  # the first picture, not the blue one
    assert 0 < (drafted.images - exact.images).abs().mean().item() < 0.02  # draft applied to MPO too
