"""Plain LitServe with a no-op model: the front-end benchmark's LitServe peer.

    python -m benchmarks.peers.litserve_noop --port 8300

Started as LitServe's docs start a server (one HTTP process, one worker, no batching), with a LitAPI
that base64-decodes a JSON ``{"image": ...}`` body, as LitServe's image examples take it, and answers
a fixed top-5 JSON. What it measures is LitServe's own request path on this machine.
"""

from __future__ import annotations

import argparse
import base64
import sys
from collections.abc import Sequence

import litserve as ls

TOP_K = 5
ANSWER = [{"label": "no-op", "index": i, "probability": 0.2} for i in range(TOP_K)]


class NoopLitAPI(ls.LitAPI):
    def setup(self, device: str) -> None:
        pass

    def decode_request(self, request: dict) -> bytes:
        return base64.b64decode(request["image"])  # the front end's share of a JSON upload

    def predict(self, x: bytes) -> list[dict]:
        return ANSWER

    def encode_response(self, output: list[dict]) -> dict:
        return {"predictions": output}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    # Imported by module name, not as __main__: the spawned worker unpickles it from there.
    from benchmarks.peers.litserve_noop import NoopLitAPI as Api

    ls.LitServer(Api(), accelerator="cpu").run(port=args.port, generate_client_file=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
