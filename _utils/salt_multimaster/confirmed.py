"""
What a peer last confirmed to hold with the primary: the base of a
three-way sync (the primary now, the peer now, the last state both held).

Kept on the peer, in its state store (:mod:`salt_multimaster.store`,
``<minion cachedir>/multimaster``), next to its key history, per
replicated category:

* ``minion_keys``, ``file_roots``, ``pillar_roots``: per bucket
  (:func:`manifest.bucket_of`), the bucket's part (``{state: {id: sha256}}``,
  ``{saltenv: {path: [size, mode, sha256]}}``) as the peer held it when it
  equalled the primary's, and its digest (``""``: recorded empty): the
  ``confirmed`` table;
* ``master_config``: the sha256 of each replicated option's value (the
  ``confirmed:master_config`` meta entry): no value, no secret.

Not a cache: every save is flushed, in one transaction.  A record lost
with a damaged store is none: the sync then plans its buckets as before
this record existed (the key history's conflicts), never as the peer's
change.

A bucket is recorded whole where the peer's bucket, after an apply, has the
primary's digest; an apply that leaves items of a recorded bucket as they
were (changed on the peer since: kept) records the items it wrote only.  A
no-op sync writes nothing; a change sync writes the buckets it changed.
"""

import json

from salt_multimaster import manifest, protocol
from salt_multimaster import store as state_store

ALL_BUCKETS = tuple(str(b) for b in range(manifest.BUCKETS))
#: the digest recorded for a bucket that held nothing
EMPTY = ""
#: the meta entry of the record of the replicated options
CONFIG = "confirmed:master_config"


def part_digest(part):
    """A bucket part's digest as the sync computes it; :data:`EMPTY` for an empty part."""
    part = {outer: inner for outer, inner in (part or {}).items() if inner}
    return manifest.bucket_digests({"": part})[""] if part else EMPTY


def value_sha(key, value):
    """The sha256 recorded for one replicated option's value."""
    return protocol.config_digest({key: value})


def _load(text):
    """A recorded part from its JSON; None when it is not one."""
    try:
        part = json.loads(text)
    except ValueError:
        return None
    valid = isinstance(part, dict) and all(isinstance(inner, dict) for inner in part.values())
    return part if valid else None


class Record:
    """
    The record of one bucketed category: ``digest`` (``{bucket: digest}``
    of the recorded buckets), :meth:`part` of one, :meth:`set` staged
    until :meth:`save`.
    """

    def __init__(self, state_dir, cat):
        self.state_dir, self.cat = state_dir, cat
        self.digest = dict(state_store.select(
            state_dir, "SELECT bucket, digest FROM confirmed WHERE cat = ?", (cat,)))
        self.changed = {}

    def part(self, bucket):
        """The recorded part of ``bucket`` (``{}``: recorded empty); None: not recorded."""
        if bucket in self.changed:
            return self.changed[bucket]
        if bucket not in self.digest:
            return None
        rows = state_store.select(
            self.state_dir, "SELECT part FROM confirmed WHERE cat = ? AND bucket = ?",
            (self.cat, bucket))
        return _load(rows[0][0]) if rows else None

    def set(self, bucket, part):
        """
        Record ``part`` for ``bucket``; nothing written when it is recorded
        so already (and readable).
        """
        part = {outer: dict(inner) for outer, inner in part.items() if inner}
        if self.digest.get(bucket) != part_digest(part) or self.part(bucket) is None:
            self.changed[bucket] = part

    def save(self):
        """Write the changed buckets, in one flushed transaction (the record is spent)."""
        if not self.changed:
            return
        rows = [(self.cat, bucket, part_digest(part), json.dumps(part, sort_keys=True))
                for bucket, part in sorted(self.changed.items())]

        def write(found):
            found.db.executemany("INSERT OR REPLACE INTO confirmed VALUES (?, ?, ?, ?)", rows)

        state_store.record(self.state_dir, write, f"the {self.cat} confirmed")


def changed_items(current, base):
    """
    ``{outer: {name: base value, or None}}``: the items of a bucket whose
    value now (``current``) is not the recorded one (``base``); None: the
    item was not there.
    """
    ret = {}
    for outer in set(current) | set(base):
        now, was = current.get(outer) or {}, base.get(outer) or {}
        for name in set(now) | set(was):
            if now.get(name) != was.get(name):
                ret.setdefault(outer, {})[name] = was.get(name)
    return ret


