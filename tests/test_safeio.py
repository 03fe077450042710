"""Reading what an untrusted command line names: regular files only, bounded, never /proc;
symlinks resolved inside the process's root; text cleaned before it is shown."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from exporter.config.schema import WeightsConfig
from exporter.storage.weighttree import walk_weights
from exporter.trust.safeio import Refused, open_checked, pseudo_path, read_regular, resolve_in_root
from exporter.trust.untrusted import clean


def test_only_small_regular_files_are_read(tmp_path: Path) -> None:
    small = tmp_path / "refs-main"
    small.write_text("a" * 40)
    assert read_regular(str(small), 64) == b"a" * 40
    with pytest.raises(Refused) as big:
        read_regular(str(small), 39)
    assert big.value.reason == "too_large"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "zero").symlink_to("/dev/zero")
    for path in (fifo, tmp_path / "zero", tmp_path):
        with pytest.raises(Refused) as refused:
            read_regular(str(path), 1 << 20)  # returns at once: never opened to block or read
        assert refused.value.reason == "not_regular", path
    # /proc's own files are regular files of size 0: read up to the bound, and no further.
    assert b"Uid:" in read_regular("/proc/self/status", 1 << 16)
    with pytest.raises(Refused):
        read_regular("/proc/self/status", 16)


def test_pseudo_file_systems_are_refused_by_name_and_by_type(tmp_path: Path) -> None:
    for path in ("/proc", "/proc/1/root", "/sys/../proc/self", "/dev/shm/x", "//sys"):
        assert pseudo_path(path), path
    for path in ("/procfs", "/home/u/proc", "relative/proc", "/devices"):
        assert not pseudo_path(path), path
    (tmp_path / "p").symlink_to("/proc/self")
    with pytest.raises(Refused) as refused:
        open_checked(str(tmp_path / "p"))
    assert refused.value.reason == "pseudo_filesystem"


def test_symlinks_resolve_inside_the_processs_root(tmp_path: Path) -> None:
    root = tmp_path / "container"
    (root / "mnt" / "models").mkdir(parents=True)
    (root / "models").symlink_to("/mnt/models")  # absolute: inside the container
    (root / "mnt" / "models" / "up").symlink_to("../../../../../..")
    assert resolve_in_root(str(root), "/models") == f"{root}/mnt/models"
    assert resolve_in_root(str(root), "/models/up/etc") == f"{root}/etc"  # ".." stops at root
    assert resolve_in_root(str(root), "/models/absent/x") == f"{root}/mnt/models/absent/x"
    (root / "loop").symlink_to("loop")
    with pytest.raises(OSError):
        resolve_in_root(str(root), "/loop")


def test_a_weights_walk_never_enters_proc_and_stops_at_its_bound(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for i in range(5):
        (model / f"model-{i}.safetensors").write_bytes(b"x")
    (model / "host").symlink_to("/proc")
    tree = walk_weights(WeightsConfig(paths=(str(model),)))
    assert len(tree.files) == 5
    assert not walk_weights(WeightsConfig(paths=("/proc",))).files
    with pytest.raises(Refused) as refused:
        walk_weights(WeightsConfig(paths=(str(model),)), max_entries=4)
    assert refused.value.reason == "too_many_files"


def test_untrusted_text_is_valid_utf8_without_controls_and_bounded() -> None:
    argv_text = os.fsdecode(b"caf\xe9\x1b[31m\xff\r\nx") + "\u202e"
    assert clean(argv_text) == "caf\ufffd[31m\ufffd x"  # the line break: one space
    assert clean("a" * 300, limit=10) == "a" * 9 + "\u2026"
    assert clean("\ud800") == "\ufffd"  # a lone surrogate no byte escapes to (JSON)
    assert clean("plain") == "plain"
