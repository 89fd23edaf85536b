"""The whole tune (service/tune/tuner.py and its phases) with compile-trt and the servers replaced at
their seams by fakes that answer as a model would: the flow from engines to the answer, the confirm
rounds, the budget, resuming, and every way a tune ends without an answer. The real servers and
compiles run in tests/e2e/test_tune.py."""

from __future__ import annotations

import json

import pytest

from service.settings import read_config_file
from service.tune import bench as bench_module
from service.tune import builds as builds_module
from service.tune import session as session_module
from service.tune.engines import GATE_FAILED, OK, UNAVAILABLE, EngineBuild
from service.tune.ladder import CLOSED, POISSON, RateSearch, Step
from service.tune.machine import Machine
from service.tune.measure import OK as MEASURED
from service.tune.measure import Measurement
from service.tune.settings import TuneSettings
from service.tune.space import Candidate
from service.tune.tuner import TuneFailed, Tuner, TuneSetupError

DEFAULT = Candidate("onnx-fp32", 32, 1, 0.0, 0, 0, "pil", "cpu")
ENGINE_SPEED = {"onnx-fp32": 100.0, "inductor-fp32": 60.0, "inductor-bf16": 130.0}
BATCH_SPEED = {1: 0.6, 4: 1.0, 8: 0.9, 32: 0.7}


def capacity(c: Candidate) -> float:
    """A model of a server: closed-loop images/s within the target."""
    return ENGINE_SPEED[c.engine] * BATCH_SPEED[c.max_batch_size] * (1.3 if c.workers_per_device == 2 else 1.0)


class FakeWorld:
    """compile-trt and vision-serve as the tuner sees them: builds, and measurements of a model."""

    def __init__(self, tmp_path, gate_fails=(), unavailable=(), sustain=0.7, interrupt_at=None, seconds=5.0):
        self.tmp_path, self.gate_fails, self.unavailable = tmp_path, set(gate_fails), set(unavailable)
        self.sustain, self.interrupt_at, self.seconds = sustain, interrupt_at, seconds
        self.builds: list[str] = []
        self.measured: list[tuple[str, str, int, str]] = []  # (key, phase, round, config file name)
        self.plans = []

    def build_engine(self, settings, engine, batch, log_dir, accelerator):
        self.builds.append(engine)
        if engine in self.gate_fails:
            return EngineBuild(
                engine, GATE_FAILED, "", 1.0, "compile-trt: accuracy gate FAILED", ["compile-trt"], batch
            )
        if engine in self.unavailable:
            return EngineBuild(engine, UNAVAILABLE, "", 1.0, "compile-trt: no such library", ["compile-trt"], batch)
        artifact = self.tmp_path / "artifacts" / f"{engine}-{'-'.join(map(str, batch))}"
        artifact.mkdir(parents=True, exist_ok=True)
        (artifact / "manifest.json").write_text("{}")
        return EngineBuild(engine, OK, str(artifact), 1.0, "cosine 1", ["compile-trt", "--backend", engine], batch)

    def measure(self, candidate, config, images, plan, poisson, log, status, phase, round_number):
        if self.interrupt_at is not None and len(self.measured) == self.interrupt_at:
            raise KeyboardInterrupt
        self.measured.append((candidate.key, phase, round_number, config.name))
        self.plans.append(poisson)
        assert read_config_file(config)["max_batch_size"] == candidate.max_batch_size  # what a server would read
        top = capacity(candidate)
        steps = [Step(CLOSED, 4, 0.0, 60, 60, 0, top, 20.0, 40.0, 50.0, 2.0, 1.0)]
        search = RateSearch(plan.p99_ms, top, plan.load_factor, poisson.max_runs, poisson.fixed_rate)
        while (rate := search.next_rate()) is not None:
            search.record(self._poisson(rate, top))
        reference = self._poisson(poisson.reference_rate, top) if poisson.reference_rate else None
        return Measurement(
            candidate, phase, round_number, MEASURED, plan.p99_ms, steps, search.runs, reference, seconds=self.seconds
        )

    def _poisson(self, rate: float, top: float) -> Step:
        p99 = 30.0 + 60.0 * rate / top if rate <= self.sustain * top else 400.0
        return Step(POISSON, 0, rate, 50, 50, 0, rate, p99 / 2, p99, p99, 1.5, 1.0)


