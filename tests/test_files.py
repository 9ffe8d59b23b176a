"""Atomic writes: the file appears whole with a normal mode, or not at all."""

import os
import stat

import pytest

from treegraft_dist.files import replacing, write_json, write_text


def test_a_written_file_has_the_mode_of_a_new_file(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    path = tmp_path / "sub" / "a.json"
    write_json(path, {"a": 1})
    assert path.read_text().strip() == '{\n "a": 1\n}'
    assert stat.S_IMODE(os.stat(path).st_mode) == stat.S_IMODE(os.stat(plain).st_mode)
    assert sorted(p.name for p in path.parent.iterdir()) == ["a.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "b.txt"
    write_text(path, "old")
    with pytest.raises(RuntimeError):
        with replacing(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("interrupted")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["b.txt"]
