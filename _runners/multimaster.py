"""
Keep peer masters true replicas of the primary master.

Run on the primary master.  Peers are reached through their own salt-minion,
which is a minion of the primary (``multimaster:peers`` lists those minion
ids).  Configuration lives in the primary's master config:

.. code-block:: yaml

    multimaster:
      peers: [master02, master03]
      topology: shared            # shared | signed
      replicate: [master_keys, minion_keys, file_roots, pillar_roots, master_config]
      master_config_keys: [nodegroups, external_auth, publisher_acl, peer, peer_run]

Keyword arguments of each function override it.  The logic lives in the
``salt_multimaster`` package (``primary``: sync, status, restore, failback;
``jobs``: the publishes; ``settings``: this config): this module reads
Salt's dunders and passes them down, guards each public function
(``guard``) and picks the compact reports.
"""

import functools
import importlib
import inspect
import logging
import os
import sys

import salt.utils.extmods
from salt.exceptions import SaltInvocationError

log = logging.getLogger(__name__)

__virtualname__ = "multimaster"


def _import_core():
    """
    Import the core modules this runner uses (ImportError while the core is
    not importable): when this module is imported, and by :func:`_load_core`.
    """
    # pylint: disable=global-statement,import-outside-toplevel,redefined-outer-name
    global salt_multimaster, fleet, guard, jobs, membership_steps, primary, promote_core
    global report, rotation_steps, settings, transport
    import salt_multimaster
    from salt_multimaster import (fleet, guard, jobs, membership_steps, primary, report,
                                  rotation_steps, settings, transport)
    # the public function promote() takes the module's name
    from salt_multimaster import promote as promote_core


try:
    _import_core()
    HAS_CORE = True
except ImportError:
    HAS_CORE = False


def _load_core():
    """
    With the repository as a file_roots root, ``salt-run saltutil.sync_runners``
    brings this runner but not ``_utils``: sync the utils once, then import.
    """
    global HAS_CORE  # pylint: disable=global-statement
    if HAS_CORE:
        return True
    try:
        synced = salt.utils.extmods.sync(__opts__, "utils")
        log.info("multimaster: synced utils for the runner: %s", synced)
        importlib.invalidate_caches()
        utils_dir = os.path.join(__opts__["extension_modules"], "utils")
        if utils_dir not in sys.path:
            sys.path.append(utils_dir)
        _import_core()
        HAS_CORE = True
    except Exception as exc:  # pylint: disable=broad-except
        log.debug("multimaster: core not importable: %s", exc)
    return HAS_CORE


def _answer(fun, message, args, kwargs):  # pylint: disable=unused-argument
    """How a call with bad arguments, or one that failed, is answered (:func:`_public`)."""
    return _invalid(message)


def _public(*extra):
    """
    This runner's one wrapper of its public functions
    (:func:`salt_multimaster.guard.public`): ``extra`` names what a
    function's ``**kwargs`` accepts; any other keyword is answered with
    every accepted one and the closest match, nothing run; whatever it
    raises is answered as a named error (``result: False``, ``retcode``).
    """

    def decorate(func):
        if HAS_CORE:
            return guard.public(__virtualname__, _answer, extra)(func)

        # the file_roots install's first load: the core comes with
        # __virtual__ (_load_core), so the guard is made at the call
        @functools.wraps(func)
        def guarded_at_call(*args, **kwargs):
            return guard.public(__virtualname__, _answer, extra)(func)(*args, **kwargs)

        # as the guard's: Salt passes every keyword, the guard checks them
        del guarded_at_call.__wrapped__
        guarded_at_call.__signature__ = inspect.signature(lambda *args, **kwargs: None)
        return guarded_at_call

    return decorate


def __virtual__():
    if _load_core():
        return __virtualname__
    return (False, "multimaster: the salt_multimaster core is missing; pip install "
            "salt-multimaster, or run 'salt-run saltutil.sync_all' with the repository in "
            "file_roots")


def _invalid(message):
    """Bad input or a failed call: ``result: False``, the error, a non-zero exit."""
    return settings.invalid(__context__, message)


def _own_job(fun):
    """
    ``(jid, event)`` of this call: the ``__jid__`` Salt set for the runner
    job (None outside one) and, when ``salt-run`` itself runs ``fun``, the
    job's connection to the master event bus (``__jid_event__``), which
    prints its progress lines; else None (the reactor, the scheduler, a
    ``peer_run`` call).  Salt stores the job's record as for any runner job.
    """
    event = globals().get("__jid_event__") if __opts__.get("fun") == fun else None
    return globals().get("__jid__"), event


