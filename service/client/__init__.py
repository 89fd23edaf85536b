"""The client side, in the caller's process (no torch, nothing of the server imported):
``VisionClient`` and ``AsyncVisionClient`` (vision_client.py), `vision-classify` (cli.py), and the
launcher that runs vision-serve as a child process (launcher.py, for the demo, tests and tools)."""

from service.client.vision_client import (
    AsyncVisionClient,
    Classification,
    ClassifyError,
    ImageInput,
    Prediction,
    VisionClient,
)

__all__ = ["AsyncVisionClient", "Classification", "ClassifyError", "ImageInput", "Prediction", "VisionClient"]
