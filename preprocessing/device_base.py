"""The frame every device-decoding backend (dali, cvcuda, torch) shares.

Per batch: probe every header on the CPU (cheap) -> the JPEGs a device decoder takes go through
the backend's batched path -> everything else (other formats, CMYK, truncated files, and any item
the device decoder fails on) is decoded by Pillow and uploaded -> rows are put back in input order.

A batched device decoder fails the whole call when one item is bad (measured: DALI's ``run()``,
torchvision's batched ``decode_jpeg``), so a failed batch is split in halves and retried until the
failing items stand alone; those go to Pillow, which either decodes them (an image the device
decoder cannot handle) or names what is wrong with them (a corrupt one). Every good image of the
batch still gets its answer, at the cost of about ``2 * log2(batch)`` extra device calls per bad item.
A failure that broke the device itself (a sticky CUDA error) is raised as ``DeviceUnusable`` instead:
no image is to blame, and the worker must be replaced (service/worker/loop.py).
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from preprocessing import _defaults
from preprocessing.base import ImageDecodeError, ImageError, Normalizer, PreparedBatch, Preprocessor
from preprocessing.device_health import DeviceUnusable, unusable_device
from preprocessing.geometry import CropPlan, plan_crop
from preprocessing.pil_backend import PilPreprocessor
from preprocessing.probe import ImageProbe, probe_image
from preprocessing.spec import PreprocessSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceItem:
    """One image bound for the device decoder, with what its header told us."""

    index: int  # position in the caller's batch
    data: bytes
    probe: ImageProbe
    plan: CropPlan  # resize + crop geometry for its displayed (EXIF-rotated) size


class DeviceItemsFailed(Exception):
    """Raised by ``decode_on_device`` when the decoder names the items it failed on (nvImageCodec)."""

    def __init__(self, positions: Sequence[int]) -> None:
        super().__init__(f"the device decoder failed on {len(positions)} item(s)")
        self.positions = list(positions)


@dataclass
class DecodeCounts:
    """How the items of this preprocessor's batches were decoded, since it was created."""

    device: int = 0  # decoded by the device decoder
    pillow: int = 0  # routed to Pillow by their header (format, colour model, truncation)
    device_failed: int = 0  # the device decoder failed on them alone; handed to Pillow
    split_retries: int = 0  # extra device calls spent isolating failing items


