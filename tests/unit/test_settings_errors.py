"""Settings errors (issue 54): one type naming the flag, the value and the fix, and one way out of each
command: exit status 2 and one line on stderr, ``PROG: error: MESSAGE``, for compile-trt, vision-serve
and vision-tune alike (compile/settings_errors.py)."""

from __future__ import annotations

import ast
import json
import pickle
from pathlib import Path

import pytest

from compile.settings_errors import HIDDEN, SettingsError, exit_on_settings_error
from service.tune.errors import TuneSetupError

ROOT = Path(__file__).resolve().parents[2]

# The modules whose every refusal of a value is a SettingsError: a bare ValueError here would lose the
# flag, the value and the fix, and (past the settings) the usage error's exit status.
CONVERTED = (
    "compile/cli.py",
    "compile/cli_flags.py",
    "compile/model_request.py",
    "compile/settings.py",
    "compile/devices.py",
    "compile/build.py",
    "compile/catalog.py",
    "compile/gate.py",
    "compile/model_source.py",
    "compile/quantization/modelopt.py",
    "compile/quantization/onnx_qdq.py",
    "compile/quantization/pt2e.py",
    "service/cli.py",
    "service/settings.py",
    "service/supervisor/planning/layout.py",
    "service/supervisor/planning/planner.py",
    "service/tune/cli.py",
    "service/tune/journal.py",
    "service/tune/machine.py",
    "service/tune/settings.py",
)
# The settings proper: each of their refusals says the fix in a field of its own.
SETTINGS = ("compile/cli_flags.py", "compile/model_request.py", "compile/settings.py", "service/settings.py",
            "service/tune/settings.py")  # fmt: skip
CLIS = ("compile/cli.py", "service/cli.py", "service/tune/cli.py")


