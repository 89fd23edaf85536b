"""The preprocessing flags (compile/preprocess_flags.py), as compile-trt, vision-serve and vision-tune take
them: each parsed, each refusal naming its flag and the fix, each laid over a catalog, timm, folder and
model-file spec changing its own fields only, taken from env vars and a config file, refused with an
artifact, shown in the serving plan (/info), and carried by the manifest (an older manifest still read)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from compile.catalog import get_model_entry
from compile.manifest import Manifest, ManifestError, read_manifest, write_manifest
from compile.model_request import ModelRequest
from compile.model_source import resolve_model
from compile.preprocess_flags import PREPROCESS_FIELDS, preprocess_spec
from compile.settings import CompileSettings
from compile.settings_errors import SettingsError
from preprocessing.spec import PreprocessSpec
from service.settings import ServeSettings, render_config, resolve_settings
from service.tune.settings import TuneSettings

IMAGENET = {"mean": "0.485,0.456,0.406", "std": "0.229,0.224,0.225"}
# resnet50's own (torchvision's IMAGENET1K_V2 preset), which the override tests start from.
RESNET50 = PreprocessSpec(232, 224, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), "bilinear")


def changed(before: PreprocessSpec, after: PreprocessSpec) -> dict[str, object]:
    """The fields ``after`` holds other than ``before``'s, as to_dict writes them."""
    old, new = before.to_dict(), after.to_dict()
    return {name: value for name, value in new.items() if old[name] != value}


@pytest.mark.parametrize(
    ("flags", "parsed"),
    [
        ({"resize_size": "256"}, {"resize": 256}),
        ({"resize_size": " 240 X 200 "}, {"resize": (240, 200)}),
        ({"resize_size": 256}, {"resize": 256}),  # a number from code, or from a config file, as before
        ({"resize_mode": "cover"}, {"resize_mode": "cover"}),
        ({"crop_size": "224"}, {"crop": (224, 224)}),
        ({"crop_size": "224x192"}, {"crop": (224, 192)}),
        ({"crop_size": "None"}, {"crop": (0, 0)}),
        ({"crop_pct": "0.875"}, {"crop_pct": 0.875}),
        ({"crop_rounding": "floor"}, {"crop_rounding": "floor"}),
        ({"pad_fill": "124, 116,104"}, {"pad_fill": (124, 116, 104)}),
        ({"pad_fill": "255"}, {"pad_fill": (255, 255, 255)}),
        ({"interpolation": "bicubic"}, {"interpolation": "bicubic"}),
        ({"antialias": "off"}, {"antialias": False}),
        ({"antialias": "ON"}, {"antialias": True}),
        ({"rescale_factor": "1/127.5"}, {"rescale_factor": 1 / 127.5}),
        ({"rescale_factor": "0.5"}, {"rescale_factor": 0.5}),
        ({"normalize": "off"}, {"normalize": False}),
        ({"channel_order": "bgr"}, {"channel_order": "BGR"}),
        ({"mean": "0.5,0.25,0"}, {"mean": (0.5, 0.25, 0.0)}),
        ({"std": "1,1,0.5"}, {"std": (1.0, 1.0, 0.5)}),
    ],
)
def test_each_flag_parses(flags: dict, parsed: dict) -> None:
    got = ModelRequest("m", **flags).preprocess_flags
    assert {name: getattr(got, name) for name in parsed} == parsed
    untouched = {f.name for f in dataclasses.fields(got)} - set(parsed) - {"texts"}
    assert all(getattr(got, name) is None for name in untouched)


