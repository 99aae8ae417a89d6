"""
The day the primary is down, on the primary's side: the three-way plan of
a sync (what a peer changed since it last confirmed the primary's state is
left in place and named, never reverted), the failback of a peer's changes
to the primary, and the primary's epoch (promote, fencing).

A sync plans each item from three states: the primary's now, the peer's
now, and the one the peer last confirmed (its record,
:mod:`salt_multimaster.confirmed`, which its inventory reports as the items
changed since, per bucket):

* the peer's item unchanged since its record (or no record: a peer never
  confirmed): planned as before, the primary's side applied;
* changed on the peer, the same as the primary's now: nothing to do;
* changed on the peer, the primary's unchanged since: ``peer_changed``,
  left in place;
* changed on both sides, and they differ: a conflict, left in place.

``multimaster.failback`` carries what the peer changed to the primary, with
the checks of a sync the other way (:func:`carry_ops`); ``force=True`` (or
failback's ``keep``) makes the peer take the primary's side.

Plain Python: no Salt dunders.
"""

from salt_multimaster import confirmed, fsutil, membership, protocol, replicate

#: what an operator did to a key, by the key dir it is in now
KEY_VERBS = {"minions": "accepted", "minions_pre": "made pending",
             "minions_rejected": "rejected", "minions_denied": "denied",
             "minions_autosign": "listed for autosign"}
PEER_CHANGED = "peer_changed"
CONFLICT = "conflict"
#: changed on the peer to what the primary holds now: nothing to apply, the
#: peer's record to write again
CONVERGED = "converged"
#: key dirs a peer's salt-master fills by itself: a minion signing in is
#: pending there, one signing in with another key denied.  A key that
#: appears there is no operator's change: planned as before.
AUTOMATIC = ("minions_pre", "minions_denied")


# ---------------------------------------------------------------------------
# Three-way planning
# ---------------------------------------------------------------------------
def _by_id(man, ids=None):
    """``{id: {state: sha256}}`` of a keys manifest (of ``ids`` only, when given)."""
    ret = {}
    for state, keys in man.items():
        for mid, sha in keys.items():
            if ids is None or mid in ids:
                ret.setdefault(mid, {})[state] = sha
    return ret


def _safe(value):
    """A roots entry as a peer in step holds it (the mode a sync writes)."""
    return None if value is None else [value[0], fsutil.safe_mode(value[1]), value[2]]


def _without(man, drop):
    """``man`` (``{outer: {name: value}}``) less the ``(outer, name)`` in ``drop``."""
    if not drop:
        return man
    ret = {}
    for outer, entries in man.items():
        kept = {name: value for name, value in entries.items() if (outer, name) not in drop}
        if kept:
            ret[outer] = kept
    return ret


def key_label(mid, peer, base):
    """How a report names the key item ``mid`` and what the peer did to it."""
    if not peer:
        state = sorted(base)[0]
        return f"{state}/{mid}", "deleted"
    state = sorted(peer)[0]
    verb = KEY_VERBS.get(state, "changed")
    if not base:
        return f"{state}/{mid}", verb
    if set(peer) != set(base):
        return f"{state}/{mid}", f"{verb} (was {sorted(base)[0]}/{mid})"
    return f"{state}/{mid}", "another key"


def _line(kind, label, what, where="the peer"):
    if kind == PEER_CHANGED:
        return f"{label}: {what} on {where} since its last sync (kept)"
    return (f"{label}: {what} on {where} and changed on the primary since the peer's last "
            "sync (kept; multimaster.failback takes the peer's side, force=True the primary's)")


