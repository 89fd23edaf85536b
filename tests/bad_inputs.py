"""A corpus of bad image bodies and the 4xx status each must get, shared by tests and the soak script.

Every item is built in memory (Pillow, numpy, zlib, struct), deterministically, so a failure names
bytes anyone can rebuild. ``statuses`` were measured against ``probe_image`` and the ``pil`` and
``dali`` (CPU) backends, not guessed; ``tests/unit/test_bad_inputs_decode.py`` keeps them honest. No
pytest here: the soaks and the GPU answers check of ``benchmarks/`` (run from a checkout, as the tests
are) import this module to throw the same bodies at a running server.

``content_type`` is what a careless or hostile client would plausibly send with the body. The
statuses are the decoder's verdict on the bytes; a server that refuses the content type itself
(415 for ``text/plain``) lands on the same code for those items.
"""

from __future__ import annotations

import functools
import io
import struct
import zlib
from dataclasses import dataclass

import numpy as np
from PIL import Image

from compile.sample_photos import sample_photo_file

# Larger than the servers' 100 MP limit (preprocessing._defaults.MAX_IMAGE_PIXELS) yet a valid file.
BIG_VALID_JPEG_SIDE = 12_000
_SEED = 20240607  # any fixed value: the "random" items must be the same bytes on every run


@dataclass(frozen=True)
class BadInput:
    """One body a correct server must refuse, and the 4xx codes it may refuse it with."""

    name: str
    body: bytes
    content_type: str
    statuses: frozenset[int]
    why: str


def _encode(img: Image.Image, fmt: str, **save_kwargs: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save_kwargs)
    return buf.getvalue()


def _small_photo() -> Image.Image:
    return Image.open(io.BytesIO(sample_photo_file("chelsea"))).convert("RGB").resize((64, 48))


def _random_bytes(n: int) -> bytes:
    return np.random.default_rng(_SEED).integers(0, 256, n, dtype=np.uint8).tobytes()


def _jpeg_until_scan_data(jpeg: bytes) -> bytes:
    """SOI and every header segment up to and including the start-of-scan header: no entropy data."""
    at = jpeg.index(b"\xff\xda")  # SOS; the tables before it never contain this byte pair
    (length,) = struct.unpack(">H", jpeg[at + 2 : at + 4])
    return jpeg[: at + 2 + length]


def _jpeg_with_broken_huffman_table(jpeg: bytes) -> bytes:
    """All 16 DHT code-length counts set to 255: Pillow's header parser skips DHT, libjpeg refuses it.

    So the probe passes (and routes it to the device decoder), and the pixel decode fails everywhere.
    """
    at = jpeg.index(b"\xff\xc4")  # DHT: marker (2), length (2), class/id (1), 16 counts
    data = bytearray(jpeg)
    data[at + 5 : at + 21] = b"\xff" * 16
    return bytes(data)


