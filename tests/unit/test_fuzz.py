"""Property tests (hypothesis) over the paths untrusted bytes take: header probe, decoders, request parsing.

The property for images: whatever the bytes, a backend answers with a decoded row (right shape,
finite values) or an ``ImageError`` of 400, 413 or 415, never another exception; and the good
image batched with the fuzzed one, and decoded after it, comes out bit-identical to decoding it
alone (the worker survives, its decoder state is not poisoned). For request parsing: a value or an
``ServiceError`` with a 4xx, nothing else.

CI runs a small, derandomized budget (reproducible; the whole file takes well under a minute on two
cores). For a longer, randomized fuzz (failures are saved in ``.hypothesis/`` and replayed first
on the next run)::

    VISION_SERVE_FUZZ_EXAMPLES=20000 python -m pytest -q tests/unit/test_fuzz.py -x

The variable raises every test's ``max_examples`` to at least that number and turns off
derandomization, so each long run explores inputs CI never saw.
"""

from __future__ import annotations

import base64
import math
import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from PIL import Image

from compile.catalog import get_model_entry
from preprocessing import create_preprocessor
from preprocessing.base import ImageDecodeError, Preprocessor
from preprocessing.probe import probe_image
from preprocessing.registry import backend_problem
from service import _defaults as service_defaults
from service.errors import ServiceError
from service.http.predict.parsing import decode_base64_image, predict_top_k
from tests.conftest import encode, sample_array

SPEC = get_model_entry("efficientnet-lite0").preprocess
IMAGE_STATUSES = frozenset({400, 413, 415})
FUZZ_EXAMPLES = int(os.environ.get("VISION_SERVE_FUZZ_EXAMPLES", "0"))

# Pillow warns about the corrupt TIFF/EXIF tags the mutations produce, then goes on; that is the
# expected path, not a finding. Any exception still fails the tests.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:PIL.TiffImagePlugin")


def fuzz_settings(examples: int) -> settings:
    """``examples`` in CI (derandomized); at least ``VISION_SERVE_FUZZ_EXAMPLES``, randomized, when set."""
    return settings(
        max_examples=max(examples, FUZZ_EXAMPLES),
        deadline=None,  # DALI's first runs and Pillow's big allocations vary; a hang still shows as slowness
        derandomize=FUZZ_EXAMPLES == 0,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


def _small_seeds() -> dict[str, bytes]:
    """Real image bytes to mutate: chelsea at 64x48 (cheap to decode) in every format we serve."""
    small = Image.fromarray(sample_array("chelsea")).resize((64, 48), Image.Resampling.BILINEAR)
    exif = Image.Exif()
    exif[0x0112] = 6  # EXIF orientation: mutations then reach the EXIF parsing and the rotation paths
    return {
        "jpeg": encode(small, "JPEG", quality=90),
        "jpeg-progressive": encode(small, "JPEG", quality=90, progressive=True),
        "jpeg-exif": encode(small, "JPEG", quality=90, exif=exif),
        "png": encode(small, "PNG"),
        "webp": encode(small, "WEBP", quality=80),
        "gif": encode(small, "GIF"),
        "bmp": encode(small, "BMP"),
        "tiff": encode(small, "TIFF"),
    }


SEEDS = _small_seeds()
GOOD = SEEDS["jpeg"]  # a JPEG the device decoder takes: its survival is what a failed batch endangers
MAGIC_LENGTH = 12  # RIFF, size, WEBP: the longest signature probe.sniff_format reads
MAGICS = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF89a", b"BM", b"II*\x00", b"MM\x00*", b"RIFF\x00\x00\x00\x00WEBP")


@st.composite
def mutated_images(draw: st.DrawFn) -> bytes:
    """A real image with 1-4 byte flips, overwrites, insertions, deletions or a truncation.

    Offsets start past the magic number (12 bytes at most; ``arbitrary_bytes`` covers broken magic,
    which only ever gets a 415). Half of them fall in bytes 12..255, inside the headers, where a
    mutation gets furthest into the parsers; uniform offsets alone would almost always land in the
    entropy-coded pixel data.
    """
    data = bytearray(SEEDS[draw(st.sampled_from(sorted(SEEDS)), label="seed")])
    for _ in range(draw(st.integers(1, 4))):
        if len(data) <= MAGIC_LENGTH:
            break
        last = len(data) - 1
        at = draw(st.one_of(st.integers(MAGIC_LENGTH, min(255, last)), st.integers(MAGIC_LENGTH, last)))
        op = draw(st.sampled_from(("flip", "overwrite", "insert", "delete", "truncate")))
        if op == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "overwrite":
            chunk = draw(st.binary(min_size=1, max_size=8))
            data[at : at + len(chunk)] = chunk
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 16))]
        else:
            del data[at:]
    return bytes(data)


# Arbitrary bytes mostly fail the format sniff (415); behind a real magic number or a real header
# they get into the format parsers.
arbitrary_bytes = st.one_of(
    st.binary(max_size=512),
    st.builds(lambda magic, tail: magic + tail, st.sampled_from(MAGICS), st.binary(max_size=512)),
    st.builds(
        lambda seed, cut, tail: SEEDS[seed][:cut] + tail,
        st.sampled_from(sorted(SEEDS)),
        st.integers(0, 200),
        st.binary(max_size=512),
    ),
)


@pytest.fixture(scope="module", params=("pil", "dali"))
def backend(request: pytest.FixtureRequest) -> Iterator[Preprocessor]:
    problem = backend_problem(request.param, "cpu")
    if problem:
        pytest.skip(problem)
    yield create_preprocessor(request.param, SPEC, "cpu", max_batch_size=4)


@pytest.fixture(scope="module")
def good_row(backend: Preprocessor) -> torch.Tensor:
    batch = backend([GOOD])
    assert batch.errors == [None]
    return batch.images


def check_probe(data: bytes) -> None:
    try:
        probe = probe_image(data)
    except ImageDecodeError as exc:
        event(f"probe: {exc.error.status_code}")  # the mix shows with --hypothesis-show-statistics
        assert exc.error.status_code in IMAGE_STATUSES, exc.error
    else:
        event(f"probe: passed, {probe.format}")


def check_backend(backend: Preprocessor, good_row: torch.Tensor, data: bytes) -> None:
    """Decoded or a 4xx, and the good image beside it and after it is untouched."""
    batch = backend([data, GOOD])
    fuzzed, good = batch.errors
    event(f"{backend.name}: {200 if fuzzed is None else fuzzed.status_code}")
    assert good is None, f"the good image failed next to the fuzzed one: {good}"
    size = SPEC.crop_size
    if fuzzed is None:
        assert batch.images.shape == (2, 3, size, size)
        assert torch.isfinite(batch.images[0]).all()
    else:
        assert fuzzed.status_code in IMAGE_STATUSES, fuzzed
        assert fuzzed.detail
        assert batch.images.shape == (1, 3, size, size)
    assert torch.equal(batch.images[-1:], good_row), "the good row changed next to the fuzzed item"
    after = backend([GOOD])
    assert after.errors == [None] and torch.equal(after.images, good_row), "the decoder did not recover"


@fuzz_settings(150)
@given(data=mutated_images())
def test_mutated_images_probe(data: bytes) -> None:
    check_probe(data)


@fuzz_settings(150)
@given(data=mutated_images())
def test_mutated_images_decode(backend: Preprocessor, good_row: torch.Tensor, data: bytes) -> None:
    check_backend(backend, good_row, data)


@fuzz_settings(150)
@given(data=arbitrary_bytes)
def test_arbitrary_bytes_probe(data: bytes) -> None:
    check_probe(data)


@fuzz_settings(100)
@given(data=arbitrary_bytes)
def test_arbitrary_bytes_decode(backend: Preprocessor, good_row: torch.Tensor, data: bytes) -> None:
    check_backend(backend, good_row, data)


@pytest.fixture(scope="module")
def pil_and_dali() -> tuple[Preprocessor, Preprocessor]:
    problem = backend_problem("dali", "cpu")
    if problem:
        pytest.skip(problem)
    return create_preprocessor("pil", SPEC, "cpu"), create_preprocessor("dali", SPEC, "cpu", max_batch_size=4)


@fuzz_settings(100)
@given(data=mutated_images())
def test_backends_give_the_same_status(pil_and_dali: tuple[Preprocessor, Preprocessor], data: bytes) -> None:
    """A client must get the same answer whichever backend the server runs (DALI falls back to Pillow)."""
    pil, dali = pil_and_dali
    pil_error, dali_error = pil([data]).errors[0], dali([data]).errors[0]
    pil_status = 200 if pil_error is None else pil_error.status_code
    dali_status = 200 if dali_error is None else dali_error.status_code
    assert pil_status == dali_status, (pil_error, dali_error)


