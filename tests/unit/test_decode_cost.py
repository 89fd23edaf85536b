"""Decode cost bounded from the bytes (preprocessing/decode_cost.py): hostile files refused before any
decoder, every ordinary encoding accepted; and the HTTP process's header check stays fast on them."""

from __future__ import annotations

import io
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from preprocessing.decode_cost import check_decode_cost
from preprocessing.errors import ImageDecodeError
from preprocessing.pil_backend import PilPreprocessor
from preprocessing.probe import check_image_header, check_jpeg_data, open_image, probe_image
from preprocessing.spec import PreprocessSpec
from tests.conftest import encode, sample_array

PHOTOS = ("chelsea", "coffee", "astronaut", "rocket")
SPEC = PreprocessSpec(256, 224, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


def refusal(data: bytes) -> str:
    with pytest.raises(ImageDecodeError) as caught:
        check_image_header(data)
    assert caught.value.error.status_code == 400
    return caught.value.error.detail


def with_frame_size(jpeg: bytes, width: int, height: int) -> bytes:
    """The same JPEG with only the size in its SOF0/SOF2 header changed."""
    for marker in (b"\xff\xc0", b"\xff\xc2"):
        at = jpeg.find(marker)
        if at > 0:
            return jpeg[: at + 5] + struct.pack(">HH", height, width) + jpeg[at + 9 :]
    raise AssertionError("no SOF0/SOF2 marker")


def ordinary_jpegs() -> list[tuple[str, bytes]]:
    cases = []
    flat = np.full((480, 640, 3), 128, np.uint8)
    for name, pixels in [*[(p, sample_array(p)) for p in PHOTOS], ("flat", flat)]:
        for quality in (1, 75, 100):
            for progressive in (False, True):
                for subsampling in (0, 2):
                    data = encode(
                        pixels, quality=quality, progressive=progressive, subsampling=subsampling, optimize=True
                    )
                    cases.append((f"{name} q{quality} prog={progressive} sub={subsampling}", data))
    cases.append(("1x1", encode(np.zeros((1, 1, 3), np.uint8))))
    cases.append(("1x5000 flat", encode(np.zeros((5000, 1, 3), np.uint8), quality=1, optimize=True)))
    cases.append(("gray", encode(Image.fromarray(sample_array("chelsea")).convert("L"), progressive=True)))
    cases.append(("cmyk", encode(Image.fromarray(sample_array("coffee")).convert("CMYK"))))
    return cases


@pytest.mark.parametrize(("name", "data"), ordinary_jpegs(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_ordinary_jpeg_encoding_is_accepted(name: str, data: bytes) -> None:
    check_decode_cost(data)
    check_jpeg_data(data)  # the strict pass too: q1 and flat images are thin enough to take it
    open_image(data).load()


@pytest.mark.parametrize("progressive", [False, True])
@pytest.mark.parametrize(("width", "height"), [(1, 65_000), (451, 1200), (1000, 1000)])
def test_a_frame_larger_than_its_data_is_refused_by_the_strict_pass(width: int, height: int, progressive: bool) -> None:
    """Frames whose blocks the data could hold by length (the header check lets them through), but does
    not code: refused in the workers, by the Pillow backend and by every device backend's probe."""
    photo = encode(sample_array("chelsea"), quality=75, progressive=progressive)
    forged = with_frame_size(photo, width, height)
    check_image_header(forged)  # the HTTP process's cheap check cannot tell
    for check in (check_jpeg_data, probe_image, PilPreprocessor(SPEC).decode):
        with pytest.raises(ImageDecodeError) as caught:
            check(forged)
        assert caught.value.error.status_code == 400
        assert f"{width}x{height}" in caught.value.error.detail and "ends before" in caught.value.error.detail


def test_the_strict_pass_leaves_other_libjpeg_warnings_to_pillow() -> None:
    """Junk bytes between the scan and the end marker (sloppy encoders write them) make libjpeg warn
    "extraneous bytes": not this check's business, and Pillow decodes such files."""
    flat = encode(np.full((64, 64, 3), 200, np.uint8), quality=50)
    sloppy = flat[:-2] + b"\x00\x00junk" + flat[-2:]
    check_jpeg_data(sloppy)
    open_image(sloppy).load()


def test_a_mildly_forged_frame_passes_when_its_data_is_not_thin() -> None:
    """The documented limit of the strict pass: it runs below 32 bits a block only, so a photo that
    claims a few more rows than it codes (bits a block stay photo-like) decodes with gray rows."""
    photo = encode(sample_array("chelsea"), quality=95)
    check_jpeg_data(with_frame_size(photo, 451, 340))


@pytest.mark.parametrize("progressive", [False, True])
def test_a_jpeg_whose_frame_claims_more_pixels_than_its_data_holds_is_refused(progressive: bool) -> None:
    photo = encode(sample_array("chelsea"), quality=90, progressive=progressive)
    detail = refusal(with_frame_size(photo, 9000, 9000))
    assert "9000x9000" in detail and "scan data" in detail
    check_image_header(photo)  # the photo itself passes


def test_a_progressive_jpeg_with_thousands_of_scans_is_refused_fast() -> None:
    photo = encode(sample_array("coffee"), quality=75, progressive=True)
    last_scan = photo.rindex(b"\xff\xda")
    scan = photo[last_scan:-2]  # the last scan, its header and data, without the end marker
    bomb = photo[:-2] + scan * 1500 + b"\xff\xd9"
    started = time.perf_counter()
    detail = refusal(bomb)
    assert time.perf_counter() - started < 0.5  # header walking, not decoding (which takes seconds)
    assert "more than 100 scans" in detail


def png_chunk(kind: bytes, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def test_a_png_of_many_empty_chunks_is_refused_and_an_animated_png_is_not() -> None:
    png = encode(np.zeros((64, 64, 3), np.uint8), "PNG")
    header_end = png.index(b"IDAT") - 4
    bomb = png[:header_end] + png_chunk(b"tEXt", b"") * 20_000 + png[header_end:]
    assert "chunks" in refusal(bomb)
    frames = [Image.new("RGB", (8, 8), (i % 256, 0, 0)) for i in range(2000)]
    animated = io.BytesIO()
    frames[0].save(animated, "PNG", save_all=True, append_images=frames[1:])
    check_image_header(animated.getvalue())


def test_a_tiff_cut_into_thousands_of_strips_is_refused_and_ordinary_tiffs_are_not() -> None:
    bomb = io.BytesIO()
    Image.new("RGB", (1, 10_000), (10, 20, 30)).save(bomb, "TIFF", tiffinfo={278: 1})  # one row per strip
    assert "10,000 strips or tiles" in refusal(bomb.getvalue())
    for kwargs in ({}, {"compression": "tiff_deflate"}, {"tiffinfo": {278: 16}}):
        check_image_header(encode(sample_array("astronaut"), "TIFF", **kwargs))


def test_a_gif_with_millions_of_extension_blocks_is_refused_and_an_animated_gif_is_not() -> None:
    gif = encode(Image.new("P", (16, 16), 1), "GIF")
    image_start = gif.index(b"\x2c")
    bomb = gif[:image_start] + b"\x21\xfe\x01x\x00" * 200_000 + gif[image_start:]  # 1 MB of comments
    assert "extension blocks" in refusal(bomb)
    animated = io.BytesIO()
    frames = [Image.new("P", (64, 64), i) for i in range(5)]
    frames[0].save(animated, "GIF", save_all=True, append_images=frames[1:], comment=b"hello" * 100, loop=0)
    check_image_header(animated.getvalue())
