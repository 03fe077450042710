"""Text from other users' command lines, environments, files and logs, made fit to show.

Why: an argv, a path or a log line is whatever bytes another user chose. `os.fsdecode` keeps a
byte that is not UTF-8 as a lone surrogate, which prometheus_client cannot encode (every scrape a
500), a JSON parser may refuse and a page cannot show; a terminal runs what ESC, the C1 controls
(CSI is U+009B), BEL and BS say; a bidirectional override makes `txt.exe` read as `exe.txt`; tag
characters (U+E0000 block) carry text an agent reads and a person cannot see. So every string
that leaves the exporter passes through `clean` at one of its two exits: the /api/v1 documents'
`to_json` (exporter/api.py: /api/v1/status, /api/v1/loads, the live page, `status`, `history`,
`wait` and the MCP tools all read those) and the metric label values (exporter/collector.py).
Cleaning at the exits rather than where text enters: it enters at dozens of places (argv,
environ, readlink, mountinfo, log lines, HTTP answers, SQLite), and a place forgotten there
would leak; the exits are two.

What `clean` does: invalid UTF-8 and lone surrogates become U+FFFD; tab, line and page breaks
become a space (words stay apart); every other character of Unicode's categories Cc and Cf, and
the line and paragraph separators, is dropped; the length is bounded when asked.
"""

from __future__ import annotations

import re

MAX_TEXT = 256
# Unicode 14's categories Cc (C0, DEL, C1) and Cf (soft hyphen, Arabic and Syriac marks, zero
# widths, bidi embeddings, overrides and isolates, invisible operators, BOM, interlinear
# annotations, tags) and U+2028/U+2029; tests/test_untrusted.py checks it against the running
# Python's unicodedata, so a newer Unicode's additions are caught.
_CONTROL_AND_FORMAT = (
    "\x00-\x1f\x7f-\x9f\xad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e"
    "\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb"
    "\U000110bd\U000110cd\U00013430-\U00013438\U0001bca0-\U0001bca3\U0001d173-\U0001d17a"
    "\U000e0001\U000e0020-\U000e007f"
)
_DROPPED = re.compile(f"[{_CONTROL_AND_FORMAT}]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_SPACES = re.compile("[\t\n\v\f\r\x85\u2028\u2029]+")


def clean(text: str, limit: int | None = MAX_TEXT) -> str:
    """Valid UTF-8 without control or format characters, at most `limit` characters (an
    ellipsis marks a cut; None: no bound)."""
    if not text.isascii() or _DROPPED.search(text):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: os.fsdecode's escapes, or JSON's \ud800
            try:  # the bytes they stand for, decoded as UTF-8 should have been
                text = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
            except UnicodeEncodeError:  # a surrogate that no byte escapes to
                text = _SURROGATE.sub("\ufffd", text)
        text = _DROPPED.sub("", _SPACES.sub(" ", text))
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "\u2026"
