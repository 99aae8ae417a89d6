"""
``salt-run multimaster.promote``, run on a peer master when the primary is
gone for good: this master becomes the primary (issue 33 item 5).

Steps (each reported):

``check``
    This master is a peer (a primary's sync reached it: its
    ``multimaster-sync.conf``, its epoch record), or already the primary
    promoted here (a second run changes nothing but syncs again).
``epoch``
    Its record (:mod:`salt_multimaster.epoch`) takes the next epoch, itself
    as the primary, the old primary retired, and its peers: the old
    primary's peers less this master's own host (or ``peers=``).
``config``
    Those peers listed in ``master.d/multimaster-peers.conf``, the drop-in
    ``add_peer`` owns (:mod:`salt_multimaster.membership`), so that
    ``multimaster.sync`` here reaches them.
``sync``
    A sync of those peers: they record the new epoch, and from then on
    refuse a sync from the old primary, named (``this master was promoted
    away from <old> at epoch N: run multimaster.failback on <new>
    instead``).
``minions``
    The formula's pillar follows the primary: ``multimaster:masters`` lists
    the primary first, and no minion should keep listing a master that is
    gone.  Pillar files are the operator's: each minion whose config or
    cached pillar still lists the old primary is named, with the commands
    (the ones remove_peer gives), and the pillar and top file changes are
    next steps.

Plain Python: Salt comes in through :class:`membership_steps.SaltOps`.
"""

import logging
import os

from salt.exceptions import SaltInvocationError

from salt_multimaster import (epoch, layout, membership, membership_steps, protocol, report,
                              settings)

log = logging.getLogger(__name__)


class PromoteError(ValueError):
    """This master cannot be promoted; nothing was changed."""


def _check(opts, rec):
    own = opts["id"]
    dropin = protocol.dropin_path(opts)
    if rec["primary"] == own and rec["epoch"] > 0:
        return f"{own} is the primary already (epoch {rec['epoch']}): its peers are synced again"
    if not os.path.isfile(dropin) and rec["primary"] in (None, own):
        raise PromoteError(f"{own} is no peer master: no primary's sync reached it (no {dropin}, "
                           "no epoch record); promote runs on a peer")
    return (f"{own} follows {rec['primary'] or 'its primary'} at epoch {rec['epoch']}: it "
            f"becomes the primary at epoch {rec['epoch'] + 1}")


def _configure(salt_ops, peers, test):
    """The ``config`` step: ``peers`` in this master's multimaster-peers.conf."""
    opts = salt_ops.opts
    _topology, dropin, dropin_peers, configured = membership_steps.primary_setup(
        opts, "multimaster.promote", opts["id"])
    want = [p for p in peers if p not in configured]
    if not want:
        return {"result": None if test else True,
                "comment": f"multimaster:peers lists {', '.join(peers) or 'no peer'} already"}
    if test:
        return {"result": None, "comment": f"{dropin} would list {', '.join(dropin_peers + want)}"}
    membership.write_dropin(dropin, dropin_peers + want)
    loaded = salt_ops.reload_peers()
    missing = [p for p in want if p not in loaded]
    if missing:
        return {"result": False, "comment": f"{dropin} written but Salt does not load "
                                            f"{', '.join(missing)} from it"}
    return {"result": True, "comment": f"{dropin} lists {', '.join(dropin_peers + want)}"}


def _next_steps(opts, rec, new):
    own_entry = epoch.master_entry(opts) or opts["id"]
    steps = [f"pillar multimaster:masters: list {own_entry} first"
             + (f" and remove {rec['entry']}" if rec.get("entry") else "")
             + ", then salt '*' saltutil.refresh_pillar and salt '*' state.apply "
               "salt.multimaster (the formula writes each minion's master list in that order)",
             "top file: apply salt.multimaster.master to "
             + (f"{rec['self']} (this master's own minion)" if rec.get("self") else
                "this master's own minion")
             + ", no longer to the old primary's: the salt/key reactor, the pull channel and "
               "the scheduled sync are the primary's"]
    if new.get("topology") and new["topology"] != "shared":
        steps.append(f"set multimaster:topology: {new['topology']} in this master's "
                     "master.d/multimaster.conf")
    missing = [p for p in new["peers"] if not protocol.pull_allowed(opts.get("peer_run"), p)]
    if missing:
        steps.append(f"{', '.join(missing)} may not pull a large sync from this master: add\n"
                     + protocol.peer_run_snippet(missing))
    return steps


