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
        height, width = self.spec.input_size
        return PreparedBatch(torch.empty((0, 3, height, width), device=self.device), errors)


def value_affine(spec: PreprocessSpec) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(scale, bias)`` per model channel: ``pixel * scale + bias`` is ``spec``'s rescale + normalize of a
    0..255 pixel, as one multiply-add (every backend folds its values this way)."""
    if not spec.normalize:
        return (spec.rescale_factor,) * 3, (0.0,) * 3
    scale = tuple(spec.rescale_factor / s for s in spec.std)
    bias = tuple(-m / s for m, s in zip(spec.mean, spec.std, strict=True))
    return scale, bias


class Normalizer:
    """uint8 RGB batch -> float32 NCHW model input: channels put in ``spec.channel_order``, then
    ``pixel * rescale_factor``, ``(value - mean) / std``, as one fused multiply-add.

    The result is a permuted view, so it is NCHW in shape and channels-last in memory, which is the
    layout convolution kernels prefer on both CPU (oneDNN) and GPU (cuDNN).
    """

    def __init__(self, spec: PreprocessSpec, device: torch.device) -> None:
        scale, bias = value_affine(spec)
        self.scale = torch.tensor(scale, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        self.bias = torch.tensor(bias, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        self.bgr = spec.channel_order == "BGR"
        self.device = device

    def __call__(self, batch_nhwc_uint8: torch.Tensor) -> torch.Tensor:
        """A uint8 NHWC RGB batch (Pillow's) -> the model's float32 NCHW input."""
        return self.nchw(batch_nhwc_uint8.to(self.device, non_blocking=True).permute(0, 3, 1, 2).float())

    def nchw(self, batch_nchw: torch.Tensor) -> torch.Tensor:
        """Normalize an NCHW batch of RGB 0..255 values (any float dtype) that is already on the device."""
        if not self.bgr:
            return torch.addcmul(self.bias, batch_nchw, self.scale)
        # Each channel's multiply-add written straight into its flipped place: a flip of either tensor
        # would be one more pass over the batch, which BGR models would pay on every request.
        out = torch.empty_like(batch_nchw, dtype=torch.promote_types(batch_nchw.dtype, self.scale.dtype))
        for model_channel in range(3):
            rgb = 2 - model_channel
            torch.addcmul(
                self.bias[:, model_channel], batch_nchw[:, rgb], self.scale[:, model_channel], out=out[:, model_channel]
            )
        return out
