"""Sizes and rates as people write them, in both decimal and binary units."""

from __future__ import annotations

import pytest

from exporter.units import parse_rate, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("0", 0),
        ("512B", 512),
        ("256MiB", 256 * 1024**2),
        ("256 MiB", 256 * 1024**2),
        ("1.5GiB", 3 * 1024**3 // 2),
        ("64Ki", 64 * 1024),
        ("2TiB", 2 * 1024**4),
        ("2GB", 2 * 10**9),
        ("10kB", 10_000),
        ("10KB", 10_000),
        ("3M", 3 * 10**6),
        (" 1G ", 10**9),
        (".5KiB", 512),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("240MB/s", 240e6),
        ("3GB/s", 3e9),
        ("3GiB/s", 3 * 1024**3),
        ("1.5 MiB/s", 1.5 * 1024**2),
        ("100/s", 100.0),
    ],
)
def test_parse_rate(text: str, expected: float) -> None:
    assert parse_rate(text) == pytest.approx(expected)


@pytest.mark.parametrize(
    "text", ["", "MiB", "-1MiB", "12 apples", "1Mb", "1mb", "1..5G", "1e3", "nan", "1 G B"]
)
def test_bad_sizes_fail_in_one_line_naming_the_input(text: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_size(text)
    message = str(caught.value)
    assert "\n" not in message and repr(text) in message


@pytest.mark.parametrize("text", ["240MB", "0MB/s", "fast", "240Mbit/s", "/s", "1e400GB/s"])
def test_bad_rates_fail_in_one_line_naming_the_input(text: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_rate(text)
    message = str(caught.value)
    assert "\n" not in message and repr(text) in message


def test_too_large_for_a_float_is_an_error_not_infinity() -> None:
    with pytest.raises(ValueError):
        parse_size("9" * 400 + "EiB")
