"""The defaults chosen from the engine and the machine (service/supervisor/planning/sizing.py): workers
per device and engine threads for 1, 2, 16 and 64 cores (faked) and for GPUs (faked: no GPU here),
the cores a process may use, what a model costs, and the plan that carries the choice."""

from __future__ import annotations

import os

import pytest

from service import _defaults
from service.settings import ServeSettings
from service.supervisor.planning import cores as cores_module
from service.supervisor.planning.cores import quota_cores, usable_cores
from service.supervisor.planning.sizing import ModelCost, choose_sizing, measure_cost

SMALL = ModelCost(0.39, "counted")  # EfficientNet-Lite0
LARGE = ModelCost(11.5, "counted")  # ResNet-152
UNKNOWN = ModelCost(None, "not counted")


@pytest.mark.parametrize(
    ("cores", "small", "large"),
    [
        (1, (1, 1), (1, 1)),
        (2, (2, 1), (2, 1)),  # large: two at least, one decoding while the other runs
        (16, (16, 1), (2, 8)),
        (64, (16, 4), (8, 8)),  # small: capped at MAX_CPU_WORKERS, the rest as threads
    ],
)
def test_cpu_defaults_for_small_and_large_models_on_1_2_16_and_64_cores(cores, small, large) -> None:
    for cost, expected in ((SMALL, small), (LARGE, large)):
        sizing = choose_sizing(0, 0, "cpu", 1, cores, cost)
        assert (sizing.workers_per_device, sizing.engine_threads) == expected, (cores, cost)
        assert (sizing.workers_source, sizing.threads_source) == ("auto", "auto")
        assert sizing.workers_per_device * sizing.engine_threads <= cores, "never oversubscribed"
        assert f"{cores} usable cores" in sizing.why


def test_a_model_of_unknown_cost_gets_the_large_models_layout() -> None:
    """Unknown is treated as large: a small model served that way loses some throughput; a large one
    served as small would run a lone request on one thread."""
    for cores in (1, 2, 16, 64):
        unknown = choose_sizing(0, 0, "cpu", 1, cores, UNKNOWN)
        large = choose_sizing(0, 0, "cpu", 1, cores, LARGE)
        assert (unknown.workers_per_device, unknown.engine_threads) == (large.workers_per_device, large.engine_threads)
        assert "unknown" in unknown.why


def test_no_core_count_oversubscribes_and_every_core_is_used() -> None:
    for cores in range(1, 130):
        for cost in (SMALL, LARGE):
            sizing = choose_sizing(0, 0, "cpu", 1, cores, cost)
            used = sizing.workers_per_device * sizing.engine_threads
            assert cores - sizing.workers_per_device < used <= cores, (cores, cost, sizing)
            assert 1 <= sizing.workers_per_device <= _defaults.MAX_CPU_WORKERS


def test_a_value_given_is_kept_and_the_other_is_fitted_around_it() -> None:
    workers_set = choose_sizing(4, 0, "cpu", 1, 16, LARGE)
    assert (workers_set.workers_per_device, workers_set.engine_threads) == (4, 4)
    assert (workers_set.workers_source, workers_set.threads_source) == ("set", "auto")
    threads_set = choose_sizing(0, 4, "cpu", 1, 16, SMALL)
    assert (threads_set.workers_per_device, threads_set.engine_threads) == (4, 4)
    assert (threads_set.workers_source, threads_set.threads_source) == ("auto", "set")
    both = choose_sizing(3, 5, "cpu", 1, 2, SMALL)  # the user's word, even oversubscribed
    assert (both.workers_per_device, both.engine_threads, both.why) == (3, 5, "both set")
    more_than_cores = choose_sizing(4, 0, "cpu", 1, 2, SMALL)
    assert more_than_cores.engine_threads == 1


