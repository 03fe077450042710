"""The live load page served at `/`: one static HTML file with its CSS and JS inline.

GPU hosts are often air-gapped, so the page loads nothing from anywhere but the exporter, and it
says so to the browser: the Content-Security-Policy allows only the page's own inline script and
style (by hash) and requests to its own origin. All data comes from `/api/v1/status` and
`/api/v1/loads`, fetched by relative URLs so the page also works behind a path prefix.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from importlib import resources

CONTENT_TYPE = "text/html; charset=utf-8"
_INLINE = {"script": "script-src", "style": "style-src"}


def _hashes(html: str, tag: str) -> str:
    digests = []
    for body in re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.DOTALL):
        digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
        digests.append(f"'sha256-{digest}'")
    return " ".join(digests) or "'none'"


@functools.cache
def page() -> tuple[bytes, list[tuple[str, str]]]:
    """The page's bytes and the headers that go with them (read once per process)."""
    static = resources.files("exporter.exposition.http").joinpath("static")
    html = static.joinpath("index.html").read_text(encoding="utf-8")
    policy = ["default-src 'none'"]
    policy += [f"{directive} {_hashes(html, tag)}" for tag, directive in _INLINE.items()]
    policy += ["connect-src 'self'", "img-src data:", "base-uri 'none'", "form-action 'none'"]
    policy += ["frame-ancestors 'none'"]
    headers = [
        ("Content-Security-Policy", "; ".join(policy)),
        ("X-Content-Type-Options", "nosniff"),
        ("Referrer-Policy", "no-referrer"),
        ("Cache-Control", "no-cache"),
    ]
    return html.encode(), headers
