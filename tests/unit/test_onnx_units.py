"""The onnx backend's pieces on a small real network: export arguments, ONNX Runtime session, IO binding,
padding and splitting, precision refusals, the manifest's engine name, and the Triton configs and
DALI crop geometry of the model repository export."""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import json
import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from compile import _defaults
from compile.backends import PRECISION_DTYPES, BackendUnavailable, PrecisionCast, get_backend
from compile.backends.onnx import (
    BF16_REFUSAL,
    CPU_FP16_REFUSAL,
    OnnxBackend,
    OnnxSessionEngine,
    execution_providers,
    export_kwargs,
    open_session,
    quiet_exporter_logs,
    session_options,
    session_settings,
)
from compile.build import plan_compile
from compile.compat import device_problems, version_problems
from compile.manifest import read_manifest
from compile.settings import CompileSettings
from compile.triton_repository import (
    MARKER,
    RepositoryModels,
    check_exportable,
    check_replaceable,
    parse_model_config,
    repository_configs,
)
from preprocessing.geometry import plan_crop
from preprocessing.spec import PreprocessSpec
from service.worker.engine import ServedModel
from tests.conftest import encode

ort = pytest.importorskip("onnxruntime")
CROP = 32


def small_network() -> nn.Module:
    """Conv, batch norm, pooling and a linear head: the operators of the catalog's classifiers, small."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )
    with torch.no_grad():  # batch norm statistics that are not the identity
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    return model.eval()


def export(model: nn.Module, path, precision: str = "fp32", batch=(1, 4, 8)) -> None:
    settings = CompileSettings(backend="onnx", precision=precision, batch=batch)
    cast = PrecisionCast(copy.deepcopy(model), PRECISION_DTYPES[precision])
    OnnxBackend().build(cast.eval(), settings, torch.device("cpu"), (CROP, CROP), path)


@pytest.fixture(scope="module")
def small_onnx(tmp_path_factory):
    model = small_network()
    path = tmp_path_factory.mktemp("onnx") / "model.onnx"
    export(model, path)
    return model, path


def test_execution_providers_for_cpu_and_for_a_gpu_without_one() -> None:
    assert execution_providers(torch.device("cpu"), ["CPUExecutionProvider"]) == [("CPUExecutionProvider", {})]
    with pytest.raises(BackendUnavailable, match=r"vision-serve\[onnx-gpu\]"):
        execution_providers(torch.device("cuda:1"), ["CPUExecutionProvider"])
    cuda, cpu = execution_providers(torch.device("cuda:1"), ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert cuda[0] == "CUDAExecutionProvider" and cuda[1]["device_id"] == 1 and cuda[1]["use_tf32"] == 0
    assert cpu == ("CPUExecutionProvider", {})  # nodes without a CUDA kernel still run


def test_session_options_are_set_for_serving() -> None:
    settings = session_settings(torch.device("cpu"), threads=3)
    options = session_options(settings)
    assert options.intra_op_num_threads == 3 and options.inter_op_num_threads == 1
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert options.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    json.dumps(settings)  # recorded in the manifest


def resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_cpu_sessions_of_one_process_hold_one_workspace_between_them(tmp_path) -> None:
    """A worker process holding many models pays a batch's intermediate tensors once, not per session:
    four sessions of a model with large activations grow the process by less than one session's
    workspace, and each still computes what the model does. Measured in a fresh process: the arena
    is the process's, and other tests' sessions in this one may have grown it already."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as fresh:
        first, added = fresh.submit(four_sessions_memory, str(tmp_path)).result(timeout=300)
    assert first > 12, f"the first session's workspace ({first:.0f} MiB) should hold a batch's activations"
    assert added < first / 2, f"3 more sessions added {added:.0f} MiB beside the first's {first:.0f} MiB"


