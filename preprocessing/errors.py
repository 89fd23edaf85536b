"""Why one image cannot become model input. No torch here: the HTTP processes check image headers
with these (preprocessing/probe.py) and never import a tensor library."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ImageError:
    """Why one input could not be turned into model input; maps straight onto an HTTP answer."""

    status_code: int
    detail: str


class ImageDecodeError(Exception):
    """Raised inside a backend for one item; the backend turns it into an ``ImageError``."""

    def __init__(self, status_code: int, detail: str) -> None:
        super().__init__(detail)
        self.error = ImageError(status_code, detail)


class DeviceUnusable(RuntimeError):
    """The device no longer runs work in this process (a sticky CUDA error); only a new process can
    use it again (preprocessing/device_health.py tells; service/worker/loop.py acts on it)."""