@pytest.fixture
def world(tmp_path, monkeypatch):
    fake = FakeWorld(tmp_path)
    monkeypatch.setattr(session_module, "probe_machine", lambda device: Machine("cpu", 0, 2, True, "test CPU"))
    monkeypatch.setattr(session_module, "default_candidate", lambda machine: DEFAULT)
    monkeypatch.setattr(builds_module, "build_engine", fake.build_engine)
    monkeypatch.setattr(bench_module, "measure", fake.measure)
    images = tmp_path / "images"
    images.mkdir()
    (images / "a.jpg").write_bytes(b"\xff\xd8\xff\xe0 not decoded by the fakes")
    return fake


def settings(tmp_path, **values) -> TuneSettings:
    base = {
        "model": "efficientnet-lite0",
        "p99_ms": 100.0,
        "engines": "onnx-fp32,inductor-fp32,inductor-bf16",
        "max_batch_sizes": "1,4,8,32",
        "workers_per_device": "1,2",
        "preprocess": "pil",
        "images": str(tmp_path / "images"),
        "output": str(tmp_path / "tuned.toml"),
    }
    return TuneSettings(**{**base, **values})


def best_candidate() -> Candidate:
    return max(
        (DEFAULT.replace(engine=e, max_batch_size=b, workers_per_device=w) for e in ENGINE_SPEED for b in BATCH_SPEED
         for w in (1, 2)),
        key=capacity,
    )  # fmt: skip


def test_a_full_tune_answers_with_the_best_configuration_and_confirms_it_alternating(tmp_path, world):
    outcome = Tuner(settings(tmp_path, search="full"), live_progress=False).run()
    best = best_candidate()
    assert outcome.record.tuned == best and outcome.record.grid_measured == 24
    values = read_config_file(outcome.toml)
    assert (values["max_batch_size"], values["workers_per_device"]) == (best.max_batch_size, best.workers_per_device)
    assert values["artifact"].endswith("inductor-bf16-1-8-32")
    confirm = [(phase, number, config) for _, phase, number, config in world.measured if phase != "search"]
    assert confirm == [
        ("confirm-defaults", 0, DEFAULT.key.replace(" ", "_") + ".toml"),
        ("confirm-tuned", 0, "tuned.toml"),  # the answer as written
        ("confirm-defaults", 1, DEFAULT.key.replace(" ", "_") + ".toml"),
        ("confirm-tuned", 1, "tuned.toml"),
    ]
    ratios = outcome.record.ratios()
    assert ratios["throughput"] == pytest.approx(capacity(best) / capacity(DEFAULT), rel=0.15)
    assert ratios["p99"] < 1  # the tuned one at the defaults' rate has the shorter tail
    text = outcome.toml.read_text()
    assert text.startswith("# vision-tune: efficientnet-lite0, throughput at p99 <= 100 ms")
    assert "compile-trt --backend inductor-bf16" in text and "medians of 2 alternating rounds" in text
    assert outcome.report.exists() and outcome.plot.exists() and outcome.csv.exists()
    assert world.builds == ["onnx-fp32", "inductor-fp32", "inductor-bf16"]  # the defaults' engine built once


def test_quick_search_measures_at_most_its_share_and_finds_the_best_here(tmp_path, world):
    outcome = Tuner(settings(tmp_path), live_progress=False).run()
    searched = {key for key, phase, _, _ in world.measured if phase == "search"}
    assert len(searched) <= 7  # 30 % of 24, the defaults (a grid point here, measured first) included
    assert outcome.record.grid_measured == len(searched)
    assert outcome.record.tuned == best_candidate()


def test_a_precision_that_fails_its_gate_is_dropped_and_never_served(tmp_path, world):
    world.gate_fails = {"inductor-bf16"}
    outcome = Tuner(settings(tmp_path, search="full"), live_progress=False).run()
    assert not any(key.startswith("inductor-bf16") for key, *_ in world.measured)
    assert outcome.record.space.values["engine"] == ("onnx-fp32", "inductor-fp32")
    assert "| inductor-bf16 | gate failed |" in outcome.report.read_text()


def test_a_stopped_tune_resumes_without_measuring_anything_twice(tmp_path, world):
    world.interrupt_at = 5
    with pytest.raises(KeyboardInterrupt):
        Tuner(settings(tmp_path, search="full"), live_progress=False).run()
    first = list(world.measured)
    assert len(first) == 5
    world.interrupt_at = None
    outcome = Tuner(settings(tmp_path, search="full"), live_progress=False).run()
    assert outcome.resumed == 3 + 5  # three engines and five measurements read back
    assert not set(first) & set(world.measured[5:])
    assert len(world.measured) == 24 + 4  # the grid once, then the confirm rounds
    assert world.builds == ["onnx-fp32", "inductor-fp32", "inductor-bf16"]  # compiled once across both runs


