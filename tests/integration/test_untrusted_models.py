"""Model files are untrusted input (issue 60, docs/security.md): crafted files that would write a marker
if their code ran are refused by compile-trt and vision-serve in one line (exit 2), and the marker
never appears. The loaders' own guards are tested alone in tests/unit/test_untrusted_inputs.py."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compile.offline_loads import untrusted_load
from compile.pt2_archive import load_exported_program
from compile.settings_errors import SettingsError
from tests import crafted_models as crafted

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    return crafted.exported_program(tmp_path_factory.mktemp("pt2") / "tiny.pt2")


@pytest.fixture
def marker(tmp_path) -> Path:
    return tmp_path / "code-ran"


def labels(tmp_path: Path) -> Path:
    path = tmp_path / "labels.txt"
    path.write_text("".join(f"class{i}\n" for i in range(crafted.CLASSES)))
    return path


def run_command(args: list[str], stdin: str = "", env: dict | None = None, timeout: int = 180):
    """A command of this checkout (``python -m``) as a user runs it: its own process, its stdin."""
    environment = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", *args], input=stdin, capture_output=True, text=True, timeout=timeout, env=environment
    )


def one_line_refusal(result, prog: str) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith(f"{prog}: error: ")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return lines[0]


def test_a_real_exported_program_still_loads(program) -> None:
    """The checks refuse what runs code, not what torch.export.save writes."""
    module = load_exported_program(program).module()
    assert module(torch.zeros(3, 3, crafted.IMAGE, crafted.IMAGE)).shape == (3, crafted.CLASSES)


@pytest.mark.parametrize(
    ("craft", "refused"),
    [
        (crafted.pickled_weight, "its weight 'conv.weight' is stored as a pickle"),
        (crafted.pickled_sample_inputs, "is a pickle of more than tensors"),
        (crafted.code_in_shape_expression, "is not plain arithmetic"),
        (crafted.code_in_guards, "is not a plain shape check"),
        (crafted.opaque_constant, "its constant 'evil' is stored as a pickle"),
    ],
    ids=["pickled-weight", "sample-inputs", "sympify", "guards-code", "opaque-constant"],
)
def test_a_pt2_that_would_run_code_is_refused_before_torch_reads_it(program, marker, tmp_path, craft, refused) -> None:
    evil = craft(program, tmp_path / "evil.pt2", marker)
    with pytest.raises(SettingsError, match="is refused") as caught:
        load_exported_program(evil).module()(torch.zeros(2, 3, crafted.IMAGE, crafted.IMAGE))
    assert refused in str(caught.value) and "Re-export it" in str(caught.value)
    assert not marker.exists()


def test_crafted_pt2s_run_their_code_without_the_checks(program, marker, tmp_path) -> None:
    """The crafted files are real attacks: torch.export.load alone runs them (the checks are the guard)."""
    crafts = (crafted.pickled_weight, crafted.pickled_sample_inputs, crafted.code_in_shape_expression,
              crafted.code_in_guards, crafted.opaque_constant)  # fmt: skip
    for craft in crafts:
        marker.unlink(missing_ok=True)
        with contextlib.suppress(Exception):  # the code has run by the time anything fails
            torch.export.load(str(craft(program, tmp_path / "evil.pt2", marker))).module()(torch.zeros(2, 3, 16, 16))
        assert marker.exists(), craft.__name__


def test_the_load_forces_the_weights_only_unpickler_under_the_checks(program, marker, tmp_path) -> None:
    """The net under the archive's checks: inside untrusted_load, torch.export.load's own
    torch.load(weights_only=False) of a pickled weight unpickles no code."""
    evil = crafted.pickled_weight(program, tmp_path / "evil.pt2", marker)
    with untrusted_load(), pytest.raises(Exception, match="Weights only load failed"):
        torch.export.load(str(evil))
    assert not marker.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # only for the load


def test_an_aotinductor_member_is_refused(program, tmp_path) -> None:
    evil = crafted.with_member(program, tmp_path / "aoti.pt2", "data/aotinductor/model/model.so", b"\x7fELF")
    with pytest.raises(
        SettingsError, match=r"data/aotinductor/model/model\.so.*which torch\.export\.save does not write"
    ):
        load_exported_program(evil)


def test_compile_trt_refuses_a_pt2_that_runs_code_in_one_line(program, marker, tmp_path) -> None:
    evil = crafted.pickled_weight(program, tmp_path / "evil.pt2", marker)
    args = ["compile.cli", "--model", str(evil), "--labels", str(labels(tmp_path)), *crafted.PREPROCESS,
            "--backend", "onnx", "--device", "cpu", "--output", str(tmp_path / "out")]  # fmt: skip
    line = one_line_refusal(run_command(args), "compile-trt")
    assert f"{evil} is refused: its weight 'conv.weight' is stored as a pickle" in line
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_vision_serve_refuses_a_pt2_that_runs_code_in_one_line(program, marker, tmp_path) -> None:
    evil = crafted.code_in_guards(program, tmp_path / "evil.pt2", marker)
    args = ["service.cli", "--model", str(evil), "--labels", str(labels(tmp_path)), *crafted.PREPROCESS,
            "--port", "18997", "--device", "cpu"]  # fmt: skip
    line = one_line_refusal(run_command(args), "vision-serve")
    assert "is refused: its guards_code" in line and "Re-export it" in line
    assert not marker.exists()


@pytest.mark.parametrize("prog", ["compile-trt", "vision-serve"])
def test_a_folder_with_its_own_code_is_refused_even_when_the_operator_says_yes(prog, marker, tmp_path) -> None:
    """transformers would ask y/N on the terminal (and, under vision-serve, in the planner child whose
    stdout is its answer): the folder is refused before, whatever stdin says."""
    pytest.importorskip("transformers")
    folder = crafted.remote_code_folder(tmp_path / "evil", marker)
    module = {"compile-trt": "compile.cli", "vision-serve": "service.cli"}[prog]
    args = [module, "--model", str(folder), "--device", "cpu"]
    args += ["--output", str(tmp_path / "out")] if prog == "compile-trt" else ["--port", "18998"]
    line = one_line_refusal(run_command(args, stdin="y\ny\n"), prog)
    assert "has an auto_map" in line and "runs no code from a model folder" in line
    assert not marker.exists()


def test_a_timm_folder_naming_the_hub_makes_no_request(tmp_path) -> None:
    pytest.importorskip("timm")
    from tests.hf_folders import save_timm

    folder = save_timm(tmp_path / "timm")
    config = (folder / "config.json").read_text().replace('"resnet18"', '"hf-hub:someone/model"')
    (folder / "config.json").write_text(config)
    with crafted.listener() as (endpoint, seen):
        result = run_command(
            ["compile.cli", "--model", str(folder), "--device", "cpu", "--output", str(tmp_path / "out")],
            env={"HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "0"},
        )
        line = one_line_refusal(result, "compile-trt")
    assert "names the timm architecture 'hf-hub:someone/model'" in line and "timm.list_models()" in line
    assert seen == []


def test_the_hub_is_offline_under_the_checks(tmp_path) -> None:
    """The net under the name check: timm asked for a hub model inside untrusted_load sends nothing."""
    pytest.importorskip("timm")
    code = (
        "import timm\nfrom compile.offline_loads import untrusted_load\n"
        "with untrusted_load():\n    timm.create_model('hf-hub:someone/model', pretrained=False)\n"
    )
    with crafted.listener() as (endpoint, seen):
        environment = dict(os.environ, PYTHONPATH=str(ROOT), HF_ENDPOINT=endpoint, HF_HUB_OFFLINE="0")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment)
    assert result.returncode != 0 and seen == [], (seen, result.stderr[-2000:])


def test_compile_trt_refuses_onnx_external_data_outside_its_folder(tmp_path) -> None:
    from tests.unit.test_untrusted_inputs import onnx_reading

    model = onnx_reading(tmp_path, "../outside/secret.bin")
    args = ["compile.cli", "--model", str(model), "--labels", str(labels(tmp_path)), *crafted.PREPROCESS,
            "--device", "cpu", "--output", str(tmp_path / "out")]  # fmt: skip
    line = one_line_refusal(run_command(args), "compile-trt")
    assert "its tensor 'w' takes its data from '../outside/secret.bin'" in line and "inside the model's folder" in line
