"""Read an image's header without decoding its pixels: reject bad input early, route the rest.

Every backend calls ``probe_image`` first. It turns empty, unknown, corrupt-header and oversized
inputs into their 4xx errors before any decoder sees them, which matters most for the batched
device decoders: one bad item makes a whole DALI or nvJPEG batch fail. It also tells which items
a device decoder can take (``decodes_on_device``) and which must be decoded by Pillow.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import NamedTuple

from PIL import Image, PngImagePlugin, UnidentifiedImageError

from preprocessing import _defaults
from preprocessing.decode_cost import check_decode_cost, check_plain_jpeg_cost, check_thin_jpeg_data
from preprocessing.errors import ImageDecodeError

SUPPORTED_FORMATS_HINT = "JPEG, PNG, WebP, GIF, BMP or TIFF"
# Pillow decoders we let near untrusted bytes: the formats we promise, nothing more (no EPS, which
# would hand the bytes to Ghostscript, nor the many exotic formats Pillow also reads). MPO is how
# Pillow names the multi-picture JPEGs many phones write; its JPEG opener returns those itself.
PIL_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
JPEG_FORMATS = ("JPEG", "MPO")
_SIGNATURES = {
    b"\xff\xd8\xff": "JPEG",
    b"\x89PNG\r\n\x1a\n": "PNG",
    b"GIF87a": "GIF",
    b"GIF89a": "GIF",
    b"BM": "BMP",
    b"II*\x00": "TIFF",
    b"MM\x00*": "TIFF",
}
_EXIF_ORIENTATION_TAG = 0x0112
_ORIENTATIONS = {k: k for k in range(1, 9)}
TRANSPOSING_ORIENTATIONS = (5, 6, 7, 8)  # stored sideways: width and height swap on display
_JPEG_END_OF_IMAGE = b"\xff\xd9"
# JPEG markers a plain photo's header holds before its first scan, read by ``plain_jpeg_header``.
_SOF_MARKERS = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_JPEG_SOS, _JPEG_DQT = 0xDA, 0xDB
_PLAIN_JPEG_SEGMENTS = frozenset({0xC4, 0xCC, 0xDD, 0xFE, *range(0xE0, 0xF0)})  # DHT, DAC, DRI, COM, APPn
# APP segments Pillow reads fields of while it opens the file: (marker, prefix) -> the fewest bytes
# it reads without failing. A multi-picture index (APP2 "MPF") is parsed further: never plain.
_APP_FIELDS = {(0xE0, b"JFIF"): 7, (0xE2, b"ICC_PROFILE\x00"): 14, (0xEE, b"Adobe"): 7, (0xE2, b"MPF\x00"): None}

# Pillow inflates a PNG's compressed text chunks while it opens the file, up to 64 MB per image by
# default: a small upload could stall the HTTP process on header parsing alone. Photos carry a few
# kB of text (XMP, ICC names); more is refused as a corrupt header (400).
PngImagePlugin.MAX_TEXT_MEMORY = min(PngImagePlugin.MAX_TEXT_MEMORY, 4 * 1024 * 1024)


def sniff_format(data: bytes) -> str | None:
    """The image format that ``data`` starts like, from its magic bytes alone."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    return next((fmt for magic, fmt in _SIGNATURES.items() if data.startswith(magic)), None)


def open_image(data: bytes, max_image_pixels: int = _defaults.MAX_IMAGE_PIXELS) -> Image.Image:
    """Parse the header with Pillow (pixels stay undecoded); raises ``ImageDecodeError`` with a 4xx."""
    if not data:
        raise ImageDecodeError(400, "The image is empty (0 bytes). Send the image file's bytes.")
    check_decode_cost(data, max_image_pixels)
    if Image.MAX_IMAGE_PIXELS is not None and max_image_pixels > Image.MAX_IMAGE_PIXELS:
        # Pillow refuses outright above twice its own process-wide limit (~179 MP by default); ours
        # is the one that counts, so Pillow's must not be the lower of the two.
        Image.MAX_IMAGE_PIXELS = max_image_pixels
    try:
        with warnings.catch_warnings():
            # Our own pixel limit below replaces Pillow's DecompressionBombWarning.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=PIL_FORMATS)
    except UnidentifiedImageError:
        claimed = sniff_format(data)
        if claimed:
            raise ImageDecodeError(400, f"The {claimed} image is corrupt: its header cannot be parsed.") from None
        raise ImageDecodeError(
            415, f"The data is not an image format we can read. Send {SUPPORTED_FORMATS_HINT} bytes."
        ) from None
    except Image.DecompressionBombError:
        raise ImageDecodeError(
            413, f"The image header claims more than {max_image_pixels:,} pixels. Downscale it before sending."
        ) from None
    except Exception as exc:  # a corrupt header can raise almost anything inside Pillow's plugins
        raise ImageDecodeError(400, f"The image header is corrupt: {exc}") from None
    width, height = img.size
    if width * height > max_image_pixels:
        raise ImageDecodeError(
            413,
            f"The image is {width}x{height} = {width * height:,} pixels, more than the limit of "
            f"{max_image_pixels:,}. Downscale it before sending.",
        )
    return img


class PlainJpegHeader(NamedTuple):
    """What ``plain_jpeg_header`` read: the frame, and where the first scan's data starts."""

    width: int
    height: int
    frame_marker: int  # SOF0..SOF15: sequential, progressive, arithmetic...
    sampling: bytes  # each component's sampling factors byte (h << 4 | v)
    scan_start: int  # offset of the first byte after the first SOS header


def plain_jpeg_header(data: bytes) -> PlainJpegHeader | None:
    """The frame of a JPEG whose header is plain, or ``None``: then ask Pillow.

    Walks the marker segments up to the first scan the way Pillow's JPEG opener does, checking what
    it checks (segment bounds, 8-bit samples, 1, 3 or 4 components, whole quantization tables), but
    builds none of its tables: about 5 microseconds instead of Pillow's 50 in the HTTP process, for almost all
    photo traffic. Anything unusual (junk between segments, several frames, a multi-picture index,
    markers a photo header does not hold) returns ``None``, so the answer never differs from
    Pillow's (tests/unit/test_probe.py holds it to that on fuzzed headers).
    """
    if not data.startswith(b"\xff\xd8"):
        return None
    frame, pos, end = None, 2, len(data)
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        length = (data[pos + 2] << 8) | data[pos + 3]
        body_start, body_end = pos + 4, pos + 2 + length
        if length < 2 or body_end > end:
            return None
        if marker == _JPEG_SOS:
            return None if frame is None else PlainJpegHeader(*frame, body_end)
        if marker in _SOF_MARKERS:
            if frame is not None or length < 8:
                return None
            bits, height, width, layers = (
                data[body_start],
                (data[body_start + 1] << 8) | data[body_start + 2],
                (data[body_start + 3] << 8) | data[body_start + 4],
                data[body_start + 5],
            )
            if bits != 8 or layers not in (1, 3, 4) or length != 8 + 3 * layers or not (width and height):
                return None
            frame = (width, height, marker, data[body_start + 7 : body_end : 3])
        elif marker == _JPEG_DQT:
            table = body_start
            while table < body_end:
                table += 1 + (64 if data[table] < 16 else 128)
            if table != body_end:
                return None
        elif marker not in _PLAIN_JPEG_SEGMENTS or not _plain_app_segment(data, marker, body_start, body_end):
            return None
        pos = body_end
    return None


def _plain_app_segment(data: bytes, marker: int, start: int, end: int) -> bool:
    for (app_marker, prefix), fewest in _APP_FIELDS.items():
        if marker == app_marker and data.startswith(prefix, start, end):
            return fewest is not None and end - start >= fewest
    return True


