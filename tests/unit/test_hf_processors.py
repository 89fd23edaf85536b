"""transformers' image processors as a PreprocessSpec (compile/hf_processors.py): each class's values,
read from a saved folder as AutoImageProcessor would build it, and each refusal's one line."""

from __future__ import annotations

import json
import shlex

import pytest

from compile.hf_processors import MAPPED, overridden_steps
from compile.model_request import ModelRequest
from compile.model_source import resolve_model
from compile.preprocess_flags import spec_flags
from compile.pretrained_folders import transformers_preprocess
from compile.settings_errors import SettingsError, one_line
from preprocessing.base import value_affine

tf = pytest.importorskip("transformers")

IMAGENET = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}
HALF = ((0.5,) * 3, (0.5,) * 3)


def folder_of(tmp_path, processor=None, saved: dict | None = None, model_type: str = "convnext"):
    """A folder with a classifier's config.json and the processor's saved config (``saved``: that dict
    written as preprocessor_config.json instead, keys absent as a hand-written or old one has them)."""
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    config = {"architectures": ["X"], "model_type": model_type, "id2label": {"0": "a", "1": "b"}}
    (folder / "config.json").write_text(json.dumps(config))
    if processor is not None:
        processor.save_pretrained(folder)
    if saved is not None:
        (folder / "preprocessor_config.json").write_text(json.dumps(saved))
    return folder


def spec_of(tmp_path, processor=None, **saved):
    return transformers_preprocess(folder_of(tmp_path, processor, saved or None))


def fields(spec) -> dict:
    data = spec.to_dict()
    return {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}


def exact(height, width, crop=(0, 0), interpolation="bilinear", mean_std=HALF, **values) -> dict:
    return {
        "resize_mode": "exact",
        "resize_size": 0,
        "resize_height": height,
        "resize_width": width,
        "crop_height": crop[0],
        "crop_width": crop[1],
        "interpolation": interpolation,
        "mean": mean_std[0],
        "std": mean_std[1],
        **values,
    }


def shorter(size, crop, interpolation="bicubic", mean_std=HALF, **values) -> dict:
    return {
        "resize_mode": "shorter",
        "resize_size": size,
        "crop_height": crop[0],
        "crop_width": crop[1],
        "interpolation": interpolation,
        "mean": mean_std[0],
        "std": mean_std[1],
        **values,
    }


CLIP = (tuple(tf.image_utils.OPENAI_CLIP_MEAN), tuple(tf.image_utils.OPENAI_CLIP_STD))
IMAGENET_DEFAULT = (tuple(IMAGENET["image_mean"]), tuple(IMAGENET["image_std"]))

