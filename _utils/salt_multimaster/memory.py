"""
What the primary remembers of each peer, without Salt's loader: what the
peer was last confirmed to hold (a meta entry of the primary's state
store, :mod:`salt_multimaster.store`), so that the common change sync is
one publish (:func:`expected_inventory`), and what targeted key syncs
left there since.  ``opts`` is the primary master's configuration.
"""

import logging

from salt_multimaster import keyscan, layout, manifest, outage, protocol, replicate
from salt_multimaster import store as state_store

log = logging.getLogger(__name__)

# Past this many ids a targeted key sync is a full minion_keys sync.
MAX_TARGETED_IDS = 200
# Past this many ids set by targeted syncs since a peer's last full sync,
# its minion_keys are forgotten (a full sync remembers them afresh).
MAX_HELD_IDS = 2000


def _memory_name(peer):
    return f"peer:{peer}"


def _valid_memory(held):
    """Whether a peer's memory has the shape :func:`remember` saves."""
    return isinstance(held, dict) and all(
        cat in replicate.CATEGORIES and isinstance(entry, dict)
        and (cat not in protocol.BUCKETED or isinstance(entry.get("digest"), dict))
        for cat, entry in held.items())


def _memory(opts, peer):
    """What ``peer`` was last confirmed to hold, as saved: a dict, maybe empty."""
    # none, or damaged: nothing known, the peer is asked (a second round)
    held = state_store.read(layout.state_dir(opts),
                            lambda found: found.meta(_memory_name(peer)))
    return held if _valid_memory(held) else {}


def _save_memory(opts, peer, held):
    # a stale or lost record costs a second round: the apply is conditional on it
    state_store.record(layout.state_dir(opts),
                       lambda found: found.set_meta(_memory_name(peer), held),
                       f"what {peer} holds", durable=False)


def remembered(opts, peer, categories):
    """
    ``{category: inventory entry}`` the peer was last confirmed to hold, for
    every one of ``categories``; None when one is not known.
    """
    held = _memory(opts, peer)
    if not all(isinstance(held.get(c), dict) for c in categories):
        return None
    return {cat: held[cat] for cat in categories}


def forget(opts, peer, categories):
    """Forget what the peer holds of ``categories`` (changed by other means)."""
    remember(opts, peer, categories, None, None, {})


def remember(opts, peer, categories, primary, inv, ret):
    """
    After a sync of ``peer``: a category whose report is clean (nothing
    failed, left in conflict or unconfirmed, nothing damaged on the primary)
    is held by the peer as the primary holds it now; any other is forgotten.
    """
    held = _memory(opts, peer)
    for cat in categories:
        rep = ret.get(cat)
        entry = (primary or {}).get(cat) or {}
        clean = (isinstance(rep, dict) and not rep.get("errors") and not rep.get("conflicts")
                 and not rep.get("unconfirmed") and not rep.get(outage.PEER_CHANGED)
                 and ("digest" in entry or "manifest" in entry)
                 and not entry.get("damaged") and "ids" not in entry)
        if not clean:
            held.pop(cat, None)
        elif cat in protocol.BUCKETED:
            held[cat] = {"digest": entry["digest"]}
            envs = (inv.get(cat) or {}).get("envs")
            if envs is not None:
                held[cat]["envs"] = envs
        else:
            held[cat] = dict(entry["manifest"])
    _save_memory(opts, peer, held)


def expected_inventory(held):
    """
    The inventory of a peer holding ``held`` (:func:`remembered`) as it
    answers the digests of ``held``: digests only, nothing detailed.  Plan
    with it (the buckets the primary changed since are taken from its
    previous state, checked by :func:`salt_multimaster.sync.unplannable`).
    """
    inv = {}
    for cat, entry in held.items():
        if cat in protocol.BUCKETED:
            inv[cat] = {"digest": entry["digest"], "buckets": [], "manifest": {},
                        "history": [], "errors": []}
            if "envs" in entry:
                inv[cat]["envs"] = entry["envs"]
        else:
            inv[cat] = dict(entry)
    return inv


# ---------------------------------------------------------------------------
# A targeted key sync in one publish: what the peer holds of some ids
# ---------------------------------------------------------------------------
# The peer's remembered ``minion_keys`` are its bucket digests (``digest``),
# and ``ids``: what targeted syncs since its last full sync found or left
# there, ``{id: {"keys": {state: sha256}, "received": bool}}`` (received:
# in its key history).  A bucket of the primary's last key scan with
# those ids in place is what the peer holds there when its digest is the
# remembered one: exact, whichever scan it is.  Any other id it holds
# there it received from the primary (a full sync records them).
def snapshot_keys(opts, ids):
    """
    ``{bucket: {state: {id: sha256}}}`` of the buckets of ``ids`` in the
    primary's last key scan (read, no key dir listed); None without one.
    """
    return keyscan.saved_parts(layout.state_dir(opts), {manifest.bucket_of(mid) for mid in ids})


def _overlay(part, ids):
    """A bucket's keys with the keys of ``ids`` (remembered ``ids``) in place of theirs."""
    ret = {state: {mid: sha for mid, sha in keys.items() if mid not in ids}
           for state, keys in part.items()}
    for mid, held in ids.items():
        for state, sha in held["keys"].items():
            ret.setdefault(state, {})[mid] = sha
    return {state: keys for state, keys in ret.items() if keys}