def one_line_refusal(capsys: pytest.CaptureFixture, prog: str, run) -> str:
    """What ``run()`` wrote to stderr, checked to be the usage error's one line and exit status."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        run()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(f"{prog}: error: "), err
    return err


# ---- the type -----------------------------------------------------------------------------------


def test_the_error_carries_the_flag_the_value_and_the_fix() -> None:
    error = SettingsError.must("--port", 80, "be in 1024..65535", "Pick a free port from 1024 up.")
    assert (error.flag, error.value, error.fix) == ("--port", 80, "Pick a free port from 1024 up.")
    assert str(error) == "--port must be in 1024..65535, got 80. Pick a free port from 1024 up."
    assert isinstance(error, ValueError)  # whatever caught ValueError (a load call, pydantic) still does
    assert str(SettingsError.must("--host", "x", "be one of a, b", "Use a.")).endswith("got 'x'. Use a.")


def test_the_error_crosses_processes_as_it_was_made() -> None:
    error = TuneSetupError("--work", "/w", "/w holds a tune of other settings.", "Use --restart.")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is TuneSetupError and vars(again) == vars(error) and str(again) == str(error)
    # The planner child's answer is JSON: a value that is not a JSON scalar becomes its text.
    crossed = SettingsError.from_dict(json.loads(json.dumps(SettingsError("--a, --b", (1, 2), "m.", "f.").to_dict())))
    assert (crossed.flag, crossed.value, crossed.message, crossed.fix) == ("--a, --b", "(1, 2)", "m.", "f.")


def test_a_tune_setup_error_is_a_settings_error_and_keeps_the_fields_it_wraps() -> None:
    wrapped = TuneSetupError.of(SettingsError("--images", "d", "d holds no images.", "Add some."))
    assert isinstance(wrapped, SettingsError) and (wrapped.flag, wrapped.value, wrapped.fix) == (
        "--images",
        "d",
        "Add some.",
    )
    foreign = TuneSetupError.of(ValueError("a model file that does not load: use another"))
    assert (foreign.flag, foreign.value, foreign.fix, str(foreign)) == (
        "",
        None,
        "",
        "a model file that does not load: use another",
    )


def test_the_helper_writes_one_line_whatever_the_message(capsys) -> None:
    @exit_on_settings_error("prog")
    def main() -> int:
        raise SettingsError("--x", 1, "line one\nline  two", "fix\n")

    assert one_line_refusal(capsys, "prog", main) == "prog: error: line one line two fix\n"
    assert exit_on_settings_error("prog")(lambda: 7)() == 7


def test_secrets_are_never_the_value_shown() -> None:
    from service.settings import ServeSettings, env_overrides

    for make in (
        lambda: ServeSettings(api_key=" s3cret"),
        lambda: ServeSettings(api_key="k", admin_api_key="k"),
        lambda: ServeSettings(response_cache_mb=1, response_cache_redis="http://:s3cret@h"),
    ):
        with pytest.raises(SettingsError) as refused:
            make()
        assert refused.value.value == HIDDEN and "s3cret" not in repr(refused.value) + str(refused.value)
    with pytest.raises(SettingsError) as refused:
        env_overrides({"VISION_SERVE_RESPONSE_CACHE_MB": "s3cret"})
    assert refused.value.flag == "VISION_SERVE_RESPONSE_CACHE_MB" and refused.value.value == "s3cret"  # not a secret


def test_a_config_file_key_says_so(tmp_path) -> None:
    from service.settings import read_config_file

    config = tmp_path / "serve.toml"
    config.write_text('port = "9000"\n')
    with pytest.raises(SettingsError) as refused:
        read_config_file(config)
    assert (refused.value.flag, refused.value.value, refused.value.fix) == (
        "config file key port",
        "9000",
        "Write it as port = 8000.",
    )
    config.write_text('api-kee = "s3cret"\n')
    with pytest.raises(SettingsError) as refused:
        read_config_file(config)
    assert refused.value.value == HIDDEN and "Did you mean api_key?" in str(refused.value)


# ---- the three commands -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "env", "flag", "value", "fix"),
    [
        (["--max-batch-size", "0"], {}, "--max-batch-size", "got 0", "Leave it out for 32."),
        (["--host", "10.1.2.3"], {}, "--host", "'10.1.2.3'", "Use 0.0.0.0 to listen on every interface."),
        (["--workers-per-device", "-2"], {}, "--workers-per-device", "-2", "Use 0 to let the server choose"),
        ([], {"VISION_SERVE_PORT": "eighty"}, "VISION_SERVE_PORT", "'eighty'", "Set it to an integer"),
        (["--trace-sample-rate", "0.5"], {}, "--otlp-endpoint", "0.5", "Add e.g. --otlp-endpoint"),
        (["--weights", "/no/such.pt"], {}, "--weights", "'/no/such.pt'", "Use imagenet, random, or a state_dict"),
    ],
)
def test_vision_serve_refuses_a_setting_in_one_line(argv, env, flag, value, fix, capsys, monkeypatch) -> None:
    from service.cli import main

    monkeypatch.setattr("service.settings.module_installed", lambda name: True)  # the extras are not the point
    for name, text in env.items():
        monkeypatch.setenv(name, text)
    err = one_line_refusal(capsys, "vision-serve", lambda: main(argv))
    assert flag in err and value in err and fix in err


def test_vision_serve_says_where_a_refused_value_came_from(tmp_path, capsys) -> None:
    from service.cli import main
    from service.settings import resolve_settings

    config = tmp_path / "serve.toml"
    config.write_text("max_queue = 0\n")
    err = one_line_refusal(capsys, "vision-serve", lambda: main(["--config", str(config)]))
    assert "--max-queue must be >= 1, got 0. (values set by: config file" in err and "Leave it out for" in err
    with pytest.raises(SettingsError) as refused:
        resolve_settings({}, {}, str(config))
    assert refused.value.flag == f"max_queue (config file {config})"
    with pytest.raises(SettingsError) as refused:
        resolve_settings({}, {"VISION_SERVE_PORT": "80"})
    assert (refused.value.flag, refused.value.value) == ("VISION_SERVE_PORT", 80)


def test_a_settings_error_of_the_planner_child_keeps_its_fields(monkeypatch) -> None:
    """The planner runs in a child process (service/supervisor/planning/launch.py): its refusal crosses
    as JSON and is raised again in the main process with the same flag, value and fix."""
    from service.settings import ServeSettings
    from service.supervisor.planning import child
    from service.supervisor.planning.launch import Planning

    refusal = SettingsError("--model", "resnet125", "Unknown model 'resnet125'.", "Use 'resnet152'.")

    def refuse(settings, load):
        raise refusal

    monkeypatch.setattr(child, "plan_repository", refuse)
    answer = child.answer(ServeSettings(), None)

    class Done:  # the child, done: its answer on stdout
        returncode = 0

        def communicate(self, text=None, timeout=None):
            return json.dumps(answer), ""

    planning = object.__new__(Planning)
    planning._process, planning._input, planning._keys = Done(), "", ServeSettings()
    with pytest.raises(SettingsError) as raised:
        planning.result()
    assert vars(raised.value) == vars(refusal)

    # A refusal that names no setting (a model file that does not load) crosses with its message alone.
    def fail(settings, load):
        raise ValueError("bad file")

    monkeypatch.setattr(child, "plan_repository", fail)
    answer = child.answer(ServeSettings(), None)
    with pytest.raises(SettingsError) as raised:
        planning.result()
    assert (raised.value.flag, raised.value.value, raised.value.fix, str(raised.value)) == ("", None, "", "bad file")


def test_vision_serve_maps_a_refusal_of_the_planner_like_the_others(capsys, monkeypatch) -> None:
    from service.cli import main
    from service.supervisor.planning import launch

    class Refused:
        def result(self, timeout_s=None):
            raise SettingsError("--model", "resnet125", "Unknown model 'resnet125'.", "Use 'resnet152'.")

    monkeypatch.setattr(launch, "start_planning", lambda settings: Refused())
    err = one_line_refusal(capsys, "vision-serve", lambda: main(["--model", "resnet125"]))
    assert err == "vision-serve: error: Unknown model 'resnet125'. Use 'resnet152'.\n"
    err = one_line_refusal(capsys, "vision-serve", lambda: main(["--print-config"]))
    assert "these settings would not start a server: Unknown model 'resnet125'. Use 'resnet152'." in err


@pytest.mark.parametrize(
    ("argv", "flag", "value", "fix"),
    [
        (["--batch", "8,4,1"], "--batch", "8,4,1", "Example: 1,8,32"),
        (["--optimization-level", "9"], "--optimization-level", "got 9", "Leave it out for 3"),
        (["--precision", "int8"], "--precision int8 needs --calibration DIR", "", "A good set:"),
        (["--mean", "0.5,0.5"], "--mean", "'0.5,0.5'", "Give the values the model was trained with"),
    ],
)
def test_compile_trt_refuses_a_setting_in_one_line(argv, flag, value, fix, capsys) -> None:
    from compile.cli import main

    err = one_line_refusal(capsys, "compile-trt", lambda: main(["--device", "cpu", *argv]))
    assert flag in err and value in err and fix in err


@pytest.mark.parametrize(
    ("raised", "words"),
    [
        ("labels", "--labels l.txt has 3 labels, but m.onnx outputs 5 classes. Give the labels file"),
        ("weights", "Weights file not found: w.pt."),
    ],
)
def test_compile_trt_maps_what_the_compile_refuses_the_same_way(raised, words, capsys, monkeypatch) -> None:
    """A refusal met while compiling (labels, model files, weights) exits as the settings' do."""
    import compile.build
    from compile.cli import main
    from compile.labels import LabelsError
    from compile.weights import WeightsError

    errors = {"labels": LabelsError(words), "weights": WeightsError(words)}

    def refuse(settings, progress):
        raise errors[raised]

    monkeypatch.setattr(compile.build, "compile_artifact", refuse)
    monkeypatch.setattr("compile.torch_logging.adopt_torch_logger", lambda: None)
    err = one_line_refusal(capsys, "compile-trt", lambda: main(["--device", "cpu"]))
    assert err == f"compile-trt: error: {words}\n"


