"""``exit_with_parent``: a process whose parent is killed ends by itself (tests/e2e/test_e2e.py checks a
whole server after SIGKILL of its main process)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import psutil

from service.parent_watch import EXIT_PARENT_GONE, exit_with_parent


def watched_child(parent_pid: int) -> None:
    exit_with_parent(parent_pid, interval_s=0.05)
    time.sleep(60)  # would outlive the test without the watch


def parent(pids: multiprocessing.Queue) -> None:
    child = multiprocessing.get_context("spawn").Process(target=watched_child, args=(os.getpid(),))
    child.start()
    pids.put(child.pid)
    time.sleep(60)


def test_a_child_ends_when_its_parent_is_killed() -> None:
    context = multiprocessing.get_context("spawn")
    pids = context.Queue()
    middle = context.Process(target=parent, args=(pids,))
    middle.start()
    child = psutil.Process(pids.get(timeout=60))
    time.sleep(0.3)
    assert child.is_running(), "the watch must not end a child whose parent lives"
    os.kill(middle.pid, signal.SIGKILL)
    middle.join()
    # Re-parented to init, it must end within a poll (psutil.TimeoutExpired if it does not; its exit
    # code goes to its new parent, not to us: the second test checks the code).
    child.wait(timeout=10)
    assert not child.is_running()


def test_the_watch_leaves_a_process_with_its_parent_alone() -> None:
    exits: list[int] = []
    thread = exit_with_parent(os.getppid(), interval_s=0.01, exit_process=exits.append)
    time.sleep(0.1)
    assert thread.is_alive() and exits == []
    exit_with_parent(os.getppid() + 1, interval_s=0.01, exit_process=exits.append).join(5)
    assert exits == [EXIT_PARENT_GONE]