@pytest.mark.parametrize(("gpus", "cores", "threads"), [(1, 2, 2), (1, 16, 4), (8, 16, 2), (8, 64, 4), (4, 2, 1)])
def test_gpu_defaults_one_worker_per_gpu_and_the_cores_shared_faked(gpus, cores, threads) -> None:
    for cost in (SMALL, LARGE, UNKNOWN):  # on a GPU the model's cost does not change the layout
        sizing = choose_sizing(0, 0, "cuda", gpus, cores, cost)
        assert (sizing.workers_per_device, sizing.engine_threads) == (1, threads)
        assert f"{gpus} GPU(s)" in sizing.why
    assert choose_sizing(2, 0, "cuda", gpus, cores, SMALL).workers_per_device == 2


def test_the_sizing_says_what_was_chosen_and_why() -> None:
    sizing = choose_sizing(0, 0, "cpu", 1, 2, SMALL)
    described = sizing.to_dict()
    assert described["workers_per_device"] == {"value": 2, "source": "auto"}
    assert described["engine_threads"] == {"value": 1, "source": "auto"}
    assert described["usable_cores"] == 2 and "small model" in described["why"] and "0.39 GMACs" in described["why"]
    assert sizing.describe().startswith("2 worker(s) per device (auto) x 1 engine thread(s) (auto)")


# --- the cores -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cpu_max", "v1_quota", "v1_period", "expected"),
    [
        ("max 100000\n", None, None, None),
        ("400000 100000\n", None, None, 4),
        ("150000 100000", None, None, 2),  # 1.5 CPUs: two threads can use them
        ("50000 100000", None, None, 1),
        ("garbage", None, None, None),
        (None, "-1", "100000", None),
        (None, "200000", "100000", 2),
        (None, "x", "100000", None),
        (None, None, None, None),
    ],
)
def test_a_cgroup_cpu_quota_in_cores(cpu_max, v1_quota, v1_period, expected) -> None:
    assert quota_cores(cpu_max, v1_quota, v1_period) == expected


def test_usable_cores_are_the_affinity_capped_by_the_quota(tmp_path, monkeypatch) -> None:
    cpu_max = tmp_path / "cpu.max"
    monkeypatch.setattr(cores_module, "CGROUP_V2_CPU_MAX", cpu_max)
    monkeypatch.setattr(cores_module, "CGROUP_V1_QUOTA", tmp_path / "absent")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert usable_cores() == 64  # no cgroup file: the affinity
    cpu_max.write_text("max 100000\n")
    assert usable_cores() == 64
    cpu_max.write_text("400000 100000\n")  # docker run --cpus 4 on a 64-core host
    assert usable_cores() == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # taskset -c 0,1
    assert usable_cores() == 2


# --- what a model costs --------------------------------------------------------------------------


def test_a_models_cost_is_counted_on_its_architecture_without_weights() -> None:
    from compile.catalog import get_model_entry
    from compile.weights import build_architecture

    for name, low, high in (("efficientnet-lite0", 0.3, 0.5), ("resnet152", 11.0, 12.0)):
        entry = get_model_entry(name)
        cost = measure_cost(entry.family, lambda e=entry: build_architecture(e), None, entry.preprocess.input_size)
        assert cost.gmacs is not None and low < cost.gmacs < high, (name, cost)
    assert measure_cost("broken", lambda: 1 / 0, None, (224, 224)) == ModelCost(
        None, "its operations could not be counted"
    )


def test_a_non_square_models_cost_is_counted_on_a_height_by_width_image() -> None:
    """timm's ViT takes exactly its img_size (48 high, 64 wide here): counted at (48, 64), refused at
    the swapped (64, 48), so measure_cost must build its image as (N, 3, height, width)."""
    timm = pytest.importorskip("timm")

    def vit():
        return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=(48, 64), num_classes=10)

    cost = measure_cost("timm", vit, None, (48, 64))
    assert cost.gmacs is not None and 0.05 < cost.gmacs < 0.1, cost  # 12 patches of 16x16 (196 at 224x224)
    assert measure_cost("timm", vit, None, (64, 48)).gmacs is None


