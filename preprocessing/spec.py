"""The preprocessing a model expects: what every backend must reproduce."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

SUPPORTED_INTERPOLATIONS = ("bilinear", "bicubic", "nearest")


@dataclass(frozen=True)
class PreprocessSpec:
    """Shorter-side resize, center crop, then per-channel normalization of 0..1 RGB values.

    This is torchvision's ``ClassificationPresetEval`` contract, kept as plain data so that an
    artifact manifest can carry it and every backend (Pillow, DALI, CV-CUDA) can rebuild it.
    """

    resize_size: int
    crop_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    interpolation: str = "bilinear"

    def __post_init__(self) -> None:
        object.__setattr__(self, "mean", tuple(float(m) for m in self.mean))
        object.__setattr__(self, "std", tuple(float(s) for s in self.std))
        if self.crop_size <= 0 or self.resize_size < self.crop_size:
            raise ValueError(
                f"PreprocessSpec needs 0 < crop_size <= resize_size, got crop_size={self.crop_size}, "
                f"resize_size={self.resize_size}. Use e.g. resize_size=256, crop_size=224."
            )
        if len(self.mean) != 3 or len(self.std) != 3:
            raise ValueError("PreprocessSpec.mean and .std need one value per RGB channel (3 values each).")
        if any(s <= 0 for s in self.std):
            raise ValueError(f"PreprocessSpec.std values must be > 0, got {self.std}.")
        if self.interpolation not in SUPPORTED_INTERPOLATIONS:
            raise ValueError(
                f"Unsupported interpolation {self.interpolation!r}; choose one of {SUPPORTED_INTERPOLATIONS}."
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PreprocessSpec:
        return cls(**data)