def _reported(fun, ret, rows, *args):
    """``ret``, or ``rows(ret, *args)`` when salt-run prints ``fun``'s compact report."""
    if report.compact(__opts__, fun):
        return {"outputter": "txt", "data": rows(ret, *args)}
    return ret


@_public()
def version():
    """
    Return the version of salt-multimaster and where this runner was loaded from.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.version
    """
    return {"version": salt_multimaster.__version__, "runner": __file__}


# What sync and status take besides their named parameters: rescan and
# settings.OVERRIDES less peers (named here: the core may not be imported yet).
_CONF_KWARGS = ("rescan", "topology", "replicate", "master_config_keys", "timeout",
                "inline_limit", "pull_min_files", "backup_keep")
# what add_peer and remove_peer take besides their named parameters
_MEMBERSHIP_KWARGS = ("timeout",)


@_public(*_CONF_KWARGS, "lock_wait")
def sync(peers=None, only=None, test=False, force=False, minion_ids=None, verbose=False,
         **kwargs):
    """
    Make each peer master mirror this (primary) master.

    peers
        Peer minion ids (default: ``multimaster:peers`` from the master
        config); only ids listed there are accepted: anything else is
        refused before anything is sent.
    only
        Categories to sync, among master_keys, minion_keys, file_roots,
        pillar_roots, master_config (default: ``multimaster:replicate``).
    test
        Change nothing; report exactly what a real run would change.
    force
        Replace conflicting minion keys and remove keys found only on a peer.
    minion_ids
        Sync the keys of these minions only (implies ``only=minion_keys``):
        one publish per peer (the apply) when the primary knows what the
        peer holds since its last sync, else an inventory and an apply.
        The ``salt/key`` reactor
        passes the ids of its events.  Past 200 ids, a full ``minion_keys``
        sync runs instead.
    rescan
        Read and hash every minion key and every file_roots/pillar_roots
        file on the primary and the peers, ignoring the change journal and
        the state store's stats (like ``rsync -c``): finds what changed
        behind them.  It also drops the primary fileserver's own hash cache
        (``cachedir/roots/hash``), which trusts mtimes the same way.  It
        reads every byte of the roots on every master, where a plain sync
        only stats them: use it after a suspected edit behind the cache,
        not on every run.
    lock_wait
        Seconds to wait for another sync of this primary to end (default
        ``multimaster:lock_wait``, 60).  One sync runs at a time per
        primary (a lock in ``cachedir/multimaster/sync.lock``): a second
        one waits, then does only what is left; past ``lock_wait`` it
        changes nothing, returns ``a sync is already running, jid ...``
        and ``salt-run`` exits non-zero.  ``test=True`` takes no lock.

    verbose
        In the compact report (``salt-run`` without ``--out``), list every
        name instead of the first three.

    Returns, per peer, ``{"result": bool, "<category>": {"added": [...],
    "updated": [...], "removed": [...], "conflicts": [...], "errors": [...]}}``
    (``unconfirmed``: planned, not confirmed by the peer).  Without ``--out``
    salt-run prints a compact summary per peer; ``--out=json`` or ``yaml``
    give this data.  A peer that is not a replica in service afterwards
    (failed, unreachable, conflicts left, restart required, master down)
    gets ``result: False`` and one ``error`` line, and ``salt-run`` exits
    non-zero; the other peers are still synced.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.sync
        salt-run multimaster.sync peers=master02 only=minion_keys,file_roots test=True
        salt-run multimaster.sync minion_ids=web01,web02
        salt-run multimaster.sync rescan=True
        salt-run multimaster.sync --out=json
    """
    try:
        test, verbose = settings.flag("test", test), settings.flag("verbose", verbose)
    except SaltInvocationError as exc:
        return _invalid(str(exc))
    jid, event = _own_job("multimaster.sync")
    with jobs.Salt(__opts__, event) as job:
        ret = primary.locked_sync(__opts__, __context__, job, jid, peers, only, test, force,
                                  minion_ids, **kwargs)
    return _reported("multimaster.sync", ret, report.sync_rows, test, verbose)


