"""The persisted registration (gateway.state): owner-only, refused when readable by others."""

import os
import stat
from pathlib import Path

import pytest

from gateway.state import Registration, StateError, StateStore


def reg(project: str = "p") -> Registration:
    return Registration("id1", "box", "alpr_secret", "http://h", "o", project)


def test_save_is_owner_only_and_round_trips(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    store.save(reg())
    store.save(reg("q"))
    assert stat.S_IMODE(os.stat(tmp_path / "state").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o600
    assert store.load("o/p") == reg()
    assert store.load("o/q") == reg("q")
    assert store.load("o/none") is None
    assert "alpr_secret" not in repr(store.load("o/p"))


def test_readable_by_others_is_refused(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.save(reg())
    os.chmod(store.path, 0o644)
    with pytest.raises(StateError, match="readable by others"):
        store.load("o/p")


def test_garbage_file_is_a_clear_error(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.path.write_text("{")
    os.chmod(store.path, 0o600)
    with pytest.raises(StateError, match="not a registration file"):
        store.load("o/p")
