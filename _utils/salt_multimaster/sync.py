"""
The primary's side of a sync, without Salt's loader: reading the primary's
state, planning each peer (full and targeted syncs alike: a peer never
plans), deciding how contents travel and attaching them, the pull grants
(grant, serve, revoke), merging what a peer applied into the report, and
remembering what each peer was last confirmed to hold (so the common
change sync is one publish: :func:`expected_inventory`).

The runner (``_runners/multimaster.py``) keeps the Salt-facing parts:
configuration, the publishes through ``LocalClient``, progress events and
the exit code.  ``opts`` below is the primary master's configuration.
"""

import json
import logging
import os
import secrets
import shutil
import stat
import time

from salt_multimaster import (daemon, grants, keyscan, layout, manifest, outage, protocol,
                              replicate, rootscan, seal, statefile, watch)
from salt_multimaster import store as state_store

log = logging.getLogger(__name__)

BUCKETED = ("minion_keys", "file_roots", "pillar_roots")

# Contents up to this size ride in the apply publish (sealed where secret);
# larger ones are pulled by the peer over the request channel (peer_run).
INLINE_LIMIT = 64 * 1024
# Past this many file_roots files (or bytes), the peer pulls them in bulk
# instead of fetching each from the fileserver.
PULL_MIN_FILES = 100
PULL_MIN_BYTES = 4 * 1024 * 1024
PULL_TTL = 600
# A sealed master key pair in an apply request (a 4096-bit PEM, base64).
MASTER_KEY_WEIGHT = 4096
# Backups kept on each peer (the newest; each apply that replaced or removed
# anything makes one).
BACKUP_KEEP = 10
# Past this many ids a targeted key sync is a full minion_keys sync.
MAX_TARGETED_IDS = 200
# Past this many ids set by targeted syncs since a peer's last full sync,
# its minion_keys are forgotten (a full sync remembers them afresh).
MAX_HELD_IDS = 2000
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
def saved_digests(opts, categories):
    """
    ``{category: digests}`` of the bucketed ``categories`` as the last sync
    read them on the primary (a peer in step holds these); no key or file
    is looked at.
    """
    state_dir = layout.state_dir(opts)
    digests = {}
    for cat in categories:
        if cat == "minion_keys":
            digest = keyscan.KeysSnapshot.saved_digest(opts["pki_dir"], state_dir)
        elif cat in rootscan.ROOTS:
            digest = rootscan.saved_digests(state_dir, cat)
        else:
            continue
        if digest is not None:
            digests[cat] = digest
    return digests


def read_primary(opts, categories, topology, config_keys, rescan=False):
    """The primary's manifests, and the contents they describe, on demand."""
    cache_dir = layout.state_dir(opts)
    errors, state = [], {}
    journal = watch.client(cache_dir)
    if rescan and "file_roots" in categories:
        # Salt's fileserver trusts unchanged mtimes too: else a peer fetching
        # a file rewritten behind them is told the old hash and keeps its copy
        manifest.forget_fileserver_hashes(opts["cachedir"])
    for cat in categories:
        if cat == "minion_keys":
            snap = keyscan.KeysSnapshot(opts["pki_dir"], cache_dir, rescan=rescan,
                                        watch=journal)
            errors.extend(snap.errors)
            state[cat] = {"parts": snap.parts, "digest": snap.digest, "counts": snap.counts,
                          "previous": snap.previous_parts(), "damaged": snap.damaged}
        elif cat in rootscan.ROOTS:
            scan = rootscan.RootsScan(opts, cat, cache_dir, rescan=rescan, watch=journal)
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