class DeviceDecodePreprocessor(Preprocessor):
    """Probe, route, isolate failures, assemble; subclasses only implement ``decode_on_device``."""

    def __init__(
        self,
        spec: PreprocessSpec,
        device: torch.device | str = "cpu",
        *,
        max_batch_size: int = _defaults.DEVICE_MAX_BATCH,
        max_image_pixels: int = _defaults.MAX_IMAGE_PIXELS,
        num_threads: int | None = None,
    ) -> None:
        super().__init__(spec, device)
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}.")
        self.max_batch_size = max_batch_size
        self.max_image_pixels = max_image_pixels
        self.normalize = Normalizer(spec, self.device)
        self.pillow = PilPreprocessor(spec, self.device, num_threads=num_threads, max_image_pixels=max_image_pixels)
        self.counts = DecodeCounts()

    @abstractmethod
    def decode_on_device(self, items: Sequence[DeviceItem]) -> torch.Tensor:
        """``len(items) x 3 x height x width`` (``spec.input_size``) normalized float32 on ``self.device``.

        May raise for the whole call when any item is bad (the caller isolates the culprits), or
        ``DeviceItemsFailed`` naming them when the decoder reports failures per item.
        ``len(items)`` never exceeds ``self.max_batch_size``.
        """

    def __call__(self, images: Sequence[bytes]) -> PreparedBatch:
        errors: list[ImageError | None] = [None] * len(images)
        device_items: list[DeviceItem] = []
        pillow_indices: list[int] = []
        for index, data in enumerate(images):
            try:
                item = self._device_item(index, data)
            except ImageDecodeError as exc:
                errors[index] = exc.error
                continue
            except Exception:  # anything odd about the header: Pillow decides, and names the problem
                logger.debug("header probe failed on item %d; decoding it with Pillow", index, exc_info=True)
                item = None
            if item is None:
                pillow_indices.append(index)
            else:
                device_items.append(item)
        self.counts.pillow += len(pillow_indices)
        failed_before = self.counts.device_failed

        pieces: list[tuple[list[int], torch.Tensor]] = []
        for start in range(0, len(device_items), self.max_batch_size):
            chunk_pieces, failed = self._decode_isolating(device_items[start : start + self.max_batch_size])
            pieces += chunk_pieces
            pillow_indices += failed
        if device_items and self.counts.device_failed - failed_before == len(device_items) > 1:
            logger.warning(
                "%s decoder failed on every image of a batch of %d; if this repeats, the backend is broken "
                "(everything is being decoded by Pillow, slowly): try --preprocess pil or another backend",
                self.name,
                len(device_items),
            )
        if pillow_indices:
            pillow_indices.sort()
            decoded = self.pillow([images[i] for i in pillow_indices])
            for index, error in zip(pillow_indices, decoded.errors, strict=True):
                errors[index] = error
            pieces.append(([pillow_indices[k] for k in decoded.ok_indices], decoded.images))
        return self._assemble(pieces, errors)

    def _device_item(self, index: int, data: bytes) -> DeviceItem | None:
        """The item bound for the device decoder, or ``None`` where Pillow should decode it."""
        probe = probe_image(data, self.max_image_pixels)
        if not probe.decodes_on_device or probe.width * probe.height > _defaults.DEVICE_MAX_IMAGE_PIXELS:
            return None
        plan = plan_crop(probe.width, probe.height, self.spec)
        width, height = plan.resized
        # resize_target, not resize_size: that is 0 for the box modes (exact, cover, contain).
        if width * height > _defaults.MAX_RESIZED_AREA_FACTOR * self.spec.resize_target**2:
            return None  # a long strip: Pillow resamples only the crop region (a device resize would not)
        return DeviceItem(index, data, probe, plan)

    def _decode_isolating(self, items: list[DeviceItem]) -> tuple[list[tuple[list[int], torch.Tensor]], list[int]]:
        """Decode ``items`` on the device; ``(pieces, indices the device decoder failed on)``."""
        if not items:
            return [], []
        try:
            rows = self.decode_on_device(items)
        except DeviceItemsFailed as exc:
            positions = set(exc.positions)
            if not positions or not positions <= set(range(len(items))):
                raise AssertionError(f"{self.name}: DeviceItemsFailed must name items, got {exc.positions}") from None
            failed = [items[position].index for position in sorted(positions)]
            self.counts.device_failed += len(failed)
            logger.info("%s decoder failed on %d image(s); decoding them with Pillow", self.name, len(failed))
            rest = [item for position, item in enumerate(items) if position not in positions]
            pieces, rest_failed = self._decode_isolating(rest)
            return pieces, failed + rest_failed
        except Exception as exc:  # the decoders raise RuntimeError subclasses of their own
            unusable = unusable_device(self.device)
            if unusable is not None:
                # Not the images: every retry and the Pillow upload would fail the same way.
                raise DeviceUnusable(unusable) from exc
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if len(items) == 1:
                self.counts.device_failed += 1
                logger.info("%s decoder failed on one image (%s); decoding it with Pillow", self.name, reason)
                return [], [items[0].index]
            logger.info("%s decoder failed on a batch of %d (%s); splitting it", self.name, len(items), reason)
            self.counts.split_retries += 2
            middle = len(items) // 2
            first_pieces, first_failed = self._decode_isolating(items[:middle])
            second_pieces, second_failed = self._decode_isolating(items[middle:])
            return first_pieces + second_pieces, first_failed + second_failed
        self.counts.device += len(items)
        return [([item.index for item in items], rows)], []

    def _assemble(self, pieces: list[tuple[list[int], torch.Tensor]], errors: list[ImageError | None]) -> PreparedBatch:
        ok = [i for i, error in enumerate(errors) if error is None]
        pieces = [(indices, rows) for indices, rows in pieces if indices]
        if not ok:
            return self.empty_batch(errors)
        if len(pieces) == 1 and pieces[0][0] == ok:
            return PreparedBatch(pieces[0][1], errors)
        position = {index: row for row, index in enumerate(ok)}
        height, width = self.spec.input_size
        out = torch.empty((len(ok), 3, height, width), dtype=torch.float32, device=self.device)
        for indices, rows in pieces:
            out[torch.tensor([position[i] for i in indices], device=self.device)] = rows
        return PreparedBatch(out, errors)
