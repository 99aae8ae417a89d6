"""
The key history of a peer (peer.KeyHistory): the ids it received from the
primary, one file per bucket, so that an apply of one key reads and writes
one bucket of it.
"""
import json
import os
import random

from salt_multimaster import fsutil, manifest, peer


def _apply(state, added=(), removed=()):
    """What an apply of these writes and removals leaves to update_history."""
    ops = [{"op": "write", "state": "minions", "id": mid} for mid in added]
    ops += [{"op": "remove", "state": "minions", "id": mid} for mid in removed]
    peer.update_history(state, ops, {"updated": [f"minions/{m}" for m in added],
                                     "removed": [f"minions/{m}" for m in removed]})


def _spy(monkeypatch):
    """``(read, written)``: the history bucket files read, and every file written."""
    read, written = [], []
    real_get, real_write = manifest.BucketFiles.get, fsutil.atomic_write

    def get(self, bucket):
        if self.dir.endswith(peer.HISTORY_BUCKETS) and bucket not in self._read:
            read.append(bucket)
        return real_get(self, bucket)

    monkeypatch.setattr(manifest.BucketFiles, "get", get)
    monkeypatch.setattr(fsutil, "atomic_write",
                        lambda path, *a, **k: written.append(os.path.basename(path))
                        or real_write(path, *a, **k))
    return read, written


def test_an_apply_of_one_key_reads_and_writes_one_bucket_of_the_history(tmp_path, monkeypatch):
    state = str(tmp_path)
    _apply(state, added=[f"m{i}" for i in range(400)])
    assert peer.read_history(state) == sorted(f"m{i}" for i in range(400))
    read, written = _spy(monkeypatch)
    _apply(state, added=["new1"])
    bucket = manifest.bucket_of("new1")
    assert read == [bucket]
    assert sorted(written) == sorted([f"{bucket}.json", peer.HISTORY_NAME, peer.RECORDED_NAME])
    read.clear()
    written.clear()
    _apply(state, removed=["m7"])
    assert read == [manifest.bucket_of("m7")] and f"{manifest.bucket_of('m7')}.json" in written
    assert peer.read_history(state) == sorted({f"m{i}" for i in range(400)} - {"m7"} | {"new1"})
    # the inventory's history of one bucket reads that bucket only
    read.clear()
    assert peer._history_of(state, {bucket}) == sorted(  # pylint: disable=protected-access
        m for m in [f"m{i}" for i in range(400)] + ["new1"]
        if manifest.bucket_of(m) == bucket and m != "m7")
    assert read == [bucket]


def test_a_list_history_is_damaged_and_reads_as_no_id_received(tmp_path):
    """Not this release's format: no id received (removals read as conflicts), never trusted."""
    state = str(tmp_path)
    with open(peer.history_path(state), "w", encoding="utf-8") as fh:
        json.dump([f"web{i}" for i in range(50)], fh)
    assert peer.read_history(state) == []
    _apply(state, added=["db1"])
    assert manifest.read_json(peer.history_path(state))["format"] == peer.HISTORY_FORMAT
    assert peer.read_history(state) == ["db1"]


def test_a_damaged_history_bucket_reads_as_no_id_received_and_the_others_stay(tmp_path):
    state = str(tmp_path)
    ids = [f"web{i}" for i in range(200)]
    _apply(state, added=ids)
    victim = manifest.bucket_of("web1")
    path = os.path.join(state, peer.HISTORY_BUCKETS, f"{victim}.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"bucket": {"ids": ["web1", "intruder"]}}, fh)  # not the file named
    expect = sorted(m for m in ids if manifest.bucket_of(m) != victim)
    assert peer.read_history(state) == expect
    # another bucket's apply keeps the damaged one out, and names only what it wrote
    other = next(m for m in ids if manifest.bucket_of(m) != victim)
    _apply(state, removed=[other])
    assert peer.read_history(state) == [m for m in expect if m != other]
    # the damaged bucket's ids come back with the next apply that writes them
    _apply(state, added=["web1"])
    assert "web1" in peer.read_history(state) and "intruder" not in peer.read_history(state)


def test_the_history_equals_a_set_kept_alongside_over_random_applies(tmp_path):
    state, rng = str(tmp_path), random.Random(7)
    model = {f"k{i}" for i in range(120)}
    _apply(state, added=sorted(model))
    for _ in range(40):
        added = {f"k{rng.randrange(300)}" for _ in range(rng.randrange(6))}
        removed = {f"k{rng.randrange(300)}" for _ in range(rng.randrange(6))} - added
        _apply(state, added=sorted(added), removed=sorted(removed))
        model = (model | added) - removed
        assert peer.read_history(state) == sorted(model)
    every = {manifest.bucket_of(m) for m in model}
    assert sorted(os.listdir(os.path.join(state, peer.HISTORY_BUCKETS))) == sorted(
        f"{b}.json" for b in every)
