"""Defaults of the preprocessing backends, in one place."""

# Refuse images whose header claims more pixels than this (about a 100 MP photo) before decoding:
# a decompression bomb must never reach a decoder.
MAX_IMAGE_PIXELS = 100_000_000

# Decode cost, bounded before decoding (preprocessing/decode_cost.py): the pixel limit bounds memory,
# these bound the work a small file can ask for. Ordinary encoders stay far below each.
MAX_JPEG_SCANS = 100  # progressive JPEG scans; libjpeg writes 10, mozjpeg a few dozen at most
# A JPEG whose scan data has fewer bits than this per 8x8 block is Huffman-decoded once more, strictly,
# in the worker, to refuse a frame larger than its data (decode_cost.check_thin_jpeg_data). A photo
# saved at quality 75 has about 50 bits a block, at 95 about 120: only low-quality photos and flat
# graphics pay the extra pass.
THIN_JPEG_BITS_PER_BLOCK = 32
# PNG chunks before the first frame ends: this many, plus one per this many bytes of the file; before
# the image data (metadata, which Pillow's opener walks in the HTTP process), this many alone.
MIN_CHUNK_LIMIT = 1024
BYTES_PER_EXTRA_CHUNK = 2048
# TIFF strips or tiles: this many, or one per this many bytes of the file if that is more.
MAX_TIFF_PIECES = 4096
MIN_BYTES_PER_TIFF_PIECE = 4096
# GIF extension sub-blocks before the first image: this many, plus one per this many bytes.
MAX_GIF_BLOCKS = 4096
BYTES_PER_EXTRA_GIF_BLOCK = 1024

# JPEG draft mode lets libjpeg decode at 1/2, 1/4 or 1/8 scale, which is far cheaper for big
# photos. We only ask for a draft that keeps at least this many times the resize target on the
# shorter side, so the final antialiased resize still does a real (>= 2x) reduction; measured
# effect on the model input is in tests/unit/test_preprocessing_pil.py and docs/preprocessing.md.
JPEG_DRAFT_HEADROOM = 2

# Resize-then-crop is exact but allocates the whole resized image; above this many times
# resize_size**2 (an aspect ratio beyond about 4:1) only the crop region is resampled.
MAX_RESIZED_AREA_FACTOR = 4

# Background that transparent pixels are composited onto: what a viewer shows for a cut-out image.
ALPHA_BACKGROUND = (255, 255, 255)

# Decoding threads per process for the Pillow backend (Pillow releases the GIL while decoding and
# resizing); capped because the model needs the cores too.
PIL_MAX_THREADS = 4

# Backend names, in the order `auto` tries them on a GPU (fastest first, as measured on an H100 with
# ResNet-152's spec at batch 32: torch 4,153 img/s on 1 busy CPU core, cvcuda 4,031 on 5, dali 2,508
# on 2.75; benchmarks/results/nvidia-h100-80gb-hbm3-2026-11-22); `auto` on a CPU picks `pil`.
BACKENDS = ("torch", "cvcuda", "dali", "pil")
# Backends that need a CUDA device (dali and torch also run their graph on the CPU).
GPU_ONLY_BACKENDS = ("cvcuda",)

# Largest batch a device backend decodes in one call when the server does not say (DALI sizes its
# pipeline by it); larger inputs are decoded in chunks of this size.
DEVICE_MAX_BATCH = 64

# Device decoders decode at full resolution (Pillow's JPEG draft mode decodes big photos at 1/2..1/8
# scale); above this many pixels an image goes to Pillow, which bounds a batch's decoded size on the
# GPU (64 x 24 MP x 3 bytes = 4.6 GB) and is the cheaper path for such images anyway. 12 MP and
# 20 MP camera photos stay on the device.
DEVICE_MAX_IMAGE_PIXELS = 24_000_000

# DALI's CPU worker threads (its CPU decoders and, on a GPU, the host side of nvJPEG); capped like
# Pillow's because the model and the HTTP process need the cores too.
DALI_MAX_THREADS = 4
