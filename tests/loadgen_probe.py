"""Run in the load generator's client processes by tests/unit/test_benchmarks_units.py."""

from __future__ import annotations

import os
import sys


def imported(name: str) -> tuple[int, bool]:
    """This process's pid, and whether it has imported module ``name``."""
    return os.getpid(), name in sys.modules
