"""``GET /``: a page to try the model from a browser (service/http/predict/static/index.html, no outside resources)."""

from __future__ import annotations

import functools
from importlib import resources

from fastapi.responses import HTMLResponse

# The page's script and style are inline and it talks only to this server: nothing else may load,
# and no other site may frame it (it can hold an API key).
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src blob:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


@functools.cache
def upload_page_html() -> str:
    return resources.files("service.http.predict").joinpath("static/index.html").read_text(encoding="utf-8")


def upload_page() -> HTMLResponse:
    return HTMLResponse(
        upload_page_html(),
        headers={"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff"},
    )
