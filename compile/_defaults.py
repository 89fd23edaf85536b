"""Defaults of the model catalog and weight loading, in one place."""

DEFAULT_MODEL = "resnet152"
DEFAULT_WEIGHTS = "imagenet"

# `--weights random` is seeded so that two servers (or a server and a benchmark) agree.
RANDOM_WEIGHTS_SEED = 0
# A random ResNet's residual branches start at this scale, its head at this multiple of PyTorch's init:
# finite in fp16, no all-zero convolutions, photos told apart (compile/weights.scale_residual_branches).
RANDOM_RESIDUAL_BRANCH_SCALE = 0.25
RANDOM_HEAD_SCALE = 10.0

# Where ImageNet-1k class names come from: torchvision's weight metadata, shipped with the wheel.
IMAGENET_LABELS_SOURCE = "torchvision.models.ResNet152_Weights.DEFAULT.meta['categories']"

# EfficientNet-Lite was trained in TensorFlow with inputs scaled as (x - 127) / 128 on 0..255 pixels,
# and evaluated on a 224 center crop of an image resized to 224 + 32 (the TF reference's crop_padding).
EFFICIENTNET_LITE_MEAN = (127.0 / 255.0,) * 3
EFFICIENTNET_LITE_STD = (128.0 / 255.0,) * 3

# Labels files (--labels, compile/labels.py): bounds on what a file may hold.
MAX_LABELS_FILE_BYTES = 16 * 1024 * 1024
MAX_LABEL_CHARS = 1000
# Served model names (--name): what fits a URL path segment, a metric label and a folder name.
MODEL_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
# Model files made elsewhere, by suffix: ONNX, and torch.export's ExportedProgram (torch.export.save).
ONNX_FILE_SUFFIX = ".onnx"
EXPORTED_PROGRAM_SUFFIX = ".pt2"
TIMM_PREFIX = "timm:"
# timm's own default crop_pct (timm.data.constants.DEFAULT_CROP_PCT), for a config that names none.
TIMM_DEFAULT_CROP_PCT = 0.875

LOG_LEVELS = ("debug", "info", "warning", "error")  # for compile-trt and vision-serve
LOG_FORMATS = ("text", "json")  # text for a terminal, one JSON object per line for a log pipeline

# ---- compile-trt --------------------------------------------------------------------------------
BACKENDS = ("auto", "tensorrt", "inductor", "onnx", "eager")
PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8")
# Quantized precisions: post-training static quantization, calibrated on the user's images
# (--calibration DIR), written as explicit Q/DQ (compile/quantization/). fp8 is TensorRT on a GPU
# whose tensor cores have it (compute capability 8.9 and later).
QUANTIZED_PRECISIONS = ("int8", "fp8")
# A fixed rule from what we measured (docs/compiling.md#which-engine), not a measurement at compile
# time: tensorrt on a GPU (inductor without torch_tensorrt); on a CPU onnx at fp32, inductor at
# fp16/bf16 (compile/backends/__init__.py: resolve_compile_backend).
DEFAULT_BACKEND = "auto"
DEFAULT_PRECISION = "fp32"
DEFAULT_DEVICE = "auto"  # cuda:0 if torch sees a GPU, else cpu
# MIN,OPT,MAX batch: TensorRT tunes its kernels for OPT and accepts MIN..MAX; the server's
# default --max-batch-size is 32, so the default engine covers every batch it forms.
DEFAULT_BATCH = (1, 8, 32)
# What responses and /info call an engine, where the runtime's name differs from the backend's:
# an onnx artifact is run by ONNX Runtime, so it serves as "onnxruntime-fp32".
ENGINE_RUNTIME_NAMES = {"onnx": "onnxruntime"}

