"""Check: what no decoder should see is refused in the HTTP process, before a cache lookup or a
queue slot: not an image, a corrupt header, too many pixels. Only the header is parsed, so a
decompression bomb costs microseconds and never reaches a decoder; the worker probes again."""

from __future__ import annotations

from collections.abc import Sequence

from preprocessing.errors import ImageDecodeError
from preprocessing.probe import check_image_header
from service.errors import error_of_status
from service.wire import Answer, answer_for


def header_error(image: bytes, max_image_pixels: int) -> Answer | None:
    """The 4xx ``Answer`` of an image whose header no decoder should see, or ``None`` if it may run.
    The one place the HTTP processes turn the preprocessing library's ``ImageDecodeError`` into the
    service's error."""
    try:
        check_image_header(image, max_image_pixels)
    except ImageDecodeError as exc:
        return answer_for(error_of_status(exc.error.status_code, exc.error.detail))
    return None


def refusals(images: Sequence[bytes | Answer], max_image_pixels: int) -> list[Answer | None]:
    """Each image's refusal: the error its parse already gave it (an ``Answer`` in place of its bytes),
    else its header's, else ``None``: it may run."""
    return [image if isinstance(image, Answer) else header_error(image, max_image_pixels) for image in images]
