"""The memory a running server takes: its whole process tree on the host, and its GPUs' memory.

Host: RSS summed over the processes (shared pages counted in each) and PSS (shared pages split
between them, what the processes cost together). GPU: the server's own gauge
``vision_serve_gpu_memory_used_bytes`` from its /metrics, summed over its devices; it is the
device's memory in use (total - free, as nvidia-smi shows), so on a GPU shared with other processes
it counts theirs too. Both are sampled in a thread while the server is loaded; the peaks are kept.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass

import httpx
import psutil

from service.tune import _defaults

logger = logging.getLogger(__name__)

MIB = float(1 << 20)
GPU_GAUGE = re.compile(r"^vision_serve_gpu_memory_used_bytes\{[^}]*\}\s+([0-9.eE+-]+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Footprint:
    rss_mib: float
    pss_mib: float
    gpu_mib: float  # 0.0 on a CPU


def tree_memory(pid: int) -> tuple[float, float]:
    """(RSS, PSS) in MiB of ``pid`` and all its descendants; processes that exit meanwhile are skipped."""
    rss = pss = 0
    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0, 0.0
    for process in family:
        try:
            info = process.memory_full_info()
        except psutil.Error:
            continue
        rss += info.rss
        pss += getattr(info, "pss", info.rss)
    return rss / MIB, pss / MIB


def gpu_memory_mib(base_url: str) -> float:
    """The server's GPU memory in use (all its devices), from its /metrics; 0.0 where it reports none."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(value) for value in GPU_GAUGE.findall(text)) / MIB


class FootprintSampler:
    """``with FootprintSampler(pid, url) as sampler: ...; sampler.peak()``."""

    def __init__(
        self, pid: int, base_url: str, gpu: bool = False, interval_s: float = _defaults.MEMORY_SAMPLE_S
    ) -> None:
        self.pid, self.base_url, self.gpu, self.interval_s = pid, base_url, gpu, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="footprint", daemon=True)
        self._rss = self._pss = self._gpu = 0.0

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval_s):
                return

    def sample(self) -> None:
        rss, pss = tree_memory(self.pid)
        self._rss, self._pss = max(self._rss, rss), max(self._pss, pss)
        if self.gpu:
            self._gpu = max(self._gpu, gpu_memory_mib(self.base_url))

    def peak(self) -> Footprint:
        return Footprint(round(self._rss, 1), round(self._pss, 1), round(self._gpu, 1))

    def __enter__(self) -> FootprintSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