@pytest.mark.parametrize(
    ("flags", "named", "says"),
    [
        ({"resize_size": "0"}, "--resize-size", "each side 1..4096"),
        ({"resize_size": "256x"}, "--resize-size", "N (the shorter side) or HxW"),
        ({"resize_size": "x256"}, "--resize-size", "N (the shorter side) or HxW"),
        ({"resize_size": "2.5"}, "--resize-size", "N (the shorter side) or HxW"),
        ({"resize_size": "5000"}, "--resize-size", "each side 1..4096"),
        ({"resize_size": "none"}, "--resize-size", "N (the shorter side) or HxW"),
        ({"resize_mode": "squash"}, "--resize-mode", "shorter, exact, cover, contain"),
        ({"crop_size": "0"}, "--crop-size", "N (a square), HxW, or none"),
        ({"crop_size": "224x0"}, "--crop-size", "each side 1..4096"),
        ({"crop_pct": "0"}, "--crop-pct", "in (0, 1]"),
        ({"crop_pct": "1.5"}, "--crop-pct", "in (0, 1]"),
        ({"crop_pct": "nan"}, "--crop-pct", "in (0, 1]"),
        ({"crop_rounding": "ceil"}, "--crop-rounding", "round, floor"),
        ({"pad_fill": "256,0,0"}, "--pad-fill", "0..255"),
        ({"pad_fill": "1,2"}, "--pad-fill", "0..255"),
        ({"pad_fill": "-1,0,0"}, "--pad-fill", "0..255"),
        ({"pad_fill": "1.5,0,0"}, "--pad-fill", "0..255"),
        ({"interpolation": "lanczos"}, "--interpolation", "bilinear, bicubic, nearest"),
        ({"antialias": "true"}, "--antialias", "on, off"),
        ({"rescale_factor": "0"}, "--rescale-factor", "> 0, or 1/N"),
        ({"rescale_factor": "-1"}, "--rescale-factor", "> 0, or 1/N"),
        ({"rescale_factor": "1/0"}, "--rescale-factor", "> 0, or 1/N"),
        ({"rescale_factor": "inf"}, "--rescale-factor", "> 0, or 1/N"),
        ({"normalize": "false"}, "--normalize", "on, off"),
        ({"channel_order": "RGBA"}, "--channel-order", "RGB, BGR"),
        ({"mean": "0.5,0.5"}, "--mean", "three numbers"),
        ({"std": "0.5,0,0.5"}, "--std", "> 0"),
        ({"crop_pct": "0.9", "resize_size": "256"}, "--crop-pct, --resize-size", "name the resize twice"),
        ({"crop_pct": "0.9", "crop_size": "none"}, "--crop-pct, --crop-size", "there is none"),
        ({"resize_size": "240x200", "resize_mode": "shorter"}, "--resize-size, --resize-mode", "one size"),
    ],
)
def test_each_refusal_names_its_flag_and_the_fix(flags: dict, named: str, says: str) -> None:
    """Refused by all three commands' settings, before torch: one line naming the flag, then a fix."""
    for settings_type in (CompileSettings, ServeSettings, TuneSettings):
        extra = {"p99_ms": 100.0} if settings_type is TuneSettings else {}
        with pytest.raises(SettingsError) as caught:
            settings_type(**flags, **extra)
        error = caught.value
        assert error.flag == named and says in error.message and error.fix, (settings_type, error)
        assert "\n" not in str(error)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (  # an exact box, no crop: the box is the model's input
            {"resize_size": "240x200", "crop_size": "none"},
            {"resize_mode": "exact", "resize_size": 0, "resize_height": 240, "resize_width": 200, "crop_size": 0}
            | {"crop_height": 0, "crop_width": 0},
        ),
        (
            {"resize_size": "240x200", "resize_mode": "cover"},
            {"resize_mode": "cover", "resize_size": 0, "resize_height": 240, "resize_width": 200},
        ),
        ({"resize_size": "256"}, {"resize_size": 256}),  # today's flag: the shorter side
        (
            {"resize_size": "256", "resize_mode": "exact"},
            {"resize_mode": "exact", "resize_size": 0, "resize_height": 256, "resize_width": 256},
        ),
        ({"crop_pct": "0.9"}, {"resize_size": 248}),  # floor(224 / 0.9), the shorter side as the model's
        (  # a non-square crop from a shorter-side model: timm's center mode, floor(256 / 0.875) x floor(192 / 0.875)
            {"crop_size": "256x192", "crop_pct": "0.875"},
            {"resize_mode": "cover", "resize_size": 0, "resize_height": 292, "resize_width": 219}
            | {"crop_size": 0, "crop_height": 256, "crop_width": 192},
        ),
        (
            {"resize_mode": "contain", "pad_fill": "124,116,104"},
            {"resize_mode": "contain", "resize_size": 0}
            | {"resize_height": 232, "resize_width": 232, "pad_fill": [124, 116, 104]},
        ),
        ({"crop_size": "200"}, {"crop_size": 200, "crop_height": 200, "crop_width": 200}),
        (
            {"crop_rounding": "floor", "interpolation": "bicubic", "antialias": "off"},
            {"crop_rounding": "floor", "interpolation": "bicubic", "antialias": False},
        ),
        ({"rescale_factor": "1/127.5", "normalize": "off"}, {"rescale_factor": 1 / 127.5, "normalize": False}),
        (
            {"channel_order": "BGR", "mean": "0.406,0.456,0.485", "std": "0.225,0.224,0.229"},
            {"channel_order": "BGR", "mean": [0.406, 0.456, 0.485], "std": [0.225, 0.224, 0.229]},
        ),
    ],
)
def test_flags_override_only_their_fields_of_a_catalog_models_spec(flags: dict, expected: dict) -> None:
    assert get_model_entry("resnet50").preprocess == RESNET50
    entry = resolve_model(ModelRequest("resnet50", **flags))
    assert changed(RESNET50, entry.preprocess) == expected