def four_sessions_memory(directory: str) -> tuple[float, float]:
    """MiB the first of four sessions of a wide model grew this process by, and the other three."""
    tmp_path = Path(directory)
    torch.manual_seed(0)
    wide = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    ).eval()  # fmt: skip
    path = tmp_path / "model.onnx"
    settings = CompileSettings(backend="onnx", precision="fp32", batch=(1, 8, 8))
    OnnxBackend().build(wide, settings, torch.device("cpu"), (112, 112), path)
    images = torch.randn(8, 3, 112, 112)  # each activation: 8 x 32 x 112 x 112 floats, 12.25 MiB
    with torch.no_grad():
        expected = wide(images)
    engines = []
    before = resident_mib()
    for _ in range(4):
        session, used = open_session(path, torch.device("cpu"), threads=1)
        assert used["config_entries"]["session.use_env_allocators"] == "1"
        engines.append(OnnxSessionEngine(session, torch.device("cpu")))
        torch.testing.assert_close(engines[-1](images), expected, rtol=1e-4, atol=1e-5)
        if len(engines) == 1:
            first = resident_mib() - before
    return first, resident_mib() - before - first


def test_export_kwargs_keep_the_batch_dynamic_unless_it_is_static() -> None:
    dynamic = export_kwargs((1, 8, 32))
    (shapes,) = dynamic["dynamic_shapes"]
    assert (shapes[0].min, shapes[0].max) == (1, 32)
    assert dynamic["dynamo"] and dynamic["opset_version"] == _defaults.ONNX_OPSET and not dynamic["external_data"]
    assert "dynamic_shapes" not in export_kwargs((8, 8, 8))


def test_the_exported_model_matches_eager_at_every_batch_and_in_either_layout(small_onnx) -> None:
    model, path = small_onnx
    engine = OnnxBackend().load(path, None, torch.device("cpu"))
    for size in (1, 3, 8):
        images = torch.randn(size, 3, CROP, CROP)
        with torch.no_grad():
            expected = model(images)
        torch.testing.assert_close(engine(images), expected, rtol=1e-4, atol=1e-5)
        # A channels_last batch holds the same values in another order: IO binding must not read it raw.
        torch.testing.assert_close(engine(images.contiguous(memory_format=torch.channels_last)), expected)


def test_served_onnx_engine_pads_below_min_and_splits_above_max(small_onnx) -> None:
    model, path = small_onnx
    engine = OnnxBackend().load(path, None, torch.device("cpu"))
    calls = []

    def recording(images: torch.Tensor) -> torch.Tensor:
        calls.append((len(images), images.is_contiguous()))
        return engine(images)

    served = ServedModel(
        None, "onnxruntime-fp32", recording, batch_min=2, batch_max=4, memory_format=torch.contiguous_format
    )
    images = torch.randn(7, 3, CROP, CROP).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        expected = model(images)
    torch.testing.assert_close(served(images), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(served(images[:1]), expected[:1], rtol=1e-4, atol=1e-5)
    assert calls == [(4, True), (3, True), (2, True)]  # NCHW as ONNX reads it: no copy in the engine


def test_the_cpu_provider_still_runs_fp16_convolutions_in_fp32(tmp_path) -> None:
    """Why --backend onnx refuses fp16 for a CPU: ONNX Runtime's optimizer wraps the fp16 convolution in
    casts and runs it in fp32. If a new ONNX Runtime gains the kernel, this fails and the refusal should go."""
    import onnx

    export(small_network(), tmp_path / "fp16.onnx", precision="fp16")
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(tmp_path / "fp16.onnx"), options, providers=["CPUExecutionProvider"])
    convolutions = [n.name for n in onnx.load(tmp_path / "optimized.onnx").graph.node if n.op_type == "Conv"]
    assert convolutions and all(name.startswith("InsertedPrecisionFreeCast") for name in convolutions)


@pytest.mark.gpu
def test_the_cuda_provider_runs_the_engine_on_the_gpu_through_io_binding(small_onnx) -> None:
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("this onnxruntime has no CUDA provider: pip install 'vision-serve[onnx-gpu]'")
    model, path = small_onnx
    engine = OnnxBackend().load(path, None, torch.device("cuda:0"))
    assert engine.session.get_providers()[0] == "CUDAExecutionProvider"
    images = torch.randn(5, 3, CROP, CROP, device="cuda:0")
    logits = engine(images * 1.0)  # queued on torch's stream: the engine must wait for it
    assert logits.device.type == "cuda"
    with torch.no_grad():
        expected = model.cuda()(images)
    torch.testing.assert_close(logits, expected, rtol=1e-3, atol=1e-4)


