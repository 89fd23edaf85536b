"""vision-tune's parts that need no server: settings and flags, the grid of a machine, compile-trt's
command and answers, the journal a stopped tune resumes from, the config file it writes, the
progress line, the report, and the launcher's tie between a server and the process that started it."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from service.settings import ServeSettings, read_config_file
from service.tune import _defaults
from service.tune.cli import build_parser, main, settings_from_args
from service.tune.engines import (
    FAILED,
    GATE_FAILED,
    OK,
    STATUS_BY_EXIT,
    UNAVAILABLE,
    EngineBuild,
    compile_arguments,
    gate_or_reason,
    model_slug,
)
from service.tune.journal import Journal
from service.tune.ladder import CLOSED, POISSON, Step
from service.tune.machine import Machine, build_grid, engine_batch
from service.tune.measure import OK as MEASURED
from service.tune.measure import Measurement
from service.tune.output import serve_toml, write_serve_config
from service.tune.progress import TuneProgress, clock
from service.tune.report import ConfirmRound, TuneRecord, csv_rows, markdown, ratio, write_csv, write_plot
from service.tune.search import Objective
from service.tune.search_phase import out_of_time
from service.tune.settings import TuneSettings
from service.tune.space import Candidate, SearchSpace

CPU = Machine("cpu", 0, 2, True, "test CPU")
DEFAULT = Candidate("onnx-fp32", 32, 1, 0.0, 0, 0, "pil", "cpu")


def settings(**values) -> TuneSettings:
    return TuneSettings(**{"p99_ms": 100.0, **values})


# ---- settings and flags ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"p99_ms": 0.0}, "--p99-ms is required"),
        ({"objective": "speed"}, "--objective must be throughput"),
        ({"search": "random"}, "--search must be quick"),
        ({"rate": 10.0}, "--rate is the load of --objective latency"),
        ({"output": "tuned.yaml"}, "--output must name a .toml file"),
        ({"engines": "onnx-int4"}, "--engines takes BACKEND-PRECISION"),
        ({"engines": "auto-fp32"}, "--engines takes BACKEND-PRECISION"),
        ({"max_batch_sizes": "1,0"}, "--max-batch-sizes takes numbers >= 1"),
        ({"batch_timeouts_ms": "a"}, "--batch-timeouts-ms takes numbers"),
        ({"preprocess": "opencv"}, "--preprocess takes backends"),
        ({"devices": "auto"}, "auto is not a point of the grid"),
        ({"load_factor": 1.5}, "--load-factor must be in (0, 1]"),
        ({"min_requests": 3}, "--min-requests must be >= 10"),
        ({"budget_min": -1.0}, "--budget-min must be >= 0"),
        ({"device": "gpu"}, "--device must be auto, cpu, cuda or cuda:N"),
    ],
)
def test_settings_refuse_what_cannot_be_tuned_and_say_how(values, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        settings(**values)


def test_grid_lists_parse_sorted_and_unique():
    parsed = settings(max_batch_sizes="8, 1,8", batch_timeouts_ms="0,2.5", engines="onnx-fp32,onnx-fp32").grid_values()
    assert parsed == {"max_batch_sizes": (1, 8), "batch_timeouts_ms": (0.0, 2.5), "engines": ("onnx-fp32",)}


def test_every_setting_is_a_flag_and_usage_errors_exit_2(capsys):
    args = build_parser().parse_args(["--p99-ms", "80", "--engines", "onnx-fp32", "--gate-min-cosine", "0.9999"])
    tuned = settings_from_args(args)
    assert (tuned.p99_ms, tuned.engines, tuned.gate_min_cosine, tuned.restart) == (80.0, "onnx-fp32", 0.9999, False)
    with pytest.raises(SystemExit) as exited:
        main(["--model", "efficientnet-lite0"])
    assert exited.value.code == 2 and "--p99-ms is required" in capsys.readouterr().err


def test_work_and_report_files_sit_beside_the_output(tmp_path):
    tuned = settings(output=str(tmp_path / "lite0.toml"))
    assert tuned.work_dir == tmp_path / "lite0.work"
    assert tuned.artifacts_dir == tmp_path / "lite0.work" / "artifacts"
    assert settings(output="x.toml", artifacts=str(tmp_path / "a")).artifacts_dir == tmp_path / "a"


# ---- the machine's grid ------------------------------------------------------------------------


def test_the_cpu_grid_keeps_the_defaults_and_drops_bf16_without_bf16_units():
    space, notes = build_grid(settings(), CPU)
    assert space.values["engine"] == _defaults.CPU_ENGINES
    assert 32 in space.values["max_batch_size"] and space.values["device"] == ("cpu",)
    assert "pil" in space.values["preprocess"]
    no_bf16, notes = build_grid(settings(), Machine("cpu", 0, 2, False, "old CPU"))
    assert "inductor-bf16" not in no_bf16.values["engine"]
    assert any("emulated" in note for note in notes)
    asked, _ = build_grid(settings(engines="inductor-bf16", max_batch_sizes="2"), Machine("cpu", 0, 2, False, "x"))
    assert asked.values["engine"] == ("inductor-bf16",) and asked.values["max_batch_size"] == (2,)


def test_the_gpu_grid_has_devices_pipelines_http_processes_and_gpu_preprocessing():
    """What a machine with two GPUs is offered (the machine is described, not probed: none here)."""
    two_gpus = Machine("cuda", 2, 16, False, "test GPU")
    space, notes = build_grid(settings(), two_gpus)
    assert space.values["engine"] == _defaults.GPU_ENGINES
    assert space.values["device"] == ("cuda:0", "cuda")
    assert space.values["pipeline_depth"] == (1, 2) and space.values["api_servers"] == (0, 2)
    assert set(space.values["preprocess"]) <= {"torch", "dali", "cvcuda"} and "torch" in space.values["preprocess"]
    assert any(note.startswith("preprocessing cvcuda left out") for note in notes)  # no libcuda.so.1 here
    one_gpu, _ = build_grid(settings(), Machine("cuda", 1, 16, False, "test GPU"))
    assert one_gpu.values["device"] == ("cuda",)
    with pytest.raises(ValueError, match="there are 2 GPUs"):
        build_grid(settings(devices="cuda:5"), two_gpus)


def test_the_grid_refuses_devices_and_backends_this_machine_lacks():
    with pytest.raises(ValueError, match="cvcuda cannot run here"):
        build_grid(settings(preprocess="cvcuda"), CPU)
    with pytest.raises(ValueError, match="the tune runs on cpu"):
        build_grid(settings(devices="cuda:0"), CPU)


def test_engines_cover_every_batch_of_the_grid_with_compile_trts_default_when_they_fit():
    small, _ = build_grid(settings(max_batch_sizes="1,4"), CPU)
    assert engine_batch(small) == (1, 8, 32)  # what `compile-trt --model X` builds
    large, _ = build_grid(settings(max_batch_sizes="8,128"), CPU)
    assert engine_batch(large) == (1, 8, 128)


# ---- compile-trt -------------------------------------------------------------------------------


def test_compile_arguments_pass_the_model_and_gate_flags_on(tmp_path):
    tuned = settings(model="resnet50", weights="w.pt", labels="l.txt", gate_min_cosine=0.99999, crop_size=200)
    arguments = compile_arguments(tuned, "inductor-bf16", (1, 8, 32), tmp_path / "out", "cpu")
    text = " ".join(arguments)
    assert "--model resnet50 --weights w.pt --labels l.txt --crop-size 200" in text
    assert "--gate-min-cosine 0.99999" in text
    assert "--backend inductor --precision bf16 --batch 1,8,32 --device cpu" in text
    assert "--gate-min-top1-agreement" not in text  # not given: compile-trt's own threshold
    assert compile_arguments(tuned, "onnx-fp16", (1, 8, 32), tmp_path, "cuda")[-3] == "cuda:0"
    assert model_slug(settings(model="/models/my model.onnx")) == "my_model"
    assert model_slug(settings(model="timm:resnet18", name="pets")) == "pets"


def test_compile_trt_exit_codes_and_messages_become_statuses():
    assert STATUS_BY_EXIT[0] == OK and STATUS_BY_EXIT[3] == GATE_FAILED and STATUS_BY_EXIT[4] == UNAVAILABLE
    assert STATUS_BY_EXIT.get(1, FAILED) == FAILED
    stderr = "WARNING something\ncompile-trt: accuracy gate FAILED, no artifact written:\n  cosine 0.99 FAIL\n"
    assert gate_or_reason(stderr) == "compile-trt: accuracy gate FAILED, no artifact written:\n  cosine 0.99 FAIL"
    assert gate_or_reason("a\nb\n") == "a\nb"
    build = EngineBuild("onnx-fp32", OK, "/a", 1.0, "m", ["compile-trt"])
    assert EngineBuild.from_dict(json.loads(json.dumps(build.as_dict()))) == build


# ---- the journal -------------------------------------------------------------------------------


def step(load=CLOSED, c=1, rate=0.0, p99=50.0) -> Step:
    return Step(load, c, rate, 60, 60, 0, 20.0, p99 / 2, p99, p99, 1.0, 3.0)


def measurement(candidate=DEFAULT, phase="search", number=0, seconds=30.0) -> Measurement:
    return Measurement(
        candidate, phase, number, MEASURED, 100.0, [step(c=1), step(c=2)], [step(POISSON, 0, 16.0)], seconds=seconds
    )


def test_the_journal_reads_back_what_was_written_and_what_it_cost(tmp_path):
    identity = {"model": "m", "grid": {"engine": ["onnx-fp32"]}}
    journal = Journal.open(tmp_path / "journal.jsonl", identity)
    journal.add_engine(EngineBuild("onnx-fp32", OK, "/a", 12.0, "gate ok"))
    journal.add_measurement(measurement(seconds=30.0))
    journal.add_measurement(measurement(DEFAULT.replace(max_batch_size=8), seconds=40.0))
    again = Journal.open(tmp_path / "journal.jsonl", identity)
    assert again.resumed == 3 and again.spent_s == pytest.approx(82.0)
    assert again.measurement("search", DEFAULT.key) == measurement(seconds=30.0)
    assert again.measurement("confirm-tuned", DEFAULT.key) is None


def test_a_line_cut_short_by_a_kill_is_ignored(tmp_path):
    path = tmp_path / "journal.jsonl"
    journal = Journal.open(path, {"a": 1})
    journal.add_measurement(measurement())
    with path.open("a") as f:
        f.write('{"kind": "measurement", "measurement": {"candid')
    assert Journal.open(path, {"a": 1}).resumed == 1


def test_a_journal_of_other_settings_is_refused_naming_them_unless_restarted(tmp_path):
    path = tmp_path / "journal.jsonl"
    Journal.open(path, {"p99_ms": 100.0, "model": "m"}).add_measurement(measurement())
    with pytest.raises(ValueError, match=r"p99_ms: 100.0 -> 80.0.*--restart"):
        Journal.open(path, {"p99_ms": 80.0, "model": "m"})
    assert Journal.open(path, {"p99_ms": 80.0, "model": "m"}, restart=True).resumed == 0
    assert Journal.open(path, {"p99_ms": 80.0, "model": "m"}).resumed == 0


def test_the_budget_keeps_time_for_the_confirm_rounds():
    assert not out_of_time(elapsed_s=100, durations=[60], confirm_rounds=2, budget_s=0)
    assert not out_of_time(elapsed_s=100, durations=[60], confirm_rounds=2, budget_s=600)  # 100 + 240 + 60 < 600
    assert out_of_time(elapsed_s=400, durations=[60], confirm_rounds=2, budget_s=600)
    assert out_of_time(elapsed_s=590, durations=[], confirm_rounds=0, budget_s=600) is False
    assert out_of_time(elapsed_s=601, durations=[], confirm_rounds=0, budget_s=600)


# ---- the config file ---------------------------------------------------------------------------


def test_the_answer_is_a_config_file_vision_serve_reads(tmp_path):
    values = DEFAULT.replace(max_batch_size=8, workers_per_device=2).serve_values(tmp_path / "artifact")
    path = write_serve_config(tmp_path / "tuned.toml", values, ["vision-tune: a\nsecond line", "Serve: x"])
    text = path.read_text()
    assert text.startswith("# vision-tune: a\n# second line\n# Serve: x\n")
    read = read_config_file(path)
    assert read["max_batch_size"] == 8 and read["workers_per_device"] == 2 and read["batch_timeout_ms"] == 0.0
    assert ServeSettings(**read).artifact == str(tmp_path / "artifact")


def test_a_config_the_server_would_refuse_is_never_written(tmp_path):
    with pytest.raises(ValueError, match="--max-batch-size must be >= 1"):
        write_serve_config(tmp_path / "bad.toml", {"max_batch_size": 0})
    assert list(tmp_path.iterdir()) == []
    assert serve_toml({"device": "cpu"}) == 'device = "cpu"\n'


# ---- progress ----------------------------------------------------------------------------------


def test_progress_shows_counts_and_an_eta_within_the_budget(caplog):
    assert clock(65) == "1:05" and clock(3725) == "1:02:05"
    progress = TuneProgress(total=10, budget_s=600.0, live=False)
    assert "0/10 configurations" in progress.line() and "ETA --:--" in progress.line()
    with caplog.at_level("INFO"):
        progress.item_done(30.0)
        progress.item_done(50.0)
    assert progress.eta_s() == pytest.approx(min(8 * 40.0, 600.0 - progress.elapsed_s), abs=1)
    assert "2/10 configurations" in caplog.text
    progress.status("onnx-fp32 b8: closed loop c=4")
    assert progress.line().endswith("| onnx-fp32 b8: closed loop c=4")
    progress.item_done(40.0)
    assert "|" not in progress.line(), "a finished configuration's last load step is not shown as running"
    progress.close()


def test_a_live_progress_line_redraws_in_place():
    import io

    stream = io.StringIO()
    progress = TuneProgress(total=4, stream=stream, live=True)
    progress.item_done(10.0)
    progress.message("onnx-fp32: gate passed")
    progress.close()
    text = stream.getvalue()
    assert "\r\033[K" in text and "1/4 configurations" in text and "onnx-fp32: gate passed\n" in text


# ---- the report --------------------------------------------------------------------------------


def record(tmp_path) -> TuneRecord:
    space = SearchSpace(
        {
            "engine": ("onnx-fp32",),
            "max_batch_size": (1, 32),
            "workers_per_device": (1,),
            "batch_timeout_ms": (0.0,),
            "api_servers": (0,),
            "pipeline_depth": (0,),
            "preprocess": ("pil",),
            "device": ("cpu",),
        }
    )
    tuned = DEFAULT.replace(max_batch_size=1)
    slow = Measurement(DEFAULT.replace(max_batch_size=32), "search", 0, MEASURED, 100.0, [step(c=1, p99=150.0)])
    good = measurement(tuned)
    confirm = ConfirmRound(
        Measurement(DEFAULT, "confirm-defaults", 0, MEASURED, 100.0, [step()], [step(POISSON, 0, 10.0, 80.0)]),
        Measurement(
            tuned, "confirm-tuned", 0, MEASURED, 100.0, [step()], [step(POISSON, 0, 16.0)], step(POISSON, 0, 10.0, 40.0)
        ),
    )
    return TuneRecord(
        "efficientnet-lite0", Objective("throughput", 100.0), "full", "test CPU (2 CPUs)", space, ["a note"],
        [EngineBuild("onnx-fp32", OK, "/a", 12.0, "cosine 1"), EngineBuild("inductor-bf16", GATE_FAILED, "", 9.0,
         "compile-trt: accuracy gate FAILED\n  cosine 0.99 FAIL")],
        [good, slow], DEFAULT.replace(max_batch_size=32), tuned, "done", 2, 300.0, [confirm],
        "Poisson arrivals at the rate the defaults sustained", tmp_path / "tuned.toml",
    )  # fmt: skip


def test_the_report_names_the_answer_the_dropped_engine_and_the_ratios(tmp_path):
    rec = record(tmp_path)
    ratios = rec.ratios()
    assert ratios["throughput"] == pytest.approx(16.0 / 10.0) and ratios["p99"] == pytest.approx(40.0 / 80.0)
    text = markdown(rec, "tuned.png", "tuned.csv")
    assert "**Tuned ([tuned.toml](tuned.toml)):** Poisson arrivals at 16/s" in text
    assert "| inductor-bf16 | gate failed | 9 | compile-trt: accuracy gate FAILED<br>  cosine 0.99 FAIL |" in text
    assert "**Poisson rate sustained at p99 <= 100 ms 1.60x**, **p99 0.50x**" in text
    assert "no: p99 150 ms at c=1 > 100 ms" in text and "- a note" in text
    assert ratio(math.nan) == "n/a"


def test_the_csv_has_a_row_per_load_run_and_the_plot_is_drawn(tmp_path):
    rec = record(tmp_path)
    rows = csv_rows(rec)
    # search: 3 runs + 1 run; confirm: defaults 2, tuned 3 (its reference run too)
    assert len(rows) == 3 + 1 + 2 + 3
    assert {row["phase"] for row in rows} == {"search", "confirm-defaults", "confirm-tuned"}
    assert sum(bool(row["chosen"]) for row in rows if row["phase"] == "search") == 2  # c=2 and its Poisson run
    written = write_csv(rec, tmp_path / "t.csv").read_text().splitlines()
    assert written[0].startswith("phase,round,configuration,engine") and len(written) == 1 + len(rows)
    plot = write_plot(rec, tmp_path / "t.png")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- a server dies with the process that started it --------------------------------------------


CHILD_STARTER = textwrap.dedent(
    """
    import subprocess, sys, time
    from service.client.launcher import parent_death_hook
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                             preexec_fn=parent_death_hook(True), start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(120)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_tied_to_its_parent_ends_when_the_parent_is_killed():
    starter = subprocess.Popen([sys.executable, "-c", CHILD_STARTER], stdout=subprocess.PIPE, text=True)
    child = int(starter.stdout.readline())
    os.kill(child, 0)  # running
    starter.send_signal(signal.SIGKILL)
    starter.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if psutil.Process(child).status() == psutil.STATUS_ZOMBIE:  # ended, not yet reaped by init
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the child outlived its parent")


