"""Text from other users' command lines, environments, files and logs, made fit to show.

Why: an argv, a path or a log line is whatever bytes another user chose. `os.fsdecode` keeps a
byte that is not UTF-8 as a lone surrogate, which prometheus_client cannot encode (every scrape a
500), a JSON parser may refuse and a page cannot show; a terminal runs what ESC, the C1 controls
(CSI is U+009B), BEL and BS say; a bidirectional override makes `txt.exe` read as `exe.txt`; tag
characters (U+E0000 block) carry text an agent reads and a person cannot see. So every string
that leaves the exporter passes through `clean` at one of its two exits: the /api/v1 documents'
`to_json` (exposition/api.py: /api/v1/status, /api/v1/loads, the live page, `status`, `history`,
`wait` and the MCP tools all read those) and the metric label values (exposition/collector.py).
Cleaning at the exits rather than where text enters: it enters at dozens of places (argv,
environ, readlink, mountinfo, log lines, HTTP answers, SQLite), and a place forgotten there
would leak; the exits are two.

What `clean` does: invalid UTF-8 and lone surrogates become U+FFFD; tab, line and page breaks
become a space (words stay apart); every character a person cannot see is dropped: Unicode's
categories Cc and Cf (controls, bidi overrides, zero widths, tags), Co (private use: a font may
draw anything there, or nothing), Cn (unassigned code points and the noncharacters), and the rest
of Unicode's Default_Ignorable_Code_Point (variation selectors, which the supplementary ones
U+E0100-E01EF make a second invisible alphabet of, fillers, the grapheme joiner). The categories
come from the running Python's unicodedata, so a newer Unicode's assignments follow it. The length
is bounded when asked.
"""

from __future__ import annotations

import re
import unicodedata

MAX_TEXT = 256
UNSEEN_CATEGORIES = frozenset({"Cc", "Cf", "Co", "Cn", "Cs", "Zl", "Zp"})
# Default_Ignorable_Code_Point (Unicode's DerivedCoreProperties.txt) outside Cf and Cn: marks and
# letters that render as nothing.
_IGNORABLE_RANGES = (
    (0x034F, 0x034F),  # combining grapheme joiner
    (0x115F, 0x1160),  # Hangul choseong and jungseong fillers
    (0x17B4, 0x17B5),  # Khmer inherent vowels
    (0x180B, 0x180F),  # Mongolian free variation selectors (and the vowel separator, Cf)
    (0x3164, 0x3164),  # Hangul filler
    (0xFE00, 0xFE0F),  # variation selectors
    (0xFFA0, 0xFFA0),  # halfwidth Hangul filler
    (0xE0100, 0xE01EF),  # variation selectors supplement
)
_IGNORABLE = frozenset(chr(c) for first, last in _IGNORABLE_RANGES for c in range(first, last + 1))
_ASCII_CONTROL = re.compile("[\x00-\x1f\x7f]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_SPACES = re.compile("[\t\n\v\f\r\x85\u2028\u2029]+")


def _seen(char: str) -> bool:
    """Whether a person sees `char` (one character) where it is shown."""
    if char.isascii():
        return " " <= char < "\x7f"
    return char not in _IGNORABLE and unicodedata.category(char) not in UNSEEN_CATEGORIES


def clean(text: str, limit: int | None = MAX_TEXT) -> str:
    """Valid UTF-8 of characters a person sees, at most `limit` characters (an ellipsis marks a
    cut; None: no bound)."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: os.fsdecode's escapes, or JSON's \ud800
            try:  # the bytes they stand for, decoded as UTF-8 should have been
                text = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
            except UnicodeEncodeError:  # a surrogate that no byte escapes to
                text = _SURROGATE.sub("\ufffd", text)
        text = "".join(filter(_seen, _SPACES.sub(" ", text)))
    elif _ASCII_CONTROL.search(text):
        text = _ASCII_CONTROL.sub("", _SPACES.sub(" ", text))
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "\u2026"
