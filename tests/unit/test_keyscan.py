"""
The key scanner (salt_multimaster.keyscan) and the state store it keeps
(salt_multimaster.store): what a scan finds is what a fresh listing finds,
whatever the store held, whatever the journal said.
"""

import os
import random
import sqlite3

import pytest

from salt_multimaster import keyscan, manifest, store
from tests.support.cluster import gen_keypair
from tests.support import store as store_damage
from tests.support.keys import digest_of_keys
from tests.support.watcher import FakeWatcher


@pytest.fixture(name="pki")
def _pki(tmp_path):
    pki = tmp_path / "pki"
    for state in manifest.KEY_DIRS:
        (pki / state).mkdir(parents=True)
    pub = gen_keypair(1024)[1]
    for i in range(30):
        (pki / "minions" / f"m{i}").write_bytes(pub)
    (pki / "minions_pre" / "p0").write_bytes(pub)
    return pki


@pytest.fixture(name="reads")
def _reads(monkeypatch):
    """The key files a scan reads (the paths given to keyscan's hasher)."""
    got = []
    real = keyscan._key_sha  # pylint: disable=protected-access

    def counting(state, name, path, errors):
        got.append(f"{state}/{name}")
        return real(state, name, path, errors)

    monkeypatch.setattr(keyscan, "_key_sha", counting)
    return got


def _manifest(snap):
    """``{state: {id: sha256}}`` of every key the scan found."""
    return dict({state: {} for state in manifest.KEY_DIRS},
                **manifest.merge(snap.parts, snap.parts))


def _scan(pki, state_dir, watch=None, rescan=False):
    snap = keyscan.KeysSnapshot(str(pki), str(state_dir), watch=watch, rescan=rescan)
    return snap, {"manifest": _manifest(snap), "digest": snap.digest, "counts": snap.counts,
                  "errors": snap.errors, "damaged": snap.damaged}


def _fresh(pki, tmp_path):
    """What a scan with an empty store finds."""
    return _scan(pki, tmp_path / f"fresh-{random.random()}")[1]


def test_a_scan_skips_bad_ids_non_pem_and_symlinks(pki, tmp_path):
    pub = gen_keypair(1024)[1]
    (pki / "minions" / "good").write_bytes(pub + b"\n\n")
    (pki / "minions" / "junk").write_text("not a key")
    (pki / "minions" / ".key_cache").write_text("Salt's own")
    os.symlink(pki / "minions" / "good", pki / "minions" / "linked")
    snap, got = _scan(pki, tmp_path / "state")
    assert got["manifest"]["minions"]["good"] == manifest.key_sha(pub)
    assert "junk" not in got["manifest"]["minions"] and ".key_cache" not in got["manifest"]["minions"]
    assert "linked" not in got["manifest"]["minions"]
    assert [e.split(":")[0] for e in got["errors"]] == ["minions/junk", "minions/linked"]
    assert got["damaged"] == {"minions": ["junk"]}
    assert got["digest"] == digest_of_keys(got["manifest"])
    assert got["counts"] == {s: len(got["manifest"][s]) for s in manifest.KEY_DIRS}
    assert dict(snap.parts) == manifest.split("minion_keys", got["manifest"])


def test_an_unchanged_key_is_statted_not_read(pki, tmp_path, reads):
    state = tmp_path / "state"
    first = _scan(pki, state)[1]
    assert len(reads) == 31
    reads.clear()
    assert _scan(pki, state)[1] == first and reads == []
    # Salt accepting a key: a rename into minions/ (one key read)
    (pki / "minions_pre" / "web2").write_bytes(gen_keypair(1024)[1])
    _scan(pki, state)
    reads.clear()
    os.rename(pki / "minions_pre" / "web2", pki / "minions" / "web2")
    moved = _scan(pki, state)[1]
    assert reads == ["minions/web2"] and moved == _fresh(pki, tmp_path)
    assert moved["digest"] != first["digest"]
    reads.clear()
    assert _scan(pki, state, rescan=True)[1] == moved and len(reads) == 32  # every key read


def test_a_key_rewritten_in_place_is_seen_at_the_next_scan(pki, tmp_path):
    """
    Salt 3006 and 3007 write a denied key over ``minions_denied/<id>`` in
    place when the same id comes back with yet another key, its dir's
    mtime unchanged; even with its own mtime put back, its ctime moved.
    """
    state = tmp_path / "state"
    denied = pki / "minions_denied" / "m1"
    denied.write_bytes(gen_keypair(1024)[1])
    first = _scan(pki, state)[1]
    before = denied.stat()
    with open(denied, "r+b") as fh:  # as Salt's "w+": same inode, same dir
        fh.truncate(0)
        fh.write(gen_keypair(1024)[1][:before.st_size].ljust(before.st_size, b"\n"))
    os.utime(denied, ns=(before.st_atime_ns, before.st_mtime_ns))
    again = _scan(pki, state)[1]
    assert again == _fresh(pki, tmp_path) and again["digest"] != first["digest"]