@pytest.mark.parametrize(
    ("argv", "flag", "value", "fix"),
    [
        (["--p99-ms", "80", "--engines", "onnx-int4"], "--engines", "'onnx-int4'", "Leave it out for the machine's"),
        (["--p99-ms", "80", "--rate", "5"], "--rate", "5", "Leave --rate out, or add --objective latency."),
        (["--p99-ms", "80", "--output", "t.yaml"], "--output", "'t.yaml'", "Use e.g. --output t.toml."),
        (["--p99-ms", "-1"], "--p99-ms", "-1", "Give the p99 your users need"),
    ],
)
def test_vision_tune_refuses_a_setting_in_one_line(argv, flag, value, fix, capsys) -> None:
    from service.tune.cli import main

    err = one_line_refusal(capsys, "vision-tune", lambda: main(argv))
    assert flag in err and value in err and fix in err


def test_vision_tune_maps_what_the_machine_refuses_the_same_way(tmp_path, capsys, monkeypatch) -> None:
    import service.tune.tuner
    from service.tune import cli

    class Refusing:
        def __init__(self, settings):
            raise TuneSetupError("--devices", "cuda:0", "--devices cuda:0: the tune runs on cpu.", "Change --device.")

    monkeypatch.setattr(service.tune.tuner, "Tuner", Refusing)
    monkeypatch.setattr(cli, "missing_extras", lambda: [])
    monkeypatch.setattr(cli, "_stop_on_signals", lambda: None)
    err = one_line_refusal(
        capsys, "vision-tune", lambda: cli.main(["--p99-ms", "80", "--output", str(tmp_path / "t.toml")])
    )
    assert err == "vision-tune: error: --devices cuda:0: the tune runs on cpu. Change --device.\n"