def test_flags_override_a_timm_models_spec() -> None:
    pytest.importorskip("timm")
    own = resolve_model(ModelRequest("timm:resnet18")).preprocess
    entry = resolve_model(ModelRequest("timm:resnet18", crop_pct="0.875", antialias="off", crop_rounding="floor"))
    assert own.resize_size == 235  # floor(224 / 0.95), its pretrained_cfg's
    assert changed(own, entry.preprocess) == {"resize_size": 256, "antialias": False, "crop_rounding": "floor"}


def test_flags_override_a_folders_spec(tmp_path) -> None:
    pytest.importorskip("transformers")
    from tests.unit.test_pretrained_folders import convnext_processor, transformers_folder

    folder = transformers_folder(tmp_path, convnext_processor())
    own = resolve_model(ModelRequest(str(folder))).preprocess
    assert (own.resize_size, own.crop_size) == (73, 64)  # int(64 / 0.875)
    entry = resolve_model(ModelRequest(str(folder), crop_size="48x40", crop_pct="0.8", channel_order="RGB"))
    expected = {"resize_mode": "cover", "resize_size": 0, "resize_height": 60, "resize_width": 50}
    assert changed(own, entry.preprocess) == expected | {"crop_size": 0, "crop_height": 48, "crop_width": 40}


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    """A real torch.export file of a tiny classifier taking 16x16 images, and its labels."""
    from tests.crafted_models import CLASSES, exported_program

    folder = tmp_path_factory.mktemp("model-file")
    (folder / "labels.txt").write_text("".join(f"class{i}\n" for i in range(CLASSES)))
    return exported_program(folder / "tiny.pt2"), folder / "labels.txt"


def test_a_model_file_takes_its_spec_from_the_flags(model_file) -> None:
    path, labels = model_file
    plain = resolve_model(ModelRequest(str(path), labels=str(labels), resize_size="20", crop_size="16", **IMAGENET))
    assert plain.preprocess == PreprocessSpec(20, 16, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), "bilinear")
    # --crop-pct instead of --resize-size; --normalize off needs no mean or std (nothing is normalized).
    raw = resolve_model(ModelRequest(str(path), labels=str(labels), crop_size="16", crop_pct="0.5", normalize="off"))
    assert (raw.preprocess.resize_size, raw.preprocess.normalize) == (32, False)
    assert raw.preprocess.describe() == "shorter 32, crop 16x16, bilinear, no normalize"
    with pytest.raises(SettingsError) as caught:
        resolve_model(ModelRequest(str(path), labels=str(labels), crop_pct="0.5", normalize="on"))
    assert caught.value.flag == "--crop-size, --mean, --std" and "--crop-size --mean --std missing" in str(caught.value)


