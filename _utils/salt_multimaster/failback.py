"""
``salt-run multimaster.failback peer=<id>``: carry what an operator changed
on a peer while the primary was down back to the primary, then sync every
peer, so that all masters agree again.

Steps (each reported):

``plan``
    The peer's inventory against the primary's state now, planned three-way
    as a sync plans it (:func:`salt_multimaster.outage.classify`): the items
    the peer changed since its last sync, to carry or, with ``keep``, to
    put back as the primary holds them.  ``test=True`` stops here.
``primary``
    The peer sends the contents of the keys and files to carry, each sealed
    to the primary's master key (``multimaster_peer.collect``: only from
    its pki_dir and roots); the primary writes them with the peer's own
    applier (:class:`salt_multimaster.applier.Applier`): validated operations,
    each content checked against its sha256, confined to the primary's
    pki_dir and roots, no setuid/setgid/sticky or world-writable file,
    staged and renamed, what it replaces or removes backed up in
    ``<cachedir>/multimaster/backup``.  A key that leaves ``minions/``
    makes the primary rotate its AES session key, as ``salt-key -r/-d``
    does.
``config``
    Replicated options the peer changed (its ``multimaster-sync.conf``) are
    not carried: the primary's configuration files are the operator's.
    Each is named with what to do (this step fails until it is done, or
    kept).
``peer``
    With ``keep``: a sync of the peer taking the primary's side of those
    items only.
``sync``
    A sync of every peer: the peer now holds the primary's state (its record
    is written again), and the other peers receive what was carried.

Idempotent: a second run finds nothing left to carry and syncs; a run
interrupted at any step converges when run again (an item carried already
is the same on both sides, and is left out).

Plain Python: Salt comes in through :class:`SaltOps`.
"""

import logging

from salt_multimaster import (applier, outage, report, restore, revocation, rounds,
                              validate)
from salt_multimaster import sync as core

log = logging.getLogger(__name__)

#: the categories a failback carries (master_keys are never changed on a peer by hand)
CATEGORIES = ("minion_keys", "file_roots", "pillar_roots", "master_config")


class SaltOps:
    """
    What failback asks of Salt on the primary.

    opts, conf
        The primary's options and its resolved ``multimaster`` settings.
    salt
        The Salt side of a sync's rounds (:class:`salt_multimaster.rounds.Rounds`).
    collect(peer, items, timeout)
        ``(reply, error)`` of ``multimaster_peer.collect`` on ``peer``.
    unseal(blob, purpose)
        Open what the peer sealed to this master's key.
    rotate_aes()
        Ask this master to rotate its AES session key
        (:func:`salt_multimaster.revocation.request_rotation`).
    sync_all()
        A sync of every peer of ``conf``: ``{peer: report}``.
    """

    def __init__(self, opts, conf, salt, collect, unseal, rotate_aes, sync_all):
        self.opts, self.conf, self.salt = opts, conf, salt
        self.collect, self.unseal = collect, unseal
        self.rotate_aes, self.sync_all = rotate_aes, sync_all


def _lines(items):
    return [f"{item['label']}: {item['what']} ({item['kind'].replace('_', ' ')})"
            for item in items]


def plan(ops, peer, categories):
    """
    ``(found, error)``: every item ``peer`` changed since its last sync
    (:func:`outage.classify` entries), from its inventory against the
    primary's state now.
    """
    conf = dict(ops.conf, peers=[peer])
    planner = rounds.Rounds(ops.opts, conf, ops.salt, test=True)
    primary, invs = planner.inventories(categories, [peer])
    inv, error = invs[peer]
    if error:
        return None, error
    found = []
    core.plan(conf["topology"], categories, primary, inv, False, found_all=found)
    return outage.left(found), None