def test_a_damaged_key_repaired_in_place_is_found(pki, tmp_path):
    """A key that cannot be used is reported, never read as deleted; repaired, it is found."""
    state = tmp_path / "state"
    junk = pki / "minions" / "junk"
    junk.write_text("not a key")
    first = _scan(pki, state)[1]
    assert first["damaged"] == {"minions": ["junk"]}
    assert _scan(pki, state)[1] == first
    pub = gen_keypair(1024)[1]
    with open(junk, "r+b") as fh:
        fh.truncate(0)
        fh.write(pub)
    repaired = _scan(pki, state)[1]
    assert repaired["errors"] == [] and repaired["damaged"] == {}
    assert repaired["manifest"]["minions"]["junk"] == manifest.key_sha(pub)


def test_what_was_remembered_holds_while_the_keys_are_the_same(pki, tmp_path):
    """
    The peer's history record is stamped in the scan (``history_recorded``):
    a scan finding the same keys keeps it, a change drops it (else every
    sync after a key change would cost the primary one more publish).
    """
    state = tmp_path / "state"
    snap, _ = _scan(pki, state)
    snap.remember(history=[1, 2, 3])
    os.utime(pki / "minions" / "m1")  # statted again, the same key
    again, _ = _scan(pki, state)
    assert again.meta["history"] == [1, 2, 3]
    (pki / "minions" / "web2").write_bytes(gen_keypair(1024)[1])
    changed, _ = _scan(pki, state)
    assert changed.digest != snap.digest and "history" not in changed.meta


def test_previous_parts_are_the_parts_of_the_scan_replaced(pki, tmp_path):
    state = tmp_path / "state"
    assert _scan(pki, state)[0].previous_parts() is None  # none before the first
    before = _scan(pki, state)[1]
    (pki / "minions" / "m3").rename(pki / "minions_rejected" / "m3")
    (pki / "minions" / "new").write_bytes(gen_keypair(1024)[1])
    snap, _ = _scan(pki, state)
    digest, parts = snap.previous_parts()
    assert digest == before["digest"]
    assert dict(parts()) == manifest.split("minion_keys", before["manifest"])


def test_a_scan_in_test_mode_sees_the_change_and_changes_no_store(pki, tmp_path):
    state = tmp_path / "state"
    before = _scan(pki, state)[1]
    (pki / "minions" / "new").write_bytes(gen_keypair(1024)[1])
    dry = keyscan.KeysSnapshot(str(pki), str(state), keep=False)
    assert _manifest(dry) == _fresh(pki, tmp_path)["manifest"] != before["manifest"]
    assert store.read(str(state), lambda found: found.digests(keyscan.CATEGORY)) == before[
        "digest"]
    # the next scan still replaces the one a peer in step holds
    digest, parts = _scan(pki, state)[0].previous_parts()
    assert (digest, dict(parts())) == (
        before["digest"], manifest.split("minion_keys", before["manifest"]))


@pytest.mark.parametrize("how", store_damage.DAMAGES)
def test_a_damaged_store_is_rebuilt_by_a_full_scan(pki, tmp_path, how, reads):
    state = tmp_path / "state"
    first = _scan(pki, state)[1]
    store_damage.damage(state, how, table="keys")
    reads.clear()
    assert _scan(pki, state)[1] == first and len(reads) == 31
    assert [p.name for p in state.iterdir() if ".damaged-" in p.name]  # kept for inspection
    assert oct((state / store.NAME).stat().st_mode & 0o777) == "0o600"


