"""
Plan a sync: compare the primary's manifests with a peer's and return the
operations that make the peer mirror the primary, with the report users see.

Pure functions over manifests; nothing here touches disk or Salt.
"""

from salt_multimaster import fsutil
from salt_multimaster.protocol import item_name

CATEGORIES = ("master_keys", "minion_keys", "file_roots", "pillar_roots", "master_config")
DEFAULT_CONFIG_KEYS = ("nodegroups", "external_auth", "publisher_acl", "peer", "peer_run")

# Salt checks rejected, then pending, then accepted: write before remove so a
# key moving between states is never briefly absent (a new, pending key).
WRITE, REMOVE = "write", "remove"
# Key states in which a master refuses an id (rejected) or a key (denied):
# a sync never moves a key out of them to accepted on a peer, unless forced.
REVOKED_STATES = ("minions_rejected", "minions_denied")


# A pull reply carries at most about this much content, or this many items:
# each peer_run call costs the primary Salt's own work (a Runner and a
# MasterMinion, the return stored, an event, the reply encrypted), so a few
# large replies, two in flight while the peer writes the one before.
PULL_CHUNK_BYTES = 64 * 1024 * 1024
PULL_CHUNK_ITEMS = 50000
KEY_WEIGHT = 1024  # a minion public key is about 450 bytes