def test_seeds_decode_unmutated(backend: Preprocessor) -> None:
    """The mutations start from images every backend serves; else the fuzz would only test errors."""
    batch = backend(list(SEEDS.values()))
    assert batch.errors == [None] * len(SEEDS)


def _json_containers(children: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)


# What the server can hand these functions: JSON values (json.loads gives str, int, float including
# inf/nan, bool, None, lists and dicts) and strings from query parameters and form fields.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(), _json_containers, max_leaves=8
)
number_like_text = st.one_of(
    st.integers(-(10**30), 10**30).map(str),
    st.floats().map(repr),
    st.from_regex(r"\A\s*[+-]?[0-9_٠-٩]{0,8}(\.[0-9]*)?(e[+-]?[0-9]{1,4})?\s*\Z"),
    st.text(alphabet="0123456789 \t\n+-._eE", max_size=12),
)


def wrap_base64(raw: bytes, width: int, data_url: bool) -> str:
    """``raw`` as base64 text the way clients send it: CRLF-wrapped at ``width``, maybe a data: URL."""
    encoded = base64.b64encode(raw).decode()
    text = "\r\n".join(encoded[i : i + width] for i in range(0, len(encoded), width))
    return "data:image/png;base64," + text if data_url else text


wrapped_base64 = st.builds(wrap_base64, st.binary(max_size=300), st.integers(1, 80), st.booleans())


def check_http_error(exc: ServiceError, allowed: range) -> None:
    assert exc.status in allowed, (exc.status, exc.message)
    assert isinstance(exc.message, str) and exc.message


@fuzz_settings(400)
@given(value=json_values | wrapped_base64 | st.text(alphabet="ABCDEFGHabcdefgh0123456789+/=-_ \n:,;", max_size=64))
def test_decode_base64_image_answers_bytes_or_400(value: object) -> None:
    try:
        decoded = decode_base64_image(value)
    except ServiceError as exc:
        check_http_error(exc, range(400, 500))
    else:
        assert isinstance(value, str) and isinstance(decoded, bytes)


@fuzz_settings(200)
@given(raw=st.binary(min_size=1, max_size=300), width=st.integers(1, 80), data_url=st.booleans())
def test_decode_base64_image_round_trips(raw: bytes, width: int, data_url: bool) -> None:
    """Valid base64, wrapped at any width, with or without a data: URL prefix, decodes to the bytes."""
    assert decode_base64_image(wrap_base64(raw, width, data_url)) == raw


@fuzz_settings(400)
@given(raw=json_values | number_like_text)
def test_predict_top_k_answers_an_int_in_range_or_422(raw: object) -> None:
    try:
        value = predict_top_k(raw)
    except ServiceError as exc:
        check_http_error(exc, range(422, 423))
    else:
        assert type(value) is int and 1 <= value <= service_defaults.MAX_TOP_K
        assert not isinstance(raw, bool)
        if isinstance(raw, float):
            assert math.isfinite(raw) and raw == value


def test_predict_top_k_examples() -> None:
    """The fuzz only checks the shape of the answer; these pin the meaning."""
    top = service_defaults.MAX_TOP_K
    for raw, expected in ((1, 1), ("5", 5), (" 7 ", 7), (3.0, 3), (str(top), top)):
        assert predict_top_k(raw) == expected
    for bad in (0, -1, service_defaults.MAX_TOP_K + 1, 2.5, True, None, "five", float("nan"), float("inf"), [3]):
        with pytest.raises(ServiceError) as caught:
            predict_top_k(bad)
        assert caught.value.status == 422


def test_truncated_seeds_get_past_the_probe() -> None:
    """Guard against a vacuous fuzz: cut-off images (what most mutations resemble) reach the decoders.

    If the probe refused them all, the decode tests would only ever see probe errors.
    """
    passed = [name for name, seed in SEEDS.items() if _probe_passes(seed[: len(seed) * 3 // 4])]
    assert len(passed) >= len(SEEDS) - 2, passed


def _probe_passes(data: bytes) -> bool:
    try:
        probe_image(data)
    except ImageDecodeError:
        return False
    return True
