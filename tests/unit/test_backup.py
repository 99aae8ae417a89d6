"""Backups on a peer: retention and choosing one to restore."""

import pytest

from salt_multimaster import backup


def _make(base, *names):
    for name in names:
        (base / name / "file_roots" / "base").mkdir(parents=True)
        (base / name / "file_roots" / "base" / "a.sls").write_text(name)


def test_prune_keeps_the_newest(tmp_path):
    names = [f"2026112{i}T000000.000000Z" for i in range(5)]
    _make(tmp_path, *names)
    (tmp_path / "not-a-backup").mkdir()
    assert backup.prune(tmp_path, 2) == names[:3]
    assert backup.stamps(tmp_path) == names[3:]
    assert (tmp_path / "not-a-backup").is_dir()
    with pytest.raises(backup.BackupError, match="backup_keep must be at least 1, not 0"):
        backup.prune(tmp_path, 0)


def test_choose_and_items(tmp_path):
    _make(tmp_path, "20261120T000000Z", "20261121T000000Z")
    assert backup.choose(tmp_path).endswith("20261121T000000Z")
    assert backup.choose(tmp_path, "20261120T000000Z").endswith("20261120T000000Z")
    with pytest.raises(backup.BackupError, match="invalid backup name '../etc/'"):
        backup.choose(tmp_path, "../etc/")
    with pytest.raises(backup.BackupError, match="no backup '20000101T000000Z'"):
        backup.choose(tmp_path, "20000101T000000Z")
    with pytest.raises(backup.BackupError, match="no backup under"):
        backup.choose(tmp_path / "none")
    assert backup.items(backup.choose(tmp_path)) == ["file_roots/base/a.sls"]