@_public()
def pull(request):
    """
    Serve a peer what it pulls during a sync: the operations of its sync and
    the contents of minion keys, pillar and file_roots files, in chunks.

    Not for operators: a peer's minion calls it through ``peer_run`` while
    ``multimaster.sync`` runs.  The request names a grant the sync created
    for that peer only (a random token, valid ten minutes) and a chunk of
    it; the reply is sealed to the calling peer's minion key, so job cache
    and events hold ciphertext only.  Allow it on the primary with:

    .. code-block:: yaml

        peer_run:
          master0[2-9]:
            - multimaster.pull

    CLI Example:

    .. code-block:: bash

        salt master02 publish.runner multimaster.pull
    """
    served = transport.serve_pull(__opts__, request, __opts__.get("id"),
                                  _own_job("multimaster.pull")[0])
    if "error" in served:
        return served
    # the master prints each runner return it serves with the outputter the
    # return names; no_return (built in, like nested) prints "sealed:" and
    # skips the value, where nested would decode tens of MiB of ciphertext
    return {"outputter": "no_return", "data": served}


@_public("timeout")
def restore(peer=None, backup=None, test=False, **kwargs):
    """
    Roll a peer back: put back every file a sync replaced or removed there,
    from one of the peer's backups (``<peer master cachedir>/multimaster/
    backup/<timestamp>``, the newest ``multimaster:backup_keep`` kept,
    default 10).  What the peer holds now is backed up first, so a restore is
    undone the same way; files a sync added stay.  Run ``test=True`` first:
    it lists what would be put back.  A peer master must restart when master
    keys or config were restored (done in the background where systemd runs
    it).  A later ``multimaster.sync`` makes the peer mirror the primary
    again: fix the primary first.

    peer
        One peer of ``multimaster:peers``.
    backup
        The backup's timestamp, as a sync reported it (``backup``); default:
        the newest.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.restore peer=master02 test=True
        salt-run multimaster.restore peer=master02 backup=20261123T221500.123456Z
    """
    try:
        test = settings.flag("test", test)
    except SaltInvocationError as exc:
        return _invalid(str(exc))
    ret = primary.restore(__opts__, __context__, peer, backup, test, **kwargs)
    # a refusal (result: False) is returned as it is, a peer's reply reported
    return ret if ret.get("result") is False else _reported(
        "multimaster.restore", ret, report.restore_rows, test)


@_public(*_CONF_KWARGS)
def status(peers=None, verbose=False, **kwargs):
    """
    Report, per peer, how far it is from the primary; change nothing.

    Returns per peer: ``reachable``, the master key fingerprints of the
    primary and the peer (``master_finger``), minion key counts per state on
    both sides, and per category the drift a sync would repair
    (``{"added": n, "updated": n, "removed": n, "conflicts": n}``), whether
    the peer may pull bulk (``pull_allowed``, with the ``peer_run`` snippet
    when not), whether its salt-master runs (``master_running``) and whether
    it runs older keys or config than a sync wrote (``restart_pending``).
    Without ``--out`` salt-run prints a compact summary per peer.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.status
        salt-run multimaster.status peers=master02 --out=json
    """
    try:
        # checked as sync's: the compact status has no names to list
        settings.flag("verbose", verbose)
    except SaltInvocationError as exc:
        return _invalid(str(exc))
    with jobs.Salt(__opts__, _own_job("multimaster.status")[1]) as job:
        ret = primary.status(__opts__, __context__, job, peers, **kwargs)
    return _reported("multimaster.status", ret, report.status_rows)


@_public()
def audit(
    tgt="*",
    tgt_type="glob",
    timeout=None,
    masters=None,
    master_finger=None,
    topology=None,
    master_version=None,
):
    """
    Fleet report: run ``multimaster.audit`` on the targeted minions through
    the master this runs on, and list every targeted minion that did not
    return.  Run it on the primary and on each peer to see which minions are
    connected to which master.

    The master passes its own Salt version (``master_version``) so every
    minion checks version_skew.  ``masters``, ``master_finger`` and
    ``topology`` are passed on to the minions when given (else the minions
    use their pillar).

    Returns ``{"result", "master", "saltversion", "tgt", "tgt_type",
    "counts", "minions": {id: {"ok", "findings", "masters", "master_finger",
    "saltversion"}}, "missing", "failed", "totals": {check: {severity: n}},
    "retcode"}``.  Without ``--out`` a compact table is printed (one row per
    minion, then totals per check); ``--out=json`` (or yaml, nested...) gives
    the data.  salt-run exits non-zero when a minion fails the audit or a
    targeted minion does not return.

    tgt
        Target, default ``*``.

    tgt_type
        Target type (glob, list, compound, nodegroup, ...), default ``glob``.

    timeout
        Seconds to wait for the minions (default: the master's ``timeout``).

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.audit
        salt-run multimaster.audit tgt='web*' --out=json
        salt-run multimaster.audit tgt=G@os:Debian tgt_type=compound
    """
    return fleet.audit(__opts__, __context__, functools.partial(jobs.full_returns, __opts__),
                       tgt, tgt_type, timeout, masters, master_finger, topology, master_version)


