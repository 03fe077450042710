"""Human sizes and rates (`256MiB`, `240MB/s`) -> bytes and bytes per second; seconds -> ages.

Both decimal (kB, MB, GB: powers of 1000, as disk vendors and `dd` report throughput) and binary
(KiB, MiB, GiB: powers of 1024, as file sizes are usually meant) suffixes are accepted, because the
figures people copy from `dd`, `fio` and `ls -lh` mix the two. Single letters (`K`, `M`, `G`) are
decimal, as in Kubernetes quantities. Lower-case `b` is rejected rather than guessed: `Mb` is
megabits in network speak, and a silent factor of 8 is worse than an error.
"""

from __future__ import annotations

import math
import re

MiB = 1 << 20

_NUMBER_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")
_MULTIPLIERS: dict[str, int] = {"": 1, "B": 1}
for _exp, _letter in enumerate("KMGTPE", start=1):
    _MULTIPLIERS[_letter] = _MULTIPLIERS[_letter + "B"] = 1000**_exp
    _MULTIPLIERS[_letter + "i"] = _MULTIPLIERS[_letter + "iB"] = 1024**_exp
_MULTIPLIERS["k"] = _MULTIPLIERS["kB"] = 1000

_SIZE_HINT = "expected a size like 4096, 256MiB or 2GB"
_RATE_HINT = "expected a rate like 240MB/s or 3GiB/s"


def _parse(quantity: str, text: str, hint: str) -> float:
    """`quantity` is the number and unit part of `text`, the input named in errors."""
    match = _NUMBER_RE.fullmatch(quantity)
    if match is None:
        raise ValueError(f"{hint}, got {text!r}")
    multiplier = _MULTIPLIERS.get(match.group(2))
    if multiplier is None:
        raise ValueError(f"unknown unit {match.group(2)!r} in {text!r} ({hint})")
    value = float(match.group(1)) * multiplier
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is too large")
    return value


def parse_size(text: str) -> int:
    """`256MiB` -> 268435456. A bare number is bytes; fractions round to whole bytes."""
    return round(_parse(text, text, _SIZE_HINT))


def parse_rate(text: str) -> float:
    """`240MB/s` -> 240e6 bytes per second. Must be positive: a zero rate never finishes."""
    body = text.strip()
    if not body.endswith("/s"):
        raise ValueError(f"{_RATE_HINT}, got {text!r}")
    rate = _parse(body[:-2], text, _RATE_HINT)
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {text!r}")
    return rate


def age(seconds: float) -> str:
    """45s, 2m10s, 1h05m: as `kubectl` prints ages, to the whole second."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"
