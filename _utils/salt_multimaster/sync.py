"""
The primary's side of a sync, without Salt's loader: reading the primary's
state, planning each peer (full and targeted syncs alike: a peer never
plans), and merging what a peer applied into the report.  How contents
travel (attached, pulled) is :mod:`salt_multimaster.transport`; what each
peer was last confirmed to hold (so the common change sync is one
publish) :mod:`salt_multimaster.memory`.

The runner (``_runners/multimaster.py``) keeps the Salt-facing parts:
configuration, the publishes through ``LocalClient``, progress events and
the exit code.  ``opts`` below is the primary master's configuration.
"""

import os
import stat
import time

from salt_multimaster import (daemon, journal, keyscan, layout, manifest, outage, protocol,
                              replicate, rootscan, statefile)

# A full sync reads every file and key again (rescan) when the last one
# that did is older than this (multimaster:verify_interval, seconds; 0:
# never): what stat and the change journal cannot see is caught within it.
VERIFY_INTERVAL = 86400
VERIFY_NAME = "last-verify"


def verify_due(opts, interval, now=None):
    """
    Whether a full sync of the primary of ``opts`` is to read everything
    again now: its last one (the mtime of :data:`VERIFY_NAME`, a regular
    file) is ``interval`` seconds old or more, in the future, or unknown.
    """
    if not interval:
        return False
    now = time.time() if now is None else now
    try:
        st = os.lstat(os.path.join(layout.state_dir(opts), VERIFY_NAME))
    except OSError:
        return True
    return not stat.S_ISREG(st.st_mode) or not 0 <= now - st.st_mtime < interval