# ONNX export (compile/backends/onnx.py). Opset 18 is the oldest the dynamo exporter writes, and
# every ONNX Runtime from 1.14 (Triton 23.02 and later) runs it.
ONNX_OPSET = 18
ONNX_INPUT_NAME = "images"
ONNX_OUTPUT_NAME = "logits"
# Triton model repository (compile/triton_repository.py): the dynamic batcher takes what is queued
# and never holds a request to fill a batch, as vision-serve's own default (--batch-timeout-ms 0).
TRITON_MAX_QUEUE_DELAY_US = 0
TRITON_LABELS_FILE = "labels.txt"

# ---- quantization (--precision int8/fp8, compile/quantization/) ---------------------------------
# How activation ranges are read from the calibration images. "auto" is each engine's measured best
# (docs/compiling.md#int8): the first of its backend's ``calibration_methods``.
#   minmax      the largest magnitude seen (what TensorRT and ModelOpt call "max")
#   entropy     the range whose int8 histogram keeps the most information (KL divergence, TensorRT's
#               classic calibrator)
#   percentile  the CALIBRATION_PERCENTILE-th percentile of magnitudes: outliers are clipped
#   histogram   the range that minimizes the L2 quantization error (PyTorch's HistogramObserver)
CALIBRATION_METHODS = ("auto", "minmax", "entropy", "percentile", "histogram")
DEFAULT_CALIBRATION_METHOD = "auto"
CALIBRATION_PERCENTILE = 99.999
# How many calibration images are used (a seeded sample of the folder when it holds more). What
# TensorRT's and MLPerf's ImageNet calibrations use: a few hundred images of the served distribution.
DEFAULT_CALIBRATION_COUNT = 256
MAX_CALIBRATION_COUNT = 2048  # the preprocessed set is held in memory: 2048 x 3 x 224 x 224 fp32 is 1.2 GB
# Fewer than this calibrates, with a warning: ranges from a handful of images clip what they did not see.
ADVISED_MIN_CALIBRATION_IMAGES = 100
# A calibration or evaluation image file larger than this is refused (decoded photos of a few MB
# are what servers receive; a larger file is a mistake or a decompression bomb).
MAX_DATASET_IMAGE_BYTES = 64 * 1024 * 1024
CALIBRATION_SEED = 0
# Rows per run while calibrating: the activations of one batch are held at a time.
CALIBRATION_BATCH = 8
# The quantized gate's default evaluation set: each sample photo, and this many seeded
# augmentations of it (crops, flips, small rotations, colour and JPEG changes): what a camera or an
# upload does to a photo. Disjoint from the calibration set by construction, and checked.
EVAL_AUGMENTATIONS_PER_PHOTO = 15
# Two preprocessed images whose 16x16 thumbnails differ by less than this (mean absolute difference,
# in normalized units) are the same photo: an evaluation image found in the calibration set is refused.
NEAR_DUPLICATE_DISTANCE = 0.02
MAX_EVAL_IMAGES = 256

# Where artifacts go when --output is not given: artifacts/<model>-<backend>-<precision>-<device type>.
DEFAULT_OUTPUT_ROOT = "artifacts"

# TensorRT builder: scratch memory its tactics may use, and how hard it searches (0..5, TRT's own
# default is 3; higher builds slower and sometimes runs faster).
DEFAULT_TRT_WORKSPACE_GIB = 4.0
DEFAULT_TRT_OPTIMIZATION_LEVEL = 3
TRT_OPTIMIZATION_LEVELS = range(0, 6)

