"""vision-serve whose workers serve ``tests.sleepy_model:SleepyClassifier``, for the end-to-end tests:

    SLEEPY_FILE=/tmp/sleep python -m tests.sleepy_server --model efficientnet-lite0

Everything but the model (the HTTP processes, the pool, heartbeats, restarts) is the server's own;
write a number of seconds into ``SLEEPY_FILE`` and each batch takes that long.
"""

from __future__ import annotations

import sys

from service.testing import serve_model

SLEEPY_MODEL = "tests.sleepy_model:SleepyClassifier"

if __name__ == "__main__":
    sys.exit(serve_model(sys.argv[1:], SLEEPY_MODEL, "sleepy-server"))