def test_a_resume_with_other_settings_is_refused_naming_them(tmp_path, world):
    world.interrupt_at = 2
    with pytest.raises(KeyboardInterrupt):
        Tuner(settings(tmp_path), live_progress=False).run()
    with pytest.raises(TuneSetupError, match=r"p99_ms: 100.0 -> 80.0"):
        Tuner(settings(tmp_path, p99_ms=80.0), live_progress=False).run()


def test_an_unavailable_engine_is_tried_again_on_resume(tmp_path, world):
    world.unavailable, world.interrupt_at = {"inductor-bf16"}, 1
    with pytest.raises(KeyboardInterrupt):
        Tuner(settings(tmp_path), live_progress=False).run()
    world.unavailable, world.interrupt_at = set(), None
    outcome = Tuner(settings(tmp_path), live_progress=False).run()
    assert world.builds.count("inductor-bf16") == 2 and "inductor-bf16" in outcome.record.space.values["engine"]


def test_the_budget_stops_the_search_and_keeps_time_for_the_confirm_rounds(tmp_path, world):
    world.seconds = 300.0  # five minutes a configuration: after the defaults, one more would not fit in 20
    outcome = Tuner(settings(tmp_path, search="full", budget_min=20.0), live_progress=False).run()
    assert outcome.record.stopped == "--budget-min reached"
    assert outcome.record.grid_measured == 1 and outcome.record.tuned == DEFAULT
    assert [phase for _, phase, _, _ in world.measured].count("confirm-tuned") == 2


def test_no_configuration_meeting_the_target_ends_without_an_answer_and_says_why(tmp_path, world):
    (tmp_path / "tuned.toml").write_text("# vision-tune: an earlier answer\nmax_batch_size = 8\n")
    world.sustain = 0.0  # every Poisson run misses the target
    with pytest.raises(TuneFailed, match=r"No configuration met p99 <= 100 ms.*Poisson p99 400 ms.*Raise --p99-ms"):
        Tuner(settings(tmp_path, engines="onnx-fp32", max_batch_sizes="4"), live_progress=False).run()
    assert not (tmp_path / "tuned.toml").exists()  # the earlier answer does not outlive this tune
    assert "No configuration met the target" in (tmp_path / "tuned.md").read_text()


def test_every_engine_dropped_ends_the_tune_with_compile_trts_reasons(tmp_path, world):
    world.gate_fails = {"onnx-fp32", "inductor-fp32", "inductor-bf16"}
    with pytest.raises(TuneFailed, match=r"No engine of the grid compiled.*onnx-fp32: gate failed"):
        Tuner(settings(tmp_path), live_progress=False).run()
    assert world.measured == []


def test_the_latency_objective_offers_everyone_the_rate_the_defaults_sustain(tmp_path, world):
    outcome = Tuner(settings(tmp_path, objective="latency", search="full"), live_progress=False).run()
    defaults_rate = outcome.record.measurement(DEFAULT).sustained.rate
    later = [plan.fixed_rate for (_, phase, _, _), plan in zip(world.measured, world.plans, strict=True)][1:]
    assert set(later) == {defaults_rate}
    tuned = outcome.record.measurement(outcome.record.tuned)
    assert all(tuned.sustained.p99_ms <= m.sustained.p99_ms for m in outcome.record.measurements if m.sustained)


def test_setup_errors_are_usage_errors(tmp_path, world):
    (tmp_path / "empty").mkdir()
    with pytest.raises(TuneSetupError, match="holds no images"):
        Tuner(settings(tmp_path, images=str(tmp_path / "empty")), live_progress=False).run()
    with pytest.raises(TuneSetupError, match="cvcuda cannot run here"):
        Tuner(settings(tmp_path, preprocess="cvcuda"), live_progress=False).run()


def test_the_journal_holds_every_measurement_as_json(tmp_path, world):
    Tuner(settings(tmp_path, engines="onnx-fp32", max_batch_sizes="4,32", confirm_rounds=1, search="full")).run()
    lines = (tmp_path / "tuned.work" / "journal.jsonl").read_text().splitlines()
    kinds = [json.loads(line)["kind"] for line in lines]
    assert kinds[0] == "header" and kinds.count("engine") == 1 and kinds.count("measurement") == 2 * 2 + 2