def classify(cat, mine, theirs, record, forced=()):
    """
    The three-way part of a plan of ``cat`` (``minion_keys``,
    ``file_roots``, ``pillar_roots``).

    mine, theirs
        The primary's and the peer's manifests of the buckets compared
        (``{outer: {name: value}}``; the primary's roots modes as on the
        primary).
    record
        The inventory's record of ``cat`` (``{"changed": {outer: {name:
        value recorded, or None}}, ...}``: the items changed on the peer
        since it last confirmed them), or None (a peer that keeps none).
    forced
        Item names planned as before whatever the peer did (``force`` of
        those items only: failback's ``keep``), True for all
        (:func:`forced`).

    Returns ``(mine, theirs, found)``: the manifests without the items the
    peer changed since (left in place), and ``found``, one entry per such
    item ``{"cat", "name", "label", "kind", "what", "line", "peer", "base",
    "primary"}``
    (``kind``: ``peer_changed`` or ``conflict``; the values as in the
    manifests, None for an item absent).  Items changed on the peer to the
    primary's are dropped too (nothing to do) and found as ``converged``
    (``{"cat", "name", "kind"}`` only): not reported, the peer's record of
    them to write again (:func:`converged`).
    """
    changed = (record or {}).get("changed") or {}
    if not changed or forced is True:
        return mine, theirs, []
    found, drop = [], set()
    if cat == "minion_keys":
        ids = {mid for items in changed.values() for mid in items}
        now, prim = _by_id(theirs, ids), _by_id(mine, ids)
        for mid in sorted(ids):
            peer = now.get(mid, {})
            base = dict(peer)
            for state, items in changed.items():
                if mid in items:
                    if items[mid] is None:
                        base.pop(state, None)
                    else:
                        base[state] = items[mid]
            primary = prim.get(mid, {})
            if mid in forced or base == {state: sha for state, sha in peer.items()
                                         if state not in AUTOMATIC or state in base}:
                continue  # forced, or only signed in to the peer since: as before
            drop |= {(state, mid) for state in set(peer) | set(primary)}
            if peer == primary:
                found.append({"cat": cat, "name": mid, "kind": CONVERGED})
                continue
            label, what = key_label(mid, peer, base)
            kind = PEER_CHANGED if primary == base else CONFLICT
            found.append({"cat": cat, "name": mid, "label": label, "kind": kind, "what": what,
                          "line": _line(kind, label, what), "peer": peer or None,
                          "base": base or None, "primary": primary or None})
    else:
        for env, items in sorted(changed.items()):
            for rel, base in sorted(items.items()):
                name = f"{env}:{rel}"
                peer = (theirs.get(env) or {}).get(rel)
                primary = (mine.get(env) or {}).get(rel)
                if name in forced:
                    continue
                drop.add((env, rel))
                if peer == _safe(primary):
                    found.append({"cat": cat, "name": name, "kind": CONVERGED})
                    continue
                what = "removed" if peer is None else "added" if base is None else "edited"
                kind = PEER_CHANGED if _safe(primary) == base else CONFLICT
                found.append({"cat": cat, "name": name, "label": name, "kind": kind,
                              "what": what, "line": _line(kind, name, what), "peer": peer,
                              "base": base, "primary": primary})
    return _without(mine, drop), _without(theirs, drop), found


def classify_config(mine, theirs, record, forced=()):
    """
    :func:`classify` of ``master_config``: ``mine``/``theirs`` the option
    values, ``record`` the sha256 the peer last confirmed of each
    (``config_record`` of its inventory).  Returns ``(mine, found)``:
    the values to write (the peer's for the options it changed since: kept)
    and the items found, named by option.
    """
    found, values = [], dict(mine)
    if forced is True:
        return values, found
    for key in sorted(mine):
        base = (record or {}).get(key)
        peer_sha = confirmed.value_sha(key, theirs.get(key))
        if base is None or peer_sha == base or key in forced:
            continue
        values[key] = theirs.get(key)
        if theirs.get(key) == mine[key]:
            found.append({"cat": "master_config", "name": key, "kind": CONVERGED})
            continue
        kind = PEER_CHANGED if confirmed.value_sha(key, mine[key]) == base else CONFLICT
        found.append({"cat": "master_config", "name": key, "label": key, "kind": kind,
                      "what": "changed",
                      "line": _line(kind, key, "changed", f"the peer ({protocol.DROPIN_NAME})"),
                      "peer": None, "base": None, "primary": None})
    return values, found


def report(rep, found):
    """Add the items ``found`` by :func:`classify` to a category's report."""
    for item in found:
        if item["kind"] == CONFLICT:
            rep["conflicts"].append(item["line"])
        elif item["kind"] == PEER_CHANGED:
            rep.setdefault(PEER_CHANGED, []).append(item["line"])
    return rep


