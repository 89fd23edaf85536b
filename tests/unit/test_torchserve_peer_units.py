"""The pure parts of the TorchServe peer: its config.properties text and its label mapping.

They are checked against the readers TorchServe itself uses: java.util.Properties (the frontend's
ConfigManager), the launcher's own properties reader, and ts.utils.util's label functions, so a
wrong key or format fails here rather than as a silently ignored setting in a benchmark.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks.peers.torchserve_peer import (
    TorchServeConfig,
    TorchServePorts,
    build_mar,
    config_properties,
    index_to_name,
)
from compile.catalog import get_model_entry

PORTS = TorchServePorts(inference=18080, management=18081, metrics=18082)

# Loads a file with java.util.Properties, as the frontend's ConfigManager does, and prints key<TAB>value.
JAVA_DUMP = """
import java.io.FileInputStream;
import java.util.Properties;
import java.util.TreeSet;

public class DumpProperties {
    public static void main(String[] args) throws Exception {
        Properties props = new Properties();
        try (FileInputStream in = new FileInputStream(args[0])) {
            props.load(in);
        }
        for (String key : new TreeSet<>(props.stringPropertyNames())) {
            System.out.println(key + "\\t" + props.getProperty(key));
        }
    }
}
"""


def java_properties(path: Path, tmp_path: Path) -> dict[str, str]:
    java = shutil.which("java")
    if java is None:
        pytest.skip("needs a Java runtime (TorchServe's frontend needs one too)")
    source = tmp_path / "DumpProperties.java"
    source.write_text(JAVA_DUMP)
    # Java 11+ runs a single source file directly, no javac step.
    result = subprocess.run([java, str(source), str(path)], capture_output=True, text=True, check=True, timeout=120)
    return dict(line.split("\t", 1) for line in result.stdout.splitlines())


@pytest.mark.parametrize("batch_size", [1, 8])
def test_config_properties_parse_as_java_properties(batch_size: int, tmp_path: Path) -> None:
    store = tmp_path / "model store"  # a space: must survive as part of the value
    path = tmp_path / "config.properties"
    path.write_text(config_properties(TorchServeConfig(batch_size=batch_size), PORTS, store))

    props = java_properties(path, tmp_path)

    assert props["inference_address"] == "http://127.0.0.1:18080"
    assert props["management_address"] == "http://127.0.0.1:18081"
    assert props["metrics_address"] == "http://127.0.0.1:18082"
    assert props["model_store"] == str(store)
    assert props["load_models"] == "resnet152.mar"
    assert props["disable_token_authorization"] == "true"
    model = json.loads(props["models"])["resnet152"]["1.0"]
    assert model["batchSize"] == batch_size
    assert model["maxBatchDelay"] == 100  # TorchServe's default, stated explicitly
    assert model["marName"] == "resnet152.mar" and model["defaultVersion"] is True
    # Left to TorchServe: its default queue, and its default worker count when none is asked for.
    assert "job_queue_size" not in props
    assert "default_workers_per_model" not in props
    assert "minWorkers" not in model and "maxWorkers" not in model


def test_config_properties_workers_and_vmargs_are_read_by_the_launcher(tmp_path: Path) -> None:
    from ts.model_server import load_properties  # what `torchserve --start` reads vmargs with

    config = TorchServeConfig(batch_size=8, max_batch_delay_ms=5, workers=1, vmargs="-Xmx1g -XX:+UseG1GC")
    path = tmp_path / "config.properties"
    path.write_text(config_properties(config, PORTS, tmp_path))

    props = load_properties(str(path))

    assert props["vmargs"] == "-Xmx1g -XX:+UseG1GC"
    assert props["default_workers_per_model"] == "1"
    model = json.loads(props["models"])["resnet152"]["1.0"]
    assert (model["minWorkers"], model["maxWorkers"], model["maxBatchDelay"]) == (1, 1, 5)


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        TorchServeConfig(batch_size=0)
    with pytest.raises(ValueError):
        TorchServeConfig(workers=0)


def test_free_ports_are_distinct() -> None:
    ports = TorchServePorts.free()
    assert len({ports.inference, ports.management, ports.metrics}) == 3


def test_index_to_name_is_read_by_torchserve(tmp_path: Path) -> None:
    from ts.utils.util import load_label_mapping, map_class_to_label

    labels = get_model_entry("resnet152").labels
    path = tmp_path / "index_to_name.json"
    path.write_text(json.dumps(index_to_name(labels)))

    mapping = load_label_mapping(str(path))  # what BaseHandler.initialize calls

    assert len(mapping) == 1000
    assert mapping["0"] == labels[0] and mapping["999"] == labels[999]
    # What ImageClassifier.postprocess answers for top-2 classes 281 and 0 of one image.
    assert map_class_to_label([[0.75, 0.25]], mapping, [[281, 0]]) == [{labels[281]: 0.75, labels[0]: 0.25}]


def test_build_mar_needs_a_pt_file(tmp_path: Path) -> None:
    # BaseHandler loads TorchScript only from *.pt; another suffix would fail inside the worker.
    with pytest.raises(ValueError, match=r"\.pt"):
        build_mar(tmp_path / "model.pth", tmp_path / "store")
