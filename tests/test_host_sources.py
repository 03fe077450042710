"""The host sources that declare themselves (exporter/sources/__init__.py's `HOST_SOURCE`): with
their keys spread over their modules, nothing but this keeps two sources off one `source` label."""

from __future__ import annotations

import exporter.sources
from exporter.sources import SourceKey, host_sources


def test_every_source_has_a_name_of_its_own_and_a_declared_one_samples_the_host() -> None:
    declared = [source.key for source in host_sources()]
    assert declared, "the disk, netfs and zfs sources declare themselves"
    assert not any(key.per_target for key in declared)
    keys = [key for key in vars(exporter.sources).values() if isinstance(key, SourceKey)]
    names = [key.name for key in keys + declared]
    assert len(names) == len(set(names)), sorted(names)
