"""Class labels from a file: one label per line, in class-index order (Triton's ``labels.txt``).

The file sets the number of classes. Read strictly, because a shifted line silently renames every
class after it: a UTF-8 byte-order mark is dropped (editors on Windows write one), Windows line
ends are accepted, but a blank line, a label with spaces at its ends or a file that is not UTF-8
is refused with its line number.
"""

from __future__ import annotations

from pathlib import Path

from compile import _defaults

# `--labels imagenet`: the 1,000 ImageNet classes in torchvision's order, for a model file made
# elsewhere whose classes are ImageNet's (a file's labels are never assumed).
IMAGENET_LABELS_KEYWORD = "imagenet"


class LabelsError(ValueError):
    """The labels file cannot be used; the message says which line and how to fix it."""


def read_labels(path: str | Path) -> tuple[str, ...]:
    """The labels in ``path``, one per line; raises ``LabelsError`` naming the line at fault."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise LabelsError(
            f"--labels {path}: file not found. Give a text file with one class label per line, in the order of "
            f"the model's outputs, or '{IMAGENET_LABELS_KEYWORD}' for the 1,000 ImageNet classes."
        )
    raw = path.read_bytes()
    if len(raw) > _defaults.MAX_LABELS_FILE_BYTES:
        raise LabelsError(f"--labels {path} is {len(raw):,} bytes; at most {_defaults.MAX_LABELS_FILE_BYTES:,}.")
    try:
        text = raw.decode("utf-8-sig")  # drops a byte-order mark
    except UnicodeDecodeError as exc:
        raise LabelsError(f"--labels {path} is not UTF-8 text ({exc}). Save it as UTF-8.") from None
    lines = text.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()  # trailing newlines are not classes
    if not lines:
        raise LabelsError(f"--labels {path} is empty: it needs one label per class, one per line.")
    for number, label in enumerate(lines, start=1):
        if not label.strip():
            raise LabelsError(
                f"--labels {path}: line {number} is blank. Every line is one class, in the model's output order: "
                "remove the blank line (or name the class) so the labels after it do not shift."
            )
        if label != label.strip():
            raise LabelsError(f"--labels {path}: line {number} ({label!r}) has spaces at its ends; remove them.")
        if len(label) > _defaults.MAX_LABEL_CHARS:
            raise LabelsError(f"--labels {path}: line {number} is longer than {_defaults.MAX_LABEL_CHARS} characters.")
    return tuple(lines)