def promote(salt_ops, test=False, peers=None, address=None, tgt="*", tgt_type="glob"):
    """
    The steps of ``salt-run multimaster.promote`` (see the module): the
    report ``{"master", "test", "steps", "next_steps", "result"}``,
    ``retcode`` 1 in it when a step failed.  Raises :class:`PromoteError`
    (or :class:`membership.MembershipError`) when this master cannot be
    promoted (nothing changed).
    """
    opts = salt_ops.opts
    state = layout.state_dir(opts)
    rec = epoch.read(state)
    steps = {}
    comment = _check(opts, rec)
    new = epoch.promoted(rec, opts["id"], peers)
    ret = {"master": opts["id"], "test": test, "epoch": new["epoch"], "steps": steps,
           "retired": new["retired"], "peers": new["peers"]}
    steps["check"] = {"result": True, "comment": comment}
    if new != rec:
        if not test:
            epoch.write(state, new)
        steps["epoch"] = {"result": None if test else True,
                          "comment": f"epoch {new['epoch']}: {opts['id']} "
                                     f"{'would be' if test else 'is'} the primary"
                                     + (f", {', '.join(new['retired'])} retired"
                                        if new["retired"] else "")}
    steps["config"] = _configure(salt_ops, new["peers"], test)
    if steps["config"]["result"] is False:
        return report.steps_done(ret)
    if new["peers"]:
        if test:
            steps["sync"] = {"result": None, "comment": f"would sync {', '.join(new['peers'])}: "
                                                        f"they record epoch {new['epoch']}"}
        else:
            kwargs = {"topology": new["topology"]} if new.get("topology") else {}
            synced = salt_ops.sync(peers=",".join(new["peers"]), test=False, **kwargs)
            failed = sorted(p for p in new["peers"]
                            if not (synced.get(p) or {}).get("result"))
            steps["sync"] = {"result": not failed, "changes": {
                p: synced.get(p) for p in new["peers"]},
                "comment": (f"{', '.join(new['peers'])} synced: epoch {new['epoch']} recorded "
                            "there" if not failed else
                            f"not synced: {', '.join(failed)} (see changes; run "
                            "salt-run multimaster.sync again)")}
    entry = address or rec.get("entry")
    todo = []
    if entry:
        rows, todo = membership_steps.minions(salt_ops, entry, [], tgt, tgt_type, False)
        listing = sorted(rows.get("still_lists", []) + rows.get("pillar_lists", []))
        steps["minions"] = {"result": True, "minions": rows, "comment": (
            f"{len(listing)} minion(s) still list {entry}: {', '.join(listing)}" if listing
            else f"no minion that answered lists {entry}")}
    ret["next_steps"] = todo + _next_steps(opts, rec, new)
    return report.steps_done(ret)


def run(opts, context, sync, test, peers, address, tgt, tgt_type):
    """
    ``salt-run multimaster.promote`` (its arguments) with this master's
    Salt (:func:`membership_steps.salt_ops`; ``sync``: the runner's
    ``multimaster.sync``): the return of :func:`promote`, or bad input
    refused; ``context``: the runner's ``__context__`` (the exit code).
    """
    try:
        test = settings.flag("test", test)
        ret = promote(membership_steps.salt_ops(opts, sync), test,
                      None if peers is None else settings.as_list(peers, "peers"), address, tgt,
                      tgt_type)
    except (SaltInvocationError, PromoteError, membership.MembershipError) as exc:
        ret = settings.invalid(context, f"multimaster.promote: {exc}")
    if ret.get("retcode"):
        context["retcode"] = ret["retcode"]
    return ret