def read_primary_keys(opts, ids):
    """
    The primary's state for a targeted key sync of ``ids``: the
    ``minion_keys`` entry of :func:`read_primary` over these ids only (a
    few stat calls per id, no listing of every key).
    """
    errors = []
    keys = keyscan.keys_state(opts["pki_dir"], ids, errors=errors)
    damaged = manifest.damaged_sources(errors)
    state = {"minion_keys": {"ids": sorted(ids), "manifest": keys, "damaged": damaged},
             "errors": [str(e) for e in errors]}
    state["damaged"] = damaged_messages(state, ["minion_keys"])
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
    return {c: primary[c]["digest"] for c in categories if "digest" in (primary.get(c) or {})}


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
        if cat not in BUCKETED or not isinstance(theirs, dict):
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


def plan(topology, categories, primary, inv, force, found_all=None):
    """
    ``({category: ops}, {category: report})`` making the peer whose
    inventory is ``inv`` mirror ``primary`` (:func:`read_primary`, or
    :func:`read_primary_keys` for a targeted sync).  ``force``: a bool, or
    ``{category: item names}`` forced (:func:`outage.forced`).
    ``found_all``: a list given every item the peer changed since its last
    sync (:func:`outage.classify`).
    """
    ops, report = {}, {}
    for cat in categories:
        theirs = inv.get(cat) or {}
        entry = primary[cat]
        found = []
        keep = outage.forced(force, cat)
        if cat == "minion_keys" and "ids" in entry:
            # targeted: the peer's keys of these ids, all of them detailed
            mine, peer_man, found = outage.classify(
                cat, entry["manifest"], theirs.get("manifest") or {}, theirs.get("record"), keep)
            cat_ops, rep = outage.plan_keys(mine, peer_man, theirs.get("history"), force,
                                            damaged=entry["damaged"])
        elif cat in BUCKETED:
            # only the buckets where the peer differs are compared
            need, peer_man, history = peer_buckets(cat, primary, theirs)
            mine = manifest.merge(entry["parts"], need) if need else {}
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
# Contents: how they travel, attached, pulled
# ---------------------------------------------------------------------------
def peer_pub(opts, peer):
    """The peer minion's public key, as accepted on this master."""
    with open(os.path.join(opts["pki_dir"], "minions", peer), encoding="utf-8") as fh:
        return fh.read()


def content_path(opts, cat, fields):
    """Where the primary holds the content of an item (:func:`protocol.parse_item` fields)."""
    if cat == "minion_keys":
        return os.path.join(opts["pki_dir"], fields["state"], fields["id"])
    return manifest.locate(opts[cat][fields["env"]], fields["rel"])


