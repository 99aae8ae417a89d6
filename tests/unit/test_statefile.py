"""
salt_multimaster.statefile, the one reader and writer of salt-multimaster's
own state files, and the state files a sync's rounds do not read (the
rotation record and staged keypair, the reactor's queue, the pull grants,
the locks, the backups): each damaged one is "unknown", rebuilt or refused
by name, logged once, never "nothing to do".
"""

import json
import logging
import os

import pytest

from salt_multimaster import backup, grants, lock, rotation, statefile


@pytest.mark.parametrize("data, why", [
    (b"", "empty"), (b"  \n", "empty"), (b"\x95\xff{}", "not UTF-8"),
    (b'{"a": [1, 2', "not JSON (truncated?)"), (b"[1, 2]", "not the expected content"),
])
def test_read_names_what_is_wrong(tmp_path, data, why):
    path = tmp_path / "state.json"
    path.write_bytes(data)
    with pytest.raises(statefile.Damaged) as exc:
        statefile.read(str(path), valid=lambda v: isinstance(v, dict))
    assert str(exc.value).startswith(f"{path} is damaged ({why}")


def test_read_missing_directory_and_good(tmp_path):
    path = tmp_path / "state.json"
    assert statefile.read(str(path)) is None
    path.mkdir()
    with pytest.raises(statefile.Damaged, match=r"is damaged \(a directory\)"):
        statefile.read(str(path))
    path.rmdir()
    path.write_text('{"a": 1}')
    assert statefile.read(str(path)) == {"a": 1}


def test_load_answers_the_default_logs_once_and_notes_it(tmp_path, caplog):
    path = tmp_path / "cache.json"
    path.write_bytes(b"\x00garbage")
    statefile.noticing()
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert statefile.load(str(path), "read again", default={}) == {}
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [f"multimaster: {path} is damaged (not JSON (truncated?)): read again"]
    assert statefile.noticed() == [f"{path}: not JSON (truncated?)"]
    assert path.read_bytes() == b"\x00garbage"  # reading changes nothing


def test_write_and_remove_move_a_directory_aside(tmp_path):
    path = tmp_path / "sub" / "state.json"
    path.parent.mkdir()
    path.mkdir()
    (path / "x").write_text("kept")
    statefile.write(str(path), "{}")
    assert path.read_text() == "{}"
    (aside,) = (tmp_path / "sub").glob("state.json.damaged-*")
    assert (aside / "x").read_text() == "kept"
    path.unlink()
    path.mkdir()
    assert statefile.remove(str(path)) is True and not path.exists()
    assert statefile.remove(str(path)) is False
    # a file where a directory of the state dir must be
    (tmp_path / "peers").write_text("garbage")
    statefile.write(str(tmp_path / "peers" / "m2.json"), "{}", root=str(tmp_path))
    assert (tmp_path / "peers" / "m2.json").read_text() == "{}"
    assert len(list(tmp_path.glob("peers.damaged-*"))) == 1


def test_a_lock_file_that_is_a_directory_is_made_again(tmp_path):
    path = tmp_path / lock.LOCK_NAME
    path.mkdir()
    with lock.SyncLock(str(path), "123"):
        assert lock.read_holder(str(path)) == "123"
    path.write_bytes(b"\xff\xfe garbage")
    assert lock.read_holder(str(path)) is None or isinstance(lock.read_holder(str(path)), str)


def test_a_damaged_rotation_record_refuses_by_name(tmp_path):
    path = tmp_path / rotation.RECORD_NAME
    assert rotation.load_record(str(tmp_path)) is None
    for data in (b"\x95garbage", b"", b'{"topology": "shared"}', b"[]"):
        path.write_bytes(data)
        with pytest.raises(rotation.RotationError) as exc:
            rotation.load_record(str(tmp_path))
        assert str(exc.value).startswith(f"the rotation record {path} is damaged (")
        assert "rotate_key fresh=True" in str(exc.value)
    # a new one (fresh=True) replaces it, a directory moved aside
    path.unlink()
    path.mkdir()
    record = rotation.new_record("shared", ["m2"], "m1")
    rotation.save_record(str(tmp_path), record)
    assert rotation.load_record(str(tmp_path)) == json.loads(path.read_text())


def test_a_damaged_staged_keypair_is_never_replaced_by_another(tmp_path):
    priv, pub = rotation.stage_keypair(str(tmp_path), 1024)
    assert rotation.stage_keypair(str(tmp_path), 1024) == (priv, pub)
    staged = tmp_path / rotation.STAGE_NAME
    (staged / "master.pub").write_bytes(os.urandom(40))
    with pytest.raises(rotation.RotationError, match="the staged keypair .* is damaged"):
        rotation.stage_keypair(str(tmp_path), 1024)
    (staged / "master.pub").unlink()
    with pytest.raises(rotation.RotationError, match="fresh=True"):
        rotation.stage_keypair(str(tmp_path), 1024)


def test_grants_and_backups_over_damaged_dirs(tmp_path):
    pull = tmp_path / "pull"
    pull.write_text("not a directory")
    assert grants.expired(str(pull)) == []
    pull.unlink()
    pull.mkdir()
    (pull / f"abc{grants.JIDS_SUFFIX}").write_bytes(b"\xff\n123\n")
    assert grants.jids(str(pull), "abc") == ["123"]
    base = tmp_path / "backup"
    base.write_text("not a directory")
    assert backup.stamps(str(base)) == [] and backup.prune(str(base)) == []


def test_the_reactors_damaged_queue_syncs_every_key(tmp_path):
    import importlib.util  # pylint: disable=import-outside-toplevel

    from tests.conftest import REPO  # pylint: disable=import-outside-toplevel

    spec = importlib.util.spec_from_file_location(
        "mm_reactor_damage", REPO / "_runners" / "multimaster_reactor.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.__salt__ = {}
    queue = str(tmp_path / "key-sync.pending")
    take, put = mod._take, mod._put  # pylint: disable=protected-access
    for data in (b"\x95\xff garbage\n", b"web1\nnot an id\n"):
        (tmp_path / "key-sync.pending").write_bytes(data)
        assert take(queue) == {mod.ALL}
        assert take(queue) is None
    (tmp_path / "key-sync.pending").mkdir()
    (tmp_path / "key-sync.pending.lock").unlink()
    (tmp_path / "key-sync.pending.lock").mkdir()
    assert take(queue) == {mod.ALL}
    put(queue, ["web1"])
    assert take(queue) == {"web1"}
