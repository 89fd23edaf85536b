"""``python -m service.supervisor.planning MAIN_PID``: the planner child process (child.py does the
work). Its first act is to watch its parent (service/parent_watch.py): planning imports torch and
reads engines for seconds, and a main process killed meanwhile (SIGKILL, the OOM killer) must not
leave it running; the watch starts before any of those imports.
"""

from __future__ import annotations

import os
import sys

from service.parent_watch import exit_with_parent


def run(argv: list[str]) -> None:
    """Watch ``argv[0]`` (the main process's pid; the parent at start if not given), then plan."""
    exit_with_parent(int(argv[0]) if argv else os.getppid())
    from service.supervisor.planning.child import main  # imports torch: after the watch started

    main()


if __name__ == "__main__":
    run(sys.argv[1:])
