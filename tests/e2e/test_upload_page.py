"""The upload page at GET /, in a real browser: Debian's headless Chromium driven by Playwright
(tests/e2e/conftest.py), against a real server on loopback with an API key, a real model and real
photos."""

from __future__ import annotations

import base64
import re

import pytest

from service.client.launcher import ServerProcess
from tests.conftest import CAT_LABELS

API_KEY = "page-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--model", "efficientnet-lite0", "--max-batch-size", "4", "--api-key", API_KEY]
    with ServerProcess(args, log_path=tmp_path_factory.mktemp("page") / "server.log") as running:
        yield running


@pytest.fixture
def page(browser, server):
    context = browser.new_context()
    opened = context.new_page()
    opened.main_response = opened.goto(f"{server.url}/")
    yield opened
    context.close()


def enter_key(page) -> None:
    page.click("#key-box summary")  # the field sits in a closed <details>, as a user finds it
    page.fill("#api-key", API_KEY)


def top5(page) -> list[tuple[str, float]]:
    page.wait_for_selector("#predictions .prediction")
    rows = page.locator("#predictions .prediction")
    labels = rows.locator(".label").all_inner_texts()
    probabilities = [float(text.rstrip(" %")) for text in rows.locator(".prob").all_inner_texts()]
    return list(zip(labels, probabilities, strict=True))


def test_a_chosen_photo_gets_its_top5_as_labelled_bars_and_the_latency(page, tmp_path, chelsea_jpeg) -> None:
    photo = tmp_path / "chelsea.jpg"
    photo.write_bytes(chelsea_jpeg)
    enter_key(page)
    page.set_input_files("#file", str(photo))
    predictions = top5(page)
    assert len(predictions) == 5
    assert predictions[0][0] in CAT_LABELS
    probabilities = [p for _, p in predictions]
    assert probabilities == sorted(probabilities, reverse=True) and 0 < probabilities[0] <= 100
    # Each bar is as wide as its probability.
    first_bar = page.locator("#predictions .prediction .bar").first.get_attribute("style")
    assert f"width: {max(0.5, probabilities[0]):.1f}%" in first_bar
    latency = page.inner_text("#latency")
    assert re.search(r"\d+ ms round trip · \d+\.\d ms in the server · batch of \d+ · efficientnet-lite0", latency)
    assert page.is_visible("#preview") and not page.is_visible("#error")
    page.screenshot(path=str(tmp_path / "upload-page.png"), full_page=True)


def test_a_dropped_photo_is_classified(page, coffee_jpeg) -> None:
    enter_key(page)
    # Drop a file the way a desktop drag does: a drop event whose DataTransfer holds it.
    data_transfer = page.evaluate_handle(
        """(b64) => {
            const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
            const transfer = new DataTransfer();
            transfer.items.add(new File([bytes], "coffee.jpg", { type: "image/jpeg" }));
            return transfer;
        }""",
        base64.b64encode(coffee_jpeg).decode(),
    )
    page.dispatch_event("#drop", "drop", {"dataTransfer": data_transfer})
    assert top5(page)[0][0] == "espresso"


def test_without_the_key_the_page_asks_for_it_and_then_works(page, tmp_path, chelsea_jpeg) -> None:
    photo = tmp_path / "chelsea.jpg"
    photo.write_bytes(chelsea_jpeg)
    page.set_input_files("#file", str(photo))
    page.wait_for_selector("#error.shown")
    assert page.inner_text("#error").startswith("HTTP 401")
    assert page.get_attribute("#key-box", "open") is not None  # the key field was opened for the user
    page.fill("#api-key", API_KEY)
    page.set_input_files("#file", [])
    page.set_input_files("#file", str(photo))
    assert top5(page)[0][0] in CAT_LABELS
    assert not page.is_visible("#error")


def test_a_file_that_is_not_an_image_shows_the_servers_explanation(page, tmp_path) -> None:
    text_file = tmp_path / "notes.txt"
    text_file.write_text("not a picture at all")
    enter_key(page)
    page.set_input_files("#file", str(text_file))
    page.wait_for_selector("#error.shown")
    message = page.inner_text("#error")
    assert message.startswith("HTTP 415") and "image" in message
    assert not page.is_visible("#result")


def test_the_page_may_load_nothing_from_elsewhere_nor_be_framed(page) -> None:
    """It can hold an API key: its Content-Security-Policy (which the tests above run under) says so."""
    policy = page.main_response.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert "frame-ancestors 'none'" in policy
