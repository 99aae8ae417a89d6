"""
The steps of ``salt-run multimaster.add_peer`` and ``multimaster.remove_peer``
on the primary (:func:`add_peer`, :func:`remove_peer`): check, write the
drop-in, restart and sync, start the new peer, point the minions at it
or away from it.  They ask Salt for what they need through a
:class:`SaltOps` (:func:`salt_ops`: this master's, through
:mod:`salt_multimaster.jobs`; :func:`run`: the runner's call of the
steps); plain Python, no Salt dunders.  The drop-in, the checks and the
reports they use: :mod:`salt_multimaster.membership`.
"""

import functools
import logging
import time

import salt.config
from salt.exceptions import SaltInvocationError

from salt_multimaster import jobs, layout, membership, protocol, report, settings

log = logging.getLogger(__name__)

# Seconds a started peer master is given to answer on its ports, and how
# often it is asked meanwhile.
PEER_START_WAIT = 60
PEER_START_POLL = 2


class SaltOps:
    """
    What the steps of add_peer and remove_peer ask of Salt: :func:`salt_ops`
    builds one from the runner's ``__opts__`` and clients, a unit test from fakes.

    opts
        The primary's options (the runner's ``__opts__``): the steps set its
        ``multimaster`` (:meth:`reload_peers`; a test run, for its sync),
        which the sync reads.
    cmd(tgt, fun, arg=None, kwarg=None, tgt_type="glob", timeout=30)
        ``{minion id: return}`` of the minions that returned ``fun``.
    minions(tgt, tgt_type)
        The ids of the accepted minions ``tgt`` matches.
    cached_pillars(minions)
        ``{minion id: pillar}`` from the master's minion data cache.
    sync(peers, test)
        ``multimaster.sync`` of ``peers`` (keyword arguments): its return.
    sleep, monotonic
        The clock of the wait for a started salt-master.
    """

    def __init__(self, opts, cmd, minions, cached_pillars, sync, sleep=time.sleep,
                 monotonic=time.monotonic):
        self.opts = opts
        self.cmd = cmd
        self.minions = minions
        self.cached_pillars = cached_pillars
        self.sync = sync
        self.sleep = sleep
        self.monotonic = monotonic

    def reload_peers(self):
        """Read the master config again (the drop-in just written): the peers Salt now loads."""
        fresh = salt.config.master_config(self.opts["conf_file"])
        self.opts["multimaster"] = fresh.get("multimaster")
        return membership.effective_peers(fresh)

    def host(self, peer, topology, timeout):
        """The peer host's ``multimaster_peer.host_check`` return (None: no answer)."""
        return self.cmd(peer, "multimaster_peer.host_check", kwarg={"topology": topology},
                        timeout=timeout).get(peer)


def salt_ops(opts, sync):
    """
    The :class:`SaltOps` of this master's Salt (the runner's, for add_peer,
    remove_peer and promote): its calls through :mod:`salt_multimaster.jobs`,
    ``sync`` the runner's ``multimaster.sync``.
    """
    return SaltOps(opts, cmd=functools.partial(jobs.cmd, opts),
                   minions=functools.partial(jobs.minions, opts),
                   cached_pillars=functools.partial(jobs.cached_pillars, opts), sync=sync)


def run(opts, context, sync, fun, steps, peer, kwargs, **args):
    """
    ``steps`` (:func:`add_peer`/:func:`remove_peer`) of ``peer`` run with this
    master's Salt (:func:`salt_ops`), bad input refused before anything is
    sent; without ``--out``, salt-run running ``fun`` prints the compact
    report.  ``context``: the runner's ``__context__`` (the exit code).
    """
    try:
        for flag in ("test", "force"):
            if flag in args:
                args[flag] = settings.flag(flag, args[flag])
        args["timeout"] = settings.timeout(kwargs.get("timeout") or 30)
        ret = steps(salt_ops(opts, sync), peer, **args)
    except (SaltInvocationError, membership.MembershipError) as exc:
        ret = settings.invalid(context, str(exc))
    if ret.get("retcode"):
        context["retcode"] = ret["retcode"]
    if not report.compact(opts, fun):
        return ret
    return {"outputter": "txt", "data": membership.report_rows(ret)}


def primary_setup(opts, fun, peer):
    """
    The primary's side of ``fun`` (add_peer/remove_peer) for ``peer``:
    ``(topology, drop-in path, drop-in peers, peers Salt loads)``.  Raises
    :class:`MembershipError` when no peer is named or the drop-in cannot be
    used.
    """
    if not peer or not isinstance(peer, str):
        raise membership.MembershipError(f"{fun}: name the peer: salt-run {fun} <peer minion id>")
    conf = opts.get("multimaster") or {}
    topology = conf.get("topology", "shared") if isinstance(conf, dict) else "shared"
    if topology not in layout.TOPOLOGIES:
        raise membership.MembershipError(f"unknown multimaster:topology {topology!r}")
    dropin = membership.dropin_path(opts)
    shadow = membership.shadowed(opts["conf_file"], dropin)
    if shadow:
        raise membership.MembershipError(shadow)
    return topology, dropin, membership.read_dropin(dropin), membership.effective_peers(opts)


