"""Unit tests of the replication core: plans, manifests, sealing, safe writes."""

import hashlib
import os
import stat

import pytest

from salt_multimaster import (fsutil, history, keyscan, manifest, peer, protocol, replicate,
                              rootscan, seal)
from tests.support.cluster import gen_keypair
from tests.support.history import received

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
    ``durable=False`` (the hash caches, the saved roots manifests, what a
    peer was last confirmed to hold): the same rename into
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
        batch = fsutil.Batch(stage_root=str(tmp_path / "stage"))
        for i in range(count):
            batch.write(str(dest / f"f{i}"), b"data", 0o644)
        batch.commit()
        assert calls == expected
        assert sorted(os.listdir(dest)) == sorted(f"f{i}" for i in range(count))


def test_batch_commits_all_writes_then_removals(tmp_path):
    root, stage_root = tmp_path / "root", tmp_path / "stage"
    root.mkdir()
    keep = root / "old"
    keep.write_text("old")
    gone = root / "gone"
    gone.write_text("x")
    batch = fsutil.Batch(stage_root=str(stage_root))
    batch.write(str(keep), b"new", mode=0o600)
    batch.write(str(root / "added"), b"added")
    batch.remove(str(gone))
    assert keep.read_text() == "old" and not (root / "added").exists() and gone.exists()
    # staged in one private directory of the batch, outside the destinations,
    # which the manifests (and Salt's key listing) never read
    (stage,) = [p for p in stage_root.iterdir() if p.is_dir()]
    assert stat.S_IMODE(stage.stat().st_mode) == 0o700
    assert sum(len(files) for _, _, files in os.walk(stage)) == 2
    scan = rootscan.RootsScan({"file_roots": {"base": [str(root)]}}, "file_roots",
                              str(tmp_path / "state"))
    assert manifest.merge(scan.parts, scan.parts) == {"base": {
        "gone": [1, 0o644, hashlib.sha256(b"x").hexdigest()],
        "old": [3, 0o644, hashlib.sha256(b"old").hexdigest()]}}
    batch.commit()
    assert keep.read_text() == "new" and stat.S_IMODE(keep.stat().st_mode) == 0o600
    assert (root / "added").read_text() == "added" and not gone.exists()
    assert sorted(os.listdir(root)) == ["added", "old"] and os.listdir(stage_root) == []


def test_batch_abort_leaves_destinations_alone(tmp_path):
    dest = tmp_path / "k"
    dest.write_text("before")
    batch = fsutil.Batch(stage_root=str(tmp_path / "stage"))
    batch.write(str(dest), b"after")
    batch.abort()
    assert dest.read_text() == "before"
    assert os.listdir(tmp_path / "stage") == []
    assert sorted(os.listdir(tmp_path)) == ["k", "stage"]


def test_batch_failed_rename_removes_nothing(tmp_path):
    (tmp_path / "pre").mkdir()
    (tmp_path / "pre" / "m1").write_text("pub")
    (tmp_path / "acc").mkdir()
    (tmp_path / "acc" / "m1").mkdir()  # a directory where the key goes: the rename fails
    batch = fsutil.Batch(stage_root=str(tmp_path / "stage"))
    batch.write(str(tmp_path / "acc" / "m1"), b"pub")
    batch.remove(str(tmp_path / "pre" / "m1"))
    with pytest.raises(OSError):
        batch.commit()
    # the move did not happen by half: the key is still pending, nothing staged is left
    assert (tmp_path / "pre" / "m1").read_text() == "pub"
    assert os.listdir(tmp_path / "acc") == ["m1"] and (tmp_path / "acc" / "m1").is_dir()
    assert batch.staged == [] and batch.removals == [] and os.listdir(tmp_path / "stage") == []


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


def test_the_key_history_record_takes_the_ids_of_the_buckets_equal_to_the_primarys(
        tmp_path):
    """
    history.record_history: every id of a bucket equal to the primary's is in
    the key history, none of a bucket that differs; a record that finds
    nothing new writes nothing (the history's generation unchanged), and
    the key scan is stamped with the generation found (``history_recorded``).
    """
    pki, state = tmp_path / "pki", str(tmp_path / "state")
    (pki / "minions").mkdir(parents=True)
    pub = gen_keypair(1024)[1]
    for i in range(40):
        (pki / "minions" / f"m{i}").write_bytes(pub)
    mopts = {"pki_dir": str(pki), "cachedir": str(tmp_path / "cache")}

    def record(primary=None):
        digest = keyscan.KeysSnapshot(str(pki), state).digest  # the primary's, the same keys
        history.record_history(mopts, state, primary or digest)
        return history.generation(state)

    first = record()
    assert received(state) == sorted(f"m{i}" for i in range(40))
    assert record() == first  # nothing new: nothing written
    assert peer.keys_inventory(mopts, state, {})["history_recorded"] is True
    # a key the primary does not hold (its bucket differs): not received
    (pki / "minions" / "odd").write_bytes(pub)
    held = keyscan.KeysSnapshot(str(pki), state).digest
    primary = dict(held, **{manifest.bucket_of("odd"): "another digest"})
    assert record(primary) == first and "odd" not in received(state)
    # an apply that removed m3 (so the history lost it) and then wrote it
    # back unchanged elsewhere: the record finds it again
    history.update_history(state, [{"op": "remove", "state": "minions", "id": "m3"}],
                           {"updated": [], "removed": ["minions/m3"]})
    assert "m3" not in received(state)
    assert record() == first + 2 and "m3" in received(state) and "odd" in received(state)