@_public(*_MEMBERSHIP_KWARGS)
def add_peer(peer=None, address=None, test=False, tgt="*", tgt_type="glob", **kwargs):
    """
    Make ``peer``, the new master host's accepted salt-minion, a peer master
    of this primary: ``check`` its host, list it in the drop-in ``config``,
    ``sync`` everything to it (the master keys before its salt-master's
    first start; the drop-in put back when the sync fails), ``start`` its
    salt-master, and report the ``minions`` that get it at their next
    ``state.apply salt.multimaster``.  ``address`` overrides how minions
    name the new master.

    Arguments, steps and report: docs/add-remove-peer.rst.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.add_peer master03 test=True
        salt-run multimaster.add_peer master03
        salt-run multimaster.add_peer master03 address=master03.example.com
    """
    return membership_steps.run(__opts__, __context__, sync, "multimaster.add_peer",
                                membership_steps.add_peer, peer, kwargs, address=address,
                                test=test, tgt=tgt, tgt_type=tgt_type)


@_public(*_MEMBERSHIP_KWARGS)
def remove_peer(peer=None, address=None, test=False, force=False, tgt="*", tgt_type="glob",
                **kwargs):
    """
    Take ``peer``, added by add_peer, out of this primary's peers once no
    minion lists its master: the ``minions`` whose config or pillar still
    do are named and nothing changes (``force=True`` goes on anyway); then
    the ``config`` drop-in stops listing it.  Its salt-master is left
    running: stop it afterwards.

    Arguments, steps and report: docs/add-remove-peer.rst.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.remove_peer master03 test=True
        salt-run multimaster.remove_peer master03
    """
    return membership_steps.run(__opts__, __context__, sync, "multimaster.remove_peer",
                                membership_steps.remove_peer, peer, kwargs, address=address,
                                test=test, force=force, tgt=tgt, tgt_type=tgt_type)


@_public()
def rotate_key(peers=None, topology=None, test=False, fresh=False, tgt="*", tgt_type="glob",
               restart_cmd=None, restart_wait=120, verify_wait=60, timeout=15):
    """
    Give every master a new master key without losing a minion, one master
    at a time: the peers (``multimaster:peers``), then this primary.  Each
    master's old keypair is kept in its protected backup
    (``<cachedir>/multimaster/backup/<timestamp>/master_keys``, 0400 in 0700
    dirs).  A master is rotated only once the previous one serves its new
    key, so at every moment the other masters answer.

    - topology ``signed``: each master generates its new key itself (the
      private key never leaves its host) and signs it with the shared
      master_sign key; minions with ``verify_master_pubkey_sign`` accept it.
    - topology ``shared``: the new shared keypair is generated here, reaches
      each peer sealed to its minion key, then every minion is told the new
      public key, then this master switches.

    Afterwards every targeted minion is audited (``multimaster.audit``) for
    the new key; those that do not confirm are listed by id with the exact
    remedy, and ``salt-run`` exits non-zero.  An unfinished rotation (a
    master that did not restart, a stopped minion) is resumed by running
    the same command again (its record: ``<cachedir>/multimaster/rotation.json``).

    peers
        Default ``multimaster:peers``.
    topology
        Default ``multimaster:topology``, else ``shared``.
    test
        Change nothing: the checks and the plan.
    fresh
        Forget an unfinished rotation and start a new one.
    tgt, tgt_type
        The minions to tell (shared) and audit; default every minion.
    restart_cmd
        How a master restarts (run on its host); default
        ``multimaster:master_restart_cmd``, else on a peer host its minion
        option ``multimaster.master_restart_cmd``, else the service manager
        (systemd on this primary), else the run stops with
        ``restart_required`` and the remedy.  A command whose program is
        not installed is refused before that master's key is written.
    restart_wait
        Seconds to wait for a restarted master to serve its new key (the
        primary's restart command exiting non-zero ends the wait at once).
    verify_wait
        Seconds to wait for minions to reconnect before they are listed.
    timeout
        Seconds for each call to the peers and minions.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.rotate_key test=True
        salt-run multimaster.rotate_key
        salt-run multimaster.rotate_key topology=signed --out=json
    """
    return rotation_steps.rotate_key(
        __opts__, globals().get("__jid__"), globals().get("__jid_event__"), status,
        peers=peers, topology=topology, test=test, fresh=fresh, tgt=tgt, tgt_type=tgt_type,
        restart_cmd=restart_cmd, restart_wait=restart_wait, verify_wait=verify_wait,
        timeout=timeout)