def _configure(salt_ops, dropin, peers, steps):
    """
    Write the drop-in listing ``peers`` and read the config again: the peers
    Salt now loads, or None with the failed ``config`` step in ``steps``.
    """
    try:
        membership.write_dropin(dropin, peers)
        return salt_ops.reload_peers()
    except (OSError, membership.MembershipError) as exc:
        steps["config"] = {"result": False, "comment": f"{dropin} not written: {exc}"}
        return None


def minions(salt_ops, entry, exclude, tgt, tgt_type, adding):
    """
    Per-minion rows (:func:`salt_multimaster.membership.minion_rows`) and
    next steps for ``entry``: the minions' live audit plus their cached pillar.
    """
    ids = sorted(set(salt_ops.minions(tgt, tgt_type)) - set(exclude))
    if not ids:
        return {}, []
    rets = salt_ops.cmd(ids, "multimaster.audit", tgt_type="list",
                        timeout=max(int(salt_ops.opts.get("timeout") or 5), 10))
    current = {mid: ret["masters"] for mid, ret in rets.items()
               if isinstance(ret, dict) and isinstance(ret.get("findings"), list)}
    pillars = membership.pillar_masters(salt_ops.cached_pillars(ids), ids)
    rows = membership.minion_rows(entry, ids, current, pillars, adding)
    return rows, membership.next_steps(rows, entry, adding)


def add_peer(salt_ops, peer, address=None, test=False, tgt="*", tgt_type="glob", timeout=30):
    """
    The steps of ``salt-run multimaster.add_peer`` (check, config, sync,
    start, minions; see docs/add-remove-peer.rst): the report, ``retcode``
    1 in it when the peer is not a configured replica in service.  Raises
    :class:`MembershipError` for a peer it must not add (nothing sent).
    """
    opts = salt_ops.opts
    topology, dropin, dropin_peers, configured = primary_setup(opts, "multimaster.add_peer",
                                                               peer)
    membership.check_new_peer(peer, opts, configured, dropin_peers)
    steps = {}
    ret = {"peer": peer, "test": test, "steps": steps, "next_steps": []}

    host = salt_ops.host(peer, topology, timeout)
    check = membership.check_host(peer, host, opts["id"], membership.pub_sha(opts, topology))
    steps["check"] = {"result": check["result"], "comment": check["comment"]}
    if not check["result"]:
        return report.steps_done(ret)
    try:
        ret["master_entry"] = membership.master_entry(host, address)
    except membership.MembershipError as exc:
        steps["check"] = {"result": False, "comment": str(exc)}
        return report.steps_done(ret)
    if not protocol.pull_allowed(opts.get("peer_run"), peer):
        ret["next_steps"].append(
            f"{peer} may not pull a sync's bulk: a first sync larger than inline_limit is "
            "refused; apply salt.multimaster.master on this primary (it grants every peer), "
            "or add:\n" + protocol.peer_run_snippet([peer]))

    peers = dropin_peers + [peer]
    if test:
        steps["config"] = {"result": None,
                           "comment": f"{dropin} would list {', '.join(peers)}"}
        saved = opts.get("multimaster")  # the sync reads the peers of opts
        opts["multimaster"] = dict(saved if isinstance(saved, dict) else {},
                                   peers=configured + [peer])
        try:
            synced = salt_ops.sync(peers=peer, test=True)
        finally:
            opts["multimaster"] = saved
    else:
        loaded = _configure(salt_ops, dropin, peers, steps)
        if loaded is None:
            return report.steps_done(ret)
        if peer not in loaded:
            membership.write_dropin(dropin, dropin_peers)
            salt_ops.reload_peers()
            steps["config"] = {"result": False, "comment": (
                f"{dropin} written but Salt does not load {peer} from it (an include of your "
                "config sets multimaster after master.d?): put back as it was")}
            return report.steps_done(ret)
        steps["config"] = {"result": True, "comment": f"{dropin} lists {', '.join(peers)}"}
        try:
            synced = salt_ops.sync(peers=peer, test=False)
        except Exception as exc:  # pylint: disable=broad-except
            log.exception("multimaster: add_peer: the sync of %s failed", peer)
            synced = {"error": f"{exc.__class__.__name__}: {exc}"}
    res = synced.get(peer) if isinstance(synced, dict) else None
    kept = membership.sync_kept(res, peer)
    steps["sync"] = {"result": (None if test else True) if kept else False,
                     "comment": ("replicated" if not test else "would replicate") if kept
                     else f"not replicated: {(res or synced or {}).get('error')}",
                     "changes": res}
    if not kept:
        if not test:
            membership.write_dropin(dropin, dropin_peers)
            salt_ops.reload_peers()
            steps["config"] = {"result": False, "comment": f"{dropin} put back as it was: "
                                                           "the sync failed"}
        return report.steps_done(ret)

    master = membership.master_step(check["master"], res, test)
    if master.pop("start"):
        master.update(start_master(salt_ops, peer, timeout))
    steps["start"] = master
    rows, todo = minions(salt_ops, ret["master_entry"], configured + [peer], tgt, tgt_type,
                         True)
    will = rows.get("will_get", [])
    steps["minions"] = {"result": True, "minions": rows, "comment": (
        f"{len(will)} minion(s) will list {ret['master_entry']} after state.apply "
        f"salt.multimaster: {', '.join(will) or 'none'}")}
    ret["next_steps"].extend(todo)
    return report.steps_done(ret)