def left(found):
    """The items of ``found`` left in place: changed on the peer, or on both sides."""
    return [item for item in found if item["kind"] != CONVERGED]


def converged(found):
    """Whether an item of ``found`` reached the primary's state on the peer: its record to write."""
    return any(item["kind"] == CONVERGED for item in found)


def forced(force, cat):
    """
    The item names of ``cat`` planned as before whatever the peer did: a set
    (failback's ``keep``), or True for every item (``force=True``).
    """
    if isinstance(force, dict):
        return set(force.get(cat) or ())
    return True if force is True else set()


def plan_keys(mine, theirs, history, force, damaged=None):
    """
    :func:`replicate.plan_keys` where ``force`` may name ids
    (``{"minion_keys": ids}``, failback's ``keep``): those are planned
    with force, the others without.
    """
    if not isinstance(force, dict):
        return replicate.plan_keys(mine, theirs, history, force, damaged=damaged)
    ids = forced(force, "minion_keys")

    def part(man, inside):
        return {state: {mid: sha for mid, sha in keys.items() if (mid in ids) == inside}
                for state, keys in man.items()}

    ops, rep = replicate.plan_keys(part(mine, False), part(theirs, False), history, False,
                                   damaged=damaged)
    if ids:
        more, rep2 = replicate.plan_keys(part(mine, True), part(theirs, True), history, True,
                                         damaged=damaged)
        ops.extend(more)
        for kind, items in rep2.items():
            rep[kind] = sorted(rep[kind] + items)
        ops.sort(key=lambda op: op["op"] != replicate.WRITE)
    return ops, rep


def confirm_digests(primary, categories):
    """
    The ``confirm`` of an apply: the primary's digests of the roots it
    syncs, and the sha256 of each replicated option, from which the peer
    records what it holds in step (the keys' digests travel as
    ``keys_digest``).  None when there is nothing to confirm.
    """
    ret = {}
    for cat in ("file_roots", "pillar_roots"):
        if cat in categories and "digest" in (primary.get(cat) or {}):
            ret[cat] = primary[cat]["digest"]
    if "master_config" in categories and "manifest" in (primary.get("master_config") or {}):
        ret["master_config"] = {key: confirmed.value_sha(key, value) for key, value in
                                primary["master_config"]["manifest"].items()}
    return ret or None


def stale(inv, categories, primary):
    """
    Whether the peer (its inventory ``inv``) holds something as the
    primary does whose record is not written yet: an apply, even of
    nothing, records it.
    """
    if any(((inv.get(cat) or {}).get("record") or {}).get("stale")
           for cat in categories if cat in protocol.BUCKETED):
        return True
    record = inv.get("config_record")
    if "master_config" not in categories or not isinstance(record, dict):
        return False
    theirs = inv.get("master_config") or {}
    return any(theirs.get(key) == value and record.get(key) != confirmed.value_sha(key, value)
               for key, value in primary["master_config"]["manifest"].items())


# ---------------------------------------------------------------------------
# Failback: a peer's changes carried to the primary
# ---------------------------------------------------------------------------
class FailbackError(ValueError):
    """Bad input to failback; nothing was changed."""


def _names(item):
    """Every name ``keep=`` may give ``item`` by."""
    names = {item["name"], item["label"], f"{item['cat']}:{item['name']}", item["cat"]}
    if item["cat"] == "master_config":
        names.add(protocol.DROPIN_NAME)
    return names


def kept(found, keep):
    """
    The items of ``found`` whose primary side is kept (``keep``:
    ``primary`` for every item, or a list of names as ``failback test=True``
    shows them: a minion id or ``<state>/<id>``, ``<saltenv>:<path>``, an
    option, ``<category>:<name>`` or a whole category).  Raises
    :class:`FailbackError` for a name that matches no item (a category
    may have none).
    """
    entries = membership.as_list(keep)
    if entries == ["primary"]:
        return list(found)
    ret, unknown = [], []
    for entry in entries:
        hit = [item for item in found if entry in _names(item)]
        if not hit and entry not in replicate.CATEGORIES:
            # a typo would carry what was meant to be kept
            unknown.append(entry)
        ret.extend(item for item in hit if item not in ret)
    if unknown:
        raise FailbackError(f"keep: no item changed on the peer is named "
                            f"{', '.join(map(repr, unknown))} (see failback test=True)")
    return ret