def test_onnx_runtime_still_rejects_a_bf16_convolution_graph(tmp_path) -> None:
    """Why --backend onnx refuses bf16. If a new ONNX Runtime loads this, the refusal should go."""
    model = PrecisionCast(small_network(), torch.bfloat16).eval()
    path = tmp_path / "bf16.onnx"
    with torch.no_grad(), quiet_exporter_logs():
        torch.onnx.export(model, (torch.randn(2, 3, CROP, CROP),), str(path), **export_kwargs((2, 2, 2)))
    with pytest.raises(Exception, match=r"bfloat16"):
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_refused_precisions_and_triton_exports_fail_before_any_work(tmp_path) -> None:
    lite0 = {"model": "efficientnet-lite0", "backend": "onnx", "device": "cpu"}
    with pytest.raises(BackendUnavailable) as refused:
        plan_compile(CompileSettings(**lite0, precision="bf16"))
    assert str(refused.value) == BF16_REFUSAL and "--backend inductor" in BF16_REFUSAL
    with pytest.raises(BackendUnavailable) as refused:
        plan_compile(CompileSettings(**lite0, precision="fp16"))
    assert str(refused.value) == CPU_FP16_REFUSAL and "--device cuda" in CPU_FP16_REFUSAL
    OnnxBackend().check_precision("fp16", torch.device("cuda:0"))  # fp16 is for GPUs
    with pytest.raises(ValueError, match="use it with --backend onnx"):
        plan_compile(CompileSettings(backend="inductor", device="cpu", triton_repository=str(tmp_path)))
    with pytest.raises(ValueError, match="--batch 1,OPT,MAX"):
        plan_compile(CompileSettings(**lite0, batch=(2, 8, 32), triton_repository=str(tmp_path)))
    with pytest.raises(ValueError, match="MAX >= 2"):
        check_exportable("onnx", (1, 1, 1))
    # A folder in the way is found before the compile, not after it.
    (tmp_path / "efficientnet-lite0").mkdir()
    (tmp_path / "efficientnet-lite0" / "config.pbtxt").write_text('name: "mine"\n')
    with pytest.raises(ValueError, match="was not written by compile-trt"):
        plan_compile(CompileSettings(**lite0, triton_repository=str(tmp_path)))
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        plan_compile(CompileSettings(**lite0, triton_repository=str(tmp_path / "a-file")))


def artifact_manifest(tmp_path, **changes):
    """A real manifest as compile-trt writes it, with ``changes``; ``backend_config`` left out when None."""
    from compile.manifest import Manifest

    fields = {f.name: None for f in dataclasses.fields(Manifest)}
    data = {
        **fields,
        "format_version": _defaults.MANIFEST_FORMAT_VERSION,
        "model": "efficientnet-lite0",
        "model_family": "efficientnet_lite",
        "preprocess": PreprocessSpec(256, 224, (0.5,) * 3, (0.5,) * 3).to_dict(),
        "labels": [f"class {i}" for i in range(1000)],
        "backend": "onnx",
        "precision": "fp32",
        "batch_min": 1,
        "batch_opt": 8,
        "batch_max": 32,
        "device_type": "cpu",
        "device_capability": "AVX512",
        "device_isa": "avx512 avx512_vnni avx512_bf16",
        "engine_file": "model.onnx",
        "activation": "softmax",
        "versions": {"onnxruntime": "1.32.0", "torch": "2.14.0"},
        **changes,
    }
    data = {k: v for k, v in data.items() if v is not None or k not in ("backend_config",)}
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    return read_manifest(tmp_path)


def test_an_onnx_manifest_names_its_runtime_and_older_manifests_still_read(tmp_path) -> None:
    manifest = artifact_manifest(tmp_path, backend_config=None)
    assert manifest.engine_name == "onnxruntime-fp32"
    assert manifest.backend_config == {}  # written before the field existed
    assert artifact_manifest(tmp_path, backend="inductor").engine_name == "inductor-fp32"


