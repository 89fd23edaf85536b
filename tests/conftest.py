"""Shared fixtures: real sample images (scikit-image, public domain / CC0) and the gpu marker."""

from __future__ import annotations

import functools
import io

import numpy as np
import psutil
import pytest
import torch
from PIL import Image

CAT_LABELS = {"tabby", "tiger cat", "Egyptian cat"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch sees none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@functools.cache
def sample_array(name: str) -> np.ndarray:
    from skimage import data

    return np.asarray(Image.fromarray(getattr(data, name)()).convert("RGB"))


def encode(img: Image.Image | np.ndarray, fmt: str = "JPEG", **save_kwargs: object) -> bytes:
    if isinstance(img, np.ndarray):
        img = Image.fromarray(img)
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save_kwargs)
    return buf.getvalue()


@pytest.fixture(scope="session")
def chelsea_jpeg() -> bytes:
    return encode(sample_array("chelsea"), quality=92)


@pytest.fixture(scope="session")
def coffee_jpeg() -> bytes:
    return encode(sample_array("coffee"), quality=92)


@pytest.fixture(scope="session")
def truncated_jpeg(chelsea_jpeg: bytes) -> bytes:
    """A JPEG cut in the middle of its pixel data: the header parses, the decode fails."""
    return chelsea_jpeg[: len(chelsea_jpeg) // 2]


def command_line(process: psutil.Process) -> str:
    """The process's command line, or "" once it has exited or is a zombie not yet reaped.

    A shell's short-lived children (command substitutions, `mkdir`) turn into zombies between
    listing and reading; psutil raises for those, and a scan of children must not fail on them.
    """
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def inference_workers(server_process) -> list[psutil.Process]:
    """The spawned inference worker processes of a running ``service.process.ServerProcess``."""
    children = psutil.Process(server_process.process.pid).children(recursive=True)
    return [p for p in children if "spawn_main" in command_line(p)]
