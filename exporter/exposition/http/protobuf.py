"""/metrics in Prometheus's protobuf format: the one format a Prometheus 2.x ingests native
histograms in (`--enable-feature=native-histograms` makes it ask for this first).

Encoded by hand, about a hundred lines, rather than with the protobuf runtime: the messages are
five (MetricFamily, Metric, LabelPair, Gauge/Counter, Histogram with its Bucket and BucketSpan,
as in prometheus/client_model's metrics.proto) and only ever written. Served only with
`metrics.native_histograms`; every other scrape gets the text formats as before.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

from prometheus_client.core import Metric

CONTENT_TYPE = (
    "application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; encoding=delimited"
)
_TYPES = {"counter": 0, "gauge": 1, "histogram": 4}  # metrics.proto's MetricType
_VARINT, _FIXED64, _BYTES = 0, 1, 2  # wire types


def wants_protobuf(accept: str) -> bool:
    """Whether an Accept header asks for the delimited MetricFamily stream."""
    return any(
        part.split(";")[0].strip() == "application/vnd.google.protobuf"
        and "proto=io.prometheus.client.MetricFamily" in part.replace(" ", "")
        and "encoding=delimited" in part.replace(" ", "")
        for part in accept.split(",")
    )


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1  # negative int64 as two's complement, ten bytes
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _tag(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _uint(field: int, value: int) -> bytes:
    return _tag(field, _VARINT) + _varint(value)


def _sint(field: int, value: int) -> bytes:
    return _uint(field, (value << 1) ^ (value >> 63))  # zigzag


def _double(field: int, value: float) -> bytes:
    return _tag(field, _FIXED64) + struct.pack("<d", value)


def _bytes(field: int, payload: bytes) -> bytes:
    return _tag(field, _BYTES) + _varint(len(payload)) + payload


def _text(field: int, value: str) -> bytes:
    return _bytes(field, value.encode("utf-8", "replace"))


def _labels(labels: dict[str, str]) -> bytes:
    return b"".join(_bytes(1, _text(1, k) + _text(2, v)) for k, v in sorted(labels.items()))


def _histogram(samples: list[Any]) -> bytes:
    """One label set's samples (buckets, _count, _sum, and the native one if any)."""
    body, buckets = b"", b""
    for sample in samples:
        if sample.name.endswith("_count"):
            body += _uint(1, int(sample.value))
        elif sample.name.endswith("_sum"):
            body += _double(2, sample.value)
        elif sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf":
            bucket = _uint(1, int(sample.value)) + _double(2, float(sample.labels["le"]))
            buckets += _bytes(3, bucket)
        native = sample.native_histogram
        if native is not None:
            body += _sint(5, native.schema) + _double(6, native.zero_threshold)
            body += _uint(7, int(native.zero_count))
            for span in native.pos_spans or ():
                body += _bytes(12, _sint(1, span.offset) + _uint(2, span.length))
            body += b"".join(_sint(13, delta) for delta in native.pos_deltas or ())
    return body + buckets


def _metrics(family: Metric) -> Iterable[bytes]:
    if family.type != "histogram":
        for sample in family.samples:
            value = _double(1, sample.value)  # Gauge and Counter: `double value = 1`
            yield _labels(sample.labels) + _bytes(3 if family.type == "counter" else 2, value)
        return
    series: dict[tuple[tuple[str, str], ...], list[Any]] = {}
    for sample in family.samples:
        key = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
        series.setdefault(key, []).append(sample)
    for key, samples in series.items():
        yield _labels(dict(key)) + _bytes(7, _histogram(samples))


def render(families: Iterable[Metric]) -> bytes:
    """Every family with samples as one length-delimited MetricFamily message each."""
    out = bytearray()
    for family in families:
        if not family.samples:
            continue
        # A counter's family is named as its samples are, with `_total` (as client_golang does).
        name = family.samples[0].name if family.type == "counter" else family.name
        body = _text(1, name) + _text(2, family.documentation) + _uint(3, _TYPES[family.type])
        body += b"".join(_bytes(4, metric) for metric in _metrics(family))
        out += _varint(len(body)) + body
    return bytes(out)
