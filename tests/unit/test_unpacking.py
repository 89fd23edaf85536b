"""Where AOTInductor's unpacked packages go (compile/unpacking.py): a folder per process, under the server's
root when it names one, removed at a normal exit, or by the server when a worker ended otherwise.

The loaders here do what torch's ``aoti_load_package`` does, on a real shared library: unpack a package's
layout into a new temp folder and ``dlopen`` the engine library from it. Recent torch makes that folder
in ``TMPDIR``; torch 2.11 (the GPU machine's) always in ``/tmp``. The served path, with a real package
and a real server, is tests/integration/test_compile.py::test_served_artifact_classifies_chelsea_as_a_cat.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from compile.unpacking import (
    ELSEWHERE_FILE,
    UNPACK_ROOT_ENV,
    process_unpack_dir,
    remove_every_unpacked,
    remove_folder,
    remove_unpacked_of,
    unpack_root,
)

CHILD = """
import ctypes, json, os, shutil, sys, tempfile, _json
from compile.unpacking import load_unpacked, process_unpack_dir

def unpack(parent):
    top = tempfile.mkdtemp(dir=parent)
    model = os.path.join(top, "m", "data", "aotinductor", "model")
    os.makedirs(model)
    library = shutil.copy(_json.__file__, os.path.join(model, "engine.wrapper.so"))
    return ctypes.CDLL(library), top

torch, ending = sys.argv[1], sys.argv[2]
# Read while loading, as the loader reads it: torch 2.11 does not.
engine, top = load_unpacked(lambda: unpack("/tmp" if torch == "2.11" else os.environ["TMPDIR"]))
print(json.dumps({"pid": os.getpid(), "folder": process_unpack_dir(), "top": top}), flush=True)
if ending == "os._exit":
    os._exit(0)
"""


def run_child(torch: str, ending: str, root: Path) -> dict:
    env = {**os.environ, UNPACK_ROOT_ENV: str(root)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, torch, ending], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


@pytest.fixture
def leftovers():
    """Folders a child unpacked into /tmp, removed whatever the test found."""
    found: list[str] = []
    yield found
    for path in found:
        shutil.rmtree(path, ignore_errors=True)


def test_recent_torch_unpacks_into_the_process_folder_which_goes_at_exit(tmp_path) -> None:
    child = run_child("recent", "return", tmp_path / "unpacked")
    assert Path(child["top"]).parent == Path(child["folder"])
    assert Path(child["folder"]).parent == tmp_path / "unpacked" and Path(child["folder"]).name.startswith("unpacked-")
    assert not Path(child["folder"]).exists()


def test_torch_2_11_unpacks_into_tmp_and_that_folder_goes_at_exit(tmp_path, leftovers) -> None:
    child = run_child("2.11", "return", tmp_path / "unpacked")
    leftovers.append(child["top"])
    assert Path(child["top"]).parent == Path("/tmp")
    assert not Path(child["top"]).exists() and not Path(child["folder"]).exists()


@pytest.mark.parametrize("torch", ["recent", "2.11"])
def test_a_worker_ending_with_os_exit_leaves_it_to_the_server(torch, tmp_path, leftovers, monkeypatch) -> None:
    child = run_child(torch, "os._exit", tmp_path / "unpacked")
    leftovers.append(child["top"])
    engine = next(Path(child["top"]).rglob("engine.wrapper.so"))
    assert engine.exists()
    other = tmp_path / "unpacked" / f"unpacked-{child['pid'] + 1}-abc"  # another worker's, still running
    other.mkdir()
    monkeypatch.setenv(UNPACK_ROOT_ENV, str(tmp_path / "unpacked"))
    remove_unpacked_of(child["pid"])
    assert not Path(child["top"]).exists() and not Path(child["folder"]).exists() and other.is_dir()


def test_the_server_removes_what_every_worker_left_when_it_stops(tmp_path, leftovers, monkeypatch) -> None:
    children = [run_child("2.11", "os._exit", tmp_path / "unpacked") for _ in range(2)]
    leftovers.extend(child["top"] for child in children)
    monkeypatch.setenv(UNPACK_ROOT_ENV, str(tmp_path / "unpacked"))
    remove_every_unpacked()
    assert not any(Path(child["top"]).exists() or Path(child["folder"]).exists() for child in children)


def test_a_recorded_folder_that_no_longer_holds_a_package_is_kept(tmp_path) -> None:
    folder, unrelated = tmp_path / "unpacked-1-x", tmp_path / "reused-name"
    folder.mkdir()
    unrelated.mkdir()
    (folder / ELSEWHERE_FILE).write_text(f"{unrelated}\n")
    remove_folder(str(folder))
    assert not folder.exists() and unrelated.is_dir()


def test_the_folder_is_made_once_per_process_and_again_when_removed(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(UNPACK_ROOT_ENV, str(tmp_path))
    monkeypatch.setattr("compile.unpacking._folder", None)
    first = process_unpack_dir()
    assert process_unpack_dir() == first and Path(first).parent == tmp_path
    os.rmdir(first)  # something cleaned the temp dir under a running process
    assert process_unpack_dir() != first and Path(process_unpack_dir()).is_dir()


def test_the_root_is_set_for_children_while_the_server_runs(monkeypatch) -> None:
    monkeypatch.delenv(UNPACK_ROOT_ENV, raising=False)
    with unpack_root("/run/vision-serve-ipc-x/unpacked"):
        assert os.environ[UNPACK_ROOT_ENV] == "/run/vision-serve-ipc-x/unpacked"
    assert UNPACK_ROOT_ENV not in os.environ


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
