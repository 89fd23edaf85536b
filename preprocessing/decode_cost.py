"""Bound what decoding an image costs, from its bytes alone, before any decoder (or Pillow's opener)
sees them.

The pixel limit bounds the memory a decode takes, not its time: a small file can hold thousands of
progressive JPEG scans that each sweep the whole image, millions of TIFF strips or PNG chunks that
Pillow walks one by one in Python, or a JPEG frame header that claims far more pixels than its scan
data could code (libjpeg then fills the rest with gray, and Pillow reports no error). Each check
here reads headers only: microseconds for a photo, and it stops early on a hostile file.
"""

from __future__ import annotations

import re
import struct

from preprocessing import _defaults
from preprocessing.errors import ImageDecodeError

# A marker that ends entropy-coded data: not FF00 (a stuffed byte), RSTn or a fill byte.
_SCAN_END = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_SOF_MARKERS = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_PROGRESSIVE = frozenset({0xC2, 0xC6, 0xCA, 0xCE})
# The fewest bits a Huffman-coded 8x8 block takes: sequential, a DC code and an EOB of at least one
# bit each; progressive, one bit in its DC scan. Arithmetic coding (SOF9 and up) has no useful bound.
_MIN_BITS_PER_BLOCK = {0xC0: 2, 0xC1: 2, 0xC2: 1}
_JPEG_SOS, _JPEG_EOI = 0xDA, 0xD9
_NO_LENGTH = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM, RSTn
_PNG_CHUNK = struct.Struct(">I4s")


