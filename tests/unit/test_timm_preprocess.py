"""timm's eval transform as a PreprocessSpec, field by field for each crop mode, timm's defaults for
what a config leaves out, and the refusals of what no backend here reproduces (the pixels themselves:
tests/integration/test_timm_parity.py)."""

from __future__ import annotations

import json

import pytest

from compile.model_request import ModelRequest
from compile.model_source import resolve_model
from compile.settings_errors import SettingsError
from compile.timm_support import timm_preprocess
from preprocessing.spec import PreprocessSpec

IMAGENET = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}
VALUES = {**IMAGENET, "interpolation": "bicubic"}


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        # center, square: torchvision's Resize(int) of the shorter side to floor(224 / 0.875) = 256.
        ({"input_size": (3, 224, 224)}, {"resize_size": 256, "crop_size": 224}),
        # floor, not round: 224 / 0.9 = 248.9.
        ({"input_size": (3, 224, 224), "crop_pct": 0.9}, {"resize_size": 248, "crop_size": 224}),
        # crop_pct over 1 (volo's): the crop is larger than the resize, padded with 0.
        ({"input_size": (3, 448, 448), "crop_pct": 1.15}, {"resize_size": 389, "crop_size": 448}),
        # center, non-square: cover the floor(H / pct) x floor(W / pct) box (ResizeKeepRatio), crop H x W.
        (
            {"input_size": (3, 192, 256), "crop_pct": 0.9, "crop_mode": "center"},
            {"resize_mode": "cover", "resize_height": 213, "resize_width": 284, "crop_height": 192, "crop_width": 256},
        ),
        # squash: to the box exactly, then crop.
        (
            {"input_size": (3, 160, 128), "crop_pct": 0.95, "crop_mode": "squash"},
            {"resize_mode": "exact", "resize_height": 168, "resize_width": 134, "crop_height": 160, "crop_width": 128},
        ),
        ({"input_size": (3, 224, 224), "crop_pct": 1.0, "crop_mode": "squash"}, {"resize_mode": "exact"}),
        # border: fit inside the box, pad to H x W with round(255 * mean).
        (
            {"input_size": (3, 224, 192), "crop_pct": 0.9, "crop_mode": "border"},
            {
                "resize_mode": "contain",
                "resize_height": 248,
                "resize_width": 213,
                "crop_height": 224,
                "crop_width": 192,
                "pad_fill": (124, 116, 104),
            },
        ),
    ],
    ids=["center-default", "center-floor", "center-padded", "center-non-square", "squash", "squash-1", "border"],
)
def test_each_crop_mode_is_its_spec(config: dict, expected: dict) -> None:
    spec = timm_preprocess("x", {**VALUES, **config})
    height, width = config["input_size"][1:]
    box = expected.get("resize_mode", "shorter") != "shorter"
    defaults = {
        "resize_mode": "shorter",
        "resize_height": 0,
        "resize_width": 0,
        "crop_height": height,
        "crop_width": width,
        "crop_size": height if height == width else 0,
        "pad_fill": (0, 0, 0),
    }
    if box:  # the box's sides when the case does not say them: floor(side / crop_pct)
        crop_pct = config.get("crop_pct", 0.875)
        defaults.update(resize_height=int(height / crop_pct), resize_width=int(width / crop_pct))
    wanted = {**defaults, "resize_size": 0 if box else None, **expected}
    for name, value in wanted.items():
        if value is not None:
            assert getattr(spec, name) == value, (name, spec)
    assert spec.input_size == (height, width)
    # What timm's transform always does: crops centred with round, antialiased Pillow resizes,
    # pixel / 255 then (value - mean) / std per RGB channel.
    assert (spec.crop_rounding, spec.antialias, spec.normalize, spec.channel_order) == ("round", True, True, "RGB")
    assert spec.rescale_factor == pytest.approx(1 / 255)
    assert (spec.mean, spec.std, spec.interpolation) == (IMAGENET["mean"], IMAGENET["std"], "bicubic")


def test_the_shorter_side_resize_is_chosen_by_timms_own_test() -> None:
    """timm resizes the shorter side (Resize(int)) when the two scaled sides are equal, not when the
    input is square: 224x225 at crop_pct 2 scales both to 112, then crops (pads) 224x225."""
    timm_data = pytest.importorskip("timm.data")
    cfg = {**VALUES, "input_size": (3, 224, 225), "crop_pct": 2.0}
    resize = timm_data.create_transform(**timm_data.resolve_data_config(pretrained_cfg=cfg)).transforms[0]
    assert type(resize).__name__ == "Resize" and resize.size == 112
    spec = timm_preprocess("x", cfg)
    assert (spec.resize_mode, spec.resize_size, spec.input_size) == ("shorter", 112, (224, 225))
    spec = timm_preprocess("x", {**cfg, "crop_pct": 0.875})  # 256 and 257: cover
    assert (spec.resize_mode, spec.resize_height, spec.resize_width) == ("cover", 256, 257)


