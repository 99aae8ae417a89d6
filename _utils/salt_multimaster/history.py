"""
The key history of a peer: the minion ids it received from the primary
(the ``history`` table of the state store in the peer host minion's
``<cachedir>/multimaster``), so that a later removal on the primary reads
as a deletion, and a key found only on the peer as a conflict.
"""

import logging

from salt_multimaster import journal, keyscan, layout, manifest, replicate, store

log = logging.getLogger(__name__)

#: the meta entries of the key history (:class:`KeyHistory`): its generation
#: (one more at each change) and the buckets found recorded (:func:`record_history`)
HISTORY = "history"
RECORDED = "history_recorded"


class KeyHistory:
    """
    The ids this peer received from the primary (the ``history`` table of
    its state store, :mod:`salt_multimaster.store`): an apply that writes
    one key reads and writes the ids of its bucket, not the ids of every
    key.  Lost with a damaged store, it reads as no id received (a removal
    on the primary then reads as a conflict here, never as a deletion)
    until the history record finds the keys equal again.
    """

    def __init__(self, state_dir):
        self.state_dir = state_dir
        self.changed = {}
        self._ids = {}

    def ids(self, bucket):
        """The ids of ``bucket`` received (a set)."""
        if bucket in self.changed:
            return set(self.changed[bucket])
        if bucket not in self._ids:
            self._ids[bucket] = {mid for (mid,) in store.select(
                self.state_dir, "SELECT id FROM history WHERE bucket = ?", (bucket,))}
        return set(self._ids[bucket])

    def set_ids(self, bucket, ids):
        """Make ``ids`` the ids of ``bucket`` received (saved by :meth:`save`)."""
        if set(ids) != self.ids(bucket):
            self.changed[bucket] = set(ids)

    def save(self, recorded=None):
        """
        Write the changed buckets (the history's generation one more), and
        ``recorded`` (``{bucket: digest}``, :func:`record_history`) at the
        generation saved, in one flushed transaction.
        """
        if not self.changed and recorded is None:
            return
        changed = self.changed

        def write(found):
            generation = found.meta(HISTORY, 0)
            if changed:
                generation = (generation if isinstance(generation, int) else 0) + 1
                for bucket, ids in changed.items():
                    found.db.execute("DELETE FROM history WHERE bucket = ?", (bucket,))
                    found.db.executemany("INSERT OR REPLACE INTO history VALUES (?, ?)",
                                         [(mid, bucket) for mid in sorted(ids)])
                found.set_meta(HISTORY, generation)
            if recorded is not None:
                found.set_meta(RECORDED, {"generation": generation, "buckets": recorded})

        store.record(self.state_dir, write, "the ids received")
        self._ids.update(changed)
        self.changed = {}


def history_of(state_dir, buckets):
    """The ids of ``buckets`` received from the primary (a sorted list): their rows only."""
    if not buckets:
        return []
    history = KeyHistory(state_dir)
    return sorted(mid for bucket in buckets for mid in history.ids(bucket))


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
    recorded = _recorded(state_dir)
    added = {r.split("/", 1)[1] for r in report["updated"]}
    dropped = {r.split("/", 1)[1] for r in report["removed"]} - written
    history = KeyHistory(state_dir)
    for bucket in {manifest.bucket_of(mid) for mid in added | dropped}:
        ids = history.ids(bucket)
        history.set_ids(bucket, (ids | {m for m in added if manifest.bucket_of(m) == bucket})
                        - dropped)
    # the buckets of the ids this apply touched are recorded no more
    touched = {manifest.bucket_of(op["id"]) for op in ops}
    history.save({b: d for b, d in recorded.items() if b not in touched})


def _recorded(state_dir):
    """
    ``{bucket: digest}`` of the buckets every id of which, at that digest,
    is in the key history, as the last :func:`record_history` found them
    (valid at the history's generation it saved them with).
    """
    got = store.read(state_dir, lambda found: (found.meta(HISTORY), found.meta(RECORDED)))
    generation, data = got or (None, None)
    if not isinstance(data, dict) or data.get("generation", 0) != (generation or 0) \
            or not isinstance(data.get("buckets"), dict):
        return {}
    return data["buckets"]


def journal_client(mopts):
    """The change journal of this peer master (its engine's socket), for the reads of its state."""
    return journal.client(layout.state_dir(mopts))


def record_history(mopts, state_dir, primary_digest):
    """
    The explicit history step of an apply: every id of a bucket where this
    peer's keys equal the primary's (``primary_digest``: the primary's
    bucket digests) came from the primary.  Stamped in the key scan, so
    the inventory tells the primary whether it is recorded
    (``history_recorded``).  A bucket recorded at its digest before, and
    untouched by an apply since, is not read again.
    """
    snap = keyscan.KeysSnapshot(mopts["pki_dir"], state_dir, watch=journal_client(mopts))
    same = [b for b, digest in snap.digest.items() if primary_digest.get(b) == digest]
    recorded = {b: d for b, d in _recorded(state_dir).items() if snap.digest.get(b) == d}
    todo = [b for b in same if b not in recorded]
    if todo:
        held = {}
        for keys in manifest.merge(snap.parts, todo).values():
            for mid in keys:
                held.setdefault(manifest.bucket_of(mid), set()).add(mid)
        history = KeyHistory(state_dir)
        for bucket, ids in held.items():
            history.set_ids(bucket, history.ids(bucket) | ids)
        recorded.update({b: snap.digest[b] for b in todo})
        history.save(recorded)
    snap.remember(history=generation(state_dir))
