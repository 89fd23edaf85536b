"""A non-square model input (``PreprocessSpec.input_size`` = (height, width): 48 high, 64 wide) through
compile-trt's build and gate in process, then served: eager and ONNX on a real pretrained model
(EfficientNet-Lite0, its weights ship in a package), AOTInductor on a small network (its C++ compile
is the cost).

The flags that ask for such a preprocessing belong to another change; here the resolved plan's entry
gets the spec where the flags would put it, and everything after (gate inputs, the backend's build
and export, the engine's load, the gate, the manifest, the server's load) is the real code.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from torch import nn

from compile.backends.inductor import InductorBackend
from compile.build import _manifest, build_and_gate, plan_compile
from compile.devices import describe_device
from compile.manifest import read_manifest, write_manifest
from compile.progress import Progress
from compile.settings import CompileSettings
from compile.versions import library_versions
from compile.weights import load_model
from preprocessing.spec import PreprocessSpec
from service.worker.engine import load_artifact

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
NON_SQUARE = PreprocessSpec(0, 0, MEAN, STD, resize_mode="exact", resize_height=48, resize_width=64)
CPU = torch.device("cpu")


def compile_non_square(tmp_path, backend: str):
    """The artifact folder of efficientnet-lite0 at NON_SQUARE, built and gated by compile-trt's own steps."""
    settings = CompileSettings(
        model="efficientnet-lite0",
        backend=backend,
        device="cpu",
        batch=(1, 2, 4),
        output=str(tmp_path / "artifact"),
    )
    plan = plan_compile(settings)
    plan = dataclasses.replace(plan, entry=dataclasses.replace(plan.entry, preprocess=NON_SQUARE))
    loaded = load_model(plan.entry, settings.weights)
    versions = library_versions(plan.backend.extra_versions())
    config = plan.backend.config(settings, CPU)
    manifest = _manifest(
        settings, plan.entry, loaded, plan.backend, describe_device(CPU), versions, "test", "", "state_dict", config
    )
    folder = tmp_path / "artifact"
    folder.mkdir()
    manifest = build_and_gate(plan, loaded, manifest, folder, Progress(live=False))
    write_manifest(folder, manifest)
    return folder, loaded.module.eval()


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """``compiled(backend)``: compile_non_square's answer, built once per backend for the module."""
    built: dict = {}

    def get(backend: str):
        if backend not in built:
            built[backend] = compile_non_square(tmp_path_factory.mktemp(backend), backend)
        return built[backend]

    return get


def served_logits(folder, images: torch.Tensor) -> torch.Tensor:
    served = load_artifact(folder, CPU)
    assert served.entry.preprocess.input_size == (48, 64)  # the manifest carried the spec
    with torch.inference_mode():
        return served(images.contiguous(memory_format=served.memory_format))


@pytest.mark.parametrize("backend", ["eager", "onnx"])
def test_a_non_square_model_compiles_gates_and_serves_at_height_by_width(compiled, backend: str) -> None:
    if backend == "onnx":
        pytest.importorskip("onnxruntime")
    folder, reference = compiled(backend)
    manifest = read_manifest(folder)
    assert manifest.validation["passed"] and manifest.preprocess == NON_SQUARE
    if backend == "onnx":
        import onnx

        (image,) = onnx.load(str(folder / "model.onnx")).graph.input
        assert [d.dim_value for d in image.type.tensor_type.shape.dim][1:] == [3, 48, 64]
    images = torch.randn(2, 3, 48, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(images)
    torch.testing.assert_close(served_logits(folder, images), expected, rtol=1e-4, atol=1e-4)


def test_a_worker_warms_a_non_square_onnx_engines_lone_session_at_height_by_width(compiled) -> None:
    """Two CPU workers: the lone-image session is warmed with one zero image at load, of the model's
    input size (ONNX Runtime refuses any other for a file of fixed sides)."""
    pytest.importorskip("onnxruntime")
    from service.settings import ServeSettings
    from service.worker.classifier import load_served_model

    folder, _ = compiled("onnx")
    settings = ServeSettings(artifact=str(folder), device="cpu", workers_per_device=2, engine_threads=1)
    served = load_served_model(settings, CPU)
    assert served.lone_run is not None
    with torch.inference_mode():
        assert served(torch.zeros(1, 3, 48, 64), alone=True).shape == (1, 1000)


def test_aot_inductor_compiles_a_non_square_input_as_height_by_width(tmp_path) -> None:
    """A small network: AOTInductor's C++ compile of EfficientNet takes minutes on 2 cores, this ~15 s."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, (3, 1)), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 46 * 64, 10)).eval()
    path = tmp_path / "model.pt2"
    InductorBackend().build(model, CompileSettings(backend="inductor", batch=(1, 2, 4)), CPU, (48, 64), path)
    engine = InductorBackend().load(path, types.SimpleNamespace(precision="fp32"), CPU)
    images = torch.randn(3, 3, 48, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(images)
    # The linear layer takes exactly 8 x 46 x 64 features: the program was traced at 48 high, 64 wide.
    torch.testing.assert_close(engine(images.contiguous(memory_format=torch.channels_last)), expected)
