"""A real ``redis-server`` for the response cache's tests: on a free loopback port, in a temporary
directory, nothing saved to disk; killed at the end. Skipped where Redis is not installed, failed there
when CI requires every tool (VISION_SERVE_REQUIRE_TOOLS=1, as tests/tools.py does)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from service.client.launcher import free_port
from tests.tools import REQUIRE_ENV

START_TIMEOUT_S = 10.0


@dataclass
class RedisServer:
    url: str
    process: subprocess.Popen
    log: Path

    def client(self) -> redis.Redis:
        """A synchronous client of its own, to look at or stall the server from outside the code tested."""
        return redis.Redis.from_url(self.url, socket_timeout=5)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def redis_server_path() -> str:
    """The ``redis-server`` executable; skips the test where it is missing, or fails it when CI requires it."""
    found = shutil.which("redis-server") or next(
        (path for path in ("/usr/bin/redis-server", "/usr/local/bin/redis-server") if os.access(path, os.X_OK)), None
    )
    if found:
        return found
    message = "redis-server is not installed: apt-get install redis-server"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(message)
    pytest.skip(message)


@contextlib.contextmanager
def running_redis(directory: Path) -> Iterator[RedisServer]:
    """A ``redis-server`` answering PING on a free loopback port, working in ``directory``."""
    server = start(redis_server_path(), directory)
    try:
        yield server
    finally:
        server.kill()


def start(executable: str, directory: Path, attempts: int = 3) -> RedisServer:
    """Started and answering; on another port when the one picked was taken meanwhile."""
    for attempt in range(attempts):
        port = free_port()
        log = directory / f"redis-{port}.log"
        command = [executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        command += ["--dir", str(directory), "--enable-debug-command", "yes", "--logfile", str(log)]
        process = subprocess.Popen(command, cwd=directory, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        server = RedisServer(f"redis://127.0.0.1:{port}/0", process, log)
        try:
            wait_until_it_answers(server)
            return server
        except RuntimeError:
            server.kill()
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def wait_until_it_answers(server: RedisServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    with server.client() as client:
        while True:
            if server.process.poll() is not None:
                log = server.log.read_text()[-2000:] if server.log.exists() else ""
                raise RuntimeError(f"redis-server exited with {server.process.returncode}:\n{log}")
            try:
                if client.ping():
                    return
            except redis.exceptions.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer PING at {server.url} in {START_TIMEOUT_S} s")
            time.sleep(0.05)


@pytest.fixture(name="redis_server")
def redis_server_fixture(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh ``redis-server`` for one test, as ``redis_server``: import ``redis_server_fixture`` into a
    test module to use it."""
    with running_redis(tmp_path) as server:
        yield server
