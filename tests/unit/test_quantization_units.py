"""Issue 43's pieces without a model run: the flags, the calibration and evaluation sets (reading,
sampling, decoding, the disjointness check), the gate's quantized measures, and the options each
quantizer is given. compile-trt's answers to bad sets are checked through its own entry point."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from compile import _defaults
from compile.backends import BackendUnavailable, get_backend
from compile.cli import main
from compile.gate import compare_logits, photo_lines
from compile.quantization.datasets import (
    DatasetError,
    augmented_photos,
    check_disjoint,
    files_digest,
    preprocess_files,
    read_image_folder,
)
from compile.quantization.onnx_qdq import CalibrationReader, quantize_options
from compile.settings import CompileSettings
from preprocessing.spec import PreprocessSpec
from tests.conftest import encode, sample_array

SPEC = PreprocessSpec(resize_size=64, crop_size=56, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))


def write_photos(folder, names=("chelsea", "coffee"), fmt="JPEG"):
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / f"{name}.{fmt.lower()}").write_bytes(encode(sample_array(name), fmt))
    return folder


def test_int8_without_calibration_is_a_usage_error_that_says_what_a_good_set_is() -> None:
    with pytest.raises(ValueError, match="--precision int8 needs --calibration DIR") as refused:
        CompileSettings(model="efficientnet-lite0", precision="int8")
    assert "not the images you evaluate on" in str(refused.value)
    with pytest.raises(ValueError, match="--precision fp32 needs none"):
        CompileSettings(model="efficientnet-lite0", calibration="/tmp")
    with pytest.raises(ValueError, match=r"--calibration-count must be 1\.\.2048"):
        CompileSettings(model="efficientnet-lite0", precision="int8", calibration="/tmp", calibration_count=0)
    with pytest.raises(ValueError, match="--calibration-method must be one of"):
        CompileSettings(model="efficientnet-lite0", precision="int8", calibration="/tmp", calibration_method="kl")


def test_compile_trt_answers_a_missing_calibration_with_exit_code_2(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--model", "efficientnet-lite0", "--precision", "int8", "--device", "cpu"])
    assert exited.value.code == 2
    assert "needs --calibration DIR" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda root: root / "missing", "does not exist"),
        (lambda root: (root / "empty").mkdir() or root / "empty", "holds no images"),
        (lambda root: (root / "notes.txt").write_text("x") and root / "notes.txt", "is a file"),
        (lambda root: (root / "zero").mkdir() or (root / "zero" / "a.jpg").write_bytes(b"") or root / "zero", "empty"),
    ],
)
def test_compile_trt_answers_an_unusable_calibration_folder_with_exit_code_2(tmp_path, capsys, make, message) -> None:
    folder = make(tmp_path)
    argv = ["--model", "efficientnet-lite0", "--precision", "int8", "--backend", "onnx", "--device", "cpu"]
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--calibration", str(folder), "--output", str(tmp_path / "out")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--calibration" in err and message in err
    assert not (tmp_path / "out").exists()


def test_a_calibration_folder_is_read_recursively_and_sampled_with_a_seed(tmp_path) -> None:
    for index in range(6):
        sub = tmp_path / f"class{index % 2}"
        sub.mkdir(exist_ok=True)
        (sub / f"{index}.png").write_bytes(encode(sample_array("coffee")[index:], "PNG"))
    (tmp_path / "labels.csv").write_text("not an image")
    every = read_image_folder(str(tmp_path), "--calibration", 100)
    assert every.found == 6 and len(every.names) == 6 and every.names[0] == "class0/0.png"
    sample = read_image_folder(str(tmp_path), "--calibration", 3)
    again = read_image_folder(str(tmp_path), "--calibration", 3)
    assert sample.found == 6 and len(sample.names) == 3 and sample.names == again.names
    assert sample.digest == again.digest != every.digest
    assert sample.describe() == {"source": str(tmp_path), "count": 3, "found": 6, "sha256": sample.digest}


def test_the_engine_cache_key_covers_the_calibration_set(tmp_path) -> None:
    """An int8 engine is as its calibration set made it: a compile calibrated on other images (a smaller
    sample of the folder, or the same names with other pixels) must get another cache key, or it would be
    handed the engine already in its output folder. All else that goes into the key is held the same, and
    the same set planned twice gives the same key."""
    from compile.build import engine_cache_key, plan_compile

    folder = write_photos(tmp_path / "calibration", names=("chelsea", "coffee"))
    evaluation = write_photos(tmp_path / "evaluation", names=("rocket",))  # quicker than the augmented samples
    given = {"model": "efficientnet-lite0", "backend": "onnx", "device": "cpu", "precision": "int8"}
    given |= {"gate_images": str(evaluation), "output": str(tmp_path / "out")}

    def key(**settings: object) -> str:
        plan = plan_compile(CompileSettings(**given, calibration=str(folder), **settings))
        device = {"type": "cpu", "name": "cpu", "capability": "AVX2", "isa": "avx2"}
        return engine_cache_key(plan, "ab" * 32, {"torch": "2.0"}, device, {"option": 1})

    first = key()
    assert key() == first, "the same set, planned again"
    assert key(calibration_count=1) != first, "a sample of one of its two images"
    (folder / "coffee.jpeg").write_bytes(encode(sample_array("astronaut"), "JPEG"))
    assert key() != first, "the same names with other pixels"


def test_the_digest_covers_names_and_contents() -> None:
    base = files_digest([("a.jpg", b"1"), ("b.jpg", b"2")])
    assert base == files_digest([("b.jpg", b"2"), ("a.jpg", b"1")])
    assert base != files_digest([("a.jpg", b"1"), ("b.jpg", b"3")])
    assert base != files_digest([("a.jpg", b"1"), ("c.jpg", b"2")])


def test_images_that_do_not_decode_are_named(tmp_path) -> None:
    folder = write_photos(tmp_path / "calib")
    (folder / "broken.jpg").write_bytes(encode(sample_array("astronaut"))[:300])
    (folder / "text.png").write_bytes(b"not a png at all")
    files = read_image_folder(str(folder), "--calibration", 10)
    with pytest.raises(DatasetError, match=r"2 of 4 images do not decode: broken.jpg .*text.png"):
        preprocess_files(files, SPEC, "--calibration")


def test_decoded_sets_are_preprocessed_as_served(tmp_path) -> None:
    folder = write_photos(tmp_path / "calib", fmt="PNG")
    images = preprocess_files(read_image_folder(str(folder), "--calibration", 10), SPEC, "--calibration")
    assert images.shape == (2, 3, 56, 56) and images.dtype == torch.float32
    assert images.min() >= -2.0 and images.max() <= 2.0  # (x - 0.5) / 0.25 on 0..1 pixels


NON_SQUARE = PreprocessSpec(0, 0, (0.5,) * 3, (0.25,) * 3, resize_mode="exact", resize_height=48, resize_width=64)


def test_a_non_square_model_is_calibrated_and_judged_on_height_by_width_images() -> None:
    """Calibration and evaluation images are the model's input: 48 high, 64 wide, whatever the photo's
    shape (an EXIF-rotated one, a wide strip, a tiny one); the copy check works on them too."""
    from compile.quantization.datasets import ImageFiles

    chelsea = sample_array("chelsea")
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways, displayed upright
    sideways = encode(Image.fromarray(chelsea).transpose(Image.Transpose.ROTATE_90), quality=95, exif=exif)
    wide = encode(Image.fromarray(sample_array("rocket")).resize((900, 120)))
    tiny = encode(Image.fromarray(sample_array("coffee")).resize((7, 5)), "PNG")
    calibration_files = [("sideways.jpg", sideways), ("wide.jpg", wide), ("tiny.png", tiny)]
    calibration = preprocess_files(ImageFiles("c", tuple(calibration_files), 3), NON_SQUARE, "--calibration")
    assert calibration.shape == (3, 3, 48, 64)
    evaluation = preprocess_files(ImageFiles("e", (("chelsea.png", encode(chelsea, "PNG")),), 1), NON_SQUARE, "--eval")
    # The upright photo and its sideways-stored copy are the same input once the EXIF rotation is applied.
    with pytest.raises(DatasetError, match=r"chelsea\.png = sideways\.jpg"):
        check_disjoint(calibration, [n for n, _ in calibration_files], evaluation, ["chelsea.png"])
    check_disjoint(calibration[1:], ["wide.jpg", "tiny.png"], evaluation, ["chelsea.png"])


def test_augmentations_are_seeded_varied_and_keep_the_original_first() -> None:
    photos = [("coffee", encode(sample_array("coffee"), "PNG"))]
    first, second = augmented_photos(photos, 4), augmented_photos(photos, 4)
    assert [name for name, _ in first] == ["coffee", "coffee-aug00", "coffee-aug01", "coffee-aug02", "coffee-aug03"]
    assert first == second and first[0] == photos[0]
    sizes = {Image.open(io.BytesIO(data)).size for _, data in first[1:]}
    assert len(sizes) == 4  # every crop differs


def test_an_evaluation_image_found_in_the_calibration_set_is_refused_even_re_encoded() -> None:
    photo = sample_array("chelsea")
    calibration_files = [("cat.jpg", encode(photo, "JPEG", quality=70)), ("coffee.jpg", encode(sample_array("coffee")))]
    evaluation_files = [("chelsea.png", encode(photo, "PNG")), ("rocket.png", encode(sample_array("rocket"), "PNG"))]
    from compile.quantization.datasets import ImageFiles

    calibration = preprocess_files(ImageFiles("c", tuple(calibration_files), 2), SPEC, "--calibration")
    evaluation = preprocess_files(ImageFiles("e", tuple(evaluation_files), 2), SPEC, "--eval")
    with pytest.raises(
        DatasetError, match=r"1 evaluation images are also in the calibration set: chelsea.png = cat.jpg"
    ):
        check_disjoint(calibration, ["cat.jpg", "coffee.jpg"], evaluation, ["chelsea.png", "rocket.png"])
    check_disjoint(calibration[1:], ["coffee.jpg"], evaluation, ["chelsea.png", "rocket.png"])  # disjoint: passes


def test_augmented_photos_are_not_taken_for_copies_of_each_other() -> None:
    """The default evaluation set is the sample photos and their augmentations: the check must not
    find near-copies among different photos (its threshold is below what a crop or a tilt changes)."""
    photos = augmented_photos([("coffee", encode(sample_array("coffee"), "PNG"))], 6)
    from compile.quantization.datasets import ImageFiles

    images = preprocess_files(ImageFiles("e", tuple(photos), 7), SPEC, "--eval")
    names = [name for name, _ in photos]
    for index in range(len(photos)):
        others = [i for i in range(len(photos)) if i != index]
        check_disjoint(images[others], [names[i] for i in others], images[index : index + 1], [names[index]])


def test_quantized_measures_agreement_in_the_top5_and_probability_drop() -> None:
    reference = torch.tensor([[4.0, 1.0, 0.0, 0.0, 0.0, 0.0, -1.0], [0.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    same = compare_logits(reference.clone(), reference)
    assert same["top5_agreement"] == 1.0 and same["mean_prob_drop"] == pytest.approx(0.0, abs=1e-12)
    # Row 0 keeps class 0 in its top-5 (second place); row 1 drops class 1 to last place.
    moved = torch.tensor([[4.0, 5.0, 0.0, 0.0, 0.0, 0.0, -1.0], [0.0, -9.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    measures = compare_logits(moved, reference)
    assert measures["top1_agreement"] == 0.0 and measures["top5_agreement"] == 0.5
    p_ref, p_out = reference.double().softmax(1), moved.double().softmax(1)
    expected = ((p_ref[0, 0] - p_out[0, 0]) + (p_ref[1, 1] - p_out[1, 1])).item() / 2
    assert measures["mean_prob_drop"] == pytest.approx(expected)


def test_int8_thresholds_gate_classes_and_probabilities_and_random_weights_gate_logits() -> None:
    real = CompileSettings(model="efficientnet-lite0", precision="int8", calibration="/tmp")
    assert set(real.gate_thresholds()) == {"top1_agreement", "top5_agreement", "mean_prob_drop"}
    random = CompileSettings(model="resnet152", weights="random", precision="int8", calibration="/tmp")
    assert random.gate_thresholds() == _defaults.RANDOM_WEIGHTS_QUANTIZED_THRESHOLDS
    tightened = CompileSettings(
        model="efficientnet-lite0",
        precision="int8",
        calibration="/tmp",
        gate_min_top5_agreement=0.99,
        gate_max_prob_drop=0.01,
    )
    assert tightened.gate_thresholds()["top5_agreement"] == 0.99
    assert tightened.gate_thresholds()["mean_prob_drop"] == 0.01


def test_a_large_photo_list_reports_only_the_changed_classes() -> None:
    few = [{"name": f"p{i}", "reference": "cat", "compiled": "cat"} for i in range(3)]
    assert len(photo_lines(few)) == 3
    many = [{"name": f"p{i}", "reference": "cat", "compiled": "dog" if i == 5 else "cat"} for i in range(20)]
    lines = photo_lines(many)
    assert lines[0].strip() == "photos whose top-1 changed: 1 of 20" and "p5" in lines[1] and len(lines) == 2


def test_each_backend_names_its_calibration_methods_and_refuses_others() -> None:
    onnx = get_backend("onnx")
    assert onnx.resolve_calibration_method("int8", "auto") == onnx.calibration_methods[0]
    assert onnx.resolve_calibration_method("int8", "minmax") == "minmax"
    with pytest.raises(BackendUnavailable, match="no 'histogram' calibration; it offers"):
        onnx.resolve_calibration_method("int8", "histogram")
    with pytest.raises(BackendUnavailable, match="cannot build --precision fp8"):
        onnx.resolve_calibration_method("fp8", "auto")
    with pytest.raises(BackendUnavailable, match=r"eager cannot build --precision int8 \(it quantizes nothing"):
        get_backend("eager").resolve_calibration_method("int8", "auto")


def test_onnx_qdq_options_are_symmetric_int8_per_channel_for_tensorrt() -> None:
    options = quantize_options("entropy")
    assert options["quant_format"] == "QDQ" and options["per_channel"]
    assert options["activation_type"] == options["weight_type"] == "QInt8"
    assert options["extra_options"]["ActivationSymmetric"] and options["extra_options"]["WeightSymmetric"]
    assert options["calibrate_method"] == "Entropy"
    with pytest.raises(ValueError, match="no 'histogram' calibration"):
        quantize_options("histogram")


def test_onnx_int8_weights_take_7_bits_on_a_cpu_without_vnni_only() -> None:
    """Without VNNI, ONNX Runtime's int8 kernels saturate full-range weights (top-1 agreement 0.33 on
    EfficientNet-Lite0): 7-bit weights there, full range on a GPU and on a CPU with VNNI."""
    from compile.devices import cpu_has_vnni
    from compile.quantization.onnx_qdq import needs_reduced_range

    assert quantize_options("entropy")["reduce_range"] is False
    assert quantize_options("entropy", reduce_range=True)["reduce_range"] is True
    assert needs_reduced_range("cuda") is False
    assert needs_reduced_range("cpu") is (not cpu_has_vnni())


def test_the_calibration_reader_yields_runs_and_honours_ranges() -> None:
    from compile.quantization import Calibration
    from compile.quantization.datasets import ImageFiles

    images = torch.arange(20 * 3 * 2 * 2, dtype=torch.float32).reshape(20, 3, 2, 2)
    reader = CalibrationReader(Calibration(images, "minmax", ImageFiles("x", (), 0)), "images")
    assert len(reader) == 3  # 8 + 8 + 4 rows
    rows = []
    while (batch := reader.get_next()) is not None:
        rows.append(batch["images"])
    assert [len(r) for r in rows] == [8, 8, 4] and np.array_equal(np.concatenate(rows), images.numpy())
    reader.set_range(1, 2)
    assert np.array_equal(reader.get_next()["images"], images[8:16].numpy()) and reader.get_next() is None


def test_auto_picks_the_int8_engine_measured_fastest_on_a_cpu(monkeypatch) -> None:
    import compile.backends as backends

    monkeypatch.setattr(backends, "torchao_status", lambda: (True, "imports"))
    assert backends.resolve_compile_backend("auto", torch.device("cpu"), "int8")[0] == "inductor"
    monkeypatch.setattr(backends, "torchao_status", lambda: (False, "ImportError"))
    backend, reason = backends.resolve_compile_backend("auto", torch.device("cpu"), "int8")
    assert backend == "onnx" and "vision-serve[quantize]" in reason