def since(state_dir, cat, digest, detailed, part_of):
    """
    What the inventory says of the record of ``cat``: ``{"changed": items
    of the ``detailed`` buckets changed since their record
    (:func:`changed_items`), "unknown": detailed buckets not recorded,
    "stale": the other buckets whose record is not what the peer holds
    now}``.  ``digest``: the peer's bucket digests now; ``part_of(bucket)``
    its part of a detailed bucket.  Reads the files of the detailed
    recorded buckets only.
    """
    rec = Record(state_dir, cat)
    detailed = set(detailed)
    ret = {"changed": {}, "unknown": [], "stale": []}
    for bucket in sorted(detailed):
        base = rec.part(bucket)
        if base is None:
            ret["unknown"].append(bucket)
            continue
        for outer, items in changed_items(part_of(bucket), base).items():
            ret["changed"].setdefault(outer, {}).update(items)
    ret["stale"] = [b for b in ALL_BUCKETS
                    if b not in detailed and rec.digest.get(b) != digest.get(b, EMPTY)]
    return ret


def applied(cat, ops, failed):
    """
    ``{bucket: [(outer, name, value or None)]}`` of the operations of
    ``cat`` the apply carried out (``failed``: the names it reports failed).
    """
    ret = {}
    for op in ops:
        if cat == "minion_keys":
            outer, name, label = op["state"], op["id"], f"{op['state']}/{op['id']}"
            value = op.get("sha256")
            bucket = manifest.bucket_of(name)
        else:
            outer, name, label = op["env"], op["rel"], f"{op['env']}:{op['rel']}"
            value = [op.get("size"), op.get("mode"), op.get("sha256")]
            bucket = manifest.bucket_of(f"{outer}/{name}")
        if label in failed:
            continue
        ret.setdefault(bucket, []).append(
            (outer, name, value if op["op"] == "write" else None))
    return ret


def _taking(base, pairs, part):
    """``base`` whose items ``pairs`` (``(outer, name)``) are what ``part`` holds of them."""
    ret = {outer: dict(inner) for outer, inner in base.items()}
    for outer, name in pairs:
        value = (part.get(outer) or {}).get(name)
        if value is None:
            ret.get(outer, {}).pop(name, None)
        else:
            ret.setdefault(outer, {})[name] = value
    return {outer: inner for outer, inner in ret.items() if inner}


def record_apply(state_dir, cat, done, primary_digest, now_digest, now_parts):
    """
    Record what an apply of ``cat`` left in step with the primary.

    done
        :func:`applied` of the apply.
    primary_digest
        The primary's bucket digests (None: not given, only the items it
        wrote in recorded buckets are recorded).
    now_digest, now_parts
        The peer's bucket digests and parts (``{bucket: part}``) as a scan
        after the apply read them.

    A bucket the apply wrote, or whose record is not what the peer holds,
    is recorded whole when the peer's part has the primary's digest; else,
    if recorded, its record takes what the peer holds now of the items
    written (of a key, its id in every state: the apply's operations alone
    do not tell which states it left).
    """
    rec = Record(state_dir, cat)
    todo = set(done)
    if primary_digest is not None:
        todo |= {b for b in ALL_BUCKETS if rec.digest.get(b) != now_digest.get(b, EMPTY)}
    for bucket in sorted(todo):
        part = now_parts.get(bucket) or {}
        if primary_digest is not None and (
                now_digest.get(bucket, EMPTY) == primary_digest.get(bucket, EMPTY)):
            rec.set(bucket, part)
            continue
        base = rec.part(bucket)
        if base is None or not done.get(bucket):
            continue
        pairs = {(outer, name) for outer, name, _value in done[bucket]}
        if cat == "minion_keys":
            pairs = {(state, name) for _outer, name in pairs for state in manifest.KEY_DIRS}
        rec.set(bucket, _taking(base, pairs, part))
    rec.save()


# ---------------------------------------------------------------------------
# master_config: the sha256 of each replicated option's value
# ---------------------------------------------------------------------------
def config_record(state_dir):
    """``{option: sha256}`` recorded for the replicated options (``{}``: none)."""
    data = state_store.read(state_dir, lambda found: found.meta(CONFIG))
    return data if isinstance(data, dict) else {}


def forget_config(state_dir):
    """Forget what the peer confirmed of the replicated options (its drop-in was damaged)."""
    state_store.record(state_dir, lambda found: found.db.execute(
        "DELETE FROM meta WHERE name = ?", (CONFIG,)), "the options forgotten")


def record_config(state_dir, values, primary_shas):
    """
    Record the options whose value on the peer (``values``, after the
    apply) is the primary's (``primary_shas``: ``{option: sha256}``).
    """
    old = config_record(state_dir)
    new = dict(old)
    for key, sha in primary_shas.items():
        if key in values and value_sha(key, values[key]) == sha:
            new[key] = sha
    if new != old:
        state_store.record(state_dir, lambda found: found.set_meta(CONFIG, new),
                           "the options confirmed")