def _in(bucket, ids):
    return {mid: held for mid, held in ids.items() if manifest.bucket_of(mid) == bucket}


def _bucket_digest(part):
    """A bucket's digest as the peer computes it; None for an empty bucket (no digest)."""
    return manifest.bucket_digests({"": part})[""] if part else None


def _keys_of(part, mid):
    return {state: keys[mid] for state, keys in part.items() if mid in keys}


def _valid_ids(known):
    return isinstance(known, dict) and all(
        isinstance(held, dict) and isinstance(held.get("keys"), dict)
        and isinstance(held.get("received"), bool) for held in known.values())


def targeted_held(opts, peer, ids, base):
    """
    What ``peer`` holds of the keys of ``ids``, known exactly from what it
    was last confirmed to hold and ``base`` (:func:`snapshot_keys`), else
    None (then ask it: two publishes).  ``{"keys": {id: {state: sha256}},
    "received": [held ids in its key history], ...}``; the rest is for
    :func:`remember_targeted`.
    """
    held = remembered(opts, peer, ["minion_keys"])
    if held is None or base is None:
        return None
    entry = held["minion_keys"]
    digest, known = entry.get("digest"), entry.get("ids", {})
    if not isinstance(digest, dict) or not _valid_ids(known):
        return None
    parts = {}
    for bucket in {manifest.bucket_of(mid) for mid in ids}:
        parts[bucket] = _overlay(base.get(bucket, {}), _in(bucket, known))
        if _bucket_digest(parts[bucket]) != digest.get(bucket):
            log.debug("multimaster: %s's keys of bucket %s not known", peer, bucket)
            return None
    keys = {mid: _keys_of(parts[manifest.bucket_of(mid)], mid) for mid in ids}
    received = [mid for mid in sorted(ids) if keys[mid]
                and (known[mid]["received"] if mid in known else True)]
    return {"keys": keys, "received": received, "digest": digest, "ids": known, "base": base}


def targeted_inventory(held):
    """The targeted inventory (``peer.targeted_inventory``) of a peer holding ``held``."""
    man = {}
    for mid, keys in held["keys"].items():
        for state, sha in keys.items():
            man.setdefault(state, {})[mid] = sha
    return {"minion_keys": {"manifest": man, "history": list(held["received"]), "errors": []}}


def _after(entry, rep, inv):
    """
    ``{id: {"keys", "received"}}`` of the targeted ids on a peer after a
    clean apply of ``rep`` to it, from its keys of them before (``inv``):
    the primary's keys; received as the peer's key history records it
    (``history.update_history``: a write adds the id, a removal alone drops it).
    """
    def ids(kinds):
        return {item.split("/", 1)[1] for kind in kinds for item in rep[kind]}

    written, removed = ids(("added", "updated")), ids(("removed",))
    before = set(inv["minion_keys"].get("history") or [])
    return {mid: {"keys": _keys_of(entry["manifest"], mid),
                  "received": mid in written or (mid in before and mid not in removed)}
            for mid in entry["ids"]}


def remember_targeted(opts, peer, held, primary, ret, inv):
    """
    After a targeted key sync of ``peer``.  ``held``: what the primary knew
    it held of the ids (:func:`targeted_held`, or None); ``inv``: the keys
    of the ids it was planned from, the expected ones or its own (None: a
    peer that refused the condition).  A clean report updates exactly the
    remembered digests of the ids' buckets (those ids hold the primary's
    keys now, the rest of each bucket is as it was); else ``minion_keys``
    is forgotten, and when ``held`` is None only if keys changed.
    """
    rep = ret.get("minion_keys")
    entry = primary["minion_keys"]
    if held is None:
        if isinstance(rep, dict) and any(rep.get(k) for k in ("added", "updated", "removed")):
            forget(opts, peer, ["minion_keys"])
        return
    clean = (inv is not None and ret.get("result") and isinstance(rep, dict)
             and not rep.get("errors") and not rep.get("conflicts") and not rep.get("unconfirmed")
             and not rep.get(outage.PEER_CHANGED)
             and not entry.get("damaged") and not primary.get("errors"))
    if not clean:
        forget(opts, peer, ["minion_keys"])
        return
    known = dict(held["ids"])
    known.update(_after(entry, rep, inv))
    digest = dict(held["digest"])
    for bucket in {manifest.bucket_of(mid) for mid in entry["ids"]}:
        base, mine = held["base"].get(bucket, {}), _in(bucket, known)
        part = _overlay(base, mine)
        if part:
            digest[bucket] = _bucket_digest(part)
        else:
            digest.pop(bucket, None)
        # as the last scan says (and received, if held): no need to remember
        for mid, now in mine.items():
            if _keys_of(base, mid) == now["keys"] and (now["received"] or not now["keys"]):
                del known[mid]
    if len(known) > MAX_HELD_IDS:
        forget(opts, peer, ["minion_keys"])
        return
    memory = _memory(opts, peer)
    memory["minion_keys"] = {"digest": digest, "ids": known} if known else {"digest": digest}
    _save_memory(opts, peer, memory)
