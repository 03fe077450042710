"""Text from other users' command lines, environments and files, made fit to show.

An argv is bytes: `os.fsdecode` keeps a byte that is not UTF-8 as a lone surrogate, which
prometheus_client cannot encode (every scrape a 500) and a page cannot show. What goes into a
label, a JSON document or a log line passes through `clean`: invalid UTF-8 replaced, control and
bidirectional-override characters dropped, the length bounded.
"""

from __future__ import annotations

import re

MAX_TEXT = 256
_DROPPED = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def clean(text: str, limit: int = MAX_TEXT) -> str:
    """Valid UTF-8, no control characters, at most `limit` characters (an ellipsis marks a cut)."""
    if not text.isascii() or _DROPPED.search(text):
        try:
            raw = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a surrogate that no byte escapes to
            raw = text.encode("utf-8", "surrogatepass")
        text = _DROPPED.sub("", raw.decode("utf-8", "replace"))
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"