def carry(ops, peer, items):
    """
    The ``primary`` step: the peer's side of ``items`` written on this
    master, as a sync writes a peer (:mod:`failback`).
    """
    step = {"result": True, "changes": {}}
    contents, errors = {}, []
    for batch in outage.batches(outage.collect_items(items), restore.COLLECT_MAX_BYTES):
        reply, error = ops.collect(peer, batch, ops.conf["timeout"])
        if error:
            errors.append(error)
            break
        contents.update(reply.get("items") or {})
        errors.extend(reply.get("errors") or [])
    if errors:
        step.update(result=False, errors=errors,
                    comment=f"nothing written: {len(errors)} item(s) not read on {peer}")
        return step
    try:
        todo = validate.ops(outage.carry_ops(items, contents))
    except validate.InvalidInput as exc:
        step.update(result=False, comment=f"nothing written: {exc}")
        return step
    app = applier.Applier(ops.opts, lambda blob, purpose: ops.unseal(blob, f"failback/{purpose}"))
    try:
        applied = applier.apply_categories(app, todo, ops.conf["topology"], lambda _ops: {})
    except BaseException:
        app.batch.abort()  # nothing half written
        raise
    app.commit()
    for cat, cat_ops in todo.items():
        failed = set(applied[cat]["failed"])
        rep = step["changes"][cat] = {"added": [], "updated": [], "removed": [],
                                      "errors": applied[cat]["errors"]}
        for op in cat_ops:
            name = (f"{op['state']}/{op['id']}" if cat == "minion_keys"
                    else f"{op['env']}:{op['rel']}")
            if name not in failed:
                rep["removed" if op["op"] == "remove" else "updated"].append(name)
        if failed:
            step["result"] = False
    if app.backed_up:
        step["backup"] = app.backup_root
    gone = outage.revoked(todo, applied)
    if gone:
        try:
            step["aes_rotation"] = ops.rotate_aes()
        except revocation.RevocationError as exc:
            step["aes_rotation"] = f"not requested: {exc}"
            step["result"] = False
    done = sum(len(r["updated"]) + len(r["removed"]) for r in step["changes"].values())
    step["comment"] = (f"{done} change(s) of {peer} written on the primary"
                       + ("" if step["result"] else ", some failed (see errors)")
                       + (f"; {', '.join(gone)} no longer accepted: AES key rotation "
                          f"{step['aes_rotation']}" if gone else ""))
    return step


def _peer_ok(res):
    """Whether a sync's report of the peer applied what it planned (the items forced)."""
    reps = [rep for rep in (res or {}).values() if isinstance(rep, dict) and "errors" in rep]
    return bool(reps) and not any(rep["errors"] or rep.get("unconfirmed") for rep in reps)


def failback(ops, peer, test=False, keep=None):
    """
    The steps of ``salt-run multimaster.failback`` (see the module): the
    report ``{"peer", "test", "steps", "result"}``, ``retcode`` 1 in it
    when the masters do not agree afterwards.  Raises
    :class:`outage.FailbackError` for bad input (nothing changed).
    """
    categories = [c for c in ops.conf["replicate"] if c in CATEGORIES]
    steps = {}
    ret = {"peer": peer, "test": test, "steps": steps}
    found, error = plan(ops, peer, categories)
    if error:
        steps["plan"] = {"result": False, "comment": error}
        return report.steps_done(ret)
    keep_items = outage.kept(found, keep)
    taken = [item for item in found if item not in keep_items]
    moved = [item for item in taken if item["cat"] != "master_config"]
    config = [item for item in taken if item["cat"] == "master_config"]
    steps["plan"] = {
        "result": None if test else True,
        "comment": (f"{len(found)} item(s) changed on {peer} since its last sync: "
                    f"{len(moved)} to carry to the primary, {len(keep_items)} to put back as "
                    f"the primary holds them, {len(config)} option(s) not carried"
                    if found else f"nothing changed on {peer} since its last sync"),
        "carry": _lines(moved), "keep": _lines(keep_items), "config": _lines(config)}
    if test:
        if config:
            steps["config"] = {"result": False, "comment": "options changed on the peer are "
                               "not carried", "remedy": [outage.config_remedy(peer, item)
                                                         for item in config]}
        return report.steps_done(ret)
    if moved:
        steps["primary"] = carry(ops, peer, moved)
        if not steps["primary"]["result"]:
            return report.steps_done(ret)
    if config:
        steps["config"] = {"result": False,
                           "comment": f"{len(config)} option(s) changed on {peer}, not carried",
                           "remedy": [outage.config_remedy(peer, item) for item in config]}
    if keep_items:
        res = rounds.Rounds(ops.opts, dict(ops.conf, peers=[peer]), ops.salt,
                            force=outage.keep_force(keep_items)).run([peer], categories)[peer]
        steps["peer"] = {"result": _peer_ok(res), "changes": res,
                         "comment": f"{len(keep_items)} item(s) put back on {peer} as the "
                                    "primary holds them" if _peer_ok(res) else
                                    f"not put back on {peer}: {res.get('error')}"}
    synced = ops.sync_all()
    failed = sorted(p for p, res in synced.items()
                    if isinstance(res, dict) and not res.get("result"))
    steps["sync"] = {"result": not failed, "changes": synced,
                     "comment": ("every peer holds the primary's state" if not failed else
                                 f"not a replica: {', '.join(failed)} (see changes)")}
    return report.steps_done(ret)