def test_the_planner_counts_the_cost_on_the_models_input_size() -> None:
    import dataclasses

    from compile.catalog import get_model_entry
    from compile.weights import build_architecture
    from preprocessing.spec import PreprocessSpec
    from service.supervisor.planning.planner import model_cost

    spec = PreprocessSpec(0, 0, (0.5,) * 3, (0.25,) * 3, resize_mode="exact", resize_height=48, resize_width=64)
    entry = dataclasses.replace(get_model_entry("mobilenet_v3_small"), preprocess=spec)
    cost = model_cost(entry, None, "")
    assert cost == measure_cost(entry.family, lambda: build_architecture(entry), None, (48, 64))
    # Both sides count: a 48x48 or a 224x224 image costs another amount.
    assert cost.gmacs != measure_cost(entry.family, lambda: build_architecture(entry), None, (48, 48)).gmacs
    assert cost.gmacs < measure_cost(entry.family, lambda: build_architecture(entry), None, (224, 224)).gmacs


def test_a_model_files_cost_is_estimated_from_its_size(tmp_path) -> None:
    model = tmp_path / "model.onnx"
    with model.open("wb") as file:
        file.truncate(40 * 1024 * 1024)  # 10 M fp32 parameters
    cost = measure_cost("onnx", None, model, (224, 224))
    assert cost.gmacs == pytest.approx(10.49 * _defaults.GMACS_PER_MILLION_PARAMETERS, rel=0.01)
    assert "40 MiB" in cost.how and not cost.small
    assert measure_cost("onnx", None, tmp_path / "absent.onnx", (224, 224)).gmacs is None


# --- the plan carries the choice -----------------------------------------------------------------


def test_the_plan_serves_with_the_choice_for_the_machine_faked() -> None:
    from service.supervisor.planning.planner import plan_serving

    for cores, expected in ((1, (1, 1)), (2, (2, 1)), (16, (16, 1)), (64, (16, 4))):
        plan = plan_serving(ServeSettings(model="efficientnet-lite0"), cuda_count=0, cores=cores)
        settings = plan.settings
        assert (settings.workers_per_device, settings.engine_threads, plan.workers) == (*expected, expected[0])
        assert plan.model.sizing["workers_per_device"]["source"] == "auto"
    given = plan_serving(ServeSettings(model="resnet152", workers_per_device=3), cuda_count=0, cores=64)
    assert (given.settings.workers_per_device, given.settings.engine_threads) == (3, 21)
    assert given.model.sizing["workers_per_device"]["source"] == "set"
    assert "sizing" in given.model.to_dict()  # /info shows it


def test_the_plan_on_two_gpus_faked() -> None:
    from service.supervisor.planning.planner import plan_serving

    plan = plan_serving(ServeSettings(model="efficientnet-lite0", preprocess="pil"), cuda_count=2, cores=16)
    assert (plan.accelerator, plan.devices, plan.workers) == ("cuda", 2, 2)
    assert (plan.settings.workers_per_device, plan.settings.engine_threads, plan.settings.pipeline_depth) == (1, 4, 2)


def test_print_config_shows_the_choice_and_stays_a_config_file(tmp_path, capsys, monkeypatch) -> None:
    from service.cli import main
    from service.settings import resolve_settings

    monkeypatch.delenv("VISION_SERVE_WORKERS_PER_DEVICE", raising=False)  # the suite's pin (tests/conftest.py)
    assert main(["--print-config", "--model", "efficientnet-lite0", "--engine-threads", "1"]) == 0
    printed = capsys.readouterr().out
    expected = usable_cores()  # a small model, one thread each: a worker per core
    assert "workers_per_device = 0" in printed  # the setting as given: auto
    assert f"efficientnet-lite0 v1: workers_per_device = {expected} (auto), engine_threads = 1 (set)" in printed
    assert f"why: as many 1-thread workers as fit {expected} cores" in printed
    config = tmp_path / "printed.toml"
    config.write_text(printed)
    assert resolve_settings({}, {}, str(config)).settings.workers_per_device == 0  # still auto when read back


