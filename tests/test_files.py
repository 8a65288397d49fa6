"""`zeus_callbacks.core.files` on its own: how paths are walked, what a write leaves, what a read refuses."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from zeus_callbacks.core import files


def test_a_relative_link_of_ones_own_is_followed_from_its_directory(tmp_path: Path) -> None:
    """Rule: a relative link's target is resolved from the link's directory, `..` included."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "to_b").symlink_to("../b")
    files.write_atomic(tmp_path / "a" / "to_b" / "new" / "c.json", "{}")
    assert (tmp_path / "b" / "new" / "c.json").read_text() == "{}"
    assert files.read_regular(tmp_path / "a" / "to_b" / "new" / "c.json") == b"{}"


def test_a_loop_of_links_ends_in_eloop(tmp_path: Path) -> None:
    """Rule: at most MAXSYMLINKS (40) links are followed in one walk, as the kernel does."""
    (tmp_path / "x").symlink_to("y")
    (tmp_path / "y").symlink_to("x")
    with pytest.raises(OSError) as caught:
        files.write_atomic(tmp_path / "x" / "c.json", "{}")
    assert caught.value.errno == errno.ELOOP


def test_a_name_near_the_limit_gets_a_temporary_name_that_fits(tmp_path: Path) -> None:
    """Rule: the temporary name is cut to fit NAME_MAX (255 bytes) whatever the target's name."""
    name = "p" * 250 + ".json"
    files.write_atomic(tmp_path / name, "{}", mode=0o600)
    assert (tmp_path / name).read_text() == "{}" and len(os.listdir(tmp_path)) == 1


def test_a_directory_at_the_target_is_left_alone(tmp_path: Path) -> None:
    """Rule: a directory where the file should be is an error that names it, and stays as it was."""
    (tmp_path / "plo.json").mkdir()
    (tmp_path / "plo.json" / "kept").write_text("x")
    with pytest.raises(OSError) as caught:
        files.write_atomic(tmp_path / "plo.json", "{}")
    assert caught.value.filename == str(tmp_path / "plo.json")
    assert (tmp_path / "plo.json" / "kept").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plo.json"]


def test_a_missing_directory_is_named(tmp_path: Path) -> None:
    """Rule: reading, nothing is made; the message names the first directory that is missing."""
    with pytest.raises(FileNotFoundError) as caught:
        files.read_regular(tmp_path / "none" / "deeper" / "plo.json")
    assert caught.value.filename == str(tmp_path / "none")
    assert not (tmp_path / "none").exists()


def test_a_file_in_place_of_a_directory_is_named(tmp_path: Path) -> None:
    """Rule: a component that is a file is ENOTDIR, named."""
    (tmp_path / "f").write_text("")
    with pytest.raises(NotADirectoryError) as caught:
        files.write_atomic(tmp_path / "f" / "plo.json", "{}")
    assert caught.value.filename == str(tmp_path / "f")


def test_a_read_of_a_file_that_chooses_nothing_takes_anyones_file(tmp_path: Path) -> None:
    """Rule: only a file that chooses a setting is judged by its owner and mode."""
    path = tmp_path / "record.json"
    path.write_text("{}")
    path.chmod(0o666)
    assert files.read_regular(path) == b"{}"
    with pytest.raises(files.ForeignFileError, match="may be written by any user"):
        files.read_regular(path, chooses="the power limit")
