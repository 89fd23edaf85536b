"""The client's defaults, in one place: `vision-classify`, `VisionClient` and the launcher import
nothing of the server (a client machine needs no torch)."""

URL = "http://127.0.0.1:8000"
TIMEOUT_S = 60.0
CONCURRENCY = 8  # requests vision-classify keeps in flight
# What the server answers without ?top_k=, and the most it accepts (the server's own defaults hold the
# same values; a unit test keeps them equal).
TOP_K = 5
MAX_TOP_K = 1000
# The server's environment variables the client reads too: one key in the environment serves both.
API_KEY_ENV = "VISION_SERVE_API_KEY"
PORT_ENV = "VISION_SERVE_PORT"