@pytest.mark.parametrize(
    ("flags", "named", "says"),
    [
        ({"crop_size": "none"}, "--crop-size", "--crop-size none needs an exact resize"),
        ({"resize_size": "240x200", "resize_mode": "cover", "crop_size": "none"}, "--crop-size", "'cover'"),
        ({"channel_order": "BGR"}, "--channel-order", "--mean 0.485,0.456,0.406 --std 0.229,0.224,0.225"),
        ({"channel_order": "BGR", "mean": "0.5,0.5,0.5"}, "--channel-order", "--std 0.229,0.224,0.225"),
        ({"normalize": "off", "mean": "0.5,0.5,0.5"}, "--mean", "with --normalize off"),
    ],
)
def test_combinations_that_do_not_fit_the_models_spec_are_refused(flags: dict, named: str, says: str) -> None:
    with pytest.raises(SettingsError) as caught:
        resolve_model(ModelRequest("resnet50", **flags))
    assert caught.value.flag == named and says in caught.value.message and caught.value.fix, caught.value


def test_flags_that_need_what_a_boxed_spec_lacks_are_refused() -> None:
    """Over a spec with an exact 240x200 resize and no crop (ViT-like, from another model's flags)."""
    boxed = preprocess_spec(ModelRequest("m", resize_size="240x200", crop_size="none").preprocess_flags, RESNET50)
    cases = [
        ({"resize_mode": "cover"}, "--resize-mode", "crops nothing"),
        ({"resize_mode": "shorter"}, "--resize-mode", "the box 240x200"),
        ({"crop_pct": "0.9"}, "--crop-pct", "crops nothing"),
    ]
    for flags, named, says in cases:
        with pytest.raises(SettingsError) as caught:
            preprocess_spec(ModelRequest("m", **flags).preprocess_flags, boxed)
        assert caught.value.flag == named and says in caught.value.message, caught.value
    square = dataclasses.replace(boxed, resize_width=240)
    shorter = preprocess_spec(ModelRequest("m", resize_mode="shorter", crop_size="224").preprocess_flags, square)
    assert shorter.describe() == "shorter 240, crop 224x224, bilinear"  # a square box is its side
    # The same mean for every channel is the same in any order: nothing to restate.
    lite0 = get_model_entry("efficientnet-lite0").preprocess
    assert preprocess_spec(ModelRequest("m", channel_order="BGR").preprocess_flags, lite0).channel_order == "BGR"


def test_env_vars_and_a_config_file_take_the_flags_as_they_took_resize_size(tmp_path) -> None:
    """TOML numbers, booleans and arrays as the flags' text; an env var over the file; an empty one unsets."""
    old = tmp_path / "old.toml"
    old.write_text("resize_size = 256\ncrop_size = 224\n")  # a config file written before sizes took HxW
    settings = resolve_settings({}, environ={}, config_path=str(old)).settings
    assert (settings.resize_size, settings.crop_size) == ("256", "224")
    config = tmp_path / "serve.toml"
    config.write_text(
        "model = 'efficientnet-lite0'\ncrop_size = 224\ncrop-pct = 0.875\nantialias = false\nnormalize = true\n"
        "mean = [0.5, 0.5, 0.5]\npad_fill = [1, 2, 3]\nrescale_factor = 0.5\nchannel_order = 'RGB'\n"
    )
    settings = resolve_settings({}, environ={}, config_path=str(config)).settings
    values = {name: getattr(settings, name) for name in PREPROCESS_FIELDS if getattr(settings, name)}
    assert values == {"crop_size": "224", "crop_pct": "0.875", "antialias": "off", "normalize": "on"} | {
        "mean": "0.5,0.5,0.5", "pad_fill": "1,2,3", "rescale_factor": "0.5", "channel_order": "RGB"
    }  # fmt: skip
    assert resolve_model(ModelRequest.from_settings(settings)).preprocess.describe() == (
        "shorter 256, crop 224x224, bilinear, no antialias"
    )
    environ = {"VISION_SERVE_RESIZE_SIZE": "240x200", "VISION_SERVE_CROP_SIZE": "none", "VISION_SERVE_CROP_PCT": ""}
    layered = resolve_settings({"interpolation": "bicubic"}, environ=environ, config_path=str(config))
    over = layered.settings
    assert (over.resize_size, over.crop_size, over.crop_pct, over.interpolation) == ("240x200", "none", "", "bicubic")
    assert resolve_model(ModelRequest.from_settings(over)).preprocess.describe() == (
        "exact 240x200, no crop, bicubic, no antialias"
    )
    assert layered.sources["resize_size"] == "env VISION_SERVE_RESIZE_SIZE"
    # --print-config's output is a config file that gives the same settings back.
    printed = tmp_path / "printed.toml"
    printed.write_text(render_config(layered))
    assert resolve_settings({}, environ={}, config_path=str(printed)).settings == over