def keep_force(items):
    """The ``force`` of a sync that takes the primary's side of ``items`` only."""
    ret = {}
    for item in items:
        ret.setdefault(item["cat"], set()).add(item["name"])
    return ret


def collect_items(items):
    """
    ``{item name: bytes}`` (:func:`protocol.item_name`; a key weighs
    :data:`replicate.KEY_WEIGHT`): what the peer sends for ``items``.
    """
    ret = {}
    for item in items:
        if item["cat"] == "minion_keys":
            ret.update((protocol.item_name("minion_keys", {"state": state, "id": item["name"]}),
                        replicate.KEY_WEIGHT) for state in sorted(item["peer"] or {}))
        elif item["peer"] is not None:
            env, rel = item["name"].split(":", 1)
            ret[protocol.item_name(item["cat"], {"env": env, "rel": rel})] = item["peer"][0]
    return ret


def batches(sizes, limit):
    """The names of ``sizes`` (``{name: bytes}``) cut in batches of at most ``limit`` bytes."""
    ret, current, size = [], [], 0
    for name, weight in sizes.items():
        if current and size + weight > limit:
            ret.append(current)
            current, size = [], 0
        current.append(name)
        size += weight
    if current:
        ret.append(current)
    return ret


def carry_ops(items, contents):
    """
    The operations making the primary hold the peer's side of ``items``
    (the failback's), their contents (``contents``: the peer's collect,
    ``{item name: {"sha256", "size", "mode", "sealed"}}``) sealed to the
    primary.  Checked by :func:`validate.ops` and applied by the peer's own
    applier, on the primary: the same confinement, modes and sha256 checks
    as a sync the other way.  Writes come before removals.
    """
    ops = {}
    for item in items:
        cat = item["cat"]
        if cat == "minion_keys":
            peer, primary = item["peer"] or {}, item["primary"] or {}
            for state, sha in sorted(peer.items()):
                if primary.get(state) == sha:
                    continue
                name = protocol.item_name(cat, {"state": state, "id": item["name"]})
                got = contents.get(name) or {}
                ops.setdefault(cat, []).append({"op": replicate.WRITE, "state": state,
                                                "id": item["name"], "sha256": sha,
                                                "sealed": got.get("sealed", "")})
            for state in sorted(set(primary) - set(peer)):
                ops.setdefault(cat, []).append({"op": replicate.REMOVE, "state": state,
                                                "id": item["name"]})
        else:
            env, rel = item["name"].split(":", 1)
            if item["peer"] is None:
                ops.setdefault(cat, []).append({"op": replicate.REMOVE, "env": env, "rel": rel})
                continue
            size, mode, sha = item["peer"]
            got = contents.get(protocol.item_name(cat, {"env": env, "rel": rel})) or {}
            ops.setdefault(cat, []).append({"op": replicate.WRITE, "env": env, "rel": rel,
                                            "mode": fsutil.safe_mode(mode), "sha256": sha,
                                            "size": size, "sealed": got.get("sealed", "")})
    for cat_ops in ops.values():
        cat_ops.sort(key=lambda op: op["op"] != replicate.WRITE)
    return ops


def revoked(ops, applied):
    """The ids a carried apply took out of ``minions/`` on the primary (``applied``: its report)."""
    failed = set((applied.get("minion_keys") or {}).get("failed") or ())
    return sorted({op["id"] for op in ops.get("minion_keys", [])
                   if op["op"] == replicate.REMOVE and op["state"] == "minions"
                   and f"minions/{op['id']}" not in failed})


def config_remedy(peer, item):
    """What to do about an option changed on ``peer``, which failback does not carry."""
    return (f"{item['name']}: changed on {peer} ({protocol.DROPIN_NAME}), not carried: the "
            "primary's config files are yours; set it in the primary's config (as in "
            f"{peer}'s master.d/{protocol.DROPIN_NAME}), restart its salt-master and run "
            f"failback again, or keep={item['name']} to put the primary's value back on {peer}")
