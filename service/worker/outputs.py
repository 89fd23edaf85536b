"""What the worker makes of a batch's logits, on the device: the scores of the model's activation
(softmax, sigmoid or none: compile/_defaults.py ACTIVATIONS) and their top k; and, only for the
requests that asked for it, each one's whole logits row as float32 bytes (``Answer.logits``).

Only k values per image cross back to the host on the default path; the whole row does only for
the images whose request named it (OIP's ``LOGITS``, ``/predict?logits=true``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from service.wire import LOGITS_DTYPE


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.softmax(dim=1)


def _none(logits: torch.Tensor) -> torch.Tensor:
    return logits


ACTIVATION_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "softmax": _softmax,
    "sigmoid": torch.sigmoid,
    "none": _none,
}


def activation_function(activation: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function of ``activation``; ``ValueError`` for a name that is not one."""
    try:
        return ACTIVATION_FUNCTIONS[activation]
    except KeyError:
        raise ValueError(f"Unknown activation {activation!r}: one of {', '.join(ACTIVATION_FUNCTIONS)}.") from None


def top_scores(
    logits: torch.Tensor, activate: Callable[[torch.Tensor], torch.Tensor], k: int
) -> tuple[list[list[float]], list[list[int]]]:
    """Each row's k best scores and their class indices, best first, as host lists."""
    scores, indices = activate(logits).topk(k, dim=1)
    return scores.cpu().tolist(), indices.cpu().tolist()


def logits_rows(logits: torch.Tensor, rows: Sequence[int]) -> dict[int, bytes]:
    """The float32 bytes of each of ``rows`` (row indices into ``logits``), only those copied to the host."""
    if not rows:
        return {}
    picked = logits[list(rows)].cpu().numpy().astype(LOGITS_DTYPE, copy=False)
    return {row: picked[position].tobytes() for position, row in enumerate(rows)}