def test_an_onnx_artifact_runs_on_any_cpu_but_needs_its_onnxruntime(tmp_path) -> None:
    manifest = artifact_manifest(tmp_path)
    older_cpu = {"capability": "AVX2", "isa": "avx2"}
    assert device_problems(manifest, "cpu", older_cpu) == []  # ONNX Runtime picks kernels where it runs
    inductor = artifact_manifest(tmp_path, backend="inductor")
    assert "Recompile it on this machine" in device_problems(inductor, "cpu", older_cpu)[0]
    assert version_problems(manifest, {"onnxruntime": "1.32.1", "torch": "2.14.0"}) == []
    (problem,) = version_problems(manifest, {"onnxruntime": "1.30.0", "torch": "2.14.0"})
    assert "onnxruntime 1.32.0" in problem and "Recompile" in problem
    (missing,) = version_problems(manifest, {"torch": "2.14.0"})
    assert "not installed here" in missing and "vision-serve[onnx]" in missing
    # Nor to the GPU it was gated on: the same file runs on any GPU the CUDA provider supports.
    on_h100 = dataclasses.replace(manifest, device_type="cuda", device_name="NVIDIA H100", device_capability="sm_90")
    assert device_problems(on_h100, "cuda", {"type": "cuda", "name": "NVIDIA L4", "capability": "sm_89"}) == []


def test_triton_configs_parse_with_tritons_schema_and_fit_together(tmp_path) -> None:
    manifest = artifact_manifest(tmp_path)
    names = RepositoryModels.for_model(manifest.model)
    configs = {name: parse_model_config(text) for name, text in repository_configs(manifest).items()}
    ensemble, preprocess, classifier = configs[names.ensemble], configs[names.preprocess], configs[names.classifier]
    assert (ensemble.platform, preprocess.backend, classifier.backend) == ("ensemble", "dali", "onnxruntime")
    assert {c.max_batch_size for c in configs.values()} == {32}
    assert list(classifier.input[0].dims) == [3, 224, 224] and list(classifier.output[0].dims) == [1000]
    assert classifier.output[0].label_filename == ensemble.output[0].label_filename == "labels.txt"
    assert classifier.instance_group[0].kind == classifier.instance_group[0].KIND_CPU
    assert list(classifier.dynamic_batching.preferred_batch_size) == [8, 32]
    assert preprocess.input[0].allow_ragged_batch  # encoded images of different lengths share a batch
    first, second = ensemble.ensemble_scheduling.step
    assert (first.model_name, second.model_name) == (names.preprocess, names.classifier)
    # Every name a step maps exists in the model it names, and the tensors chain.
    assert set(first.input_map) == {i.name for i in preprocess.input}
    assert set(first.output_map) == {o.name for o in preprocess.output}
    assert set(second.input_map) == {i.name for i in classifier.input}
    assert set(second.output_map) == {o.name for o in classifier.output}
    assert list(first.output_map.values()) == list(second.input_map.values())
    assert set(first.input_map.values()) == {i.name for i in ensemble.input}
    assert set(second.output_map.values()) == {o.name for o in ensemble.output}
    gpu = parse_model_config(repository_configs(dataclasses.replace(manifest, device_type="cuda"))[names.classifier])
    assert gpu.instance_group[0].kind == gpu.instance_group[0].KIND_GPU
    with pytest.raises(ValueError, match="not a valid Triton model configuration"):
        parse_model_config('name: "x"\nmax_batch_sizes: 3\n')


def test_only_folders_we_wrote_are_replaced(tmp_path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "config.pbtxt").write_text('name: "theirs"\n')
    with pytest.raises(ValueError, match="was not written by compile-trt"):
        check_replaceable(theirs)
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "config.pbtxt").write_text(MARKER + '\nname: "ours"\n')
    check_replaceable(ours)
    check_replaceable(tmp_path / "absent")


# Sizes whose center-crop offsets round half to even both ways ((341 - 224) / 2 = 58.5 -> 58;
# (343 - 224) / 2 = 59.5 -> 60), portrait and landscape, square, and a crop-sized image.
CROP_SIZES = [(640, 480), (480, 640), (500, 375), (333, 500), (512, 512), (224, 224), (1000, 747), (301, 227)]


