"""The model repository's parts that need no server: its layout and per-model config, version
policies, the routing table's answers, the memory check, and the settings that turn it on."""

from __future__ import annotations

import json

import pytest

from service.errors import ServiceError
from service.model_info import ModelInfo
from service.repository.layout import (
    ModelConfig,
    RepositoryError,
    VersionPolicy,
    model_names,
    parse_config_override,
    read_model_folder,
)
from service.repository.table import RoutingTable, TableFile, VersionRoute
from service.settings import ServeSettings, resolve_settings
from service.supervisor.planning.memory import MIB, available_cpu_bytes, check_fits


def make_repository(root, layout: dict[str, list[str]], configs: dict[str, str] | None = None):
    for name, versions in layout.items():
        for version in versions:
            (root / name / version).mkdir(parents=True)
    for name, text in (configs or {}).items():
        (root / name / "config.toml").write_text(text)
    return root


def test_versions_are_positive_integer_folders_and_the_config_is_read(tmp_path) -> None:
    repository = make_repository(
        tmp_path,
        {"pets": ["1", "2", "10", "0", "007", "latest"], "birds": ["3"]},
        {"pets": "workers_per_device = 2\nmax_batch_size = 8\nbatch_timeout_ms = 1\nversion_policy = {all = true}\n"},
    )
    assert model_names(repository) == ["birds", "pets"]
    pets = read_model_folder(repository, "pets")
    assert sorted(pets.versions) == [1, 2, 10]  # Triton's rule: other folder names are not versions
    assert pets.config == ModelConfig(2, 8, 1.0, VersionPolicy("all"))
    assert read_model_folder(repository, "birds").config == ModelConfig()


@pytest.mark.parametrize(
    ("policy", "selected"),
    [
        (VersionPolicy(), [10]),
        (VersionPolicy("latest", latest=2), [2, 10]),
        (VersionPolicy("all"), [1, 2, 10]),
        (VersionPolicy("specific", specific=(1, 10)), [1, 10]),
    ],
)
def test_version_policies_select_as_triton(policy, selected) -> None:
    assert policy.select([10, 1, 2]) == selected


def test_a_specific_version_that_is_missing_is_refused_with_what_exists() -> None:
    with pytest.raises(RepositoryError, match=r"version\(s\) 3.*has 1, 2"):
        VersionPolicy("specific", specific=(3,)).select([1, 2])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_batch = 8\n", "unknown key"),
        ("max_batch_size = 0\n", "from 1 to 1024"),
        ("workers_per_device = true\n", "from 1 to 1024"),
        ("batch_timeout_ms = -1\n", "from 0 to 60000"),
        ("version_policy = {newest = 1}\n", "version_policy must be one of"),
        ("version_policy = {specific = []}\n", "positive versions"),
        ("max_batch_size = [\n", "not a readable TOML file"),
        ('activation = "relu"\n', "activation must be one of auto, softmax, sigmoid, none"),
    ],
)
def test_a_bad_config_says_what_to_fix_and_where(tmp_path, text, message) -> None:
    repository = make_repository(tmp_path, {"pets": ["1"]}, {"pets": text})
    with pytest.raises(RepositoryError, match=message) as caught:
        read_model_folder(repository, "pets")
    assert "config.toml" in str(caught.value)


def test_a_models_activation_is_its_own_over_the_flag(tmp_path) -> None:
    """config.toml's activation (a multi-label model among softmax ones) replaces --activation for that
    model's versions alone; without it the flag's value stays."""
    from service.settings import ServeSettings
    from service.supervisor.planning.planner import version_settings

    repository = make_repository(tmp_path, {"tags": ["1"], "pets": ["1"]}, {"tags": 'activation = "sigmoid"\n'})
    tags, pets = read_model_folder(repository, "tags"), read_model_folder(repository, "pets")
    assert tags.config.activation == "sigmoid" and pets.config.activation is None
    server = ServeSettings(model_repository=str(repository), activation="none")
    assert version_settings(server, "tags", tags.versions[1], tags.config).activation == "sigmoid"
    assert version_settings(server, "pets", pets.versions[1], pets.config).activation == "none"
    override = parse_config_override(json.dumps({"activation": "softmax"}))
    assert tags.config.merged(override).activation == "softmax"  # a load call's config wins, as for the rest


def test_a_missing_model_or_version_folder_names_the_fix(tmp_path) -> None:
    repository = make_repository(tmp_path, {"pets": [], "birds": ["1"]})
    (repository / "pets").mkdir()
    with pytest.raises(RepositoryError, match=r"no version folder.*compile-trt"):
        read_model_folder(repository, "pets")
    with pytest.raises(RepositoryError, match=r"not in the repository.*birds"):
        read_model_folder(repository, "cats")
    with pytest.raises(RepositoryError, match="letters, digits"):
        read_model_folder(repository, "../etc")


def test_a_load_override_in_tritons_json_form_merges_over_the_file() -> None:
    override = parse_config_override(
        json.dumps({"name": "pets", "max_batch_size": 4, "version_policy": {"specific": {"versions": [2]}}})
    )
    assert override == ModelConfig(max_batch_size=4, version_policy=VersionPolicy("specific", specific=(2,)))
    merged = ModelConfig(workers_per_device=2, max_batch_size=8).merged(override)
    assert merged == ModelConfig(2, 4, None, VersionPolicy("specific", specific=(2,)))
    pinned = ModelConfig(version_policy=VersionPolicy("specific", specific=(1,)))
    latest = parse_config_override(json.dumps({"version_policy": {"latest": {"num_versions": 1}}}))
    assert pinned.merged(latest).policy == VersionPolicy("latest", latest=1)  # Triton's default, said explicitly
    assert pinned.merged(ModelConfig()).policy == pinned.version_policy
    assert parse_config_override(json.dumps({"version_policy": {"latest": {"num_versions": 2}}})).version_policy == (
        VersionPolicy("latest", latest=2)
    )
    with pytest.raises(RepositoryError, match="JSON object"):
        parse_config_override("{not json")


