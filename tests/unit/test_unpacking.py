"""Where AOTInductor's unpacked packages go (compile/unpacking.py): a folder per process, under
the server's root when it names one, removed at a normal exit. The served path, with a real package and
a real server, is tests/integration/test_compile.py::test_served_artifact_classifies_chelsea_as_a_cat."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from compile.unpacking import (
    UNPACK_ROOT_ENV,
    process_unpack_dir,
    remove_unpacked_of,
    unpack_root,
    unpacking_into,
)

CHILD = """
import os, sys
from compile.unpacking import process_unpack_dir
folder = process_unpack_dir()
open(os.path.join(folder, "engine.so"), "wb").write(b"x")
print(folder, flush=True)
if sys.argv[1] == "os._exit":
    os._exit(0)
"""


def run_child(how: str, root: Path) -> Path:
    env = {**os.environ, UNPACK_ROOT_ENV: str(root)}
    done = subprocess.run([sys.executable, "-c", CHILD, how], env=env, capture_output=True, text=True, check=True)
    return Path(done.stdout.strip())


def test_a_process_unpacks_under_the_servers_root_and_removes_its_folder_at_exit(tmp_path) -> None:
    folder = run_child("return", tmp_path / "run" / "unpacked")
    assert folder.parent == tmp_path / "run" / "unpacked" and folder.name.startswith("unpacked-")
    assert not folder.exists()


def test_a_worker_ending_with_os_exit_leaves_its_folder_under_the_root_the_server_removes(tmp_path) -> None:
    folder = run_child("os._exit", tmp_path / "unpacked")
    assert (folder / "engine.so").exists() and folder.parent == tmp_path / "unpacked"


def test_the_folder_is_made_once_per_process_and_again_when_removed(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(UNPACK_ROOT_ENV, str(tmp_path))
    monkeypatch.setattr("compile.unpacking._folder", None)
    first = process_unpack_dir()
    assert process_unpack_dir() == first and Path(first).parent == tmp_path
    os.rmdir(first)  # something cleaned the temp dir under a running process
    assert process_unpack_dir() != first and Path(process_unpack_dir()).is_dir()


@pytest.mark.parametrize("previous", [None, "/var/tmp"])
def test_tmpdir_points_at_the_folder_only_while_loading(previous, monkeypatch) -> None:
    if previous is None:
        monkeypatch.delenv("TMPDIR", raising=False)
    else:
        monkeypatch.setenv("TMPDIR", previous)
    with unpacking_into("/somewhere/unpacked-1"):
        assert os.environ["TMPDIR"] == "/somewhere/unpacked-1"
    assert os.environ.get("TMPDIR") == previous


def test_the_root_is_set_for_children_while_the_server_runs(monkeypatch) -> None:
    monkeypatch.delenv(UNPACK_ROOT_ENV, raising=False)
    with unpack_root("/run/vision-serve-ipc-x/unpacked"):
        assert os.environ[UNPACK_ROOT_ENV] == "/run/vision-serve-ipc-x/unpacked"
    assert UNPACK_ROOT_ENV not in os.environ


def test_the_server_removes_what_an_ended_worker_left(tmp_path, monkeypatch) -> None:
    folder = run_child("os._exit", tmp_path / "unpacked")
    pid = int(folder.name.split("-")[1])
    other = tmp_path / "unpacked" / f"unpacked-{pid + 1}-abc"  # another worker's, still running
    other.mkdir()
    monkeypatch.setenv(UNPACK_ROOT_ENV, str(tmp_path / "unpacked"))
    remove_unpacked_of(pid)
    assert not folder.exists() and other.is_dir()


def test_the_server_main_and_http_processes_import_no_model_library() -> None:
    """The supervisor removes unpacked engines without importing compile.backends: that package brings
    torch, inductor and OpenAI Triton into the HTTP processes (seconds of start, memory in each), and
    Triton's bindings print leak reports at their exit, which broke the images' JSON logs."""
    code = (
        "import sys, service.supervisor.server, service.http.process; "
        "print(sorted(m for m in ('torch', 'triton', 'compile.backends', 'onnx', 'onnxruntime') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout
