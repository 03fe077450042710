"""The strict switch: a missing prerequisite skips a test, or fails it under MLE_STRICT=1."""

from __future__ import annotations

import pytest
from helpers.require import STRICT_FLAG, require, require_all


def test_missing_prerequisite_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STRICT_FLAG, raising=False)
    require(True, "present")
    with pytest.raises(BaseException, match="absent") as caught:
        require(False, "absent")
    assert caught.type is pytest.skip.Exception


def test_missing_prerequisite_fails_under_strict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STRICT_FLAG, "1")
    require(True, "present")
    # BaseException: a skip raised instead must fail this test, not skip it.
    with pytest.raises(BaseException, match=r"absent \(MLE_STRICT=1: this test must run") as caught:
        require(False, "absent")
    assert caught.type is pytest.fail.Exception


def test_every_named_prerequisite_is_known() -> None:
    with pytest.raises(KeyError):
        require_all("a-tool-nobody-has")