def assign_chunks(items, max_bytes=PULL_CHUNK_BYTES, max_items=PULL_CHUNK_ITEMS):
    """
    Cut the contents a peer pulls into chunks, in the order given (the order
    the peer applies them).  ``items``: ``[(cat, op)]``.  Minion keys come in
    chunks of their own, so the first reply (which also carries the
    operations) is small and the peer starts writing while the larger file
    chunks, of balanced size, are still on their way.  Set ``op["pull"]`` to
    the index of the chunk holding its content and return the chunks as
    lists of item names.
    """
    chunks = []
    keys = [(cat, op) for cat, op in items if cat == "minion_keys"]
    files = [(cat, op) for cat, op in items if cat != "minion_keys"]
    for group in (keys, files):
        if not group:
            continue
        weights = [op.get("size") or KEY_WEIGHT for _, op in group]
        count = max(-(-sum(weights) // max_bytes), -(-len(group) // max_items), 1)
        target = sum(weights) / count
        first, current, size = len(chunks), [], 0
        for (cat, op), weight in zip(group, weights):
            if current and (size + weight / 2 > target or len(current) >= max_items) \
                    and len(chunks) - first < count - 1:
                chunks.append(current)
                current, size = [], 0
            op["pull"] = len(chunks)
            current.append(item_name(cat, op))
            size += weight
        chunks.append(current)
    return chunks


def empty_report():
    return {"added": [], "updated": [], "removed": [], "conflicts": [], "errors": []}


def plan_keys(primary, peer, history, force=False, damaged=None):
    """
    ``primary``/``peer``: ``{state_dir: {minion_id: sha256}}``; ``history``:
    ids this peer received from the primary before.

    A peer key with the same id and other content is a conflict (left alone
    unless ``force``); a key only on the peer and never received from the
    primary is a conflict too (kept unless ``force``); so is a key the
    primary accepts that the peer revoked (:func:`revoked_on_peer`); a key
    the primary deleted or moved is removed from its old state on the peer.

    ``damaged``: ``{state_dir: [minion_id]}`` of keys the primary holds
    but cannot read or use; these ids are never removed from the peer (even
    with ``force``): each is an error instead.
    """
    report = empty_report()
    ops = []
    history = set(history or ())
    primary_ids = {}
    for state, keys in primary.items():
        for mid, sha in keys.items():
            primary_ids.setdefault(mid, {})[state] = sha
    peer_ids = {}
    for state, keys in peer.items():
        for mid, sha in keys.items():
            peer_ids.setdefault(mid, {})[state] = sha
    blocked = set()
    for mid in sorted(primary_ids):
        want = primary_ids[mid]
        have = peer_ids.get(mid, {})
        revoked = [] if force else revoked_on_peer(want, have)
        report["conflicts"].extend(revoked_conflict(state, mid) for state in revoked)
        foreign = {s for s, sha in have.items() if sha not in want.values()} - set(revoked)
        if (foreign or revoked) and not force:
            for state in sorted(foreign):
                report["conflicts"].append(
                    f"{state}/{mid}: the peer holds a different key for this id "
                    "(left alone; force=True replaces it)"
                )
            blocked.add(mid)
            continue
        for state, sha in sorted(want.items()):
            if have.get(state) == sha:
                continue
            ops.append({"op": WRITE, "state": state, "id": mid, "sha256": sha})
            report["updated" if state in have else "added"].append(f"{state}/{mid}")
    damaged_ids = {mid for ids in (damaged or {}).values() for mid in ids}
    for mid in sorted(peer_ids):
        if mid in blocked:
            continue
        want = primary_ids.get(mid, {})
        for state in sorted(peer_ids[mid]):
            if state in want:
                continue
            if mid in damaged_ids:
                report["errors"].append(
                    f"{state}/{mid}: damaged or unreadable on the primary: the peer's copy "
                    "is kept (repair the key on the primary)"
                )
                continue
            if want or mid in history or force:
                ops.append({"op": REMOVE, "state": state, "id": mid})
                report["removed"].append(f"{state}/{mid}")
            else:
                report["conflicts"].append(
                    f"{state}/{mid}: only on the peer, never on the primary "
                    "(kept; force=True removes it)"
                )
    ops.sort(key=lambda op: op["op"] != WRITE)
    return ops, report


def revoked_on_peer(want, have):
    """
    The states in which the peer revoked a key the primary accepts
    (``want``/``have``: ``{state_dir: sha256}`` of one id on each side),
    which a sync would undo: the id rejected on the peer (Salt refuses a
    rejected id whatever its key), or the very key the primary accepts
    denied there.  Left as conflicts unless ``force``.
    """
    if "minions" not in want:
        return []
    return [state for state in REVOKED_STATES if state in have and have[state] != want.get(state)
            and (state == "minions_rejected" or have[state] == want["minions"])]


def revoked_conflict(state, mid):
    """The conflict of a key the primary accepts that the peer revoked (``state`` there)."""
    how = {"minions_rejected": ("rejected", "--include-rejected"),
           "minions_denied": ("denied", "--include-denied")}[state]
    return (f"{state}/{mid}: revoked on this peer master ({how[0]} there) while the primary "
            f"accepts it: left {how[0]}; reject it on the primary too (salt-key -r {mid} "
            f"--include-accepted), or accept it again on this peer (salt-key -a {mid} "
            f"{how[1]}), or sync with force=True")


def plan_tree(primary, peer, peer_envs=None, primary_envs=None, damaged=None):
    """
    ``primary``/``peer``: ``{saltenv: {rel: [size, mode, sha256]}}``.
    Files missing or different on the peer are written; files the primary
    does not serve are removed.  A saltenv the peer does not configure
    (``peer_envs``, default: the saltenvs of ``peer``) is an error for that
    saltenv.  Files are removed only from the saltenvs the primary serves
    (``primary_envs``, default: the saltenvs of ``primary``), so partial
    manifests (one bucket) can be planned.  ``damaged``: ``{saltenv:
    [rel]}`` of files (``rel/`` for directories) the primary holds but
    cannot read: never removed from the peer, each an error instead.

    A file is written with its mode less setuid, setgid, sticky and write
    for others (:func:`fsutil.safe_mode`): the peer is compared with that
    mode, so a file whose only difference is a dropped bit is not written
    again, and each file written without a bit of its mode on the primary
    is named in the report's ``warnings`` (present only when not empty).
    """
    report = empty_report()
    ops, warnings = [], []
    peer_envs = set(peer if peer_envs is None else peer_envs)
    primary_envs = set(primary if primary_envs is None else primary_envs)
    for env in sorted(primary):
        if env not in peer_envs:
            report["errors"].append(
                f"saltenv {env!r} is not configured on the peer; add it to the peer's roots"
            )
            continue
        mine, theirs = primary[env], peer.get(env, {})
        for rel in sorted(mine):
            size, mode, sha = mine[rel]
            safe = fsutil.safe_mode(mode)
            if theirs.get(rel) == [size, safe, sha]:
                continue
            ops.append({"op": WRITE, "env": env, "rel": rel, "mode": safe, "sha256": sha,
                        "size": size})
            report["updated" if rel in theirs else "added"].append(f"{env}:{rel}")
            if safe != mode:
                warnings.append(f"{env}:{rel}: mode {mode:04o} on the primary, written as "
                                f"{safe:04o} (a peer never gets a "
                                f"{', '.join(fsutil.dropped_bits(mode))} file)")
    for env in sorted(set(peer) & primary_envs):
        mine = primary.get(env, {})
        for rel in sorted(set(peer[env]) - set(mine)):
            if _damaged_in(rel, (damaged or {}).get(env)):
                report["errors"].append(
                    f"{env}:{rel}: unreadable on the primary: the peer's copy is kept")
                continue
            ops.append({"op": REMOVE, "env": env, "rel": rel})
            report["removed"].append(f"{env}:{rel}")
    if warnings:
        report["warnings"] = warnings
    return ops, report


def safe_tree(man):
    """
    A roots manifest (``{saltenv: {rel: [size, mode, sha256]}}``, or one of
    its bucket parts) as a peer in step holds it: modes through
    :func:`fsutil.safe_mode`.
    """
    return {env: {rel: [size, fsutil.safe_mode(mode), sha]
                  for rel, (size, mode, sha) in files.items()}
            for env, files in man.items()}


def _damaged_in(rel, names):
    """Whether ``rel`` is, or lies under, one of the damaged ``names`` of a saltenv."""
    for name in names or ():
        if name == "/" or rel == name or (name.endswith("/") and rel.startswith(name)):
            return True
    return False


def plan_master_keys(primary, peer, topology):
    """
    ``primary``/``peer``: ``{"pem": sha256, "pub": sha256}`` of the pair the
    topology replicates (master or master_sign).
    """
    report = empty_report()
    ops = []
    names = {"shared": ("master.pem", "master.pub"),
             "signed": ("master_sign.pem", "master_sign.pub")}[topology]
    for kind, name in zip(("pem", "pub"), names):
        if primary.get(kind) is None:
            report["errors"].append(f"the primary has no {name}")
            continue
        if peer.get(kind) == primary[kind]:
            continue
        ops.append({"op": WRITE, "kind": kind, "name": name, "sha256": primary[kind]})
        report["updated" if peer.get(kind) else "added"].append(name)
    return ops, report


def plan_master_config(primary, peer):
    """``primary``/``peer``: ``{option: value}`` for the replicated options."""
    report = empty_report()
    changed = sorted(k for k in primary if peer.get(k) != primary[k])
    if not changed:
        return [], report
    for key in changed:
        held = key in peer and peer[key] not in (None, {}, [])
        report["updated" if held else "added"].append(key)
    return [{"op": WRITE, "values": primary}], report
