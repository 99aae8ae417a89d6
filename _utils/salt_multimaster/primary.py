"""
The primary's side of ``salt-run multimaster.sync``, ``status``, ``restore``
and ``failback``: a call's input checked (:mod:`salt_multimaster.settings`),
one sync at a time under this primary's sync lock (:func:`sync_lock`,
:mod:`salt_multimaster.lock`), the rounds of a sync run
(:class:`salt_multimaster.rounds.Rounds`) with the Salt side the runner
passes in (``job``: a :class:`salt_multimaster.jobs.Salt`), and the
failback's calls to the peer (:func:`collect`, :func:`unseal`).

Plain Python: the runner passes its ``__opts__``, its ``__context__`` (the
exit code), its jid and its jobs; it keeps the compact reports.
"""

import contextlib
import functools
import logging
import os

from salt.exceptions import SaltInvocationError

from salt_multimaster import (finger, jobs, layout, lock, manifest, membership, outage,
                              protocol, revocation, rounds, seal, settings, transport, validate)
from salt_multimaster import epoch as epochs
from salt_multimaster import failback as failback_core
from salt_multimaster import sync as sync_core

log = logging.getLogger(__name__)

# A sync waits this long for another sync of this primary to end, then gives up.
LOCK_WAIT = 60
# Past this many ids a targeted key sync is a full minion_keys sync.
MAX_TARGETED_IDS = 200


def sync(opts, context, job, peers, only, test, force, minion_ids, **kwargs):
    """A sync of ``peers`` (``multimaster.sync``'s arguments): ``{peer: report}``."""
    try:
        settings.valid(settings.checked_args, minion_ids, only)
        force = settings.flag("force", force)
        conf = settings.conf(opts, dict(kwargs, peers=peers))
    except SaltInvocationError as exc:
        return settings.invalid(context, str(exc))
    only = settings.as_list(only, "only")
    ids = sorted(set(settings.as_list(minion_ids, "minion_ids")))
    error = settings.check(opts, conf, only)
    if not error and ids:
        other = [c for c in only if c != "minion_keys"]
        bad_ids = [mid for mid in ids if not manifest.valid_minion_id(mid)]
        if other:
            error = f"minion_ids syncs minion_keys only, not {', '.join(other)}"
        elif bad_ids:
            error = f"invalid minion id(s) in minion_ids: {', '.join(map(repr, bad_ids))}"
        only = ["minion_keys"]
        if len(ids) > MAX_TARGETED_IDS:
            ids = []
    if error:
        return settings.invalid(context, error)
    # a full sync (every configured category) reads everything again once
    # per verify_interval: what stat and the change journal cannot see
    full = not test and not ids and set(only or conf["replicate"]) >= set(conf["replicate"])
    if full and not conf["rescan"] and sync_core.verify_due(opts, conf["verify_interval"]):
        log.info("multimaster: periodic full verify (verify_interval %s s): every file and "
                 "key is read again", conf["verify_interval"])
        conf["rescan"] = True
    ret = run_rounds(opts, job, conf, only or conf["replicate"], test, force, ids)
    if not all(r["result"] for r in ret.values()):
        context["retcode"] = 1
        ret["retcode"] = 1
    elif full and conf["rescan"]:
        sync_core.verified(opts)
    return ret


def run_rounds(opts, job, conf, categories, test=False, force=False, ids=None):
    """``{peer: report}`` of a sync of every peer of ``conf`` (checked input)."""
    bad = sync_core.peer_errors(opts, conf["peers"])
    ret = {peer: {"result": False, "error": message} for peer, message in bad.items()}
    peers = [p for p in conf["peers"] if p not in bad]
    if peers:
        ret.update(rounds.Rounds(opts, conf, job, test, force, ids or None).run(peers, categories))
    return ret


def locked_sync(opts, context, job, jid, peers, only, test, force, minion_ids, **kwargs):
    """
    :func:`sync` under this primary's sync lock (no lock in test mode:
    ``test`` a bool); ``job``: the :class:`salt_multimaster.jobs.Salt` of
    this call, ``jid``: its own jid or None.
    """
    if test:
        return sync(opts, context, job, peers, only, test, force, minion_ids, **kwargs)
    with sync_lock(opts, context, kwargs.pop("lock_wait", None), jid) as busy:
        if busy:
            # per peer too: a caller checking each peer's result (the
            # reactor's key_event retries a failed sync) sees the failure
            conf = opts.get("multimaster")
            for peer in settings.as_list(peers, "peers") or settings.as_list(
                    conf.get("peers") if isinstance(conf, dict) else None, "multimaster:peers"):
                busy.setdefault(peer, {"result": False, "error": busy["error"]})
            return busy
        transport.sweep_grants(opts, job.jid_dir)
        return sync(opts, context, job, peers, only, test, force, minion_ids, **kwargs)


@contextlib.contextmanager
def sync_lock(opts, context, wait=None, jid=None):
    """
    Hold this primary's sync lock (``salt_multimaster.lock``) for the block,
    naming ``jid`` (the job this sync runs in) as the holder;
    yield None, or the failed return naming the running sync's jid when it
    did not end within ``wait`` seconds (``lock_wait=``, else
    ``multimaster:lock_wait``, default 60).
    """
    if wait is None:
        conf = opts.get("multimaster")
        wait = conf.get("lock_wait", LOCK_WAIT) if isinstance(conf, dict) else LOCK_WAIT
    try:
        wait = float(wait)
        if not 0 <= wait <= 86400:
            raise ValueError(wait)
    except (TypeError, ValueError):
        yield settings.invalid(
            context, f"lock_wait must be a number of seconds (0 to 86400), not {wait!r}")
        return
    held = lock.SyncLock(os.path.join(layout.state_dir(opts), lock.LOCK_NAME), jid, wait=wait)
    try:
        held.acquire()
    except lock.Busy as exc:
        yield settings.invalid(context, str(exc))
        return
    try:
        yield None
    finally:
        held.release()