def test_the_triton_dali_graph_computes_torchvisions_crop_box() -> None:
    pytest.importorskip("nvidia.dali")
    from nvidia.dali import fn, pipeline_def, types

    from preprocessing.dali_triton import crop_box

    spec = PreprocessSpec(256, 224, (0.0,) * 3, (1.0,) * 3)

    @pipeline_def(batch_size=len(CROP_SIZES), num_threads=1, device_id=None)
    def boxes():
        encoded = fn.external_source(name="IMAGE", dtype=types.UINT8, ndim=1)
        return crop_box(encoded, spec)

    pipe = boxes()
    pipe.build()
    jpegs = [encode(Image.new("RGB", size, (90, 120, 30))) for size in CROP_SIZES]
    pipe.feed_input("IMAGE", [np.frombuffer(data, dtype=np.uint8) for data in jpegs])
    starts, ends = pipe.run()
    for i, (width, height) in enumerate(CROP_SIZES):
        left, top, right, bottom = plan_crop(width, height, spec).source_box
        np.testing.assert_allclose(np.array(starts[i]), [top, left], rtol=1e-6)
        np.testing.assert_allclose(np.array(ends[i]), [bottom, right], rtol=1e-6)


def test_backend_is_registered_under_its_name() -> None:
    backend = get_backend("onnx")
    assert backend.engine_file == "model.onnx" and backend.input_memory_format == torch.contiguous_format
    assert not backend.native_code and "onnxruntime" in backend.extra_versions()


# ---- a non-square model input (PreprocessSpec.input_size = (height, width)) -----------------------------

# 48 high, 64 wide: a swapped height and width gives 64x48, which these tests tell apart.
NON_SQUARE = PreprocessSpec(0, 0, (0.5,) * 3, (0.25,) * 3, resize_mode="exact", resize_height=48, resize_width=64)


def onnx_input_dims(path) -> list:
    import onnx

    (image,) = onnx.load(str(path)).graph.input
    return [d.dim_value or d.dim_param for d in image.type.tensor_type.shape.dim]


def test_a_non_square_input_is_exported_and_run_as_height_by_width(tmp_path) -> None:
    from compile.model_files import read_model_file

    model, path = small_network(), tmp_path / "model.onnx"
    settings = CompileSettings(backend="onnx", batch=(1, 4, 8))
    OnnxBackend().build(
        PrecisionCast(copy.deepcopy(model), torch.float32).eval(),
        settings,
        torch.device("cpu"),
        NON_SQUARE.input_size,
        path,
    )
    dims = onnx_input_dims(path)
    assert dims[1:] == [3, 48, 64] and isinstance(dims[0], str)  # the batch stays dynamic
    assert read_model_file(str(path)).image_size == (48, 64)
    engine = OnnxBackend().load(path, None, torch.device("cpu"))
    images = torch.randn(2, 3, 48, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(engine(images), model(images), rtol=1e-4, atol=1e-5)
    with pytest.raises(Exception, match=r"(?i)dimension|shape"):  # ONNX Runtime checks the fixed sides
        engine(images.transpose(2, 3).contiguous())


def test_a_non_square_int8_engine_is_calibrated_on_height_by_width_photos(tmp_path) -> None:
    from compile.quantization import Calibration
    from compile.quantization.datasets import ImageFiles, preprocess_files
    from compile.sample_photos import sample_photo_file

    photos = tuple((name, sample_photo_file(name)) for name in ("chelsea", "coffee", "astronaut", "rocket"))
    files = ImageFiles("sample photos", photos, len(photos))
    images = preprocess_files(files, NON_SQUARE, "--calibration")
    assert images.shape == (4, 3, 48, 64)
    settings = CompileSettings(backend="onnx", precision="int8", calibration=str(tmp_path), batch=(1, 4, 8))
    path = tmp_path / "model.onnx"
    model = small_network()
    OnnxBackend().build(
        model, settings, torch.device("cpu"), NON_SQUARE.input_size, path, Calibration(images, "minmax", files)
    )
    assert onnx_input_dims(path)[1:] == [3, 48, 64]
    engine = OnnxBackend().load(path, None, torch.device("cpu"))
    with torch.no_grad():
        reference = model(images)
    logits = engine(images)
    assert logits.shape == (4, 10) and torch.nn.functional.cosine_similarity(logits, reference).min() > 0.99


def test_triton_configs_declare_a_non_square_input_as_height_by_width(tmp_path) -> None:
    manifest = artifact_manifest(tmp_path, preprocess=NON_SQUARE.to_dict())
    names = RepositoryModels.for_model(manifest.model)
    configs = {name: parse_model_config(text) for name, text in repository_configs(manifest).items()}
    assert list(configs[names.classifier].input[0].dims) == [3, 48, 64]
    assert list(configs[names.preprocess].output[0].dims) == [3, 48, 64]  # what DALI hands the classifier