def _jpeg_with_frame_size(jpeg: bytes, width: int, height: int) -> bytes:
    """The photo with its SOF0 header claiming another size (the scan data stays the photo's)."""
    at = jpeg.index(b"\xff\xc0")  # SOF0: marker (2), length (2), precision (1), height (2), width (2)
    data = bytearray(jpeg)
    data[at + 5 : at + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def _png(width: int, height: int, idat: bytes) -> bytes:
    """An 8-bit RGB PNG with a correct IHDR (and CRCs everywhere) around the given IDAT payload."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def _gif(width: int, height: int, lzw_data: bytes) -> bytes:
    """A GIF89a with a 4-colour palette, one full-frame image, and ``lzw_data`` as its coded pixels."""
    screen = struct.pack("<HHBBB", width, height, 0x81, 0, 0)  # global palette of 2**(1+1) colours
    palette = b"\x00\x00\x00\xff\xff\xff\x80\x80\x80\x10\x10\x10"
    descriptor = b"\x2c" + struct.pack("<HHHHB", 0, 0, width, height, 0)
    blocks = b"".join(bytes([len(lzw_data[i : i + 255])]) + lzw_data[i : i + 255] for i in range(0, len(lzw_data), 255))
    return b"GIF89a" + screen + palette + descriptor + b"\x02" + blocks + b"\x00" + b"\x3b"


def _bmp_header(width: int, height: int, pixel_bytes: bytes) -> bytes:
    """A 24-bit BITMAPINFOHEADER BMP claiming ``width x height`` followed by only ``pixel_bytes``."""
    file_header = b"BM" + struct.pack("<IHHI", 54 + len(pixel_bytes), 0, 0, 54)
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, len(pixel_bytes), 2835, 2835, 0, 0)
    return file_header + info + pixel_bytes


def _xor_range(data: bytes, start: int, stop: int) -> bytes:
    return data[:start] + bytes(b ^ 0x5A for b in data[start:stop]) + data[stop:]


@functools.cache
def big_valid_jpeg() -> bytes:
    """A valid, flat grey 12000x12000 JPEG (144 MP), which must be refused by its header alone.

    Flat grey with optimized Huffman tables costs about 2 bits per 8x8 block: 563 KB, made in
    about 0.4 s (measured), hence the cache.
    """
    side = BIG_VALID_JPEG_SIDE
    return _encode(Image.new("L", (side, side), 128), "JPEG", quality=75, optimize=True)


def _progressive_jpeg_with_scans(scans: int) -> bytes:
    """A small progressive photo whose last scan is repeated until it has ``scans`` scans: each one
    makes the decoder sweep the whole image again."""
    photo = _encode(_small_photo(), "JPEG", progressive=True)
    last = photo.rindex(b"\xff\xda")
    repeats = scans - photo.count(b"\xff\xda")
    return photo[:-2] + photo[last:-2] * repeats + b"\xff\xd9"


def _png_with_empty_chunks(png: bytes, count: int) -> bytes:
    """Empty private chunks before the image data: Pillow's opener walks each one in Python."""
    at = png.index(b"IDAT") - 4
    return png[:at] + _png_chunk(b"prVt", b"") * count + png[at:]


def _tiff_with_one_row_per_strip(height: int) -> bytes:
    return _encode(Image.new("RGB", (1, height), (90, 60, 30)), "TIFF", tiffinfo={278: 1})


def _gif_with_comment_blocks(count: int) -> bytes:
    gif = _encode(Image.new("P", (16, 16), 1), "GIF")
    at = gif.index(b"\x2c")  # the image descriptor
    return gif[:at] + b"\x21\xfe\x01x\x00" * count + gif[at:]


@functools.cache
def bad_inputs() -> list[BadInput]:
    """The corpus, built once per process. Treat the list as read-only: it is shared."""
    photo = sample_photo_file("chelsea")  # a real photo, 451x300
    small = _small_photo()
    png = _encode(small, "PNG")
    webp = _encode(small, "WEBP", quality=80)
    header = 30  # RIFF (12) + VP8 chunk header (8) + frame tag and start code (10): the rest is coded data
    items = [
        BadInput("empty", b"", "image/jpeg", frozenset({400}), "no bytes at all"),
        BadInput(
            "jpeg_frame_claims_9000x9000",
            _jpeg_with_frame_size(photo, 9000, 9000),
            "image/jpeg",
            frozenset({400}),
            "the photo with only its frame size changed: under the pixel limit, but its scan data cannot "
            "hold 81 MP (libjpeg would fill the rest with gray and Pillow report nothing)",
        ),
        BadInput(
            "jpeg_frame_claims_1x65000",
            _jpeg_with_frame_size(photo, 1, 65_000),
            "image/jpeg",
            frozenset({400}),
            "the photo with its frame size changed to one long strip: its data is long enough for the blocks "
            "claimed, but codes only a sixth of them (libjpeg would fill the rest with gray)",
        ),
        BadInput(
            "jpeg_progressive_1500_scans",
            _progressive_jpeg_with_scans(1500),
            "image/jpeg",
            frozenset({400}),
            "a progressive photo with 1,500 scans: each one a sweep of the whole image",
        ),
        BadInput(
            "png_20000_empty_chunks",
            _png_with_empty_chunks(png, 20_000),
            "image/png",
            frozenset({400}),
            "240 KB of empty chunks before the image data, each walked in Python by Pillow's opener",
        ),
        BadInput(
            "tiff_10000_strips",
            _tiff_with_one_row_per_strip(10_000),
            "image/tiff",
            frozenset({400}),
            "a 1x10000 TIFF with one row per strip: one Python object per strip when Pillow opens it",
        ),
        BadInput(
            "gif_20000_comment_blocks",
            _gif_with_comment_blocks(20_000),
            "image/gif",
            frozenset({400}),
            "100 KB of one-byte comment extensions before the image, each walked by Pillow's opener",
        ),
        BadInput(
            "jpeg_truncated",
            photo[: len(photo) // 2],
            "image/jpeg",
            frozenset({400}),
            "first half of a real photo: header parses, pixel data ends early (upload cut off)",
        ),
        BadInput(
            "jpeg_header_then_garbage",
            _jpeg_until_scan_data(photo) + _random_bytes(4096),
            "image/jpeg",
            frozenset({400}),
            "a real photo's header up to SOS, then 4 KiB of seeded random bytes and no end marker",
        ),
        BadInput(
            "jpeg_broken_huffman_table",
            _jpeg_with_broken_huffman_table(photo),
            "image/jpeg",
            frozenset({400}),
            "passes the header probe and goes to the device decoder; every decoder rejects the DHT",
        ),
        BadInput(
            "jpeg_soi_only",
            b"\xff\xd8\xff",
            "image/jpeg",
            frozenset({400}),
            "JPEG magic bytes and nothing else: sniffed as JPEG, header unparseable",
        ),
        BadInput(
            "jpeg_frame_claims_65000x65000",
            _jpeg_with_frame_size(photo, 65_000, 65_000),
            "image/jpeg",
            frozenset({413}),
            "a 38 KB photo whose SOF header claims 4.2 gigapixels (decompression bomb header)",
        ),
        BadInput(
            "jpeg_valid_12000x12000",
            big_valid_jpeg(),
            "image/jpeg",
            frozenset({413}),
            "a valid 144 MP JPEG: over the 100 MP limit, refused before any pixel is decoded",
        ),
        BadInput(
            "png_ihdr_claims_60000x60000",
            _png(60_000, 60_000, zlib.compress(b"\x00" * 16)),
            "image/png",
            frozenset({413}),
            "68-byte PNG bomb: IHDR claims 3.6 gigapixels, CRCs correct, tiny IDAT",
        ),
        BadInput(
            "png_idat_not_deflate",
            _png(64, 48, b"\x78\x9c" + b"\xff" * 64),
            "image/png",
            frozenset({400}),
            "valid signature, IHDR and CRCs; the IDAT's deflate stream has an invalid block type",
        ),
        BadInput(
            "png_ihdr_bad_crc",
            _xor_range(png, 29, 30),  # the first byte of IHDR's CRC
            "image/png",
            frozenset({400}),
            "a real PNG with one byte of its IHDR checksum changed",
        ),
        BadInput(
            "png_truncated",
            png[: len(png) // 2],
            "image/png",
            frozenset({400}),
            "first half of a real PNG: the IDAT stream ends early",
        ),
        BadInput(
            "gif_lzw_garbage",
            _gif(64, 48, b"\xff" * 300),
            "image/gif",
            frozenset({400}),
            "valid GIF header, palette and image descriptor; LZW codes that point past the code table",
        ),
        BadInput(
            "gif_screen_claims_65535x65535",
            _gif(65_535, 65_535, b"\xff" * 8),
            "image/gif",
            frozenset({413}),
            "GIF logical screen of 4.3 gigapixels",
        ),
        BadInput(
            "webp_corrupt_vp8",
            _xor_range(webp, header, header + 200),
            "image/webp",
            frozenset({400}),
            "a real WebP with its VP8 coded data scrambled after a valid RIFF/VP8 header",
        ),
        BadInput(
            "bmp_claims_50000x50000",
            _bmp_header(50_000, 50_000, b"\x00" * 16),
            "image/bmp",
            frozenset({413}),
            "70-byte BMP whose header claims 2.5 gigapixels",
        ),
        BadInput(
            "bmp_pixels_missing",
            _bmp_header(9_000, 9_000, b"\x00" * 16),
            "image/bmp",
            frozenset({400}),
            "BMP header claims 81 MP (under the limit) but carries 16 bytes of pixels",
        ),
        BadInput(
            "text_plain",
            b"Hello! This is not an image, just some text someone uploaded by mistake.\n",
            "text/plain",
            frozenset({415}),
            "plain text",
        ),
        BadInput(
            "html_page",
            b"<!DOCTYPE html>\n<html><head><title>404 Not Found</title></head>"
            b"<body><h1>Not Found</h1><p>The requested URL was not found.</p></body></html>\n",
            "text/html",
            frozenset({415}),
            "an HTML error page, what a client gets when it forwards a failed download",
        ),
        BadInput(
            "pdf_minimal",
            b"%PDF-1.4\n1 0 obj<</Type/Catalog/Pages 2 0 R>>endobj\n"
            b"2 0 obj<</Type/Pages/Kids[]/Count 0>>endobj\ntrailer<</Root 1 0 R>>\n%%EOF\n",
            "application/pdf",
            frozenset({415}),
            "a minimal PDF document",
        ),
        BadInput(
            "svg",
            b'<svg xmlns="http://www.w3.org/2000/svg" width="64" height="48"><rect width="64" height="48"/></svg>',
            "image/svg+xml",
            frozenset({415}),
            "a vector image: image/* content type, but not a raster format we decode",
        ),
        BadInput(
            "zeros_4k",
            bytes(4096),
            "application/octet-stream",
            frozenset({415}),
            "4 KiB of zero bytes (a sparse or never-written file)",
        ),
        BadInput(
            "random_4k",
            _random_bytes(4096),
            "application/octet-stream",
            frozenset({415}),
            "4 KiB of seeded random bytes",
        ),
    ]
    names = [item.name for item in items]
    if len(set(names)) != len(names):
        raise AssertionError(f"duplicate corpus names: {names}")
    return items