# ---- what keeps it so ---------------------------------------------------------------------------


def raises_of(path: str) -> list[ast.Raise]:
    tree = ast.parse((ROOT / path).read_text(), path)
    return [node for node in ast.walk(tree) if isinstance(node, ast.Raise) and node.exc is not None]


def called_name(node: ast.expr) -> str:
    """``ValueError`` of ``raise ValueError(...)``, ``SettingsError.must`` of ``raise SettingsError.must(...)``."""
    target = node.func if isinstance(node, ast.Call) else node
    return ast.unparse(target)


@pytest.mark.parametrize("path", CONVERTED)
def test_no_bare_value_error_is_raised_where_settings_are_checked(path: str) -> None:
    bare = [node.lineno for node in raises_of(path) if called_name(node.exc) == "ValueError"]
    assert not bare, (
        f"{path}, line(s) {bare}: raise SettingsError(flag, value, message, fix) (compile/settings_errors.py), "
        "not a bare ValueError: the user is owed the flag, the value and the fix, and the command its exit status 2."
    )


@pytest.mark.parametrize("path", SETTINGS)
def test_every_refusal_of_the_settings_says_the_fix(path: str) -> None:
    missing = []
    for node in raises_of(path):
        call = node.exc
        if not (isinstance(call, ast.Call) and called_name(call).startswith("SettingsError")):
            continue
        fix = call.args[3] if len(call.args) > 3 else next((k.value for k in call.keywords if k.arg == "fix"), None)
        if fix is None or (isinstance(fix, ast.Constant) and not fix.value):
            missing.append(node.lineno)
    assert not missing, f"{path}, line(s) {missing}: give SettingsError a fix, what the user should do instead."


@pytest.mark.parametrize("path", CLIS)
def test_the_commands_map_settings_errors_in_one_place(path: str) -> None:
    text = (ROOT / path).read_text()
    assert "@exit_on_settings_error(" in text, f"{path}: decorate main with exit_on_settings_error"
    assert "parser.error(" not in text, f"{path}: raise SettingsError; exit_on_settings_error says it"


def test_the_error_module_stands_on_the_standard_library_alone() -> None:
    """compile-trt, vision-serve and vision-tune all import it: it must import nothing of theirs."""
    tree = ast.parse((ROOT / "compile/settings_errors.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {m for m in imported if m.split(".")[0] in ("compile", "service", "preprocessing")}
