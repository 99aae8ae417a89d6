"""Unit tests of the replication core: plans, manifests, sealing, safe writes."""

import hashlib
import json
import os
import stat

import pytest

from salt_multimaster import fsutil, manifest, protocol, replicate, seal
from tests.support.cluster import gen_keypair
from tests.support.keys import digest_of_keys

A, B, C = "a" * 64, "b" * 64, "c" * 64


def test_plan_keys_adds_moves_and_removes():
    primary = {"minions": {"web1": A, "mover": B}, "minions_pre": {"new": C}}
    peer = {"minions": {"web1": A, "gone": C}, "minions_pre": {"mover": B}}
    ops, report = replicate.plan_keys(primary, peer, history=["gone", "mover", "web1"])
    assert report == {
        "added": ["minions/mover", "minions_pre/new"],
        "updated": [],
        "removed": ["minions/gone", "minions_pre/mover"],
        "conflicts": [],
        "errors": [],
    }
    # writes come before removes: a moving key is never briefly absent
    assert [op["op"] for op in ops] == ["write", "write", "remove", "remove"]


def test_plan_keys_conflicts_unless_forced():
    primary = {"minions": {"web1": A}}
    peer = {"minions": {"web1": B, "local": C}}
    ops, report = replicate.plan_keys(primary, peer, history=[])
    assert ops == []
    assert [c.split(":")[0] for c in report["conflicts"]] == ["minions/web1", "minions/local"]
    ops, report = replicate.plan_keys(primary, peer, history=[], force=True)
    assert report["conflicts"] == []
    assert report["updated"] == ["minions/web1"]
    assert report["removed"] == ["minions/local"]


def test_plan_tree_and_missing_saltenv():
    primary = {"base": {"a.sls": [1, 0o644, A], "b.sls": [1, 0o644, B]}, "prod": {"p": [1, 0o644, A]}}
    peer = {"base": {"a.sls": [1, 0o644, A], "b.sls": [1, 0o755, B], "old": [1, 0o644, C]}}
    ops, report = replicate.plan_tree(primary, peer)
    assert report["updated"] == ["base:b.sls"]
    assert report["removed"] == ["base:old"]
    assert "'prod' is not configured on the peer" in report["errors"][0]
    assert {(o["op"], o["rel"]) for o in ops} == {("write", "b.sls"), ("remove", "old")}


def test_plan_master_config_only_when_different():
    assert replicate.plan_master_config({"peer": {}}, {"peer": {}}) == ([], replicate.empty_report())
    ops, report = replicate.plan_master_config({"nodegroups": {"g": "L@a"}}, {"nodegroups": {}})
    assert ops == [{"op": "write", "values": {"nodegroups": {"g": "L@a"}}}]
    assert report["added"] == ["nodegroups"]


def test_assign_chunks_keys_first_then_balanced_files():
    keys = [("minion_keys", {"state": "minions", "id": f"m{i}"}) for i in range(3000)]
    files = [("file_roots", {"env": "base", "rel": f"f{i}", "size": 10_000}) for i in range(900)]
    pillar = [("pillar_roots", {"env": "base", "rel": "p.sls", "size": 100})]
    chunks = replicate.assign_chunks(keys + files + pillar, max_bytes=4_000_000, max_items=10_000)
    # the keys alone first (3000 x 1 KiB), then 9 MB of files in 3 chunks of 3 MB
    assert [len(c) for c in chunks] == [3000, 300, 300, 301]
    sizes = [0] * 4
    for _, op in keys + files + pillar:
        sizes[op["pull"]] += op.get("size") or replicate.KEY_WEIGHT
    assert max(sizes[1:]) - min(sizes[1:]) <= 10_100
    # in apply order, each item in the chunk its operation names
    flat = [name for chunk in chunks for name in chunk]
    assert flat == [protocol.item_name(cat, op) for cat, op in keys + files + pillar]
    assert all(protocol.item_name(c, o) in chunks[o["pull"]] for c, o in keys + files + pillar)
    # the item cap holds too, and nothing pulled is no chunk
    many = [("minion_keys", {"state": "minions", "id": f"k{i}"}) for i in range(25)]
    assert [len(c) for c in replicate.assign_chunks(many, max_items=10)] == [8, 8, 9]
    assert replicate.assign_chunks([]) == []


