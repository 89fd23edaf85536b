"""Defaults of the server and client, in one place. Each server default is also a flag and a
``VISION_SERVE_*`` environment variable (see service/settings.py)."""

from compile._defaults import DEFAULT_MODEL, DEFAULT_WEIGHTS

# A compile-trt artifact directory; empty: serve the eager model named by MODEL and WEIGHTS.
ARTIFACT = ""
MODEL = DEFAULT_MODEL
WEIGHTS = DEFAULT_WEIGHTS
DEVICE = "auto"  # cuda if a GPU is visible, else cpu
PREPROCESS = "auto"
MAX_BATCH_SIZE = 32
# How long the first request of a batch waits for others. Small: on an idle server it is pure added
# latency, and under load the queue fills batches anyway while the model is busy.
BATCH_TIMEOUT_MS = 5.0
WORKERS_PER_DEVICE = 1
# Loopback by default, like TorchServe; containers pass --host 0.0.0.0.
HOST = "127.0.0.1"
PORT = 8000
LOG_LEVEL = "info"

ENV_PREFIX = "VISION_SERVE_"

TOP_K = 5
MAX_TOP_K = 1000
# Largest request body accepted (a 12 MP JPEG is ~5 MB; base64 adds a third).
MAX_BODY_BYTES = 32 * 1024 * 1024

CLIENT_URL = "http://127.0.0.1:8000"
CLIENT_TIMEOUT_S = 60.0
CLIENT_CONCURRENCY = 8
