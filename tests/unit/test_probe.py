"""The HTTP process's cheap header check (preprocessing/probe.py ``plain_jpeg_header``) against Pillow.

``plain_jpeg_header`` may say "ask Pillow" (``None``) for anything; whenever it answers a size
instead, Pillow must open the same bytes without error and report that size. Checked on real
encoder output and on hypothesis-mutated headers of it.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from preprocessing.base import ImageDecodeError
from preprocessing.probe import check_image_header, open_image, plain_jpeg_header
from tests.conftest import encode, sample_array
from tests.unit.test_fuzz import fuzz_settings


def _jpegs() -> dict[str, bytes]:
    photo = Image.fromarray(sample_array("chelsea")).resize((96, 64))
    exif = Image.Exif()
    exif[0x0112] = 6
    try:  # a real ICC profile, from Pillow's own sRGB builder where it has LittleCMS
        from PIL import ImageCms

        icc_profile = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    except (ImportError, OSError):
        icc_profile = None
    jpegs = {
        "baseline": encode(photo, "JPEG", quality=90),
        "progressive": encode(photo, "JPEG", quality=90, progressive=True),
        "exif": encode(photo, "JPEG", quality=90, exif=exif),
        "gray": encode(photo.convert("L"), "JPEG"),
        "cmyk": encode(photo.convert("CMYK"), "JPEG"),
        "optimized-dpi": encode(photo, "JPEG", optimize=True, dpi=(300, 300)),
        "comment": encode(photo, "JPEG", comment=b"taken by a test"),
        "restart": encode(photo, "JPEG", restart_marker_blocks=1),
    }
    if icc_profile:
        jpegs["icc"] = encode(photo, "JPEG", icc_profile=icc_profile)
    return jpegs


JPEGS = _jpegs()


@pytest.mark.parametrize("name", sorted(JPEGS))
def test_plain_jpegs_are_read_without_pillow_and_agree_with_it(name: str) -> None:
    data = JPEGS[name]
    assert jpeg_size(data) == open_image(data).size == (96, 64)


def test_what_is_not_a_plain_jpeg_is_left_to_pillow() -> None:
    png = encode(Image.fromarray(sample_array("chelsea")), "PNG")
    jpeg = JPEGS["baseline"]
    assert jpeg_size(png) is None
    assert jpeg_size(jpeg[:200]) is None, "a header cut before its first scan"
    assert jpeg_size(jpeg[:2] + b"\xff\xe2\x00\x08MPF\x00\x00\x00" + jpeg[2:]) is None, "a multi-picture index"


def test_the_check_refuses_what_the_probe_refuses() -> None:
    jpeg = JPEGS["baseline"]
    with pytest.raises(ImageDecodeError) as refused:
        check_image_header(jpeg, max_image_pixels=96 * 64 - 1)
    assert refused.value.error.status_code == 413 and "96x64" in refused.value.error.detail
    for bad, status in ((b"", 400), (b"hello", 415), (jpeg[:20], 400)):
        with pytest.raises(ImageDecodeError) as refused:
            check_image_header(bad)
        assert refused.value.error.status_code == status
    check_image_header(jpeg, max_image_pixels=96 * 64)


@st.composite
def mutated_headers(draw: st.DrawFn) -> bytes:
    """A real JPEG with bytes of its header (before the first scan) replaced, inserted or cut."""
    data = bytearray(JPEGS[draw(st.sampled_from(sorted(JPEGS)))])
    header_end = data.find(b"\xff\xda")
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, header_end))
        kind = draw(st.sampled_from(("replace", "insert", "cut")))
        chunk = draw(st.binary(min_size=1, max_size=4))
        if kind == "replace":
            data[at : at + len(chunk)] = chunk
        elif kind == "insert":
            data[at:at] = chunk
        else:
            del data[at : at + len(chunk)]
    return bytes(data)


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    header = plain_jpeg_header(data)
    return None if header is None else (header.width, header.height)


@given(data=mutated_headers())
@fuzz_settings(400)
def test_a_size_from_the_cheap_reader_is_what_pillow_reads(data: bytes) -> None:
    size = jpeg_size(data)
    if size is not None:  # Pillow must open it (no ImageDecodeError), at that size
        assert open_image(data, max_image_pixels=size[0] * size[1]).size == size