def test_a_bad_value_from_the_config_file_or_env_names_where_it_was_set(tmp_path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text("antialias = 'maybe'\n")
    with pytest.raises(SettingsError) as caught:
        resolve_settings({}, environ={}, config_path=str(config))
    assert caught.value.flag == f"antialias (config file {config})" and "on, off" in caught.value.message
    with pytest.raises(SettingsError) as caught:
        resolve_settings({}, environ={"VISION_SERVE_CROP_SIZE": "nothing"})
    assert caught.value.flag == "VISION_SERVE_CROP_SIZE" and "(values set by: env VISION_SERVE_CROP_SIZE)" in str(
        caught.value
    )
    config.write_text("mean = ['a', 'b', 'c']\n")
    with pytest.raises(SettingsError, match="mean must be a string"):
        resolve_settings({}, environ={}, config_path=str(config))


def test_every_command_lists_the_flags_and_refuses_a_bad_one_with_exit_2(capsys) -> None:
    from compile import cli as compile_cli
    from service import cli as serve_cli
    from service.tune import cli as tune_cli

    for module in (compile_cli, serve_cli, tune_cli):
        text = module.build_parser().format_help()
        assert all(f"--{name.replace('_', '-')}" in text for name in PREPROCESS_FIELDS), module
        assert "N|HxW" in text and "N|HxW|none" in text
    for main, prog in ((compile_cli.main, "compile-trt"), (serve_cli.main, "vision-serve")):
        with pytest.raises(SystemExit) as exited:
            main(["--resize-size", "256", "--crop-pct", "0.9"])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"{prog}: error: --crop-pct 0.9 --resize-size 256: --crop-pct sets the resize"), err


def artifact(directory, spec: PreprocessSpec) -> Manifest:
    """A manifest as compile-trt writes one, for an eager artifact with ``spec``, written into ``directory``."""
    from compile._defaults import MANIFEST_FORMAT_VERSION

    text = dict.fromkeys(("weights_sha256", "weights_sha256_of", "device_name", "device_capability", "device_isa"), "")
    manifest = Manifest(
        format_version=MANIFEST_FORMAT_VERSION,
        model="efficientnet-lite0",
        model_family="efficientnet-lite",
        weights_source="imagenet",
        preprocess=spec,
        labels_source="imagenet",
        labels=("cat", "dog"),
        backend="eager",
        precision="fp32",
        batch_min=1,
        batch_opt=1,
        batch_max=8,
        device_type="cpu",
        engine_file="model.pt",
        engine_sha256="",
        versions={},
        compiled_at="2026-01-01T00:00:00+00:00",
        compile_seconds=0.0,
        compile_settings={},
        validation={},
        cache_key="k",
        **text,
    )
    write_manifest(directory, manifest)
    (directory / "model.pt").write_bytes(b"")
    return manifest


NON_DEFAULT = [
    PreprocessSpec(
        resize_size=0, crop_size=0, mean=(0.1, 0.2, 0.3), std=(0.4, 0.5, 0.6), interpolation="bicubic",
        resize_mode="exact", resize_height=240, resize_width=200, antialias=False, rescale_factor=1 / 127.5,
        channel_order="BGR",
    ),
    PreprocessSpec(
        resize_size=0, crop_size=0, mean=(0.5,) * 3, std=(0.5,) * 3, interpolation="nearest", resize_mode="contain",
        resize_height=256, resize_width=320, crop_height=224, crop_width=192, crop_rounding="floor",
        pad_fill=(124, 116, 104), normalize=False,
    ),
]  # fmt: skip


