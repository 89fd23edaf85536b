"""Run `vision-serve` as a child process: start it, wait until it is ready, stop it with SIGTERM.

Used by the demo, the end-to-end tests and the benchmarks, so they all drive the real CLI.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

from service.client import _defaults
from service.client.vision_client import VisionClient

logger = logging.getLogger(__name__)

# How the server is started by default, and the variable that gives it its port.
VISION_SERVE_COMMAND = (sys.executable, "-m", "service.cli")
PORT_ENV = _defaults.PORT_ENV
STARTUP_TIMEOUT_S = 300.0  # ResNet-152 load + warm-up on 2 CPU cores takes well under a minute
STOP_TIMEOUT_S = 60.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServerStartError(RuntimeError):
    pass


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int, prctl: Callable[..., int], signal_number: int = signal.SIGTERM) -> None:
    """For ``Popen(preexec_fn=...)`` (see ``parent_death_hook``): the child gets ``signal_number`` when
    its parent dies, even by SIGKILL, so that a killed driver (vision-tune) leaves no server behind.
    The setting survives exec. Runs between fork and exec, so it only calls what the parent loaded."""
    if prctl(PR_SET_PDEATHSIG, signal_number, 0, 0, 0) != 0:
        return
    if os.getppid() != parent_pid:  # the parent died before the setting took: do as it would have
        os.kill(os.getpid(), signal_number)


def parent_death_hook(enabled: bool) -> Callable[[], None] | None:
    """The ``preexec_fn`` that ties a child to this process (``die_with_parent``); None when not
    ``enabled`` or not on Linux."""
    if not enabled or not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded here, not in the forked child
    return functools.partial(die_with_parent, os.getpid(), prctl)


class ServerProcess:
    """``with ServerProcess(["--model", "efficientnet-lite0"], log_path=...) as server: server.url``

    ``args`` follow ``command``: by default ``python -m service.cli``, or anything that ends in
    vision-serve, such as the Docker image's entrypoint script. The port is told as
    ``VISION_SERVE_PORT`` rather than ``--port``, so that the same works for such a command too.
    """

    def __init__(
        self,
        args: Sequence[str],
        *,
        log_path: Path,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        base_env: Mapping[str, str] | None = None,
        command: Sequence[str] = VISION_SERVE_COMMAND,
        with_parent: bool = False,
    ) -> None:
        """``env``: variables added for the server (VISION_SERVE_*) to ``base_env``, by default this
        process's environment. ``with_parent``: the server is stopped (SIGTERM) when this process
        dies, however it dies (``die_with_parent``)."""
        self.port = port or free_port()
        self.env = {**(env or {}), PORT_ENV: str(self.port)}
        self.base_env = base_env
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [*command, *args]
        self.log_path = log_path
        self.with_parent = with_parent
        self.process: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> ServerProcess:
        """``launch``, then wait until the server is ready."""
        self.launch()
        self.wait_ready(timeout)
        return self

    def launch(self) -> ServerProcess:
        """Start the process and return at once."""
        self._log = self.log_path.open("wb")
        logger.info("Starting: %s", " ".join(self.command))
        environment = {**(os.environ if self.base_env is None else self.base_env), **self.env}
        # Its own process group: a Ctrl-C meant for us does not reach it directly, and tests can
        # signal the whole server group as a terminal would.
        self.process = subprocess.Popen(
            self.command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=environment,
            preexec_fn=parent_death_hook(self.with_parent),
        )
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

    def wait(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """The exit code, once the process exits by itself; after ``timeout``, its whole group is
        killed and ``subprocess.TimeoutExpired`` raised."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_group()
            raise

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
        self._close_log()
        return self.process.returncode

    def kill_group(self) -> None:
        """SIGKILL to every process of its group (workers included): for cleaning up after a failure."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self._close_log()

    def log_text(self) -> str:
        if self._log is not None:
            self._log.flush()
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
