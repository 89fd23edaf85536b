"""The bad-input corpus (``tests/bad_inputs.py``) against the header probe and the decoders, in process.

Each item must get an ``ImageError`` with one of its stated statuses from ``probe_image`` (where the
header already tells), from ``pil`` and from ``dali`` (its CPU graph here), and must not disturb the
good images batched with it: their rows stay bit-identical to a batch of the good images alone.
The server tests and the soak script rely on these statuses; this file keeps them measured.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from compile.catalog import get_model_entry
from preprocessing import create_preprocessor
from preprocessing.base import ImageDecodeError, PreparedBatch, Preprocessor
from preprocessing.probe import probe_image
from preprocessing.registry import backend_problem
from tests.bad_inputs import BadInput, bad_inputs

SPEC = get_model_entry("efficientnet-lite0").preprocess
CORPUS = bad_inputs()
BACKENDS = ("pil", "dali")


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Preprocessor]:
    """One preprocessor per backend for the whole module: DALI builds its pipeline once (seconds)."""
    problem = backend_problem(request.param, "cpu")
    if problem:
        pytest.skip(problem)
    yield create_preprocessor(request.param, SPEC, "cpu", max_batch_size=8)


@pytest.fixture(scope="module")
def good_alone(backend: Preprocessor, chelsea_jpeg: bytes, coffee_jpeg: bytes) -> torch.Tensor:
    batch = backend([chelsea_jpeg, coffee_jpeg])
    assert batch.errors == [None, None]
    return batch.images


def statuses(batch: PreparedBatch) -> list[int]:
    return [200 if error is None else error.status_code for error in batch.errors]


def test_corpus_is_deterministic_and_named() -> None:
    """Two builds give the same bytes: the soak script and a bug report must be able to rebuild them."""
    rebuilt = bad_inputs.__wrapped__()
    assert [(i.name, i.body) for i in rebuilt] == [(i.name, i.body) for i in CORPUS]
    assert all(i.statuses and all(400 <= s < 500 for s in i.statuses) for i in CORPUS)


@pytest.mark.parametrize("item", CORPUS, ids=lambda item: item.name)
def test_probe_refuses_with_a_stated_status_or_leaves_it_to_the_decoder(item: BadInput) -> None:
    try:
        probe = probe_image(item.body)
    except ImageDecodeError as exc:
        assert exc.error.status_code in item.statuses, exc.error.detail
    else:
        # Only content that looks like an image may get past the header check; the decoders judge it.
        assert item.statuses == {400}, f"{item.name}: probe let it through as {probe}"


def test_broken_huffman_table_reaches_the_device_decoder() -> None:
    """The item exists to exercise the device path's failure isolation, so it must get that far."""
    (item,) = (i for i in CORPUS if i.name == "jpeg_broken_huffman_table")
    assert probe_image(item.body).decodes_on_device


@pytest.mark.parametrize("item", CORPUS, ids=lambda item: item.name)
def test_backend_answers_a_stated_status(backend: Preprocessor, item: BadInput) -> None:
    batch = backend([item.body])
    (error,) = batch.errors
    assert error is not None, f"{backend.name} decoded {item.name}"
    assert error.status_code in item.statuses, error.detail
    assert error.detail  # a client needs to be told what is wrong
    assert batch.images.shape == (0, 3, SPEC.crop_size, SPEC.crop_size)


@pytest.mark.parametrize("item", CORPUS, ids=lambda item: item.name)
def test_bad_item_leaves_good_rows_bit_identical(
    backend: Preprocessor, good_alone: torch.Tensor, chelsea_jpeg: bytes, coffee_jpeg: bytes, item: BadInput
) -> None:
    batch = backend([chelsea_jpeg, item.body, coffee_jpeg])
    assert batch.errors[0] is None and batch.errors[2] is None
    assert batch.errors[1] is not None and batch.errors[1].status_code in item.statuses
    assert torch.equal(batch.images, good_alone)


def test_whole_corpus_in_one_batch(
    backend: Preprocessor, good_alone: torch.Tensor, chelsea_jpeg: bytes, coffee_jpeg: bytes
) -> None:
    """Every bad item at once, good images first, in the middle and last: the failures stay per item."""
    bodies = [chelsea_jpeg] + [i.body for i in CORPUS] + [coffee_jpeg]
    middle = len(bodies) // 2
    bodies.insert(middle, chelsea_jpeg)
    batch = backend(bodies)
    got = statuses(batch)
    assert [got[0], got[middle], got[-1]] == [200, 200, 200]
    bad_statuses = got[1:middle] + got[middle + 1 : -1]
    assert all(s in i.statuses for s, i in zip(bad_statuses, CORPUS, strict=True)), bad_statuses
    expected = torch.cat([good_alone[:1], good_alone[:1], good_alone[1:]])
    assert torch.equal(batch.images, expected)
    again = backend([chelsea_jpeg, coffee_jpeg])  # the decoder is still usable, with the same results
    assert torch.equal(again.images, good_alone)
