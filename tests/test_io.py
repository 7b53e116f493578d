"""Atomic writes: temporary files are created exclusively, never through a planted symlink, and a
kill mid-save leaves nothing that the next run keeps."""

from __future__ import annotations

import os

import pytest

from gradzip import io
from gradzip.training import checkpoint


def test_atomic_write_never_follows_a_planted_symlink(tmp_path, monkeypatch):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    target = tmp_path / "ckpt-00000001.pt"
    names = iter(["planted", "fresh"])
    monkeypatch.setattr(io.secrets, "token_hex", lambda n: next(names))
    planted = tmp_path / f".{target.name}.planted{io.TEMP_SUFFIX}"
    planted.symlink_to(victim)  # the name the writer would pick first
    io.atomic_write_text(target, "new data")
    assert target.read_text() == "new data" and victim.read_text() == "precious"
    assert planted.is_symlink()  # left alone: not ours
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(io.TEMP_SUFFIX)] == [planted.name]


def test_a_failed_write_leaves_no_temporary_file_and_keeps_the_old_file(tmp_path):
    target = tmp_path / "summary.json"
    target.write_text("old")

    def boom(f):
        f.write(b"half")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        io.atomic_write(target, boom)
    assert target.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["summary.json"]


def test_temp_files_get_the_usual_mode(tmp_path):
    old = os.umask(0o022)
    try:
        io.atomic_write_text(tmp_path / "a.txt", "x")
    finally:
        os.umask(old)
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o644


def test_stale_checkpoint_temps_are_removed_and_nothing_else(tmp_path):
    stale = [tmp_path / f".ckpt-00000004.pt.abc{io.TEMP_SUFFIX}",
             tmp_path / f".ckpt-00000004-rank1.pt.def{io.TEMP_SUFFIX}"]
    for p in stale:
        p.write_bytes(b"\0" * 1000)
    keep = [tmp_path / "ckpt-00000002.pt", tmp_path / f".summary.json.x{io.TEMP_SUFFIX}", tmp_path / "notes.tmp"]
    for p in keep:
        p.write_text("k")
    with pytest.warns(UserWarning, match="removed 2 temporary file"):
        gone = checkpoint.remove_stale_temps(tmp_path)
    assert sorted(gone) == sorted(stale) and not any(p.exists() for p in stale) and all(p.exists() for p in keep)