# ---- quick vs full, from two journals ----------------------------------------------------------


def test_tune_compare_reads_two_journals_and_replays_the_strategies(tmp_path):
    from benchmarks.tune_compare import compare, markdown

    space = SearchSpace(
        {
            "engine": ("onnx-fp32", "inductor-fp32"),
            "max_batch_size": (1, 4, 8, 32),
            "workers_per_device": (1, 2),
            "batch_timeout_ms": (0.0,),
            "api_servers": (0,),
            "pipeline_depth": (0,),
            "preprocess": ("pil",),
            "device": ("cpu",),
        }
    )

    def rate(c: Candidate) -> float:
        return (
            (20.0 if c.engine == "onnx-fp32" else 12.0)
            * {1: 0.7, 4: 1.0, 8: 0.9, 32: 0.5}[c.max_batch_size]
            * (1.2 if c.workers_per_device == 2 else 1.0)
        )

    def measured(c: Candidate, phase="search", number=0, reference=None) -> Measurement:
        return Measurement(
            c, phase, number, MEASURED, 100.0, [step(c=2)], [step(POISSON, 0, rate(c), 60.0)], reference, seconds=5.0
        )

    identity = {"model": "m", "objective": "throughput", "p99_ms": 100.0, "grid": space.as_dict()}
    full, quick = Journal.open(tmp_path / "full.jsonl", identity), Journal.open(tmp_path / "quick.jsonl", identity)
    full.add_measurement(measured(DEFAULT))
    for c in space:
        if c != DEFAULT:
            full.add_measurement(measured(c))
    from service.tune.search import quick_limit, quick_search

    objective = Objective("throughput", 100.0)
    quick.add_measurement(measured(DEFAULT))
    result = quick_search(space, DEFAULT, lambda c: objective.score(measured(c)))
    for c in result.scores:
        if c != DEFAULT:
            quick.add_measurement(measured(c))
    best = max(space, key=rate)
    quick.add_measurement(measured(DEFAULT, "confirm-defaults"))
    quick.add_measurement(measured(best, "confirm-tuned", reference=step(POISSON, 0, rate(DEFAULT), 30.0)))

    record = compare(tmp_path / "full.jsonl", tmp_path / "quick.jsonl")
    assert record["grid_size"] == 16 and record["full"]["best"] == best.key
    assert record["quick"]["measured"] == len(result.scores) == quick_limit(space) == 6  # one pass: 1 + 1 + 3 + 1
    assert record["quick"]["share_of_full_best"] == pytest.approx(1.0)
    shipped = record["replayed_on_full_table"]["quick (shipped: coordinate descent from the defaults)"]
    assert shipped["share_of_best"] == pytest.approx(1.0)
    assert record["tuned_vs_defaults"]["quick"]["throughput"] == pytest.approx(rate(best) / rate(DEFAULT))
    assert record["tuned_vs_defaults"]["quick"]["p99"] == pytest.approx(30.0 / 60.0)
    assert "| quick |" in markdown(record)