@_public("lock_wait")
def failback(peer=None, test=False, keep=None, verbose=False, **kwargs):
    """
    Carry to this primary what was changed on ``peer`` since its last sync
    (the primary down: keys accepted, rejected or deleted there, files of
    its roots edited, added or removed), then sync every peer, so that all
    masters agree and a plain ``multimaster.sync`` is clean again.

    The changes come from the peer sealed to this master's key and are
    written here as a sync writes a peer: validated, each checked against
    its sha256, confined to this master's pki_dir and roots, staged, what
    they replace or remove backed up in ``<cachedir>/multimaster/backup``.
    A key that leaves ``minions/`` makes this master rotate its AES session
    key, as ``salt-key -r/-d`` does.  Options the peer changed in its
    ``multimaster-sync.conf`` are named, not carried: set them in this
    master's config, or ``keep`` them.  Every step is reported; a second
    run finds nothing left to carry; an interrupted run converges when run
    again.

    peer
        One peer of ``multimaster:peers``.
    test
        Show what the peer changed and what would be carried; change nothing.
    keep
        ``primary`` to keep this master's side of every item (as a sync with
        ``force=True`` of that peer), or the items to keep it for, named as
        ``test=True`` shows them: a minion id, ``<saltenv>:<path>``, an
        option, or a category (``minion_keys``, ``file_roots``,
        ``pillar_roots``, ``master_config``).
    lock_wait
        Seconds to wait for a running sync (default 60).
    verbose
        In the compact report, list every name.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.failback peer=master02 test=True
        salt-run multimaster.failback peer=master02
        salt-run multimaster.failback peer=master02 keep=web09,base:app/init.sls
    """
    try:
        verbose = settings.flag("verbose", verbose)
    except SaltInvocationError as exc:
        return _invalid(f"multimaster.failback: {exc}")
    jid, event = _own_job("multimaster.failback")
    with jobs.Salt(__opts__, event) as job:
        ret = primary.failback(__opts__, __context__, job, jid, peer, test, keep, **kwargs)
    return _reported("multimaster.failback", ret, report.failback_rows, verbose)


@_public()
def promote(peers=None, test=False, address=None, tgt="*", tgt_type="glob", verbose=False,
            **kwargs):
    """
    Make this peer master the primary, when the primary is gone for good:
    its epoch record takes the next epoch with this master as the primary
    and the old one retired; the old primary's other peers become this
    master's ``multimaster:peers`` (``master.d/multimaster-peers.conf``) and
    are synced, so they record the new epoch.  From then on every master
    that knows it refuses a sync from the old primary: ``this master was
    promoted away from <old> at epoch N: run multimaster.failback on <new>
    instead``.  The minions whose config or cached pillar still list the
    old primary are named, with the pillar and top file changes for the
    formula (``multimaster:masters``, the new primary first).  A second
    run changes nothing and syncs the peers again.

    Run it on the peer to promote, with the old primary stopped for good.

    peers
        This master's peers (default: the old primary's, less this host).
    test
        Show the plan; change nothing.
    address
        How minions name the old primary (default: as its syncs said).
    tgt, tgt_type
        The minions whose master list is checked (default every minion).
    CLI Example:

    .. code-block:: bash

        salt-run multimaster.promote test=True
        salt-run multimaster.promote
    """
    try:
        verbose = settings.flag("verbose", verbose)
    except SaltInvocationError as exc:
        return _invalid(f"multimaster.promote: {exc}")
    ret = promote_core.run(__opts__, __context__, sync, test, peers, address, tgt, tgt_type)
    return _reported("multimaster.promote", ret, report.steps_rows,
                     f"{__opts__['id']} (epoch {ret.get('epoch')})", verbose)