def test_print_config_fails_like_a_start_on_settings_that_cannot_serve(capsys) -> None:
    from service.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["--print-config", "--model", "no-such-model"])
    assert exited.value.code == 2 and "would not start a server" in capsys.readouterr().err


def test_the_tune_reports_what_the_servers_choice_came_to() -> None:
    """vision-tune's baseline is the defaults, workers 0: its report says what the server made of it."""
    from service.tune.report import settings_rows
    from service.tune.space import Candidate

    defaults = Candidate("onnx-fp32", 32, 0, 0.0, 0, 0, "pil", "cpu")
    tuned = defaults.replace(max_batch_size=8, workers_per_device=2)
    rows = {row[0]: row[1:] for row in settings_rows(tuned, defaults, ("2 x 1", "2 x 1"))}
    assert rows["workers_per_device"] == ["`2`", "`0` (the server's choice: 2 x 1 workers x threads)"]
    assert rows["max_batch_size"] == ["`8`", "`32`"]


def test_workers_it_chose_give_way_to_memory_and_workers_set_are_refused(monkeypatch) -> None:
    """Two workers chosen for ResNet-152 on 2 cores, with memory free for one: one worker on both cores,
    said in its sizing. Two workers the user asked for, with the same memory: refused with the numbers."""
    from service.supervisor.planning import memory, planner

    monkeypatch.setattr(planner, "usable_cores", lambda: 2)
    settings = ServeSettings(model="resnet152", weights="random")
    [chosen] = planner.plan_repository(settings, cuda_count=0)
    assert chosen.serve_plan.workers == 2  # plenty of memory here
    one_fits = memory.worker_bytes(chosen) * 3 // 2
    monkeypatch.setattr(memory, "available_cpu_bytes", lambda: one_fits)
    [fitted] = planner.plan_repository(settings, cuda_count=0)
    assert (fitted.serve_plan.workers, fitted.serve_plan.settings.engine_threads) == (1, 2)
    assert "free memory holds no more" in fitted.serve_plan.model.sizing["why"]
    with pytest.raises(ValueError, match="Not enough memory"):
        planner.plan_repository(ServeSettings(model="resnet152", weights="random", workers_per_device=2), cuda_count=0)


@pytest.mark.parametrize(
    ("configs", "cores_given"),
    [
        ({}, {"birds": 8, "lite": 8, "pets": 8}),  # one shared group: they take turns on every core
        ({"pets": 'isolation = "process"\n'}, {"birds": 4, "lite": 4, "pets": 4}),  # the group and pets
        (
            {"pets": 'isolation = "process"\n', "birds": 'isolation = "process"\n'},
            {"birds": 2, "lite": 2, "pets": 2},  # three processes' worth
        ),
    ],
)
def test_models_in_shared_processes_share_the_cores_once(tmp_path, monkeypatch, configs, cores_given) -> None:
    """Versions that start together share the cores: the ones in shared worker processes count once
    (their batches take turns), each isolated version once more."""
    from service.supervisor.planning import planner

    for name in ("birds", "lite", "pets"):
        (tmp_path / name / "1").mkdir(parents=True)
    for name, text in configs.items():
        (tmp_path / name / "config.toml").write_text(text)
    given = {}

    def plan_serving(settings, cuda_count, cores):
        given[settings.name] = cores
        return settings

    monkeypatch.setattr(planner, "usable_cores", lambda: 8)
    monkeypatch.setattr(planner, "plan_serving", plan_serving)
    monkeypatch.setattr(planner, "check_memory", lambda plans: None)
    planner.plan_repository(ServeSettings(model_repository=str(tmp_path)), cuda_count=0)
    assert given == cores_given
