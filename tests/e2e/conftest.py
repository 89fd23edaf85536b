"""The end-to-end tier's shared fixtures: a headless browser for the upload page's tests."""

from __future__ import annotations

import pytest

from tests.tools import require_tool

# No GPU, no sandbox (CI runs as root), and none of the background connections that a closed
# network refuses.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser():
    chromium = require_tool("chromium", "/usr/bin/chromium")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield launched
        launched.close()