def test_head_to_head_of_one_configuration_needs_no_server(tmp_path):
    from benchmarks.tune_compare import answer_path, candidate_of, head_to_head

    artifact = tmp_path / "artifact"
    artifact.mkdir()
    (artifact / "manifest.json").write_text(json.dumps({"backend": "inductor", "precision": "bf16"}))
    values = DEFAULT.replace(engine="inductor-bf16", max_batch_size=8).serve_values(artifact)
    full = write_serve_config(tmp_path / "full.toml", values)
    quick = write_serve_config(tmp_path / "quick.toml", values, ["another comment, the same configuration"])
    assert candidate_of(read_config_file(full)) == DEFAULT.replace(engine="inductor-bf16", max_batch_size=8)
    assert head_to_head(full, quick, {}, rounds=3, work=tmp_path / "work")["share_of_full"] == 1.0
    assert not (tmp_path / "work").exists()  # nothing was served
    assert answer_path(tmp_path / "lite0-full.journal.jsonl") == tmp_path / "lite0-full.toml"


def test_head_to_head_sends_the_images_the_tunes_sent(tmp_path):
    from benchmarks.tune_compare import tuned_images
    from service.tune.images import read_images, write_benchmark_images
    from service.tune.session import images_digest

    write_benchmark_images(tmp_path / "tune")  # what a tune without --images writes and digests
    digest = images_digest(read_images(tmp_path / "tune"))
    assert tuned_images(None, tmp_path / "work", digest) == read_images(tmp_path / "tune")
    own = tmp_path / "own"
    own.mkdir()
    (own / "one.jpg").write_bytes(read_images(tmp_path / "tune")[0])
    with pytest.raises(ValueError, match="give --images, the folder the tunes were given"):
        tuned_images(own, tmp_path / "work", digest)
    assert tuned_images(own, tmp_path / "work", images_digest(read_images(own))) == read_images(own)