def test_tree_manifest_ignores_and_confines_symlinks(tmp_path):
    root = tmp_path / "root"
    (root / ".git").mkdir(parents=True)
    (root / ".git" / "config").write_text("x")
    (root / "a.sls").write_text("a")
    (root / "a.sls.swp").write_text("s")
    (root / "link.sls").symlink_to("a.sls")
    (tmp_path / "outside").write_text("secret")
    (root / "escape").symlink_to(tmp_path / "outside")
    cache = manifest.HashCache(str(tmp_path / "cache.json"))
    errors = []
    man = manifest.tree_manifest([str(root)], manifest.Ignore([r"/\.git($|/)"], ["*.swp"]), cache, errors=errors)
    assert sorted(man) == ["a.sls", "link.sls"]
    assert man["a.sls"][2] == man["link.sls"][2]
    assert any("escape" in e for e in errors)
    assert cache.hashed == 1  # the symlink shares its target's hash entry
    cache.save()
    again = manifest.HashCache(str(tmp_path / "cache.json"))
    assert manifest.tree_manifest([str(root)], manifest.Ignore([r"/\.git($|/)"], ["*.swp"]), again) == man
    assert again.hashed == 0  # unchanged files are statted, never re-hashed


def test_tree_manifest_follows_inner_dir_symlinks_once_and_globs_in_subdirs(tmp_path):
    root = tmp_path / "root"
    (root / "sub" / "deep").mkdir(parents=True)
    (root / "sub" / "deep" / "x.sls").write_text("x")
    (root / "sub" / "deep" / "x.sls.swp").write_text("s")
    (root / "sub" / "loop").symlink_to("..")  # a loop inside the root
    (root / "alias").symlink_to("sub/deep")  # served twice, as Salt does
    (tmp_path / "away").mkdir()
    (root / "out").symlink_to(tmp_path / "away")
    errors = []
    man = manifest.tree_manifest([str(root)], manifest.Ignore(None, ["*.swp"]),
                                 manifest.HashCache(), errors=errors)
    assert sorted(man) == ["alias/x.sls", "sub/deep/x.sls"]
    assert [e.split(": ", 1)[1] for e in errors] == [
        "out: symlinked directory leads outside the root, not replicated"]


def test_keys_manifest_skips_bad_ids_and_non_pem(tmp_path):
    pki = tmp_path / "pki"
    (pki / "minions").mkdir(parents=True)
    pub = gen_keypair(1024)[1]
    (pki / "minions" / "good").write_bytes(pub)
    (pki / "minions" / "junk").write_text("not a key")
    man, errors = _listed(pki, tmp_path)
    assert list(man["minions"]) == ["good"]
    assert man["minions"]["good"] == manifest.key_sha(pub + b"\n\n")
    assert any("junk" in e and "PEM" in e for e in errors)


def _listed(pki, tmp_path):
    """Every key of ``pki`` listed afresh: ``(manifest, errors)``."""
    snap = manifest.KeysSnapshot(str(pki), str(tmp_path / "fresh"), rescan=True)
    return snap.manifest, snap.errors


def _age(pki, seconds=10):
    """Make the key dirs look last changed ``seconds`` ago."""
    for d in pki.iterdir():
        st = d.stat()
        os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns - seconds * 10**9))


def test_keys_snapshot_reused_while_no_key_dir_changed(tmp_path):
    pki, state = tmp_path / "pki", tmp_path / "state"
    for d in ("minions", "minions_pre"):
        (pki / d).mkdir(parents=True)
    state.mkdir()
    pub, other = gen_keypair(1024)[1], gen_keypair(1024)[1]
    (pki / "minions" / "web1").write_bytes(pub)
    _age(pki)
    first = manifest.KeysSnapshot(str(pki), str(state))
    assert not first.reused and first.hashed == 1
    listed, errors = _listed(pki, tmp_path)
    assert first.manifest == listed and first.errors == errors
    assert first.digest == digest_of_keys(listed)
    assert first.counts == {s: len(listed[s]) for s in manifest.KEY_DIRS}
    # nothing changed: nothing is listed, the manifest is read back only on demand
    again = manifest.KeysSnapshot(str(pki), str(state))
    assert again.reused and again.hashed == 0
    assert (again.digest, again.counts, again.errors) == (first.digest, first.counts, errors)
    assert again.buckets_read == 0 and again.manifest == listed
    # Salt accepting a key: a rename into minions/ changes the dir
    (pki / "minions_pre" / "web2").write_bytes(other)
    os.rename(pki / "minions_pre" / "web2", pki / "minions" / "web2")
    moved = manifest.KeysSnapshot(str(pki), str(state))
    assert not moved.reused and sorted(moved.manifest["minions"]) == ["web1", "web2"]
    assert moved.hashed == 1  # web2; web1 only statted
    assert moved.errors == errors
    assert moved.digest != first.digest
    # listed a moment after that change, once the filesystem's clock had
    # passed it: trusted next time
    assert manifest.KeysSnapshot(str(pki), str(state)).reused
    _age(pki)
    assert not manifest.KeysSnapshot(str(pki), str(state)).reused  # the dirs' stamps moved
    assert manifest.KeysSnapshot(str(pki), str(state)).reused
    rescanned = manifest.KeysSnapshot(str(pki), str(state), rescan=True)
    assert not rescanned.reused and rescanned.hashed == 0  # every key statted, none read