def check_image_header(data: bytes, max_image_pixels: int = _defaults.MAX_IMAGE_PIXELS) -> None:
    """Raise ``ImageDecodeError`` (4xx) for input no backend should decode; the cheap check for the
    HTTP process (plain JPEGs without Pillow, everything else as ``probe_image``)."""
    header = plain_jpeg_header(data)
    if header is None or header.width * header.height > max_image_pixels:
        open_image(data, max_image_pixels)  # checks the decode cost too
    else:
        check_plain_jpeg_cost(
            data, header.frame_marker, header.width, header.height, header.sampling, header.scan_start
        )


def check_jpeg_data(data: bytes) -> None:
    """The worker-side JPEG check, too slow for the HTTP process: a frame larger than its scan data
    (``check_thin_jpeg_data``) is refused with 400. Call it for JPEGs only, after ``open_image``."""
    header = plain_jpeg_header(data)
    if header is not None:
        check_thin_jpeg_data(data, header.frame_marker, header.width, header.height, header.sampling, header.scan_start)


@dataclass(frozen=True)
class ImageProbe:
    """What the header says about one image."""

    format: str  # Pillow's format name: JPEG, MPO, PNG, WEBP, GIF, BMP, TIFF
    mode: str  # Pillow's mode: RGB, L, CMYK, RGBA, I;16, P, ...
    width: int  # as displayed, i.e. after the EXIF orientation
    height: int
    orientation: int  # EXIF orientation, 1 (upright) when absent; read for JPEGs only
    ends_cleanly: bool  # JPEG: ends with the end-of-image marker (a cheap truncation check)

    @property
    def decodes_on_device(self) -> bool:
        """Whether the device decoders (nvJPEG via DALI, nvImageCodec, torchvision) should take it.

        Complete 8-bit grayscale or YCbCr JPEGs: what nvJPEG and its hardware engine decode, and
        almost all photo traffic. CMYK/YCCK JPEGs (Adobe's inverted CMYK trips decoders up), and
        PNG, WebP, GIF, BMP and TIFF (decoded on the CPU by every one of those libraries anyway)
        go through Pillow, which composites alpha and scales 16-bit the same way for every backend.
        A JPEG without its end marker goes to Pillow as well, which names the truncation instead
        of failing a device batch.
        """
        return self.format in JPEG_FORMATS and self.mode in ("RGB", "L") and self.ends_cleanly


def exif_orientation(img: Image.Image) -> int:
    """The EXIF orientation Pillow's ``exif_transpose`` would apply (1 when absent or malformed).

    Same rule as ``exif_transpose`` (a dict lookup): a value equal to one of 2..8 counts (6, 6.0,
    6/1), anything else (bytes, text, 6/0) leaves the image as stored, in every backend.
    """
    try:
        # Pillow's JPEG opener has already read the APP1 (EXIF) segment: no extra parsing.
        value = img.getexif().get(_EXIF_ORIENTATION_TAG, 1)
        return _ORIENTATIONS.get(value, 1)
    except Exception:  # unhashable or corrupt EXIF: Pillow's decode path will name any real problem
        return 1


def probe_image(data: bytes, max_image_pixels: int = _defaults.MAX_IMAGE_PIXELS) -> ImageProbe:
    """Header facts of one image; raises ``ImageDecodeError`` (4xx) for input no backend should decode.

    Runs in the workers, so it may also do what is too slow for the HTTP process's header check
    (``check_jpeg_data``).
    """
    img = open_image(data, max_image_pixels)
    width, height = img.size
    orientation, ends_cleanly = 1, True
    if img.format in JPEG_FORMATS:
        check_jpeg_data(data)
        orientation = exif_orientation(img)
        # Trailing padding after the marker is common and harmless.
        ends_cleanly = data.rstrip(b"\x00\r\n ").endswith(_JPEG_END_OF_IMAGE)
    if orientation in TRANSPOSING_ORIENTATIONS:
        width, height = height, width
    return ImageProbe(img.format, img.mode, width, height, orientation, ends_cleanly)