def verified(opts):
    """Record that a full sync read everything again and every peer is a replica."""
    statefile.write(os.path.join(layout.state_dir(opts), VERIFY_NAME),
                    f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")


# ---------------------------------------------------------------------------
# The primary's state
# ---------------------------------------------------------------------------
def read_primary(opts, categories, topology, config_keys, rescan=False, keep=True):
    """
    The primary's manifests, and the contents they describe, on demand;
    ``keep=False`` (test mode): the state store is not changed by the scans.
    """
    cache_dir = layout.state_dir(opts)
    errors, state = [], {}
    changes = journal.client(cache_dir)
    if rescan and "file_roots" in categories:
        # Salt's fileserver trusts unchanged mtimes too: else a peer fetching
        # a file rewritten behind them is told the old hash and keeps its copy
        manifest.forget_fileserver_hashes(opts["cachedir"])
    for cat in categories:
        if cat == "minion_keys":
            snap = keyscan.KeysSnapshot(opts["pki_dir"], cache_dir, rescan=rescan,
                                        watch=changes, keep=keep)
            errors.extend(snap.errors)
            state[cat] = {"parts": snap.parts, "digest": snap.digest, "counts": snap.counts,
                          "previous": snap.previous_parts(), "damaged": snap.damaged}
        elif cat in rootscan.ROOTS:
            scan = rootscan.RootsScan(opts, cat, cache_dir, rescan=rescan, watch=changes,
                                      keep=keep)
            errors.extend(scan.errors)
            # the digests describe a peer in step: modes less the bits a
            # sync never writes (the plan warns of those)
            state[cat] = {"parts": scan.parts, "digest": scan.safe,
                          "envs": sorted(opts.get(cat) or {}), "previous": scan.previous(),
                          "damaged": scan.damaged}
        elif cat == "master_keys":
            pem, pub = layout.master_key_files(opts, topology)
            state[cat] = {"files": {"pem": pem, "pub": pub},
                          "manifest": {"pem": manifest.sha256_or_none(pem),
                                       "pub": manifest.sha256_or_none(pub)}}
        elif cat == "master_config":
            state[cat] = {"manifest": {k: opts.get(k) for k in config_keys}}
    state["errors"] = [str(e) for e in errors]
    state["damaged"] = damaged_messages(state, categories)
    return state


def damaged_messages(state, categories):
    """
    One line per key or roots file that exists on the primary but cannot be
    read or used: the peer's copy is kept, and the sync fails for it.
    """
    lines = []
    for cat in categories:
        for where, names in sorted(((state.get(cat) or {}).get("damaged") or {}).items()):
            for name in sorted(names):
                sep = "/" if cat == "minion_keys" else ":"
                lines.append(f"{cat} {where}{sep}{name}: damaged or unreadable on the primary")
    return lines


def current_digests(primary, categories):
    """``{category: bucket digests}`` of the primary's bucketed categories."""
    return {c: primary[c]["digest"] for c in categories if c in protocol.BUCKETED}


# ---------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------
def stale(cat, primary, theirs):
    """
    The buckets where the peer differs from the primary now, and among them
    those the peer did not detail: it holds them as the digests sent to it.
    """
    need = manifest.differing(primary[cat]["digest"], theirs.get("digest") or {})
    detailed = set(theirs.get("buckets") or [])
    return need, [b for b in need if b not in detailed]


def unplannable(categories, primary, inv, sent):
    """
    Whether the peer holds, as ``sent``, buckets the primary changed since
    and whose previous content it lost (or holds otherwise: each bucket is
    checked against the digest sent).
    """
    if not isinstance(inv, dict):
        return False
    for cat in categories:
        theirs = inv.get(cat)
        if cat not in protocol.BUCKETED or not isinstance(theirs, dict):
            continue
        _, lost = stale(cat, primary, theirs)
        if not lost:
            continue
        previous = primary[cat].get("previous")
        if previous is None:
            return True
        parts = previous[1]()
        held = manifest.bucket_digests({b: parts[b] for b in lost if b in parts})
        if any(held.get(b) != (sent.get(cat) or {}).get(b) for b in lost):
            return True
    return False


def peer_buckets(cat, primary, theirs):
    """
    The buckets where the peer differs from the primary now, with the peer's
    manifest and key history there: as the peer detailed them where it
    differs from the digests sent to it, else the primary's previous state
    (which it holds: checked by :func:`unplannable`).
    """
    need, lost = stale(cat, primary, theirs)
    peer_man = manifest.restrict(cat, theirs.get("manifest") or {}, need)
    history = list(theirs.get("history") or [])
    if lost:
        old = manifest.merge(primary[cat]["previous"][1](), lost)
        for outer, entries in old.items():
            peer_man.setdefault(outer, {}).update(entries)
        if cat == "minion_keys":
            # a peer in step with the primary received every id it holds from it
            history.extend(mid for entries in old.values() for mid in entries)
    return need, peer_man, history


def only_ids(man, ids):
    """A keys manifest (``{state: {id: sha256}}``) of ``ids`` only."""
    ret = {state: {mid: sha for mid, sha in keys.items() if mid in ids}
           for state, keys in man.items()}
    return {state: keys for state, keys in ret.items() if keys}


def plan(topology, categories, primary, inv, force, found_all=None, ids=None):
    """
    ``({category: ops}, {category: report})`` making the peer whose
    inventory is ``inv`` mirror ``primary`` (:func:`read_primary`).
    ``force``: a bool, or ``{category: item names}`` forced
    (:func:`outage.forced`).  ``found_all``: a list given every item the
    peer changed since its last sync (:func:`outage.classify`).  ``ids``:
    a targeted key sync, the keys of these minion ids only.
    """
    ops, report = {}, {}
    for cat in categories:
        theirs = inv.get(cat) or {}
        entry = primary[cat]
        found = []
        keep = outage.forced(force, cat)
        if cat in protocol.BUCKETED:
            # only the buckets where the peer differs are compared
            need, peer_man, history = peer_buckets(cat, primary, theirs)
            mine = manifest.merge(entry["parts"], need) if need else {}
            if cat == "minion_keys" and ids is not None:
                mine, peer_man = only_ids(mine, ids), only_ids(peer_man, ids)
            # what the peer changed since it last confirmed: left in place
            mine, peer_man, found = outage.classify(cat, mine, peer_man, theirs.get("record"),
                                                    keep)
            if cat == "minion_keys":
                cat_ops, rep = outage.plan_keys(mine, peer_man, history, force,
                                                damaged=entry.get("damaged"))
            else:
                cat_ops, rep = replicate.plan_tree(
                    mine, peer_man, theirs.get("envs"), primary_envs=entry["envs"],
                    damaged=entry.get("damaged"))
        elif cat == "master_keys":
            cat_ops, rep = replicate.plan_master_keys(entry["manifest"], theirs, topology)
        else:
            values, found = outage.classify_config(entry["manifest"], theirs,
                                                   inv.get("config_record"), keep)
            cat_ops, rep = replicate.plan_master_config(values, theirs)
        outage.report(rep, found)
        if found_all is not None:
            found_all.extend(found)
        rep["errors"].extend(theirs.get("errors") or [])
        ops[cat], report[cat] = cat_ops, rep
    return ops, report


def drift(report, categories):
    """Counts of what a sync would change, per category, and of what it would leave."""
    ret = {}
    for cat in categories:
        ret[cat] = {k: len(report[cat][k]) for k in ("added", "updated", "removed", "conflicts")}
        if report[cat].get(outage.PEER_CHANGED):
            ret[cat][outage.PEER_CHANGED] = len(report[cat][outage.PEER_CHANGED])
    return ret


def status_categories(categories):
    """
    What ``multimaster.status`` reads of the primary and asks each peer
    for: ``categories`` plus the master and minion keys, whose
    fingerprints and counts it shows.
    """
    return sorted(set(categories) | {"master_keys", "minion_keys"})


def peer_status(peer, inv, primary, categories, topology, primary_finger, pullable):
    """
    One peer's ``multimaster.status`` row, from its inventory ``inv`` of
    :func:`status_categories` against the primary's state; the drift is
    counted over ``categories``.
    """
    _, plan_report = plan(topology, status_categories(categories), primary, inv, False)
    counts = drift(plan_report, categories)
    row = {
        "reachable": True,
        "master_finger": {"primary": primary_finger,
                          "peer": inv["master_keys"].get("fingerprint")},
        "minion_keys": {"primary": primary["minion_keys"]["counts"],
                        "peer": inv["minion_keys"].get("counts", {})},
        "drift": counts,
        "in_sync": not any(sum(d.values()) for d in counts.values())
        and not inv.get("restart_pending") and inv.get("master_running") is not False,
        # whether bulk (an initial sync) can reach this peer at all
        "pull_allowed": pullable,
        "master_running": inv.get("master_running"),
        "restart_pending": inv.get("restart_pending"),
    }
    if inv.get("master_running") is False:
        row["error"] = daemon.not_running_error(peer, inv.get("master_address"))
    if not pullable:
        row["pull_config"] = protocol.peer_run_snippet([peer])
    errors = [e for cat in categories for e in plan_report[cat]["errors"]]
    if errors:
        row["errors"] = errors
    return row


# ---------------------------------------------------------------------------
# What the peer applied
# ---------------------------------------------------------------------------
def merge(report, applied):
    """Take out of the planned lists the items the peer reports as failed."""
    for cat, rep in applied.items():
        if cat not in report or not isinstance(rep, dict):
            continue
        errors, failed = rep.get("errors"), rep.get("failed")
        if isinstance(errors, list):
            report[cat]["errors"].extend(errors)
        elif errors:
            report[cat]["errors"].append(f"peer errors not readable: {str(errors)[:200]}")
        if not isinstance(failed, list):
            if failed:
                report[cat]["errors"].append("the peer's list of failed items was trimmed")
            continue
        failed = set(failed)
        for kind in ("added", "updated", "removed"):
            # the peer names an item of master_config by the drop-in it failed to write
            report[cat][kind] = [
                item for item in report[cat][kind]
                if (item if cat != "master_config" else protocol.DROPIN_NAME) not in failed
            ]


def unconfirmed(ret, categories):
    """
    A peer that did not apply: move what was planned out of the lists of
    changes (which name only what the peer confirmed) into ``unconfirmed``.
    """
    for cat in categories:
        rep = ret.get(cat)
        if not isinstance(rep, dict):
            continue
        items = [item for kind in ("added", "updated", "removed") for item in rep[kind]]
        for kind in ("added", "updated", "removed"):
            rep[kind] = []
        if items:
            rep["unconfirmed"] = items


def finish(peer, ret, inv, categories, test=False):
    """
    The outcome of one peer's sync from what its inventory (or conditional
    apply) said of its master: a restart still required (or whose command
    failed), its master down; in ``test`` mode, the restart a real run would
    make (:func:`predict_restart`).
    """
    if test:
        predict_restart(ret, inv.get("master_restart"))
    # what the peer found damaged and rebuilt, in its inventory and its apply
    rebuilt = list(inv.get("rebuilt") or []) + [
        r for r in ret.get("rebuilt") or [] if r not in (inv.get("rebuilt") or [])]
    if rebuilt:
        ret["rebuilt"] = rebuilt
    if inv.get("restart_pending") and not ret.get("restart"):
        # keys or config written by an earlier sync, and the master not restarted since
        ret["restart"] = "restart_required"
        failed = restart_failed(peer, inv.get("master_restart"))
        if failed:
            ret["error"] = failed
    if inv.get("master_running") is False:
        # synced, yet no replica in service: say so, and fail the run
        ret["error"] = daemon.not_running_error(peer, inv.get("master_address"))
    return verdict(peer, ret, categories)


def predict_restart(ret, how):
    """
    test mode: the restart of the peer's salt-master a real run would make
    after writing master keys or options, from what the peer said of it
    (``how``: its inventory's ``master_restart``, absent from an older
    peer): ``would restart``, ``restart_required`` (would be: nothing
    restarts it there), or, for a configured command that cannot run there,
    each of those items an error (the real run refuses to write them).
    """
    # what the report writes that the peer's master loads on restart only
    planned = {cat: [i for kind in ("added", "updated") for i in ret[cat][kind]]
               for cat in ("master_keys", "master_config")
               if isinstance(ret.get(cat), dict) and (ret[cat]["added"] or ret[cat]["updated"])}
    if not planned or not isinstance(how, dict):
        return
    if how.get("refused"):
        for cat, items in planned.items():
            for kind in ("added", "updated"):
                ret[cat][kind] = []
            ret[cat]["errors"].extend(f"{item}: {how['refused']}" for item in items)
        return
    ret["restart"] = ("would restart" if how.get("possible")
                      else "would be required (no service manager; set the minion option "
                           "multimaster.master_restart_cmd there)")


def restart_failed(peer, how):
    """
    The error of a peer whose master still runs older keys or config after
    its restart command ran and failed (``how``: its inventory's
    ``master_restart``), or None.
    """
    if not isinstance(how, dict) or how.get("last_status") in (None, 0):
        return None
    return (f"{peer}'s salt-master must restart to load the new master keys or config: its "
            f"restart command {how.get('cmd')!r} exited with status {how['last_status']} "
            f"(see the log of {peer}'s salt-minion): fix the minion option "
            "multimaster.master_restart_cmd there, or restart it yourself")


def verdict(peer, ret, categories):
    """
    ``result`` False, and one ``error`` line saying why, whenever the peer is
    not a replica in service after the run: errors, conflicts left, a
    restart still required, its master down.
    """
    reasons = [ret["error"]] if ret.get("error") else []
    errors = sum(len(ret[c]["errors"]) for c in categories if isinstance(ret.get(c), dict))
    conflicts = sum(len(ret[c]["conflicts"]) for c in categories if isinstance(ret.get(c), dict))
    changed = sum(len(ret[c].get(outage.PEER_CHANGED) or ()) for c in categories
                  if isinstance(ret.get(c), dict))
    if errors and not reasons:
        reasons.append(f"{errors} item(s) failed (see errors)")
    if changed:
        reasons.append(f"{changed} item(s) changed on {peer} since its last sync, left there "
                       f"(see peer_changed): salt-run multimaster.failback peer={peer} carries "
                       "them to the primary, force=True puts the primary's back")
    if conflicts:
        reasons.append(f"{conflicts} conflict(s) left on {peer} (see conflicts; force=True "
                       "replaces or removes them)")
    if ret.get("restart") == "restart_required" and not any(
            r.startswith(f"{peer}'s salt-master must restart") for r in reasons):
        reasons.append(f"{peer}'s salt-master must restart to load the new master keys or "
                       "config (no service manager restarted it): restart it")
    if reasons:
        ret["result"] = False
        ret["error"] = "; ".join(reasons)
    return ret


def damaged_verdict(res, primary):
    """A peer is no replica of what cannot be read on the primary: fail it, naming why."""
    if primary["errors"]:
        res.setdefault("primary_errors", primary["errors"])
    if primary.get("damaged"):
        res["result"] = False
        msg = (f"{len(primary['damaged'])} damaged or unreadable source(s) on the primary, "
               "their copies on the peer kept: " + "; ".join(primary["damaged"][:5]))
        res["error"] = f"{msg}; {res['error']}" if res.get("error") else msg
    return res


def peer_errors(opts, peers):
    """Per-peer input errors: invalid id, or not an accepted minion of the primary."""
    errors = {}
    for peer in peers:
        if not manifest.valid_minion_id(peer):
            errors[peer] = f"invalid peer id {peer!r}"
        elif not os.path.isfile(os.path.join(opts["pki_dir"], "minions", peer)):
            pending = os.path.isfile(os.path.join(opts["pki_dir"], "minions_pre", peer))
            errors[peer] = (
                f"peer {peer!r} is not an accepted minion of this master: "
                + (f"its key is pending, accept it: salt-key -a {peer}" if pending else
                   "start the peer host's salt-minion with this master in its master list, "
                   f"then accept its key: salt-key -a {peer}")
            )
    return errors