def check_decode_cost(data: bytes, max_image_pixels: int = _defaults.MAX_IMAGE_PIXELS) -> None:
    """Raise ``ImageDecodeError`` (400) for an image whose decode would cost far more than its size
    suggests, or whose JPEG frame claims more pixels than its data can hold (one that claims more
    than ``max_image_pixels`` is left to the pixel limit's 413)."""
    if data.startswith(b"\xff\xd8"):
        _check_jpeg(data, max_image_pixels)
    elif data.startswith(b"\x89PNG\r\n\x1a\n"):
        _check_png(data)
    elif data[:4] in (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"):
        _check_tiff(data)
    elif data[:6] in (b"GIF87a", b"GIF89a"):
        _check_gif(data)


def _check_jpeg(data: bytes, max_image_pixels: int) -> None:
    frame = None  # (SOF marker, width, height, components' sampling factor bytes)
    pos, end = 2, len(data)
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            return  # not a marker where one belongs: Pillow names the corruption
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == _JPEG_EOI:
            break
        if marker in _NO_LENGTH:
            pos += 2
            continue
        length = (data[pos + 2] << 8) | data[pos + 3]
        body, after = pos + 4, pos + 2 + length
        if length < 2 or after > end:
            return
        if marker in _SOF_MARKERS and frame is None and length >= 8:
            components = data[body + 5]
            sampling = [data[body + 7 + 3 * i] for i in range(components) if body + 7 + 3 * i < end]
            width, height = (data[body + 3] << 8) | data[body + 4], (data[body + 1] << 8) | data[body + 2]
            frame = (marker, width, height, sampling)
        elif marker == _JPEG_SOS:
            if frame is not None:
                marker, width, height, sampling = frame
                check_plain_jpeg_cost(data, marker, width, height, sampling, after, max_image_pixels)
            return
        pos = after


def check_plain_jpeg_cost(
    data: bytes,
    frame_marker: int,
    width: int,
    height: int,
    sampling: bytes | list[int],
    scan_start: int,
    max_image_pixels: int = _defaults.MAX_IMAGE_PIXELS,
    max_scans: int = _defaults.MAX_JPEG_SCANS,
) -> None:
    """The JPEG checks, given its frame and where its first scan's data starts (the HTTP process's
    header walk has them): the scan data must be long enough for the frame, and a progressive file
    may have at most ``max_scans`` scans. A sequential scan costs in proportion to its bytes."""
    bits = _MIN_BITS_PER_BLOCK.get(frame_marker)
    for s in sampling:
        if not (s >> 4 and s & 15):
            bits = None  # a zero sampling factor: corrupt, Pillow names it
    if bits is not None and sampling and width * height <= max_image_pixels:
        blocks = count_blocks(width, height, sampling)
        scan_bytes = len(data) - scan_start
        if scan_bytes * 8 < bits * blocks:
            raise ImageDecodeError(
                400,
                f"The JPEG is corrupt: its frame header claims {width}x{height} pixels, but its {scan_bytes:,} "
                "bytes of scan data cannot hold that many (its size field was changed, or the data is cut short).",
            )
    if frame_marker in _PROGRESSIVE:
        _count_scans(data, scan_start, max_scans)


def count_blocks(width: int, height: int, sampling: bytes | list[int]) -> int:
    """The 8x8 blocks a frame's components hold, rounded up, without MCU padding (a lower bound).
    ``sampling`` holds each component's sampling factors byte (h << 4 | v), all of them nonzero."""
    h_max = v_max = blocks = 0
    for s in sampling:  # plain loops: this runs for every upload on the HTTP process's event loop
        h_max, v_max = max(h_max, s >> 4), max(v_max, s & 15)
    for s in sampling:
        columns = (width * (s >> 4) + h_max - 1) // h_max
        rows = (height * (s & 15) + v_max - 1) // v_max
        blocks += ((columns + 7) // 8) * ((rows + 7) // 8)
    return blocks


def check_thin_jpeg_data(
    data: bytes,
    frame_marker: int,
    width: int,
    height: int,
    sampling: bytes | list[int],
    scan_start: int,
    min_bits_per_block: int = _defaults.THIN_JPEG_BITS_PER_BLOCK,
) -> None:
    """Refuse a JPEG whose scan data ends before its frame's last block (400), when its data is thin
    for its frame: fewer than ``min_bits_per_block`` bits a block.

    The length check above cannot tell a photo whose frame size was raised (1x65000 from 451x300:
    7 bits a block) from a flat graphic of the same size, and libjpeg and nvJPEG both fill the
    blocks the data lacks with gray and report at most a warning, which Pillow drops. This runs
    libjpeg-turbo's Huffman decoding once, at 1/8 scale (no IDCT), with its warnings raised: for thin
    files only, so ordinary photos pay nothing, and the cost stays in proportion to the bytes sent.
    It runs in the workers (``probe.check_jpeg_data``), off the HTTP process's event loop.
    """
    if frame_marker not in _MIN_BITS_PER_BLOCK or not all(s >> 4 and s & 15 for s in sampling):
        return
    blocks = count_blocks(width, height, sampling)
    if not blocks or (len(data) - scan_start) * 8 >= min_bits_per_block * blocks:
        return
    import simplejpeg  # here: only thin JPEGs need it, and only in the workers

    try:
        simplejpeg.decode_jpeg(data, colorspace="GRAY" if len(sampling) == 1 else "RGB", min_factor=8, strict=True)
    except ValueError as exc:
        # Only a scan that stops early is this check's business; other warnings (extra bytes before
        # a marker, which sloppy encoders write) and unsupported colour spaces are left to Pillow.
        if "premature end" in str(exc).lower():
            raise ImageDecodeError(
                400,
                f"The JPEG is corrupt: its scan data ends before the last of the {width}x{height} pixels its "
                "frame header claims (its size field was changed, or the data is cut short).",
            ) from None


def _count_scans(data: bytes, scan_start: int, max_scans: int) -> None:
    scans, pos, end = 1, scan_start, len(data)
    while True:
        found = _SCAN_END.search(data, pos)
        if found is None or data[found.start() + 1] == _JPEG_EOI:
            return
        if data[found.start() + 1] == _JPEG_SOS:
            scans += 1
            if scans > max_scans:
                raise ImageDecodeError(
                    400,
                    f"The progressive JPEG has more than {max_scans} scans (ordinary encoders write at most a few "
                    "dozen); each scan makes the decoder sweep the whole image. Re-encode it.",
                )
        if found.start() + 4 > end:
            return
        pos = found.start() + 2 + ((data[found.start() + 2] << 8) | data[found.start() + 3])


def _check_png(data: bytes) -> None:
    """Chunks Pillow walks one by one in Python to open and decode the first frame: a file of
    millions of empty chunks stalls it for seconds."""
    limit = _defaults.MIN_CHUNK_LIMIT + len(data) // _defaults.BYTES_PER_EXTRA_CHUNK
    pos, end, chunks, seen_data = 8, len(data), 0, False
    while pos + 12 <= end:
        length, kind = _PNG_CHUNK.unpack_from(data, pos)
        if kind == b"IEND" or (seen_data and kind == b"fcTL"):  # the end, or the next APNG frame
            return
        seen_data = seen_data or kind == b"IDAT"
        chunks += 1
        if chunks > limit or (not seen_data and chunks > _defaults.MIN_CHUNK_LIMIT):
            raise ImageDecodeError(
                400, f"The PNG has more than {limit:,} chunks before its first frame ends; re-encode it."
            )
        pos += 12 + length


def _check_tiff(data: bytes) -> None:
    """Pillow makes a Python object per strip or tile of an uncompressed TIFF while it opens it."""
    little = data[0] == 0x49
    order = "<" if little else ">"
    big = data[2:4] in (b"+\x00", b"\x00+")
    try:
        (ifd,) = struct.unpack_from(order + ("Q" if big else "I"), data, 8 if big else 4)
        (entries,) = struct.unpack_from(order + ("Q" if big else "H"), data, ifd)
        first, size, layout = ifd + (8 if big else 2), (20 if big else 12), order + ("HHQ" if big else "HHI")
        pieces = 0
        for i in range(min(entries, 4096)):
            tag, _type, count = struct.unpack_from(layout, data, first + i * size)
            if tag in (273, 324):  # StripOffsets, TileOffsets
                pieces = max(pieces, count)
    except struct.error:
        return  # a header that runs off the end: Pillow names the corruption
    limit = max(_defaults.MAX_TIFF_PIECES, len(data) // _defaults.MIN_BYTES_PER_TIFF_PIECE)
    if pieces > limit:
        raise ImageDecodeError(
            400, f"The TIFF is cut into {pieces:,} strips or tiles (at most {limit:,} accepted); re-encode it."
        )


def _check_gif(data: bytes) -> None:
    """Extension sub-blocks before the first image, which Pillow's opener walks in Python."""
    if len(data) < 13:
        return
    pos = 13 + ((3 << ((data[10] & 7) + 1)) if data[10] & 0x80 else 0)  # header + global color table
    blocks, end = 0, len(data)
    limit = _defaults.MAX_GIF_BLOCKS + len(data) // _defaults.BYTES_PER_EXTRA_GIF_BLOCK
    while pos < end and data[pos] == 0x21:  # an extension; 0x2C starts the image, 0x3B ends the file
        pos += 2
        while pos < end and data[pos]:
            blocks += 1
            if blocks > limit:
                raise ImageDecodeError(
                    400, f"The GIF has more than {limit:,} extension blocks before its first image; re-encode it."
                )
            pos += 1 + data[pos]
        pos += 1