@pytest.mark.parametrize("spec", NON_DEFAULT, ids=["exact-no-crop-bgr", "contain-padded-floor"])
def test_the_manifest_carries_the_whole_spec(tmp_path, spec: PreprocessSpec) -> None:
    written = artifact(tmp_path, spec)
    data = json.loads((tmp_path / "manifest.json").read_text())
    assert data["preprocess"] == spec.to_dict() and set(data["preprocess"]) == {
        f.name for f in dataclasses.fields(PreprocessSpec)
    }
    assert read_manifest(tmp_path) == written and read_manifest(tmp_path).preprocess == spec


def test_a_manifest_written_before_the_other_fields_still_loads(tmp_path) -> None:
    artifact(tmp_path, RESNET50)
    data = json.loads((tmp_path / "manifest.json").read_text())
    data["preprocess"] = {"resize_size": 232, "crop_size": 224, "mean": [0.485, 0.456, 0.406]} | {
        "std": [0.229, 0.224, 0.225], "interpolation": "bilinear"
    }  # fmt: skip
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    spec = read_manifest(tmp_path).preprocess
    assert spec == RESNET50 and spec.describe() == "shorter 232, crop 224x224, bilinear"
    assert (spec.input_size, spec.crop_rounding, spec.antialias, spec.normalize) == ((224, 224), "round", True, True)


@pytest.mark.parametrize(
    "entry",
    [
        {"resize_size": 256},  # fields missing
        RESNET50.to_dict() | {"resize_mode": "squash"},
        RESNET50.to_dict() | {"resize_size": "256"},
        RESNET50.to_dict() | {"antialias": "yes"},
        RESNET50.to_dict() | {"crop_size": 0, "crop_height": 0, "crop_width": 0},  # no crop with a shorter resize
        RESNET50.to_dict() | {"resize": 256},  # a key of another format
        [256, 224],
        None,
    ],
)
def test_an_invalid_preprocess_entry_says_recompile(tmp_path, entry) -> None:
    artifact(tmp_path, RESNET50)
    data = json.loads((tmp_path / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps(data | {"preprocess": entry}))
    with pytest.raises(ManifestError, match=r"invalid preprocess entry .* Recompile the artifact"):
        read_manifest(tmp_path)


SAMPLES = {
    "resize_size": "256", "resize_mode": "exact", "crop_size": "224", "crop_pct": "0.9", "crop_rounding": "floor",
    "pad_fill": "0,0,0", "interpolation": "bicubic", "antialias": "on", "rescale_factor": "1/255",
    "normalize": "on", "channel_order": "RGB", "mean": "0.5,0.5,0.5", "std": "0.5,0.5,0.5",
}  # fmt: skip


@pytest.mark.parametrize("name", PREPROCESS_FIELDS)
def test_an_artifact_refuses_every_preprocessing_flag(tmp_path, name: str) -> None:
    """The manifest fixes the preprocessing the accuracy gate checked; even the value it holds is refused."""
    from service.supervisor.planning.planner import apply_artifact

    artifact(tmp_path, get_model_entry("efficientnet-lite0").preprocess)
    with pytest.raises(SettingsError) as caught:
        apply_artifact(ServeSettings(artifact=str(tmp_path), **{name: SAMPLES[name]}), cuda_count=0)
    assert caught.value.flag == f"--{name.replace('_', '-')}" and "fixes its labels and preprocessing" in str(
        caught.value
    )


def test_the_serving_plan_shows_the_whole_spec_and_its_summary() -> None:
    """What /info shows per model: every field of the spec the flags made, then its one-line summary."""
    from service.supervisor.planning.planner import plan_serving

    settings = ServeSettings(model="efficientnet-lite0", resize_size="240x200", crop_size="none", antialias="off")
    plan = plan_serving(dataclasses.replace(settings, workers_per_device=1, engine_threads=1), cuda_count=0)
    spec = PreprocessSpec.from_dict(plan.model.preprocess_spec)
    assert spec.input_size == (240, 200) and not spec.antialias
    shown = plan.model.to_dict()
    assert shown["preprocess_summary"] == "exact 240x200, no crop, bilinear, no antialias"
    keys = list(shown)
    assert keys[keys.index("preprocess_spec") + 1] == "preprocess_summary"