def test_a_store_held_by_another_process_is_busy_never_damaged(pki, tmp_path, monkeypatch,
                                                                caplog):
    """
    Another scan's transaction outlasting the wait is not damage: the scan
    fails, named, and nothing is moved aside; reads and records of the
    store are not used or not written, logged; all works once it is free.
    """
    state = tmp_path / "state"
    first = _scan(pki, state)[1]
    monkeypatch.setattr(store, "BUSY_TIMEOUT", 0.1)
    holder = sqlite3.connect(state / store.NAME, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # a scan of another process, under way
    try:
        (pki / "minions" / "new1").write_bytes(gen_keypair(1024)[1])
        with pytest.raises(store.Busy, match="held by another multimaster process"):
            _scan(pki, state)
        store.record(str(state), lambda found: found.set_meta("x", 1), "the test's row")
        assert "the test's row not recorded" in caplog.text
        assert store.read(str(state), lambda found: found.meta("x")) is None
        assert not [p.name for p in state.iterdir() if ".damaged-" in p.name]
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    again = _scan(pki, state)[1]
    assert again["counts"]["minions"] == first["counts"]["minions"] + 1


def test_a_scan_of_another_pki_dir_starts_afresh(pki, tmp_path):
    state = tmp_path / "state"
    _scan(pki, state)
    other = tmp_path / "other"
    (other / "minions").mkdir(parents=True)
    assert _scan(other, state)[1]["manifest"] == {s: {} for s in manifest.KEY_DIRS}


# ----- with the change journal ---------------------------------------------------------------
def test_a_scan_stats_only_the_keys_the_journal_names(pki, tmp_path, monkeypatch):
    fake = FakeWatcher([pki])
    state = tmp_path / "state"
    _scan(pki, state, fake)  # no token yet: every dir listed, the token kept
    assert fake.asked == [None]
    (pki / "minions" / "new").write_bytes(gen_keypair(1024)[1])
    fake.touch(pki / "minions", "new")
    (pki / "minions_pre" / "p0").unlink()
    fake.touch(pki / "minions_pre", "p0")
    listed = []
    real = keyscan._listing  # pylint: disable=protected-access
    monkeypatch.setattr(keyscan, "_listing",
                        lambda pki_dir, st, names: listed.append((st, names))
                        or real(pki_dir, st, names))
    got = _scan(pki, state, fake)[1]
    assert sorted(listed) == [("minions", ["new"]), ("minions_pre", ["p0"])]
    assert fake.asked[-1] == {"session": "s1", "seq": 0}
    monkeypatch.undo()
    assert got == _fresh(pki, tmp_path)
    assert got["manifest"]["minions"]["new"] and "p0" not in got["manifest"]["minions_pre"]
    listed.clear()
    monkeypatch.setattr(keyscan, "_listing", lambda *a: listed.append(a) or real(*a))
    assert _scan(pki, state, fake)[1] == got and listed == []  # nothing named since


@pytest.mark.parametrize("how", ["names-unknown", "dir-itself", "errors", "session", "rescan"])
def test_key_dirs_are_listed_when_the_journal_cannot_name_the_keys(pki, tmp_path, monkeypatch,
                                                                   how):
    fake = FakeWatcher([pki])
    state = tmp_path / "state"
    if how == "errors":
        (pki / "minions" / "junk").write_text("not a key")
    _scan(pki, state, fake)
    (pki / "minions" / "m1").unlink()
    fake.touch(pki / "minions", {"names-unknown": None, "dir-itself": ""}.get(how, "m1"))
    if how == "dir-itself":
        fake.touch(pki / "minions", "m1")
    if how == "session":
        fake.session = "s2"
    listed = []
    real = keyscan._listing  # pylint: disable=protected-access
    monkeypatch.setattr(keyscan, "_listing",
                        lambda pki_dir, st, names: listed.append((st, names))
                        or real(pki_dir, st, names))
    got = _scan(pki, state, fake, rescan=how == "rescan")[1]
    assert ("minions", None) in listed
    monkeypatch.undo()
    assert got == _fresh(pki, tmp_path)


def test_a_scan_without_the_journal_keeps_its_token(pki, tmp_path):
    """
    A scan without the journal (the peer's history record) lists every
    dir; the token kept before still covers what changed since.
    """
    fake = FakeWatcher([pki])
    state = tmp_path / "state"
    _scan(pki, state, fake)
    (pki / "minions" / "m2").unlink()
    fake.touch(pki / "minions", "m2")
    _scan(pki, state)
    (pki / "minions" / "m4").unlink()
    fake.touch(pki / "minions", "m4")
    assert _scan(pki, state, fake)[1] == _fresh(pki, tmp_path)


def test_random_key_changes_through_the_journal_read_as_a_listing(pki, tmp_path):
    """Keys added, accepted, rejected, deleted and rewritten, named by the journal, 30 rounds."""
    rng = random.Random(5)
    pubs = [gen_keypair(1024)[1] for _ in range(3)]
    fake = FakeWatcher([pki])
    state = tmp_path / "state"
    last = _scan(pki, state, fake)[1]
    for rnd in range(30):
        for _ in range(rng.randrange(1, 6)):
            here = [(s, n) for s in manifest.KEY_DIRS for n in os.listdir(pki / s)]
            what = rng.choice(["add", "move", "delete", "rewrite"]) if here else "add"
            if what == "add":
                st, name = rng.choice(manifest.KEY_DIRS), f"k{rnd}-{rng.randrange(1000)}"
                (pki / st / name).write_bytes(rng.choice(pubs))
                fake.touch(pki / st, name)
                continue
            st, name = rng.choice(here)
            if what == "move":
                to = rng.choice([s for s in manifest.KEY_DIRS if s != st])
                if (pki / to / name).exists():
                    continue
                os.rename(pki / st / name, pki / to / name)
                fake.touch(pki / to, name)
            elif what == "delete":
                (pki / st / name).unlink()
            else:
                (pki / st / name).write_bytes(rng.choice(pubs) + b"\n" * rng.randrange(3))
            fake.touch(pki / st, name)
        snap, got = _scan(pki, state, fake)
        assert got == _fresh(pki, tmp_path), rnd
        digest, parts = snap.previous_parts()
        assert digest == last["digest"], rnd
        assert dict(parts()) == manifest.split("minion_keys", last["manifest"]), rnd
        last = got
