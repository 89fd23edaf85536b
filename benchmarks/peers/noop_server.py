"""The load generator's own ceiling: a bare ASGI endpoint that reads the request body and answers a
fixed /predict-shaped JSON, on uvicorn with several processes.

    python -m benchmarks.peers.noop_server --port 8100 --workers 4

Driving this with the same client settings as a real run shows what the client can send at most;
a server measured well below that figure was not held back by its load generator.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

from service.client.launcher import free_port, parent_death_hook

STARTUP_TIMEOUT_S = 30.0
ANSWER = json.dumps(
    {"predictions": [{"label": "no-op", "index": i, "probability": 0.2} for i in range(5)], "engine": "no-op"}
).encode()
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]


async def app(scope: dict, receive, send) -> None:
    """Raw ASGI (no framework), so the figure is the client's and uvicorn's, not a framework's."""
    more_body = True
    while more_body:  # read the whole upload, as a real server must
        more_body = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": ANSWER})


@contextlib.contextmanager
def noop_server(workers: int) -> Iterator[str]:
    """A running no-op server on loopback; yields its /predict URL."""
    port = free_port()
    command = [sys.executable, "-m", "benchmarks.peers.noop_server", "--port", str(port), "--workers", str(workers)]
    # It dies with this process, however this one dies: a killed benchmark leaves no server behind.
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=parent_death_hook(True)
    )
    url = f"http://127.0.0.1:{port}/predict"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                httpx.post(url, content=b"x", timeout=1.0).raise_for_status()
                break
            except httpx.TransportError:
                if process.poll() is not None or time.monotonic() > deadline:
                    stderr = process.stderr.read().decode(errors="replace") if process.stderr else ""
                    raise RuntimeError(f"the no-op server did not start: {stderr[-2000:]}") from None
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    uvicorn.run(
        "benchmarks.peers.noop_server:app",
        host="127.0.0.1",
        port=args.port,
        workers=args.workers,
        log_level="warning",
        access_log=False,
        lifespan="off",
    )


if __name__ == "__main__":
    main()