def start_master(salt_ops, peer, timeout):
    """
    Start the peer's salt-master the way every restart of salt-multimaster
    goes (``multimaster_peer.restart_master``: the minion option
    ``multimaster.master_restart_cmd``, else the service manager) and wait
    up to :data:`PEER_START_WAIT` seconds for it: the ``start`` step's
    ``{"result", "comment"}``.
    """
    got = salt_ops.cmd(peer, "multimaster_peer.restart_master", timeout=timeout).get(peer)
    if not isinstance(got, dict) or got.get("restart") != "restarting":
        why = ("no service manager there knows salt-master, and no minion option "
               "multimaster.master_restart_cmd says how to start it"
               if isinstance(got, dict) and got.get("restart") == "restart_required" else
               got.get("error") if isinstance(got, dict) and got.get("error") else
               f"its salt-minion did not answer: {str(got)[:200]}")
        return {"result": False, "comment": (
            f"start salt-master on {peer} now ({why}): the primary's master keys are in place; "
            f"then salt-run multimaster.status peers={peer}")}
    end = salt_ops.monotonic() + PEER_START_WAIT
    while salt_ops.monotonic() < end:
        host = salt_ops.host(peer, "shared", timeout)
        if isinstance(host, dict) and host.get("master_pid"):
            return {"result": True, "comment": f"salt-master started on {peer} (pid "
                                               f"{host['master_pid']}, {got.get('cmd')}) with "
                                               "the primary's keys"}
        salt_ops.sleep(PEER_START_POLL)
    return {"result": False, "comment": f"salt-master on {peer} did not start within "
                                        f"{PEER_START_WAIT} s ({got.get('cmd')}): see its log"}


def remove_peer(salt_ops, peer, address=None, test=False, force=False, tgt="*",
                tgt_type="glob", timeout=30):
    """
    The steps of ``salt-run multimaster.remove_peer`` (minions, config; see
    docs/add-remove-peer.rst): the report, ``retcode`` 1 in it when a minion
    still lists the peer or the peer is still configured.  Raises
    :class:`MembershipError` for a peer it must not remove, or when the
    peer's master address is unknown (nothing changed).
    """
    opts = salt_ops.opts
    topology, dropin, dropin_peers, configured = primary_setup(opts, "multimaster.remove_peer",
                                                               peer)
    if peer not in configured:
        raise membership.MembershipError(
            f"{peer!r} is no peer of this primary (peers: {', '.join(configured) or 'none'})")
    if peer not in dropin_peers:
        raise membership.MembershipError(
            f"{peer!r} is listed in your own multimaster:peers, not in {dropin}: remove it "
            "there (add_peer did not add it)")
    host = None
    if not address:
        host = salt_ops.host(peer, topology, timeout)
        if not isinstance(host, dict) or "master_id" not in host:
            raise membership.MembershipError(
                f"{peer}'s minion did not say its master's address: pass address=<the "
                "entry minions list>")
    entry = membership.master_entry(host or {}, address)
    steps = {}
    ret = {"peer": peer, "test": test, "master_entry": entry, "steps": steps}
    rows, todo = minions(salt_ops, entry, configured, tgt, tgt_type, False)
    listing = sorted(rows.get("still_lists", []) + rows.get("pillar_lists", []))
    steps["minions"] = {"result": not listing, "minions": rows, "comment": (
        f"{len(listing)} minion(s) still list {entry}: {', '.join(listing)}" if listing
        else f"no minion that answered lists {entry}")}
    ret["next_steps"] = todo
    peers = [p for p in dropin_peers if p != peer]
    if listing and not force:
        steps["config"] = {"result": False, "comment": f"{peer} kept in {dropin}: minions still "
                                                       "list it (force=True removes it anyway)"}
    elif test:
        steps["config"] = {"result": None, "comment": f"{peer} would be removed from {dropin}"}
    else:
        loaded = _configure(salt_ops, dropin, peers, steps)
        if loaded is None:
            return report.steps_done(ret)
        steps["config"] = {"result": peer not in loaded, "comment": (
            f"{peer} removed from {dropin}" if peer not in loaded else
            f"{peer} removed from {dropin} but still in multimaster:peers of your config: "
            "remove it there")}
        if peer not in loaded:
            ret["next_steps"].append(f"stop salt-master on {peer}: no minion lists it and no "
                                     "sync reaches it any more")
    return report.steps_done(ret)
