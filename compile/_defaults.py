"""Defaults of the model catalog and weight loading, in one place."""

DEFAULT_MODEL = "resnet152"
DEFAULT_WEIGHTS = "imagenet"

# `--weights random` is seeded so that two servers (or a server and a benchmark) agree.
RANDOM_WEIGHTS_SEED = 0

# Where ImageNet-1k class names come from: torchvision's weight metadata, shipped with the wheel.
IMAGENET_LABELS_SOURCE = "torchvision.models.ResNet152_Weights.DEFAULT.meta['categories']"

# EfficientNet-Lite was trained in TensorFlow with inputs scaled as (x - 127) / 128 on 0..255 pixels,
# and evaluated on a 224 center crop of an image resized to 224 + 32 (the TF reference's crop_padding).
EFFICIENTNET_LITE_MEAN = (127.0 / 255.0,) * 3
EFFICIENTNET_LITE_STD = (128.0 / 255.0,) * 3
