"""How a server's start can end before it serves: raised while the main process waits for its first
ready worker (server.py), answered there with the exit that says why."""

from __future__ import annotations


class StartupInterrupted(Exception):
    """A stop signal arrived before any worker was ready."""


class WorkerStartupFailed(RuntimeError):
    """An inference worker's setup raised; its traceback is in the log above."""