def transport(opts, peer, ops, inline_limit, pull_min_files=None):
    """
    How the apply of ``ops`` reaches ``peer``, decided the same way in test
    mode: ``{"mode": "inline"|"pull"|None, "pull_files": bool, "size": bytes,
    "error": message or None}``.

    The operations and the contents of minion keys, pillar files and master
    keys ride the apply publish, sealed to the peer, only up to
    ``inline_limit`` bytes.  Past it, or past ``pull_min_files`` file_roots
    files (or 4 MiB of them), the peer pulls them point-to-point through
    ``peer_run`` (``multimaster.pull``).  A peer that may not pull is refused
    (``error``, with the ``peer_run`` snippet to add): bulk never rides the
    publish, which every minion receives.  Otherwise file_roots files come
    from this master's fileserver, point-to-point too, unless they fit in
    ``inline_limit`` with the rest (``inline_files``: sealed in the request,
    one round trip less).
    """
    pullable = protocol.pull_allowed(opts.get("peer_run"), peer)
    files = [op for op in ops.get("file_roots", []) if op["op"] == replicate.WRITE]
    pull_files = pullable and (
        len(files) > (PULL_MIN_FILES if pull_min_files is None else pull_min_files)
        or sum(op.get("size", 0) for op in files) > PULL_MIN_BYTES)
    size = protocol.payload_size(ops)
    for cat in ("master_keys", "minion_keys", "pillar_roots"):
        for op in ops.get(cat, []):
            if size > inline_limit and pullable:
                break  # enough to decide (a stat per key of an initial sync: 0.16 s)
            if op["op"] != replicate.WRITE:
                continue
            if cat == "master_keys":
                size += MASTER_KEY_WEIGHT
                continue
            try:
                # sealed contents travel base64-encoded
                size += 4 * (op["size"] if "size" in op
                             else os.path.getsize(content_path(opts, cat, op))) // 3
            except (OSError, TypeError, KeyError):
                pass
    if size <= inline_limit and not pull_files:
        files_size = sum(4 * op.get("size", inline_limit) // 3 for op in files)
        return {"mode": "inline", "pull_files": False, "size": size, "error": None,
                "inline_files": bool(files) and size + files_size <= inline_limit}
    if pullable:
        return {"mode": "pull", "pull_files": pull_files, "size": size, "error": None}
    return {"mode": None, "pull_files": False, "size": size,
            "error": protocol.refusal(peer, size, inline_limit)}


def attach_contents(opts, peer, ops, primary, how):
    """
    Fill write operations with their contents, as :func:`transport`
    decided (``how``).  Private keys and pillar files are sealed to the
    peer's minion key (inside the sealed request as well); pulled contents
    are cut in chunks.  Return the chunks the peer pulls, or None.
    """
    pub = peer_pub(opts, peer)
    chunks = None
    if how["mode"] == "pull":
        bulk = ("minion_keys", "pillar_roots") + (("file_roots",) if how["pull_files"] else ())
        chunks = replicate.assign_chunks(
            [(cat, op) for cat in bulk for op in ops.get(cat, []) if op["op"] == replicate.WRITE])
    for cat, cat_ops in ops.items():
        for op in cat_ops:
            if op["op"] != replicate.WRITE or "pull" in op:
                continue
            if cat == "file_roots" and how.get("inline_files"):
                with open(content_path(opts, cat, op), "rb") as fh:
                    op["sealed"] = seal.seal(pub, fh.read(), peer, protocol.item_name(cat, op))
            elif cat in ("minion_keys", "pillar_roots"):
                with open(content_path(opts, cat, op), "rb") as fh:
                    data = fh.read()
                if cat == "minion_keys":
                    op["data"] = data.decode()
                else:
                    op["sealed"] = seal.seal(pub, data, peer, protocol.item_name(cat, op))
            elif cat == "master_keys":
                with open(primary[cat]["files"][op["kind"]], "rb") as fh:
                    data = fh.read()
                if op["kind"] == "pem":
                    op["sealed"] = seal.seal(pub, data, peer, protocol.item_name(cat, op))
                else:
                    op["data"] = data.decode()
    return chunks


def pull_dir(opts):
    return os.path.join(opts["cachedir"], "multimaster", "pull")


def grant(opts, peer, ops, chunks):
    """
    Let ``peer`` pull, for ten minutes, the operations of its sync and the
    contents cut in ``chunks``; return the token naming the grant.
    """
    token = secrets.token_hex(16)
    body = {"peer": peer, "expires": time.time() + PULL_TTL, "ops": ops, "chunks": chunks}
    statefile.write(os.path.join(pull_dir(opts), token), json.dumps(body),
                    root=layout.state_dir(opts))
    return token


def _valid_grant(body):
    return isinstance(body, dict) and isinstance(body.get("peer"), str) and isinstance(
        body.get("expires"), (int, float)) and isinstance(body.get("chunks"), list)


def revoke(opts, token, jid_dir):
    """
    End a pull grant, and drop from the job cache (local_cache) the sealed
    chunks its pulls stored there: tens of MiB each, kept ``keep_jobs``
    hours otherwise.  ``jid_dir(jid)``: a job's directory in the job cache.
    """
    if opts.get("master_job_cache", "local_cache") == "local_cache":
        for jid in grants.jids(pull_dir(opts), token):
            shutil.rmtree(jid_dir(jid), ignore_errors=True)
    base = os.path.join(pull_dir(opts), token)
    for path in (base, f"{base}{grants.JIDS_SUFFIX}"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def sweep_grants(opts, jid_dir):
    """Revoke the expired pull grants of syncs that never revoked them (killed)."""
    for token in grants.expired(pull_dir(opts), ttl=PULL_TTL):
        log.info("multimaster: revoking the expired pull grant %s", token)
        try:
            revoke(opts, token, jid_dir)
        except OSError as exc:
            log.warning("multimaster: expired pull grant %s not revoked: %s", token, exc)


def pulled(opts, token, chunks):
    """``(chunks served, items in them)`` of the grant ``token`` so far."""
    served = min(len(grants.jids(pull_dir(opts), token)), len(chunks))
    return served, sum(len(chunk) for chunk in chunks[:served])


def serve_pull(opts, request, caller, jid):
    """
    The reply to a peer's ``multimaster.pull``: the chunk it asks of its
    grant, sealed to its minion key, or ``{"error": ...}``.
    """
    try:
        token, index = protocol.open_pull_request(request)
        body = statefile.read(os.path.join(pull_dir(opts), token), _valid_grant)
        items = body["chunks"][index]
    except (statefile.Damaged, ValueError, KeyError, TypeError, IndexError):
        return {"error": "unknown or malformed pull request"}
    if body["peer"] != caller or body["expires"] < time.time():
        log.warning("multimaster: pull refused for %s", caller)
        return {"error": f"no pull grant for {caller}"}
    contents, missing = {}, []
    for item in items:
        try:
            cat, fields = protocol.parse_item(item)
            with open(content_path(opts, cat, fields), "rb") as fh:
                contents[item] = fh.read()
        except (OSError, TypeError, KeyError, protocol.ProtocolError):
            missing.append(item)
    if jid:
        # the sync drops this job's stored return (the sealed chunk) from the
        # job cache once the peer has applied it
        with open(os.path.join(pull_dir(opts), f"{token}{grants.JIDS_SUFFIX}"), "a",
                  encoding="utf-8") as fh:
            fh.write(f"{jid}\n")
    return protocol.seal_pull_reply(peer_pub(opts, caller), caller, token, contents, missing,
                                    ops=body["ops"] if index == 0 else None)


# ---------------------------------------------------------------------------
# What the peer applied
# ---------------------------------------------------------------------------
def applied_name(cat, item):
    """The name the peer gives ``item`` of the report in its ``failed`` list."""
    return item if cat != "master_config" else protocol.DROPIN_NAME


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
            report[cat][kind] = [
                item for item in report[cat][kind] if applied_name(cat, item) not in failed
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


def _planned_daemon_items(ret):
    """``{category: [item]}`` the report writes that the peer's master loads on restart only."""
    return {cat: [i for kind in ("added", "updated") for i in ret[cat][kind]]
            for cat in ("master_keys", "master_config")
            if isinstance(ret.get(cat), dict) and (ret[cat]["added"] or ret[cat]["updated"])}


def predict_restart(ret, how):
    """
    test mode: the restart of the peer's salt-master a real run would make
    after writing master keys or options, from what the peer said of it
    (``how``: its inventory's ``master_restart``, absent from an older
    peer): ``would restart``, ``restart_required`` (would be: nothing
    restarts it there), or, for a configured command that cannot run there,
    each of those items an error (the real run refuses to write them).
    """
    planned = _planned_daemon_items(ret)
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


# ---------------------------------------------------------------------------
# What each peer was last confirmed to hold: a change sync in one publish
# ---------------------------------------------------------------------------
def _memory_name(peer):
    return f"peer:{peer}"


def _valid_memory(held):
    """Whether a peer's memory has the shape :func:`remember` saves."""
    return isinstance(held, dict) and all(
        cat in replicate.CATEGORIES and isinstance(entry, dict)
        and (cat not in BUCKETED or isinstance(entry.get("digest"), dict))
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
        elif cat in BUCKETED:
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
    previous state, checked by :func:`unplannable`).
    """
    inv = {}
    for cat, entry in held.items():
        if cat in BUCKETED:
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