# (what, saved preprocessor_config.json keys, expected spec fields): the keys as save_pretrained or a Hub
# folder writes them, absent ones taking the class's defaults.
CASES = [
    ("vit", {"image_processor_type": "ViTImageProcessor", "size": {"height": 40, "width": 56}}, exact(40, 56)),
    ("vit-defaults", {"image_processor_type": "ViTImageProcessor"}, exact(224, 224)),
    # Swin, Swinv2, DINAT...: ViT's processor as microsoft/swin-tiny-patch4-window7-224 saves it.
    ("swin", {"image_processor_type": "ViTImageProcessor", "resample": 3, "size": 224, **IMAGENET},
     exact(224, 224, interpolation="bicubic", mean_std=IMAGENET_DEFAULT)),
    ("deit-defaults", {"image_processor_type": "DeiTImageProcessor"},
     exact(256, 256, crop=(224, 224), interpolation="bicubic")),
    ("deit", {"image_processor_type": "DeiTImageProcessor", "size": {"height": 51, "width": 61},
              "crop_size": {"height": 40, "width": 56}}, exact(51, 61, crop=(40, 56), interpolation="bicubic")),
    ("beit-defaults", {"image_processor_type": "BeitImageProcessor"}, exact(224, 224, interpolation="bicubic")),
    ("convnext", {"image_processor_type": "ConvNextImageProcessor", "size": {"shortest_edge": 48}, "crop_pct": 0.875},
     shorter(54, (48, 48))),  # int(48 / 0.875)
    ("convnext-defaults", {"image_processor_type": "ConvNextImageProcessor"},
     exact(384, 384, interpolation="bicubic")),  # shortest_edge 384: a warp to 384 x 384
    ("convnext-384-crop", {"image_processor_type": "ConvNextImageProcessor", "size": {"shortest_edge": 400},
                           "do_center_crop": True, "crop_size": {"height": 384, "width": 320}},
     exact(400, 400, crop=(384, 320), interpolation="bicubic")),
    # microsoft/resnet-50's (also RegNet's, CvT's, ConvNeXtV2's processor).
    ("resnet", {"image_processor_type": "ConvNextImageProcessor", "crop_pct": 0.875, "resample": 3,
                "size": {"shortest_edge": 224}, **IMAGENET}, shorter(256, (224, 224), mean_std=IMAGENET_DEFAULT)),
    # MobileViT's class defaults: shorter side 224, then a 256 crop (padded), BGR, never normalized.
    ("mobilevit-defaults", {"image_processor_type": "MobileViTImageProcessor"},
     shorter(224, (256, 256), mean_std=((0.0,) * 3, (1.0,) * 3), normalize=False, channel_order="BGR")),
    # apple/mobilevit-small's.
    ("mobilevit", {"image_processor_type": "MobileViTImageProcessor", "crop_size": {"height": 256, "width": 256},
                   "do_flip_channel_order": True, "resample": 2, "size": {"shortest_edge": 288}},
     shorter(288, (256, 256), "bilinear", ((0.0,) * 3, (1.0,) * 3), normalize=False, channel_order="BGR")),
    ("mobilevit-rgb", {"image_processor_type": "MobileViTImageProcessor", "do_flip_channel_order": False},
     shorter(224, (256, 256), mean_std=((0.0,) * 3, (1.0,) * 3), normalize=False, channel_order="RGB")),
    # EfficientNet: (x * rescale - offset - mean) / std, then / std again (include_top): one mean, std * std.
    ("efficientnet-defaults", {"image_processor_type": "EfficientNetImageProcessor"},
     exact(346, 346, interpolation="bicubic", mean_std=((0.5,) * 3, (0.25,) * 3))),
    ("efficientnet-offset", {"image_processor_type": "EfficientNetImageProcessor", "rescale_offset": True,
                             "include_top": False, "size": {"height": 240, "width": 240}},
     exact(240, 240, interpolation="bicubic", mean_std=((1.5,) * 3, (0.5,) * 3))),
    ("efficientnet-offset-only", {"image_processor_type": "EfficientNetImageProcessor", "rescale_offset": True,
                                  "do_normalize": False, "include_top": False},
     exact(346, 346, interpolation="bicubic", mean_std=((1.0,) * 3, (1.0,) * 3), rescale_factor=1 / 255)),
    ("levit-defaults", {"image_processor_type": "LevitImageProcessor"},
     shorter(256, (224, 224), mean_std=IMAGENET_DEFAULT)),  # int(256 / 224 * 224)
    ("levit-longest-ignored", {"image_processor_type": "LevitImageProcessor",
                               "size": {"shortest_edge": 196, "longest_edge": 300}},
     shorter(224, (224, 224), mean_std=IMAGENET_DEFAULT)),  # LeViT's own resize reads shortest_edge alone
    # facebook/dinov2-*-imagenet1k-1-layer: Dinov2ForImageClassification's processor is BiT's.
    ("dinov2", {"image_processor_type": "BitImageProcessor", "crop_size": {"height": 224, "width": 224},
                "resample": 3, "size": {"shortest_edge": 256}, **IMAGENET},
     shorter(256, (224, 224), mean_std=IMAGENET_DEFAULT)),
    ("bit-defaults", {"image_processor_type": "BitImageProcessor"}, shorter(224, (224, 224), mean_std=CLIP)),
    ("poolformer-defaults", {"image_processor_type": "PoolFormerImageProcessor"},
     shorter(248, (224, 224), mean_std=IMAGENET_DEFAULT)),  # int(224 / 0.9)
    # A saved null replaces the class's default (transformers sets every key first): no crop_pct scaling.
    ("poolformer-null-crop-pct", {"image_processor_type": "PoolFormerImageProcessor", "crop_pct": None},
     shorter(224, (224, 224), mean_std=IMAGENET_DEFAULT)),
    ("poolformer-square-box", {"image_processor_type": "PoolFormerImageProcessor",
                               "size": {"height": 200, "width": 200}},
     shorter(222, (224, 224), mean_std=IMAGENET_DEFAULT)),  # an int to its resize: the shorter side
    ("poolformer-box", {"image_processor_type": "PoolFormerImageProcessor", "size": {"height": 200, "width": 240}},
     exact(222, 266, crop=(224, 224), interpolation="bicubic", mean_std=IMAGENET_DEFAULT)),
    ("mobilenet_v1-nearest", {"image_processor_type": "MobileNetV1ImageProcessor", "resample": 0},
     shorter(256, (224, 224), "nearest", antialias=False)),
    ("mobilenet_v2-defaults", {"image_processor_type": "MobileNetV2ImageProcessor"},
     shorter(256, (224, 224), "bilinear")),
    ("clip-defaults", {"image_processor_type": "CLIPImageProcessor"}, shorter(224, (224, 224), mean_std=CLIP)),
    ("clip-square", {"image_processor_type": "CLIPImageProcessor", "use_square_size": True},
     exact(224, 224, crop=(224, 224), interpolation="bicubic", mean_std=CLIP)),
    ("siglip-defaults", {"image_processor_type": "SiglipImageProcessor"}, exact(224, 224, interpolation="bicubic")),
    # Segformer's _preprocess never crops, whatever do_center_crop says.
    ("segformer", {"image_processor_type": "SegformerImageProcessor", "size": {"height": 224, "width": 224},
                   "do_center_crop": True, "crop_size": {"height": 200, "width": 200}},
     exact(224, 224, mean_std=IMAGENET_DEFAULT)),
    ("pvt-defaults", {"image_processor_type": "PvtImageProcessor"},
     exact(224, 224, interpolation="bicubic", mean_std=IMAGENET_DEFAULT)),
    ("no-rescale", {"image_processor_type": "ViTImageProcessor", "do_rescale": False, "image_mean": [127.5] * 3,
                    "image_std": [127.5] * 3}, exact(224, 224, mean_std=((127.5,) * 3, (127.5,) * 3),
                                                 rescale_factor=1.0)),
    ("no-normalize", {"image_processor_type": "ViTImageProcessor", "do_normalize": False, "rescale_factor": 0.5},
     exact(224, 224, mean_std=((0.0,) * 3, (1.0,) * 3), normalize=False, rescale_factor=0.5)),
    # Legacy names: a ...Fast type, a feature extractor's, none at all (the model_type's processor).
    ("fast-name", {"image_processor_type": "ViTImageProcessorFast", "size": 32}, exact(32, 32)),
    ("feature-extractor", {"feature_extractor_type": "DeiTFeatureExtractor"},
     exact(256, 256, crop=(224, 224), interpolation="bicubic")),
    ("do-pad-to-itself", {"image_processor_type": "ViTImageProcessor", "do_pad": True,
                          "pad_size": {"height": 224, "width": 224}}, exact(224, 224)),
]  # fmt: skip