# Accuracy gate, compiled vs eager fp32, per precision. Relative measures only: a random-init
# ResNet-152 has logits in the hundreds, so absolute differences say nothing (they are large between
# eager and AOTInductor fp32 even where every top-1 agrees).
#   top1_agreement  share of inputs whose top-1 class is the same
#   top5_overlap    mean share of the reference top-5 found in the compiled top-5
#   cosine          smallest cosine similarity of a logit vector with its reference
#   max_rel_error   largest |compiled - reference| / max|reference| over one logit vector
#   top5_agreement  share of inputs whose reference top-1 class is in the compiled top-5
#   mean_prob_drop  mean fall of the softmax probability of the reference top-1 class
# Quantized engines are gated on classes and probabilities, on real photos only (their logits move
# by design; random inputs fall outside the calibrated ranges).
GATE_THRESHOLDS = {
    "fp32": {"top1_agreement": 1.0, "top5_overlap": 0.99, "cosine": 0.9999, "max_rel_error": 1e-3},
    "fp16": {"top1_agreement": 0.95, "top5_overlap": 0.9, "cosine": 0.999, "max_rel_error": 0.05},
    "bf16": {"top1_agreement": 0.9, "top5_overlap": 0.9, "cosine": 0.99, "max_rel_error": 0.1},
    "int8": {"top1_agreement": 0.8, "top5_agreement": 0.95, "mean_prob_drop": 0.05},
    "fp8": {"top1_agreement": 0.8, "top5_agreement": 0.95, "mean_prob_drop": 0.05},
}
# A random model's quantized engine is gated on its logits, as at the other precisions, with room
# for int8's per-tensor scales (bf16 rounds each value; int8 rounds on one grid per tensor).
RANDOM_WEIGHTS_QUANTIZED_THRESHOLDS = {"cosine": 0.99, "max_rel_error": 0.2}
# What the gate checks for `--weights random`: the logits only. A random model's class ranking
# means nothing and is nearly tied by construction (random features of different photos point
# the same way, and the top-2 logit gaps can be as small as the fp16 error), so
# top-1 agreement would gate on rounding noise and fail at random; its logits still show whether
# the engine computes the same function. Top-1 and top-5 are reported, not gated; a --gate-min-*
# flag given explicitly still applies.
RANDOM_WEIGHTS_GATED = ("cosine", "max_rel_error")
# The real photos of the gate (and of the demo): scikit-image's samples, public domain or CC0, so the
# project ships no image files (compile/sample_photos.py renders them). A cat, an espresso, an astronaut, a rocket.
SAMPLE_PHOTOS = ("chelsea", "coffee", "astronaut", "rocket")
# scikit-image's other photos, none of them one of the above: the calibration set the demo, the tests and
# the benchmarks quantize with (compile/sample_photos.py: write_sample_calibration_set). Few of them are
# ImageNet scenes, so it is a stand-in for the user's own images, not an example of a good set.
SAMPLE_CALIBRATION_PHOTOS = (
    "camera",
    "clock",
    "coins",
    "brick",
    "grass",
    "gravel",
    "moon",
    "hubble_deep_field",
    "immunohistochemistry",
    "retina",
    "colorwheel",
    "cell",
)
SAMPLE_CALIBRATION_AUGMENTATIONS = 9  # seeded variants of each: 12 x (1 + 9) = 120 images
# The demo and the tests send them as JPEGs, the form photos arrive in, at the quality cameras save.
SAMPLE_PHOTO_JPEG_QUALITY = 92
# What a folder of images is read for (--gate-images, the benchmarks' --images).
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
# Random inputs added to the real sample images, seeded so two compiles see the same ones.
GATE_RANDOM_INPUTS = 16
GATE_SEED = 0

# What turns a model's logits into its scores (service/worker/outputs.py): softmax for one label per image,
# sigmoid for several (a transformers folder's problem_type multi_label_classification), none for raw
# scores (problem_type regression). A model's own, recorded in its entry and its artifact's manifest.
ACTIVATIONS = ("softmax", "sigmoid", "none")
MODEL_ACTIVATION = "softmax"
# transformers' config.json problem_type -> the activation its outputs are read through.
PROBLEM_TYPE_ACTIVATIONS = {
    "single_label_classification": "softmax",
    "multi_label_classification": "sigmoid",
    "regression": "none",
}

# Bumped when the artifact layout or manifest fields change incompatibly.
MANIFEST_FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
# CPU sessions of one process allocate their tensors from one arena registered with ONNX Runtime's
# environment (compile/backends/onnx.py: shared_cpu_arena): a batch's workspace is then held once per
# process, not once per session, which is what each added model of a shared worker process paid.
ONNX_SHARED_CPU_ARENA = True
