"""Run `vision-serve` as a child process: start it, wait until it is ready, stop it with SIGTERM.

Used by the demo, the end-to-end tests and the benchmarks, so they all drive the real CLI.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from service.client import VisionClient

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0  # ResNet-152 load + warm-up on 2 CPU cores takes well under a minute
STOP_TIMEOUT_S = 60.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServerStartError(RuntimeError):
    pass


class ServerProcess:
    """``with ServerProcess(["--model", "efficientnet-lite0"], log_path=...) as server: server.url``"""

    def __init__(
        self,
        args: Sequence[str],
        *,
        log_path: Path,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``env``: variables added to this process's environment for the server (VISION_SERVE_*)."""
        self.port = port or free_port()
        self.env = dict(env or {})
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [*args, "--port", str(self.port)]
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> ServerProcess:
        self._log = self.log_path.open("wb")
        command = [sys.executable, "-m", "service.cli", *self.args]
        logger.info("Starting: %s", " ".join(command))
        # Its own process group: a Ctrl-C meant for us does not reach it directly, and tests can
        # signal the whole server group as a terminal would.
        self.process = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **self.env},
        )
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError(
                    f"vision-serve exited with code {self.process.returncode} while starting:\n{self.log_tail()}"
                )
            with VisionClient(self.url, timeout=2.0) as client:
                if client.is_ready():
                    return
            time.sleep(0.25)
        self.stop()
        raise ServerStartError(f"vision-serve was not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, wait; SIGKILL only if it does not exit in time. Returns the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.error("vision-serve did not stop within %.0f s of SIGTERM; killing it.", timeout)
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
        return self.process.returncode

    def log_tail(self, lines: int = 40) -> str:
        if self._log is not None:
            self._log.flush()
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
