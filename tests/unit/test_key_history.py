"""
The key history of a peer (salt_multimaster.history): the ids it received from the
primary, in the ``history`` table of its state store, so that an apply of
one key reads and writes the ids of one bucket.
"""
import pathlib
import random
import sqlite3

import pytest

from salt_multimaster import history, manifest, store
from tests.support.history import received
from tests.support.store import DAMAGES, damage


def _apply(state, added=(), removed=()):
    """What an apply of these writes and removals leaves to update_history."""
    ops = [{"op": "write", "state": "minions", "id": mid} for mid in added]
    ops += [{"op": "remove", "state": "minions", "id": mid} for mid in removed]
    history.update_history(state, ops, {"updated": [f"minions/{m}" for m in added],
                                        "removed": [f"minions/{m}" for m in removed]})


def _rows(state):
    """``[(id, bucket)]`` of the history table, and the history's generation."""
    with sqlite3.connect(pathlib.Path(state) / store.NAME) as db:
        rows = db.execute("SELECT id, bucket FROM history ORDER BY id").fetchall()
        generation = db.execute("SELECT value FROM meta WHERE name = ?",
                                (history.HISTORY,)).fetchall()
    return rows, generation


def _spy(monkeypatch):
    """The buckets of the history read by bucket (``[bucket]``), and whether all of it was."""
    read = []
    real = store.select

    def select(state_dir, sql, args=()):
        if "FROM history" in sql:
            read.append(args[0] if args else "every")
        return real(state_dir, sql, args)

    monkeypatch.setattr(store, "select", select)
    return read


def test_an_apply_of_one_key_reads_and_writes_one_bucket_of_the_history(tmp_path, monkeypatch):
    state = str(tmp_path)
    _apply(state, added=[f"m{i}" for i in range(400)])
    assert received(state) == sorted(f"m{i}" for i in range(400))
    before, generation = _rows(state)
    read = _spy(monkeypatch)
    _apply(state, added=["new1"])
    bucket = manifest.bucket_of("new1")
    assert read == [bucket]
    after, generation_after = _rows(state)
    assert sorted(set(after) - set(before)) == [("new1", bucket)] and set(before) <= set(after)
    assert int(generation_after[0][0]) == int(generation[0][0]) + 1
    read.clear()
    _apply(state, removed=["m7"])
    assert read == [manifest.bucket_of("m7")]
    assert received(state) == sorted({f"m{i}" for i in range(400)} - {"m7"} | {"new1"})
    # the inventory's history of one bucket reads that bucket only
    read.clear()
    assert history.history_of(state, {bucket}) == sorted(  # pylint: disable=protected-access
        m for m in [f"m{i}" for i in range(400)] + ["new1"]
        if manifest.bucket_of(m) == bucket and m != "m7")
    assert read == [bucket]
    # an apply that changes no id of the history writes none of it
    rows, generation = _rows(state)
    _apply(state, added=["new1"])
    assert _rows(state) == (rows, generation)


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_store_reads_as_no_id_received_then_is_rebuilt(tmp_path, how):
    """Damaged: no id received (removals read as conflicts), never trusted; then rebuilt."""
    state = tmp_path
    _apply(str(state), added=[f"web{i}" for i in range(50)])
    damage(state, how, table="history")
    assert received(str(state)) == []
    _apply(str(state), added=["db1"])
    _apply(str(state), added=["db2"])
    assert received(str(state)) == ["db1", "db2"]


def test_the_history_equals_a_set_kept_alongside_over_random_applies(tmp_path):
    state, rng = str(tmp_path), random.Random(7)
    model = {f"k{i}" for i in range(120)}
    _apply(state, added=sorted(model))
    for _ in range(40):
        added = {f"k{rng.randrange(300)}" for _ in range(rng.randrange(6))}
        removed = {f"k{rng.randrange(300)}" for _ in range(rng.randrange(6))} - added
        _apply(state, added=sorted(added), removed=sorted(removed))
        model = (model | added) - removed
        assert received(state) == sorted(model)
    rows, _ = _rows(state)
    assert rows == sorted((m, manifest.bucket_of(m)) for m in model)
