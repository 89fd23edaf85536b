"""The CPU cores this server may use: what the scheduler lets it run on (``taskset``, a container's
cpuset) and what its cgroup's CPU quota pays for (``docker run --cpus 4``, a Kubernetes CPU limit),
whichever is less. ``os.cpu_count()`` counts the host's cores, and sizing workers by it in a
4-CPU container on a 64-core host would start 16 times too many threads. Nothing here imports torch:
the main process reads it too (service/supervisor/planning/layout.py).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

# cgroup v2 (one file: "QUOTA PERIOD" or "max PERIOD"), then v1 (two files, -1 for no quota).
CGROUP_V2_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def quota_cores(cpu_max: str | None, v1_quota: str | None = None, v1_period: str | None = None) -> int | None:
    """The cores a cgroup CPU quota pays for, rounded up (1.5 CPUs: 2 threads can still use them);
    None without a quota or when the files do not parse."""
    try:
        if cpu_max is not None:
            parts = cpu_max.split()
            if len(parts) != 2 or parts[0] == "max":
                return None
            return max(1, math.ceil(int(parts[0]) / int(parts[1])))
        if v1_quota is not None and v1_period is not None and int(v1_quota) > 0:
            return max(1, math.ceil(int(v1_quota) / int(v1_period)))
    except ValueError:
        return None
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def usable_cores() -> int:
    """Cores this process may use: its affinity mask, capped by its cgroup's CPU quota; at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = quota_cores(_read(CGROUP_V2_CPU_MAX), _read(CGROUP_V1_QUOTA), _read(CGROUP_V1_PERIOD))
    return max(1, min(cores, quota) if quota else cores)