def test_what_a_config_leaves_out_is_timms_default() -> None:
    timm_data = pytest.importorskip("timm.data")
    cfg = {"input_size": (3, 192, 160)}
    resolved = timm_data.resolve_data_config(pretrained_cfg=cfg)
    assert timm_preprocess("x", cfg) == timm_preprocess("x", resolved)
    assert timm_preprocess("x", {}) == timm_preprocess("x", timm_data.resolve_data_config(pretrained_cfg={"a": 1}))
    spec = timm_preprocess("x", {})
    assert spec == PreprocessSpec(
        int(224 / timm_data.DEFAULT_CROP_PCT),
        224,
        timm_data.IMAGENET_DEFAULT_MEAN,
        timm_data.IMAGENET_DEFAULT_STD,
        "bicubic",
    )
    # timm's `crop_pct or DEFAULT_CROP_PCT`: a 0 (or null) is the default, as timm reads it.
    assert timm_preprocess("x", {"crop_pct": 0}) == timm_preprocess("x", {"crop_pct": None}) == spec


def refusal(config: dict, where: str = "") -> SettingsError:
    with pytest.raises(SettingsError) as caught:
        timm_preprocess("x", {**VALUES, "input_size": (3, 224, 224), **config}, where)
    error = caught.value
    assert error.flag == "--model" and error.value == "timm:x" and "\n" not in str(error), error
    return error


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"interpolation": "lanczos"}, "its interpolation is 'lanczos', which vision-serve does not resample"),
        ({"interpolation": "lanczos"}, "nearest: 'bicubic'"),
        ({"interpolation": "box"}, "nearest: 'bilinear'"),
        ({"interpolation": "hamming"}, "nearest: 'bilinear'"),
        ({"interpolation": "random"}, "its interpolation is 'random'"),
        ({"crop_border_pixels": 3}, "its crop_border_pixels is 3, a trim vision-serve does not make (nearest: 0)"),
        ({"crop_mode": "sqaush"}, "its crop_mode is 'sqaush', not one of center, squash, border"),
        ({"crop_mode": "sqaush"}, "nearest: 'squash'"),
        ({"mean": (0.5,)}, "its mean is (0.5,); it must be three numbers, one per RGB channel"),
        ({"std": (0.2,) * 4}, "its std is (0.2, 0.2, 0.2, 0.2); it must be three numbers > 0"),
        ({"input_size": (1, 224, 224)}, "its input_size is [1, 224, 224], 1 channel(s)"),
        ({"input_size": (1, 224, 224)}, "[3, 224, 224]"),
        ({"input_size": (224, 224)}, "its input_size is (224, 224); it must be [3, height, width]"),
        ({"crop_pct": -0.5}, "its crop_pct is -0.5; it must be a number > 0 (timm's default is 0.875)"),
        ({"crop_pct": "0.9"}, "its crop_pct is '0.9'"),
        ({"crop_pct": 1000.0}, "its crop_pct 1000.0 resizes 224x224 to nothing"),
        # A crafted config must not ask for a resize of gigabytes (the bound every spec meets).
        ({"input_size": (3, 100_000, 100_000)}, "resize_size must be a whole number from 0 to 4096, got 114285"),
        ({"crop_pct": 1e-6}, "resize_size must be a whole number from 0 to 4096"),
        (
            {"crop_mode": "border", "mean": (0.5, 0.5, 1.5)},
            "pads with its mean, [0.5, 0.5, 1.5], which is not a colour",
        ),
    ],
)
def test_what_cannot_be_served_exactly_is_refused_naming_it(config: dict, expected: str) -> None:
    assert expected in str(refusal(config))


def test_a_refusal_names_every_problem_and_the_file() -> None:
    error = refusal({"interpolation": "lanczos", "crop_border_pixels": 2}, "folder/config.json")
    assert error.message.startswith("folder/config.json: timm's eval transform cannot be served exactly:")
    assert "interpolation is 'lanczos'" in error.message and "crop_border_pixels is 2" in error.message
    assert "--interpolation" in error.fix


def test_a_timm_folder_maps_its_crop_mode(tmp_path) -> None:
    """A folder's pretrained_cfg goes through the same mapping, its missing values timm's defaults."""
    cfg = {"input_size": [3, 160, 224], "crop_pct": 0.9, "crop_mode": "border", "mean": [0.5, 0.4, 0.3]}
    config = {"architecture": "resnet18", "label_names": ["a", "b"], "pretrained_cfg": cfg}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = resolve_model(ModelRequest(model=str(tmp_path))).preprocess
    assert (spec.resize_mode, spec.resize_height, spec.resize_width, spec.input_size) == (
        "contain",
        177,
        248,
        (160, 224),
    )
    assert (spec.pad_fill, spec.interpolation, spec.std) == ((128, 102, 76), "bicubic", IMAGENET["std"])
    cfg["interpolation"] = "lanczos"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SettingsError, match=r"config\.json: timm's eval transform cannot be served exactly"):
        resolve_model(ModelRequest(model=str(tmp_path)))