def test_a_denied_key_rewritten_in_place_is_seen_at_the_next_snapshot(tmp_path):
    """
    Salt 3006 and 3007 write a denied key over ``minions_denied/<id>`` in
    place (``fopen(pubfn_denied, "w+")``) when the same id comes back with
    yet another key: the dir's mtime stays.  That dir's keys are statted at
    every snapshot; the others are still taken from it.
    """
    pki, state = tmp_path / "pki", tmp_path / "state"
    for d in ("minions", "minions_denied"):
        (pki / d).mkdir(parents=True)
    (pki / "minions" / "web1").write_bytes(gen_keypair(1024)[1])
    denied = pki / "minions_denied" / "web1"
    denied.write_bytes(gen_keypair(1024)[1])
    _age(pki)
    first = manifest.KeysSnapshot(str(pki), str(state))
    assert manifest.KeysSnapshot(str(pki), str(state)).reused
    dir_stamp = (pki / "minions_denied").stat().st_mtime_ns
    with open(denied, "r+b") as fh:  # as Salt's "w+": same inode, same dir
        fh.truncate(0)
        fh.write(gen_keypair(1024)[1])
    assert (pki / "minions_denied").stat().st_mtime_ns == dir_stamp
    again = manifest.KeysSnapshot(str(pki), str(state))
    assert not again.reused and again.hashed == 1  # only the denied key read again
    assert again.manifest == _listed(pki, tmp_path)[0]
    assert again.digest != first.digest
    assert again.manifest["minions"] == first.manifest["minions"]
    assert manifest.KeysSnapshot(str(pki), str(state)).reused


def test_a_key_dir_holding_a_damaged_key_is_listed_every_time(tmp_path):
    """
    A key that cannot be used (not a PEM key, unreadable) is reported and
    never read as deleted; repaired in place (the dir's mtime unchanged, as
    an editor or ``cp`` over it does), it is found by the next listing: its
    dir is not taken from the snapshot while it holds one.  The other dirs
    still are.
    """
    pki, state = tmp_path / "pki", tmp_path / "state"
    for d in ("minions", "minions_pre"):
        (pki / d).mkdir(parents=True)
    pub = gen_keypair(1024)[1]
    (pki / "minions_pre" / "web1").write_bytes(pub)
    junk = pki / "minions" / "junk"
    junk.write_text("not a key")
    _age(pki)
    first = manifest.KeysSnapshot(str(pki), str(state))
    assert any("junk" in e and "PEM" in e for e in first.errors)
    assert first.damaged == {"minions": ["junk"]}
    again = manifest.KeysSnapshot(str(pki), str(state))
    assert not again.reused and again.errors == first.errors
    assert again.meta["dirs"] == first.meta["dirs"]
    stamp = (pki / "minions").stat().st_mtime_ns
    with open(junk, "r+b") as fh:  # repaired in place
        fh.truncate(0)
        fh.write(pub)
    assert (pki / "minions").stat().st_mtime_ns == stamp
    repaired = manifest.KeysSnapshot(str(pki), str(state))
    assert repaired.errors == [] and repaired.damaged == {}
    assert repaired.manifest["minions"] == {"junk": manifest.key_sha(pub)}
    assert manifest.KeysSnapshot(str(pki), str(state)).reused