def route(name: str, version: int, workers: tuple[int, ...]) -> VersionRoute:
    info = ModelInfo(name, "w", "torch-eager-fp32", "pil", "", {}, "", "cpu", 8, 0.0)
    return VersionRoute(name, version, workers, info)


def test_the_table_answers_the_latest_version_a_named_one_or_a_404_that_lists_what_is_loaded() -> None:
    table = RoutingTable(3, {"pets": {1: route("pets", 1, (0,)), 2: route("pets", 2, (1,))}}, (), "pets")
    assert table.resolve(None).version == 2
    assert table.resolve("pets", "1").workers == (0,)
    for name, version, text in (("cats", None, "models loaded: pets"), ("pets", "3", "versions loaded: 1, 2")):
        with pytest.raises(ServiceError, match=text) as caught:
            table.resolve(name, version)
        assert caught.value.status == 404
    two = RoutingTable(1, {"a": {1: route("a", 1, (0,))}, "b": {1: route("b", 1, (1,))}})
    with pytest.raises(ServiceError, match=r"\?model=NAME \(models loaded: a, b\)") as caught:
        two.resolve(None)
    assert caught.value.status == 400


def test_the_table_file_is_read_again_only_when_it_changed(tmp_path) -> None:
    writer, reader = TableFile(tmp_path), TableFile(tmp_path)
    assert reader.read_if_changed() is None  # nothing published yet
    writer.write(RoutingTable(1, {"pets": {1: route("pets", 1, (0,))}}, (5,), "pets"))
    first = reader.read_if_changed()
    assert first.generation == 1 and first.draining == (5,) and first.serving_workers() == {0}
    assert reader.read_if_changed() is None
    writer.write(RoutingTable(2))
    assert reader.read_if_changed().generation == 2


def test_a_load_that_does_not_fit_is_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"needs about 2,048 MiB on the GPU, which has 1,024 MiB free"):
        check_fits(2048 * MIB, 1024 * MIB, "the GPU", "pets version 2")
    check_fits(512 * MIB, 1024 * MIB, "the GPU", "pets version 2")
    check_fits(512 * MIB, None, "the GPU", "pets version 2")  # unknown: warned, not refused
    assert available_cpu_bytes() > 0


def test_repository_settings_are_checked_where_they_are_given() -> None:
    with pytest.raises(ValueError, match="needs --admin-api-key"):
        resolve_settings({"model_repository": "/models", "model_control": "explicit"}, environ={})
    with pytest.raises(ValueError, match="must differ from --api-key"):
        ServeSettings(model_repository="/models", api_key="same-key", admin_api_key="same-key")
    with pytest.raises(ValueError, match="needs --model-repository"):
        ServeSettings(model_control="explicit")
    with pytest.raises(ValueError, match="--artifact, --name: with --model-repository"):
        ServeSettings(model_repository="/models", artifact="/a", name="x")
    settings = resolve_settings(
        {"model_repository": "/models", "model_control": "explicit", "admin_api_key": "admin-key-1"}, environ={}
    ).settings
    assert "admin-key-1" not in repr(settings) and settings.as_dict()["admin_api_key"] == "(set)"


class RecordingChannel:
    """The HTTP process's channel as the watch uses it: what it was told to retire and drop."""

    api_server = 1

    def __init__(self) -> None:
        self.retired: list[int] = []
        self.dropped: list[int] = []
        self.processes: dict[int, int] = {}

    def place_workers(self, processes: dict[int, int]) -> None:
        self.processes = processes

    def retire(self, worker_id: int) -> None:
        self.retired.append(worker_id)

    def drop_worker(self, worker_id: int) -> None:
        self.dropped.append(worker_id)

    def fail_worker(self, worker_id: int, answer: object) -> int:
        return 0


def test_the_watch_follows_each_table_retires_drops_and_acknowledges(tmp_path) -> None:
    from service.http.base.worker_watch import WorkerWatch
    from service.transport.control_channel import READY, STARTING

    channel, acks, published = RecordingChannel(), [-1, -1], TableFile(tmp_path)
    watch = WorkerWatch(channel, TableFile(tmp_path), acks=acks)
    states = {0: READY, 1: STARTING}
    published.write(RoutingTable(1, {"pets": {1: route("pets", 1, (0,))}}, (), "pets", states))
    watch.refresh()
    # Worker 1 loads version 2 beside version 1: the server stays ready, and version 2 gets nothing yet.
    assert watch.ready and acks == [-1, 1] and watch.ready_in(watch.table.resolve("pets")) == [0]
    states = {0: READY, 1: READY}
    published.write(RoutingTable(2, {"pets": {2: route("pets", 2, (1,))}}, (0,), "pets", states, False, {1: 77}))
    watch.refresh()
    assert watch.table.resolve("pets").version == 2 and channel.retired == [0] and acks == [-1, 2]
    assert channel.processes == {1: 77}, "the channel picks workers by the process the table names"
    published.write(RoutingTable(3, {"pets": {2: route("pets", 2, (1,))}}, (), "pets", {1: READY}))  # 0 exited
    watch.refresh()
    assert channel.dropped == [0] and acks[1] == 3
    # A serving worker restarting: the main process publishes its state; not ready until it is back.
    published.write(RoutingTable(4, {"pets": {2: route("pets", 2, (1,))}}, (), "pets", {1: STARTING}))
    watch.refresh()
    assert not watch.ready and acks[1] == 4
