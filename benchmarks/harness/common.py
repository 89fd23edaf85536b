"""What every benchmark shares: where results go and how the machine is described."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import socket
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


def machine_tag(device: torch.device | None = None) -> str:
    """``vm-2cpu`` for CPU runs, ``nvidia-h100-80gb-hbm3`` for a GPU run: the results folder's prefix."""
    if device is not None and device.type == "cuda":
        return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
    return f"{socket.gethostname().split('.')[0]}-{os.cpu_count()}cpu"


def results_dir(override: Path | None = None, device: torch.device | None = None) -> Path:
    directory = override or RESULTS_DIR / f"{machine_tag(device)}-{datetime.date.today().isoformat()}"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def machine_record(device: torch.device | None = None) -> dict:
    record = {
        "cpus": os.cpu_count(),
        "processor": platform.processor(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if device is not None and device.type == "cuda":
        record["gpu"] = torch.cuda.get_device_name(device)
        record["cuda"] = torch.version.cuda
    return record


def replace_text(path: Path, text: str) -> None:
    """``path`` replaced whole (a temporary file renamed over it): a reader never sees half of it."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def write_results(directory: Path, stem: str, record: dict, text: str, text_suffix: str = ".txt") -> None:
    """``stem.json`` and the text beside it, each replaced whole (the GPU session packs the folder
    while a benchmark writes into it)."""
    directory.mkdir(parents=True, exist_ok=True)
    replace_text(directory / f"{stem}.json", json.dumps(record, indent=2) + "\n")
    replace_text(directory / f"{stem}{text_suffix}", text.rstrip() + "\n")
    print(f"wrote {directory / stem}.json and {text_suffix}")