def _future(path, seconds):
    """Give ``path`` an mtime ``seconds`` ahead of the filesystem's clock."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + seconds * 10**9))


def test_a_key_dir_changed_in_the_listing_s_clock_tick_is_listed_again(tmp_path):
    """
    Two changes of a key dir within one tick of the filesystem's clock can
    leave its mtime as it was (racy, as in git): a dir is trusted only when
    its mtime is older than the filesystem's clock at the listing.  The
    listing waits up to FS_CLOCK_WAIT for the clock to pass a dir changed in
    the current tick; past that (a filesystem with coarse timestamps; here a
    dir whose mtime is ahead of the clock) it is listed again next time.
    """
    pki, state = tmp_path / "pki", tmp_path / "state"
    (pki / "minions").mkdir(parents=True)
    (pki / "minions" / "web1").write_bytes(gen_keypair(1024)[1])
    _future(pki / "minions", 5)
    first = manifest.KeysSnapshot(str(pki), str(state))
    assert not first.reused
    assert first.meta["clock"][1] <= first.meta["dirs"]["minions"][2]  # the wait gave up
    assert not manifest.KeysSnapshot(str(pki), str(state)).reused
    # the same dir once the clock is past it
    _age(pki, 10)
    manifest.KeysSnapshot(str(pki), str(state))
    assert manifest.KeysSnapshot(str(pki), str(state)).reused


def test_without_the_filesystem_s_clock_a_key_dir_settles_for_two_seconds(tmp_path, monkeypatch):
    """
    When the state dir's filesystem clock is unknown (it cannot be touched,
    or the state dir is on another filesystem than the keys), a key dir
    changed less than RACY_NS before the listing by the wall clock is listed
    again next time.
    """
    pki, state = tmp_path / "pki", tmp_path / "state"
    (pki / "minions").mkdir(parents=True)
    (pki / "minions" / "web1").write_bytes(gen_keypair(1024)[1])
    monkeypatch.setattr(manifest, "_fs_clock", lambda state_dir, stamps=(): None)
    manifest.KeysSnapshot(str(pki), str(state))
    assert not manifest.KeysSnapshot(str(pki), str(state)).reused
    _age(pki, 10)
    manifest.KeysSnapshot(str(pki), str(state))
    assert manifest.KeysSnapshot(str(pki), str(state)).reused
    # a clock of another filesystem (st_dev) is not used either
    monkeypatch.setattr(manifest, "_fs_clock", lambda state_dir, stamps=(): [-1, 2**62])
    os.utime(pki / "minions")
    manifest.KeysSnapshot(str(pki), str(state))
    assert not manifest.KeysSnapshot(str(pki), str(state)).reused


def test_what_was_remembered_of_the_keys_holds_while_they_are_the_same(tmp_path):
    """
    The peer's history record is stamped in the key snapshot
    (``history_recorded``): listing the keys again because they changed a
    moment before the last listing keeps it; a real change drops it (else
    every sync after a key change would cost the primary one more publish,
    to record a history that was recorded).
    """
    pki, state = tmp_path / "pki", tmp_path / "state"
    (pki / "minions").mkdir(parents=True)
    state.mkdir()
    (pki / "minions" / "web1").write_bytes(gen_keypair(1024)[1])
    snap = manifest.KeysSnapshot(str(pki), str(state))
    snap.remember(history=[1, 2, 3])
    os.utime(pki / "minions")  # changed, the same keys: listed again
    again = manifest.KeysSnapshot(str(pki), str(state))
    assert not again.reused and again.meta["history"] == [1, 2, 3]
    (pki / "minions" / "web2").write_bytes(gen_keypair(1024)[1])
    changed = manifest.KeysSnapshot(str(pki), str(state))
    assert changed.digest != snap.digest and "history" not in changed.meta


def test_keys_snapshot_with_a_damaged_bucket_lists_again(tmp_path):
    pki, state = tmp_path / "pki", tmp_path / "state"
    (pki / "minions").mkdir(parents=True)
    state.mkdir()
    (pki / "minions" / "web1").write_bytes(gen_keypair(1024)[1])
    _age(pki)
    first = manifest.KeysSnapshot(str(pki), str(state))
    bucket = state / manifest.KEYS_SNAPSHOT_BUCKETS / f"{manifest.bucket_of('web1')}.json"
    sha = first.manifest["minions"]["web1"]
    # malformed, of the wrong shape, another key's hash (altered or stale),
    # torn, lost: the bucket is never used, the keys are listed again
    for damage in ('{"minions": {}}', '{"bucket": {"minions": {"web1": 5}}}',
                   json.dumps({"bucket": {"minions": {"web1": [1, 2, 3, "0" * 64]}}}),
                   json.dumps({"bucket": {"minions": {"web1": [1, 2, 3, sha]},
                                          "minions_pre": {"web1": [1, 2, 3, sha]}}}),
                   "", None):
        if damage is None:
            bucket.unlink()
        else:
            bucket.write_text(damage)
        again = manifest.KeysSnapshot(str(pki), str(state))
        assert again.reused and again.buckets_read == 0
        assert again.manifest == first.manifest and list(again.manifest["minions"]) == ["web1"]
        assert again.digest == first.digest
        assert json.loads(bucket.read_text())["bucket"]["minions"]["web1"][3] == sha  # saved again
    (state / "keys-snapshot.json").write_text('{"pki_dir": "%s", "errors": {}}' % pki)
    damaged = manifest.KeysSnapshot(str(pki), str(state))
    assert not damaged.reused and damaged.manifest == first.manifest


def test_keys_snapshot_names_exactly_its_buckets_files_after_a_lost_dir(tmp_path):
    """
    The bucket files lost while a key whose bucket it emptied is deleted:
    the next snapshot names a file for each bucket of its digests and no
    other, so the one after keeps its previous state (a change sync in
    one round trip) instead of listing everything again and again.
    """
    import shutil

    pki, state = tmp_path / "pki", tmp_path / "state"
    (pki / "minions").mkdir(parents=True)
    pub = gen_keypair(1024)[1]
    for i in range(10):
        (pki / "minions" / f"m{i}").write_bytes(pub)
    _age(pki)
    manifest.KeysSnapshot(str(pki), str(state))
    shutil.rmtree(state / manifest.KEYS_SNAPSHOT_BUCKETS)
    (pki / "minions" / "m3").unlink()
    _age(pki)
    first = manifest.KeysSnapshot(str(pki), str(state))
    meta = json.loads((state / manifest.KEYS_SNAPSHOT).read_text())
    assert set(meta["buckets"]) == set(meta["digest"]) == set(first.digest)
    (pki / "minions" / "m4").unlink()
    _age(pki)
    again = manifest.KeysSnapshot(str(pki), str(state))
    assert again.previous_parts() is not None and again.previous_parts()[0] == first.digest
    # a snapshot naming a file for a bucket it has no digest of is not used
    meta["buckets"]["x"] = "0" * 64
    (state / manifest.KEYS_SNAPSHOT).write_text(json.dumps(meta))
    assert not manifest.KeysSnapshot(str(pki), str(state)).reused


def test_keys_state_is_the_listing_of_chosen_ids(tmp_path):
    pki = tmp_path / "pki"
    for state in ("minions", "minions_pre", "minions_denied"):
        (pki / state).mkdir(parents=True)
    pub, other = gen_keypair(1024)[1], gen_keypair(1024)[1]
    (pki / "minions" / "web1").write_bytes(pub)
    (pki / "minions_denied" / "web1").write_bytes(other)
    (pki / "minions_pre" / "web2").write_bytes(other)
    (pki / "minions" / "junk").write_text("not a key")
    errors = []
    man, _ = _listed(pki, tmp_path)
    chosen = manifest.keys_state(str(pki), ["web1", "absent", "junk", "../x"], errors=errors)
    assert chosen == {s: {m: v for m, v in man[s].items() if m == "web1"}
                      for s in manifest.KEY_DIRS}
    assert chosen["minions_denied"] == {"web1": manifest.key_sha(other)}
    assert [e.split(":")[0] for e in errors] == ["minions/junk", "'../x'"]


def test_seal_roundtrip_and_binding():
    priv, pub = gen_keypair(2048)
    blob = seal.seal(pub, b"master.pem bytes", "peer1", "master_keys/master.pem")
    assert b"master.pem bytes" not in blob.encode()
    assert seal.unseal(priv, blob, "peer1", "master_keys/master.pem") == b"master.pem bytes"
    with pytest.raises(seal.SealError):
        seal.unseal(priv, blob, "peer2", "master_keys/master.pem")
    with pytest.raises(seal.SealError):
        seal.unseal(gen_keypair(2048)[0], blob, "peer1", "master_keys/master.pem")
    raw = seal.seal(pub, b"bulk", "peer1", "pull/t", binary=True)
    assert isinstance(raw, bytes) and b"bulk" not in raw
    assert seal.unseal(priv, raw, "peer1", "pull/t") == b"bulk"
    # as Salt's msgpack layer may hand it back: str when valid UTF-8
    as_text = raw.decode("utf-8", "surrogateescape")
    assert seal.unseal(priv, as_text, "peer1", "pull/t") == b"bulk"
    with pytest.raises(seal.SealError):
        seal.unseal(priv, raw, "peer1", "pull/other")
    # a bulk reply altered or cut short on the way is refused, not half read
    tampered = raw[:-1] + bytes([raw[-1] ^ 1])
    for bad in (tampered, raw[:len(seal.BINARY_MAGIC) + 100], raw[:-20]):
        with pytest.raises(seal.SealError):
            seal.unseal(priv, bad, "peer1", "pull/t")


def test_unseal_loads_the_private_key_once_per_process():
    """An apply opens one blob per sealed item: the key is parsed once."""
    priv, pub = gen_keypair(2048)
    blobs = [seal.seal(pub, f"item {i}".encode(), "peer1", f"p/{i}") for i in range(5)]
    seal._private_key.cache_clear()
    assert [seal.unseal(priv, b, "peer1", f"p/{i}") for i, b in enumerate(blobs)] == [
        f"item {i}".encode() for i in range(5)]
    info = seal._private_key.cache_info()
    assert (info.misses, info.hits) == (1, 4)
    # a key that is no key is still refused, and not cached
    with pytest.raises(seal.SealError):
        seal.unseal(b"not a key", blobs[0], "peer1", "p/0")
    assert seal._private_key.cache_info().currsize == 1


def test_atomic_write_modes_and_safe_join(tmp_path):
    path = tmp_path / "k.pem"
    path.symlink_to(tmp_path / "elsewhere")
    fsutil.atomic_write(str(path), b"data", mode=0o400)
    assert not path.is_symlink() and path.read_bytes() == b"data"
    assert stat.S_IMODE(path.stat().st_mode) == 0o400
    assert not (tmp_path / "elsewhere").exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".mm-")] == []
    for bad in ("../x", "/etc/passwd", "a/../../x", ""):
        with pytest.raises(fsutil.PathError):
            fsutil.safe_join(str(tmp_path), bad)
    (tmp_path / "out").symlink_to("/tmp")
    with pytest.raises(fsutil.PathError):
        fsutil.safe_join(str(tmp_path), "out/x")


def test_a_cache_is_written_atomically_without_disk_flushes(tmp_path, monkeypatch):
    """
    ``durable=False`` (the hash caches, the key snapshot, the saved roots
    manifests, what a peer was last confirmed to hold): the same rename into
    place, no fsync; everything else is flushed, file and directory.
    """
    flushed = []
    monkeypatch.setattr(fsutil.os, "fsync", lambda fd: flushed.append(os.fstat(fd).st_mode))
    fsutil.atomic_write(str(tmp_path / "cache.json"), "{}", mode=0o600, durable=False)
    assert flushed == [] and (tmp_path / "cache.json").read_text() == "{}"
    assert stat.S_IMODE((tmp_path / "cache.json").stat().st_mode) == 0o600
    fsutil.atomic_write(str(tmp_path / "record.json"), "{}", mode=0o600)
    assert [stat.S_ISREG(m) for m in flushed] == [True, False]  # the file, then its dir
    assert [p for p in os.listdir(tmp_path) if p.startswith(".mm-")] == []
    # what is written so is a cache its readers rebuild when it is unreadable
    state = tmp_path / "state"
    pki = tmp_path / "pki"
    (pki / "minions").mkdir(parents=True)
    (pki / "minions" / "web1").write_bytes(gen_keypair(1024)[1])
    first = manifest.KeysSnapshot(str(pki), str(state))
    (state / manifest.KEYS_SNAPSHOT_BUCKETS / f"{manifest.bucket_of('web1')}.json").write_text(
        "")  # lost in a crash
    (state / manifest.KEYS_SNAPSHOT).write_text("")
    again = manifest.KeysSnapshot(str(pki), str(state))
    assert not again.reused and again.digest == first.digest
    assert again.manifest == first.manifest


def test_a_small_batch_flushes_its_files_a_large_one_syncs_once(tmp_path, monkeypatch):
    """
    ``sync`` flushes every filesystem of the host (a busy master's job
    cache, its logs): a batch of up to FSYNC_EACH_MAX files flushes each
    file instead; above that one ``sync`` beats a flush per file.
    """
    calls = []
    monkeypatch.setattr(fsutil.os, "sync", lambda: calls.append("sync"))
    monkeypatch.setattr(fsutil.os, "fsync", lambda fd: calls.append(
        "file" if stat.S_ISREG(os.fstat(fd).st_mode) else "dir"))
    for count, expected in ((2, ["file", "file", "dir"]),
                            (fsutil.FSYNC_EACH_MAX + 1, ["sync", "dir"])):
        calls.clear()
        dest = tmp_path / str(count)
        dest.mkdir()
        batch = fsutil.Batch()
        for i in range(count):
            batch.write(str(dest / f"f{i}"), b"data", 0o644)
        batch.commit()
        assert calls == expected
        assert sorted(os.listdir(dest)) == sorted(f"f{i}" for i in range(count))


def test_batch_commits_all_writes_then_removals(tmp_path):
    keep = tmp_path / "old"
    keep.write_text("old")
    gone = tmp_path / "gone"
    gone.write_text("x")
    batch = fsutil.Batch()
    batch.write(str(keep), b"new", mode=0o600)
    batch.write(str(tmp_path / "added"), b"added")
    batch.remove(str(gone))
    assert keep.read_text() == "old" and not (tmp_path / "added").exists() and gone.exists()
    # staged in one private directory beside the destinations, which the
    # manifests (and Salt's key listing: a dot entry) never read
    (stage,) = [p for p in tmp_path.iterdir() if p.name.startswith(".mm-stage-")]
    assert stat.S_IMODE(stage.stat().st_mode) == 0o700 and len(list(stage.iterdir())) == 2
    assert manifest.tree_manifest([str(tmp_path)], manifest.Ignore(), manifest.HashCache()) == {
        "gone": [1, 0o644, hashlib.sha256(b"x").hexdigest()],
        "old": [3, 0o644, hashlib.sha256(b"old").hexdigest()]}
    batch.commit()
    assert keep.read_text() == "new" and stat.S_IMODE(keep.stat().st_mode) == 0o600
    assert (tmp_path / "added").read_text() == "added" and not gone.exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".mm-")] == []


def test_batch_abort_leaves_destinations_alone(tmp_path):
    dest = tmp_path / "k"
    dest.write_text("before")
    batch = fsutil.Batch()
    batch.write(str(dest), b"after")
    batch.abort()
    assert dest.read_text() == "before"
    assert os.listdir(tmp_path) == ["k"]


def test_batch_failed_rename_removes_nothing(tmp_path):
    (tmp_path / "pre").mkdir()
    (tmp_path / "pre" / "m1").write_text("pub")
    (tmp_path / "acc").mkdir()
    (tmp_path / "acc" / "m1").mkdir()  # a directory where the key goes: the rename fails
    batch = fsutil.Batch()
    batch.write(str(tmp_path / "acc" / "m1"), b"pub")
    batch.remove(str(tmp_path / "pre" / "m1"))
    with pytest.raises(OSError):
        batch.commit()
    # the move did not happen by half: the key is still pending, nothing staged is left
    assert (tmp_path / "pre" / "m1").read_text() == "pub"
    assert os.listdir(tmp_path / "acc") == ["m1"] and (tmp_path / "acc" / "m1").is_dir()
    assert batch.staged == [] and batch.removals == []


def test_buckets_exchange_only_what_changed():
    base = {f"f{i}.sls": [1, 0o644, A] for i in range(200)}
    primary = {"base": dict(base, **{"f7.sls": [1, 0o644, B]})}
    peer = {"base": dict(base), "dev": {"x": [1, 0o644, C]}}
    pparts, tparts = manifest.split("file_roots", primary), manifest.split("file_roots", peer)
    diff = manifest.differing(manifest.bucket_digests(pparts), manifest.bucket_digests(tparts))
    assert 1 <= len(diff) <= 2  # f7's bucket, and dev/x's if it is another one
    ops, report = replicate.plan_tree(manifest.merge(pparts, diff), manifest.merge(tparts, diff),
                                      peer_envs=["base", "dev"], primary_envs=primary)
    assert report["updated"] == ["base:f7.sls"]
    assert report["removed"] == []  # dev is not served by the primary: left alone
    keys = {"minions": {f"m{i}": A for i in range(300)}}
    parts = manifest.split("minion_keys", keys)
    assert manifest.merge(parts, list(parts)) == keys
    assert 1 < len(parts) <= manifest.BUCKETS


def _reference_part_digest(part):
    """The digest as protocol 1 defines it, written the plain way."""
    h = hashlib.sha256()
    for outer in sorted(part):
        for name, value in sorted(part[outer].items()):
            fields = [outer, name] + (list(map(str, value)) if isinstance(value, list)
                                      else [str(value)])
            h.update("".join(f"{len(f)}:{f}" for f in fields).encode("utf-8", "surrogateescape"))
            h.update(b"\n")
    return h.hexdigest()


def test_bucket_digests_stay_those_of_protocol_1():
    """
    Primary and peers of different releases compare these digests: a faster
    computation must give the same bytes (keys with a sha, files with
    [size, mode, sha], names that are not ASCII or not UTF-8 at all).
    """
    keys = {"minions": {f"web{i}": hashlib.sha256(str(i).encode()).hexdigest()
                        for i in range(300)},
            "minions_pre": {"caf\u00e9": "ab" * 32, "bad\udcff": "cd" * 32},
            "minions_rejected": {}}
    roots = {"base": {f"dir{i % 7}/f{i}.sls": [i * 10, 0o644, "ef" * 32] for i in range(300)},
             "prod": {"\u00fcber.sls": [0, 0o600, "01" * 32]}}
    for cat, man in (("minion_keys", keys), ("file_roots", roots)):
        parts = manifest.split(cat, man)
        assert len(parts) > 40
        assert manifest.bucket_digests(parts) == {
            b: _reference_part_digest(p) for b, p in parts.items()}
        assert sum(len(e) for p in parts.values() for e in p.values()) == sum(
            len(e) for e in man.values())
    assert manifest.bucket_of("web1") == str(hashlib.sha1(b"web1").digest()[0] % 64)


def test_later_runs_each_write_once_in_order_and_logs_a_failure(tmp_path, caplog):
    later = fsutil.Later()
    done = []
    later.add(done.append, 1)
    later.add(fsutil.atomic_write, str(tmp_path / "missing-dir" / "f"), b"x")
    later.add(done.append, 2)
    assert done == []
    with caplog.at_level("WARNING"):
        later.run()
        later.run()
    assert done == [1, 2]
    warned = [r.getMessage() for r in caplog.records if "cache not saved" in r.getMessage()]
    assert len(warned) == 1, warned
    assert warned[0].startswith("multimaster: cache not saved ([Errno 2] No such file or "
                                f"directory: '{tmp_path}/missing-dir/")
    assert warned[0].endswith("), read again next time")
    fsutil.now_or_later(None, done.append, 3)
    assert done == [1, 2, 3]


def test_saved_roots_parts_write_and_read_the_changed_buckets_only(tmp_path, monkeypatch):
    """
    The roots manifest cut in buckets as the last read found it (the
    primary's previous state): a save writes the buckets whose digest
    changed, a bucket is read when looked up, and the previous parts stay
    the answer after a save (another peer planned later in the same sync).
    """
    man = {"base": {f"f{i}.sls": [i, 0o644, f"{i:064x}"] for i in range(200)}}
    roots = {"base": [str(tmp_path)]}
    first = manifest.RootsParts(str(tmp_path), "file_roots")
    assert first.previous() is None
    first.save(first.update(roots, man, None, None), None)
    parts = manifest.split("file_roots", man)
    assert first.raw == first.safe == manifest.bucket_digests(parts) and first.parts == parts
    written = []
    real = fsutil.atomic_write
    monkeypatch.setattr(fsutil, "atomic_write",
                        lambda path, *a, **k: written.append(os.path.basename(path))
                        or real(path, *a, **k))
    last = manifest.RootsParts(str(tmp_path), "file_roots")
    assert last.digest == first.safe
    now = {"base": dict(man["base"], **{"f7.sls": [8, 0o644, "f" * 64]})}
    now["base"].pop("f9.sls")
    changed = sorted({manifest.bucket_of("base/f7.sls"), manifest.bucket_of("base/f9.sls")})
    digest, previous = last.previous()
    assert sorted(last.update(roots, now, None, None)) == changed
    last.save(last.update(roots, now, None, None), None)
    assert sorted(written) == sorted([f"{b}.json" for b in changed] + ["roots-file_roots.json"])
    assert digest == first.safe and dict(previous()) == parts  # as when the save began
    again = manifest.RootsParts(str(tmp_path), "file_roots")
    new_parts = manifest.split("file_roots", now)
    assert again.digest == manifest.bucket_digests(new_parts)
    assert dict(again.previous()[1]()) == new_parts
    # a bucket's file lost or altered: that bucket is missing, never wrong
    bucket = changed[0]
    (tmp_path / "roots-file_roots.d" / f"{bucket}.json").write_text(
        json.dumps({"bucket": parts[bucket]}))
    damaged = manifest.RootsParts(str(tmp_path), "file_roots")
    assert bucket not in damaged.previous()[1]() and dict(damaged.previous()[1]()) == {
        b: p for b, p in new_parts.items() if b != bucket}
    # and it is written again by the next read, although its digest is the same
    assert bucket in damaged.update(roots, now, None, None)
    # the single file of an earlier release: no saved state
    (tmp_path / "roots-file_roots.json").write_text(json.dumps({"digest": digest, "manifest": man}))
    assert manifest.RootsParts(str(tmp_path), "file_roots").digest is None


def test_the_key_history_record_reads_only_the_buckets_not_recorded_at_their_digest(
        tmp_path, monkeypatch):
    """
    peer.record_history: every id of a bucket equal to the primary's is in
    the key history; a bucket recorded at its digest, untouched by an apply
    and with the history file unchanged since, is not read again.
    """
    from salt_multimaster import peer

    pki, state = tmp_path / "pki", str(tmp_path / "state")
    (pki / "minions").mkdir(parents=True)
    pub = gen_keypair(1024)[1]
    for i in range(40):
        (pki / "minions" / f"m{i}").write_bytes(pub)
    mopts = {"pki_dir": str(pki), "cachedir": str(tmp_path / "cache")}
    asked = []
    real = manifest.merge
    monkeypatch.setattr(manifest, "merge", lambda parts, buckets: asked.append(sorted(buckets))
                        or real(parts, buckets))

    def record():
        asked.clear()
        digest = manifest.KeysSnapshot(str(pki), state).digest  # the primary's, the same keys
        peer.record_history(mopts, state, digest)
        return asked[0] if asked else []

    every = sorted(manifest.KeysSnapshot(str(pki), state).digest)
    assert record() == every
    assert sorted(peer.read_history(state)) == sorted(f"m{i}" for i in range(40))
    assert record() == []  # all recorded
    new = next(f"n{i}" for i in range(1000) if manifest.bucket_of(f"n{i}") in every)
    (pki / "minions" / new).write_bytes(pub)
    assert record() == [manifest.bucket_of(new)] and new in peer.read_history(state)
    # an apply that removed m3 (so the history lost it) and then wrote it back
    # unchanged elsewhere: its bucket is read again
    peer.update_history(state, [{"op": "remove", "state": "minions", "id": "m3"}],
                        {"updated": [], "removed": ["minions/m3"]})
    assert "m3" not in peer.read_history(state)
    assert record() == [manifest.bucket_of("m3")] and "m3" in peer.read_history(state)
    # the history rewritten by anyone else: every bucket is checked again
    with open(peer.history_path(state), "w", encoding="utf-8") as fh:
        json.dump({"format": 1, "buckets": {}}, fh)  # not this release's format
    assert record() == every and len(peer.read_history(state)) == 41
