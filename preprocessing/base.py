"""The one interface every preprocessing backend implements.

``Preprocessor.__call__(list[bytes]) -> PreparedBatch``: encoded images in, a normalized
``N x 3 x H x W`` float tensor on the model's device out, plus one error slot per input. A bad item
never raises: it gets an ``ImageError`` in its slot and the good items are still returned, so the
server can answer each request of a batch on its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from preprocessing.errors import ImageDecodeError, ImageError
from preprocessing.spec import PreprocessSpec

__all__ = ["ImageDecodeError", "ImageError", "Normalizer", "PreparedBatch", "Preprocessor"]


@dataclass
class PreparedBatch:
    """The decoded, normalized batch.

    ``images`` holds only the items that decoded, in input order; ``errors`` has one slot per
    input: ``None`` where the item is in ``images``, an ``ImageError`` where it is not.
    """

    images: torch.Tensor
    errors: list[ImageError | None]

    def __post_init__(self) -> None:
        n_ok = sum(e is None for e in self.errors)
        if self.images.shape[0] != n_ok:
            raise ValueError(f"PreparedBatch has {self.images.shape[0]} images but {n_ok} error-free slots.")

    @property
    def ok_indices(self) -> list[int]:
        return [i for i, e in enumerate(self.errors) if e is None]

    def __len__(self) -> int:
        return len(self.errors)


class Preprocessor(ABC):
    """Decode + resize + crop + normalize a list of encoded images into one device tensor."""

    name: ClassVar[str]

    def __init__(self, spec: PreprocessSpec, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.device = torch.device(device)

    @abstractmethod
    def __call__(self, images: Sequence[bytes]) -> PreparedBatch:
        """Never raises for a bad item; see ``PreparedBatch``."""

    def empty_batch(self, errors: list[ImageError | None]) -> PreparedBatch:
        size = self.spec.crop_size
        return PreparedBatch(torch.empty((0, 3, size, size), device=self.device), errors)


class Normalizer:
    """uint8 NHWC batch -> float32 NCHW, ``(x / 255 - mean) / std`` as one fused multiply-add.

    The result is a permuted view, so it is NCHW in shape and channels-last in memory, which is the
    layout convolution kernels prefer on both CPU (oneDNN) and GPU (cuDNN).
    """

    def __init__(self, spec: PreprocessSpec, device: torch.device) -> None:
        std = torch.tensor(spec.std, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        mean = torch.tensor(spec.mean, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        self.scale = 1.0 / (255.0 * std)
        self.bias = -mean / std
        self.device = device

    def __call__(self, batch_nhwc_uint8: torch.Tensor) -> torch.Tensor:
        x = batch_nhwc_uint8.to(self.device, non_blocking=True).permute(0, 3, 1, 2).float()
        return self.nchw(x)

    def nchw(self, batch_nchw: torch.Tensor) -> torch.Tensor:
        """Normalize an NCHW batch of 0..255 values (any float dtype) that is already on the device."""
        return torch.addcmul(self.bias, batch_nchw, self.scale)