@pytest.mark.parametrize(("saved", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_processor_maps_to_the_spec_that_reproduces_it(tmp_path, saved, expected) -> None:
    spec = spec_of(tmp_path, **saved)
    got = fields(spec)
    defaults = {"crop_rounding": "floor", "antialias": True, "rescale_factor": 1 / 255, "normalize": True,
                "channel_order": "RGB", "pad_fill": (0, 0, 0)}  # fmt: skip
    want = {**defaults, **expected}
    for key, value in want.items():  # approx per field: it takes no tuples inside a dict
        assert got[key] == (value if isinstance(value, str) else pytest.approx(value)), (key, spec.describe())


def test_a_processor_without_a_type_is_its_model_types(tmp_path) -> None:
    folder = folder_of(tmp_path, saved={"size": {"height": 40, "width": 56}}, model_type="deit")
    spec = transformers_preprocess(folder)
    assert (spec.resize_height, spec.resize_width, spec.crop_height, spec.interpolation) == (40, 56, 224, "bicubic")


def test_a_nested_processor_config_comes_first_as_in_transformers(tmp_path) -> None:
    folder = folder_of(tmp_path, saved={"image_processor_type": "ViTImageProcessor"})
    nested = {"image_processor": {"image_processor_type": "ViTImageProcessor", "size": {"height": 40, "width": 56}}}
    (folder / "processor_config.json").write_text(json.dumps(nested))
    assert transformers_preprocess(folder).input_size == (40, 56)
    from transformers import AutoImageProcessor

    assert AutoImageProcessor.from_pretrained(folder, local_files_only=True).size.height == 40  # the same file wins


@pytest.mark.parametrize(
    "options",
    [{"rescale_offset": True, "include_top": True}, {"rescale_offset": True, "include_top": False},
     {"rescale_offset": False, "include_top": True}, {"do_normalize": False, "include_top": True},
     {"do_rescale": False, "include_top": True}, {"do_normalize": False, "rescale_offset": True, "include_top": False}],
)  # fmt: skip
def test_efficientnets_values_fold_exactly_into_one_mean_and_std(tmp_path, options) -> None:
    """A flat image keeps its value through any resize: the processor's output is the value step alone."""
    import numpy as np
    from PIL import Image

    processor = tf.EfficientNetImageProcessor(size={"height": 8, "width": 8}, image_std=[0.2, 0.3, 0.4], **options)
    spec = spec_of(tmp_path, processor)
    scale, bias = value_affine(spec)
    for level in (0, 37, 200, 255):
        pixels = processor(images=Image.fromarray(np.full((5, 7, 3), level, np.uint8)), return_tensors="pt")
        theirs = pixels.pixel_values[0, :, 0, 0].tolist()
        ours = [level * s + b for s, b in zip(scale, bias, strict=True)]
        assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-5), (options, level)


# (what, saved keys, words the one line must hold): each names the field and the nearest flags.
REFUSALS = [
    ("perceiver", {"image_processor_type": "PerceiverImageProcessor"}, "center-crops the photo"),
    ("siglip2", {"image_processor_type": "Siglip2ImageProcessor"}, "NaFlex"),
    ("donut", {"image_processor_type": "DonutImageProcessor"}, "thumbnail"),
    ("textnet", {"image_processor_type": "TextNetImageProcessor"}, "size_divisor"),
    ("pp-lcnet", {"image_processor_type": "PPLCNetImageProcessor"}, "round()"),
    ("lanczos", {"image_processor_type": "ViTImageProcessor", "resample": 1}, "resample is 1 (lanczos)"),
    ("box", {"image_processor_type": "ViTImageProcessor", "resample": 4}, "resample is 4 (box)"),
    ("hamming", {"image_processor_type": "ViTImageProcessor", "resample": 5}, "resample is 5 (hamming)"),
    ("longest-edge", {"image_processor_type": "ViTImageProcessor", "size": {"shortest_edge": 224, "longest_edge": 400}},
     "caps the longer side (longest_edge)"),
    ("max-height", {"image_processor_type": "ViTImageProcessor", "size": {"max_height": 224, "max_width": 224}},
     "max_height x max_width"),
    ("do-pad", {"image_processor_type": "ViTImageProcessor", "do_pad": True, "pad_size": {"height": 256, "width": 256}},
     "do_pad pads the 224x224 input at its bottom and right"),
    ("no-resize", {"image_processor_type": "ViTImageProcessor", "do_resize": False}, "do_resize is False"),
    ("no-crop", {"image_processor_type": "BitImageProcessor", "do_center_crop": False},
     "do_center_crop is False: the model input's size would vary"),
    ("convnext-null-crop-pct", {"image_processor_type": "ConvNextImageProcessor", "size": {"shortest_edge": 224},
                                "crop_pct": None}, "crop_pct is null"),
    ("convnext-second-crop", {"image_processor_type": "ConvNextImageProcessor", "size": {"shortest_edge": 224},
                              "do_center_crop": True, "crop_size": {"height": 200, "width": 200}},
     "crops a second time"),
    ("huge", {"image_processor_type": "ConvNextImageProcessor", "size": {"shortest_edge": 224}, "crop_pct": 1e-5},
     "a side over 4096 is not a classifier's input"),
    ("unknown", {"image_processor_type": "FancyImageProcessor"}, "'FancyImageProcessor' is not one vision-serve maps"),
]  # fmt: skip


@pytest.mark.parametrize(("saved", "words"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_what_cannot_be_reproduced_is_refused_in_one_line_with_the_nearest_flags(tmp_path, saved, words) -> None:
    folder = folder_of(tmp_path, saved=saved)
    with pytest.raises(SettingsError) as caught:
        resolve_model(ModelRequest(model=str(folder)))
    message = str(caught.value)
    assert words in message and str(folder / "preprocessor_config.json") in message, message
    assert one_line(message) == message and "--resize-size" in message and "--interpolation" in message, message


def test_imagegpts_clusters_have_no_nearest_flags(tmp_path) -> None:
    folder = folder_of(tmp_path, saved={"image_processor_type": "ImageGPTImageProcessor"})
    with pytest.raises(SettingsError, match=r"color-cluster ids.*No preprocessing flag makes"):
        transformers_preprocess(folder)


def test_a_processor_that_ships_its_code_is_refused(tmp_path) -> None:
    saved = {"image_processor_type": "ViTImageProcessor", "auto_map": {"AutoImageProcessor": "proc.MyProcessor"}}
    with pytest.raises(SettingsError, match="auto_map names an image processor shipped as code"):
        spec_of(tmp_path, **saved)


def test_the_nearest_flags_serve_a_refused_folder_with_that_spec(tmp_path) -> None:
    """The fix is runnable: every flag it names, given, serves the folder (the exact resize, bicubic)."""
    folder = folder_of(tmp_path, saved={"image_processor_type": "ViTImageProcessor", "resample": 1,
                                        "size": {"height": 40, "width": 56}})  # fmt: skip
    with pytest.raises(SettingsError) as caught:
        resolve_model(ModelRequest(model=str(folder)))
    words = shlex.split(caught.value.fix.removeprefix("Pass ").split(" to serve it")[0])
    flags = {
        name.removeprefix("--").replace("-", "_"): value for name, value in zip(words[::2], words[1::2], strict=True)
    }
    spec = resolve_model(ModelRequest(model=str(folder), **flags)).preprocess
    assert (spec.resize_mode, spec.input_size, spec.interpolation) == ("exact", (40, 56), "bicubic")
    assert spec_flags(spec) == " ".join(words)


def test_the_mapped_classes_override_only_the_reviewed_steps() -> None:
    """The installed transformers' classes are the ones reviewed; a class that changes one more step of the
    torchvision pipeline would not be (planted here: a ViT processor with its own center crop)."""
    for name, steps in MAPPED.items():
        assert overridden_steps(getattr(tf, name)) == sorted(steps), name

    class CroppedOtherwise(tf.ViTImageProcessor):
        def center_crop(self, image, size, **kwargs):
            return image

    assert overridden_steps(CroppedOtherwise) == ["center_crop"]


def test_the_rounding_is_transformers_int_offsets(tmp_path) -> None:
    """DeiT's 40x56 crop of a 51x61 resize: offsets int(5.5) = 5 and int(2.5) = 2, where torchvision's
    round() would take 6 and 2; the pixels say which (a ramp image, nearest, no values step)."""
    import numpy as np
    import torch
    from PIL import Image

    from preprocessing.pil_backend import PilPreprocessor
    from tests.conftest import encode

    processor = tf.DeiTImageProcessor(size={"height": 51, "width": 61}, crop_size={"height": 40, "width": 56},
                                      resample=0, do_normalize=False)  # fmt: skip
    spec = spec_of(tmp_path, processor)
    ramp = np.stack(np.meshgrid(np.arange(61), np.arange(51)), -1).astype(np.uint8) * 4
    image = np.concatenate([ramp, np.zeros((51, 61, 1), np.uint8)], -1)
    ours = PilPreprocessor(spec, "cpu", num_threads=1)([encode(image, "PNG")]).images[0]
    theirs = processor(images=Image.fromarray(image), return_tensors="pt").pixel_values[0]
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert round(ours[0, 0, 0].item() * 255 / 4) == 2 and round(ours[1, 0, 0].item() * 255 / 4) == 5  # x 2, y 5