def status(opts, context, job, peers, **kwargs):
    """``multimaster.status`` of ``peers``: ``{peer: how far it is from this primary}``."""
    try:
        conf = settings.conf(opts, dict(kwargs, peers=peers))
    except SaltInvocationError as exc:
        return settings.invalid(context, str(exc))
    error = settings.check(opts, conf, [])
    if error:
        return settings.invalid(context, error)
    categories = conf["replicate"]
    bad = sync_core.peer_errors(opts, conf["peers"])
    ret = {peer: {"reachable": False, "in_sync": False, "error": message}
           for peer, message in bad.items()}
    peers = [p for p in conf["peers"] if p not in bad]
    if not peers:
        ret["retcode"] = 1
        return ret
    primary, invs = rounds.Rounds(opts, conf, job, test=True).inventories(
        sync_core.status_categories(categories), peers)
    pub = primary["master_keys"]["files"]["pub"]
    primary_finger = finger.file_finger(pub, opts.get("hash_type", "sha256")) or None
    for peer in peers:
        inv, error = invs[peer]
        pullable = protocol.pull_allowed(opts.get("peer_run"), peer)
        ret[peer] = ({"reachable": False, "in_sync": False, "pull_allowed": pullable,
                      "error": error} if error else
                     sync_core.peer_status(peer, inv, primary, categories, conf["topology"],
                                           primary_finger, pullable))
    if not all(r.get("reachable") and r.get("master_running") is not False
               for r in ret.values()):
        context["retcode"] = 1
        ret["retcode"] = 1
    return ret


def restore(opts, context, peer, backup, test, **kwargs):
    """
    ``multimaster.restore`` of ``peer`` from its backup ``backup`` (``test``:
    a bool, checked by the runner): ``{peer: its reply}``.
    """
    try:
        if len(settings.as_list(peer, "peer")) != 1:
            raise SaltInvocationError("restore takes one peer: peer=<id of multimaster:peers>")
        conf = settings.conf(opts, dict(kwargs, peers=peer))
    except SaltInvocationError as exc:
        return settings.invalid(context, str(exc))
    peer = conf["peers"][0]
    bad = sync_core.peer_errors(opts, [peer])
    if bad:
        return settings.invalid(context, bad[peer])
    request = protocol.request("multimaster_peer.restore", backup_name=backup, test=test)
    got, error = jobs.Job(opts, [peer], "multimaster_peer.restore", request,
                          conf["timeout"]).replies()[peer]
    if error:
        return settings.invalid(context, error)
    ret = {peer: got}
    if not got.get("result"):
        context["retcode"] = 1
        ret["retcode"] = 1
    return ret


# ---------------------------------------------------------------------------
# The outage (salt-run multimaster.failback): the Salt side of the steps in
# salt_multimaster.failback.
# ---------------------------------------------------------------------------
def collect(opts, peer, items, timeout):
    """``(reply, error)`` of ``multimaster_peer.collect``: contents sealed to this master's key."""
    with open(layout.master_key_files(opts, "shared")[1], encoding="utf-8") as fh:
        reply_pub = fh.read()
    conf = settings.conf(opts, {})
    request = protocol.request("multimaster_peer.collect", items=items,
                               reply_to=opts["id"], reply_pub=reply_pub,
                               epoch=epochs.claim(opts, conf["peers"], conf["topology"]))
    return jobs.Job(opts, [peer], "multimaster_peer.collect", request, timeout).replies()[peer]


def unseal(opts, blob, purpose):
    """Open what a peer sealed to this master's own key."""
    with open(layout.master_key_files(opts, "shared")[0], "rb") as fh:
        return seal.unseal(fh.read(), blob, opts["id"], purpose)


def failback(opts, context, job, jid, peer, test, keep, **kwargs):
    """
    ``multimaster.failback`` of ``peer`` (its arguments): the steps' return,
    its ``retcode`` in ``context`` too.
    """
    lock_wait = kwargs.pop("lock_wait", None)
    try:
        test = settings.flag("test", test)
        if len(settings.as_list(peer, "peer")) != 1:
            raise SaltInvocationError("failback takes one peer: peer=<id of multimaster:peers>")
        conf = settings.conf(opts, kwargs)
        settings.valid(validate.peers, settings.as_list(peer, "peer"), conf["peers"])
        membership.as_list(keep)
    except (SaltInvocationError, membership.MembershipError) as exc:
        return settings.invalid(context, f"multimaster.failback: {exc}")
    peer = settings.as_list(peer, "peer")[0]
    error = settings.check(opts, conf, [])
    bad = sync_core.peer_errors(opts, [peer])
    if error or bad:
        return settings.invalid(context, error or bad[peer])
    salt_ops = failback_core.SaltOps(
        opts, conf, job, collect=functools.partial(collect, opts),
        unseal=functools.partial(unseal, opts),
        rotate_aes=lambda: revocation.request_rotation(opts),
        sync_all=lambda: run_rounds(opts, job, conf, conf["replicate"]))
    try:
        if test:
            ret = failback_core.failback(salt_ops, peer, True, keep)
        else:
            with sync_lock(opts, context, lock_wait, jid) as busy:
                if busy:
                    return busy
                transport.sweep_grants(opts, job.jid_dir)
                ret = failback_core.failback(salt_ops, peer, False, keep)
    except outage.FailbackError as exc:
        return settings.invalid(context, f"multimaster.failback: {exc}")
    if ret.get("retcode"):
        context["retcode"] = ret["retcode"]
    return ret
