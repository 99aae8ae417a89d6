"""
The key history of a peer: the minion ids it received from the primary
(the ``history`` table of the state store in the peer host minion's
``<cachedir>/multimaster``), so that a later removal on the primary reads
as a deletion, and a key found only on the peer as a conflict.
"""

import logging

from salt_multimaster import journal, keyscan, layout, manifest, replicate, store

log = logging.getLogger(__name__)

#: the meta entry of the key history's generation (one more at each change)
HISTORY = "history"


def _ids(state_dir, bucket):
    """The ids of ``bucket`` received from the primary (a set): its rows only."""
    return {mid for (mid,) in store.select(
        state_dir, "SELECT id FROM history WHERE bucket = ?", (bucket,))}


def _save(state_dir, changed):
    """
    Make ``changed`` (``{bucket: ids}``) the ids of those buckets received,
    the history's generation one more, in one flushed transaction: an apply
    that writes one key reads and writes the ids of its bucket, not the ids
    of every key.  Lost with a damaged store, the history reads as no id
    received (a removal on the primary then reads as a conflict here, never
    as a deletion) until the history record finds the keys equal again.
    """
    def write(found):
        generation = found.meta(HISTORY, 0)
        for bucket, ids in changed.items():
            found.db.execute("DELETE FROM history WHERE bucket = ?", (bucket,))
            found.db.executemany("INSERT OR REPLACE INTO history VALUES (?, ?)",
                                 [(mid, bucket) for mid in sorted(ids)])
        found.set_meta(HISTORY, (generation if isinstance(generation, int) else 0) + 1)

    if changed:
        store.record(state_dir, write, "the ids received")


def history_of(state_dir, buckets):
    """The ids of ``buckets`` received from the primary (a sorted list): their rows only."""
    return sorted(mid for bucket in buckets for mid in _ids(state_dir, bucket))


def generation(state_dir):
    """The key history's generation (None: never saved)."""
    return store.read(state_dir, lambda found: found.meta(HISTORY))


def update_history(state_dir, ops, report):
    """
    Remember the ids received from the primary (``report``: what an apply
    of the ``minion_keys`` ``ops`` did), so that a later removal there reads
    as a deletion, and a key found only here as a conflict.  Reads and
    writes the buckets of those ids only.
    """
    written = {op["id"] for op in ops if op["op"] == replicate.WRITE}
    added = {r.split("/", 1)[1] for r in report["updated"]}
    dropped = {r.split("/", 1)[1] for r in report["removed"]} - written
    changed = {}
    for bucket in {manifest.bucket_of(mid) for mid in added | dropped}:
        ids = _ids(state_dir, bucket)
        now = (ids | {m for m in added if manifest.bucket_of(m) == bucket}) - dropped
        if now != ids:
            changed[bucket] = now
    _save(state_dir, changed)


def record_history(mopts, state_dir, primary_digest, snap=None):
    """
    The explicit history step of an apply: every id of a bucket where this
    peer's keys equal the primary's (``primary_digest``: the primary's
    bucket digests) came from the primary.  Stamped in the key scan
    (``snap``: the one just taken, else a new one), so the inventory tells
    the primary whether it is recorded (``history_recorded``).
    """
    snap = snap or keyscan.KeysSnapshot(mopts["pki_dir"], state_dir,
                                        watch=journal.client(layout.state_dir(mopts)))
    changed = {}
    for bucket, digest in snap.digest.items():
        if primary_digest.get(bucket) == digest:
            ids = {mid for keys in snap.parts.get(bucket, {}).values() for mid in keys}
            known = _ids(state_dir, bucket)
            if not ids <= known:
                changed[bucket] = known | ids
    _save(state_dir, changed)
    snap.remember(history=generation(state_dir))
