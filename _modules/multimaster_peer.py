"""
Peer-side half of ``salt-run multimaster.sync``.

Loads only on a host with a salt-master configuration: the minion running
next to a peer master.  The master configuration is found at the minion
option ``multimaster.master_config`` (default: ``$SALT_MASTER_CONFIG`` or
``/etc/salt/master``); its ``pki_dir``, ``cachedir``, ``file_roots`` and
``pillar_roots`` are the ones managed.

The primary's runner calls these functions; operators rarely need them
directly, except ``multimaster_peer.inventory`` to see what a peer holds.
The logic lives in :mod:`salt_multimaster.peer` (the inventory),
:mod:`salt_multimaster.applier` and :mod:`salt_multimaster.restore`; this
module opens the sealed requests and passes in the Salt-specific parts
(unseal with this minion's key, fetch from the primary's fileserver, pull
through ``publish.runner``, restart the local salt-master).
"""

import concurrent.futures
import logging
import os
import threading
import time

import salt.config
import salt.fileclient
from salt.exceptions import CommandExecutionError

try:
    from salt_multimaster import (applier, backup, daemon, fsutil, guard, layout, membership,
                                  peer, protocol, replicate, restart, rotation, seal, statefile,
                                  validate)
    from salt_multimaster import epoch as fencing
    from salt_multimaster import restore as restoring

    HAS_CORE = True
except ImportError:
    HAS_CORE = False

log = logging.getLogger(__name__)

__virtualname__ = "multimaster_peer"

# file_roots files fetched from the primary's fileserver at once
FETCH_THREADS = 4


def _master_config_path():
    return __opts__.get("multimaster.master_config") or os.environ.get(
        "SALT_MASTER_CONFIG", "/etc/salt/master"
    )


def __virtual__():
    if not HAS_CORE:
        return (False, "multimaster_peer: the salt_multimaster core is missing")
    if not os.path.isfile(_master_config_path()):
        return (
            False,
            f"multimaster_peer: no salt-master configuration at {_master_config_path()} "
            "(set the minion option multimaster.master_config)",
        )
    return __virtualname__


def _master_opts():
    path = _master_config_path()
    # the drop-in a sync writes, damaged: moved aside, written again by the sync
    applier.dropin_damaged(path, _state_dir())
    try:
        return salt.config.master_config(path)
    except Exception as exc:  # pylint: disable=broad-except
        raise CommandExecutionError(f"cannot read the master config {path}: {exc}") from exc


def _state_dir():
    return layout.state_dir(__opts__)


def _minion_key():
    with open(os.path.join(__opts__["pki_dir"], "minion.pem"), "rb") as fh:
        return fh.read()


def _unseal(blob, purpose):
    """Open what the primary sealed to this minion."""
    return seal.unseal(_minion_key(), blob, __opts__["id"], purpose)


def _request(fun, sealed, given):
    """
    The keyword arguments of this call: the request the primary sealed to
    this minion (``sealed``, published as ``{peer id: blob}``: the publish
    reaches every minion, the arguments only this one), else those ``given``
    on the command line.
    """
    if sealed is None:
        return given
    try:
        kwargs = protocol.open_request(_minion_key(), __opts__["id"], f"multimaster_peer.{fun}",
                                       sealed)
        return protocol.request_args(f"multimaster_peer.{fun}", kwargs, given)
    except protocol.ProtocolError as exc:
        raise CommandExecutionError(f"multimaster_peer.{fun}: {exc}") from None


def _after_return(work):
    """
    Run ``work`` once this job has returned, in a thread of the job's
    process (which waits for it before it exits).
    """
    threading.Thread(target=peer.record_after_return, args=(_state_dir(), work),
                     name="multimaster-key-history", daemon=False).start()


def _refused(fun, exc):
    """Bad input from the primary or the CLI: a named error, result False, a non-zero exit."""
    log.error("multimaster: %s refused: %s", fun, exc)
    __context__["retcode"] = 1
    return {"result": False, "error": f"{fun}: {exc}"}


def _fenced(fun, mopts, sealed, claim):
    """
    The refusal of a request (sealed: from a primary's runner) of a primary
    this master was promoted away from (:func:`salt_multimaster.epoch.fence`,
    which records a newer epoch), else None.
    """
    if sealed is None:
        return None  # an operator's own call
    try:
        fencing.fence(layout.state_dir(mopts), claim, __opts__["id"])
    except fencing.Fenced as exc:
        log.error("multimaster: %s refused: %s", fun, exc)
        __context__["retcode"] = 1
        return _reply({"result": False, "error": str(exc)})
    return None


def _answer(fun, message, args, kwargs):  # pylint: disable=unused-argument
    """
    How a call with bad arguments, or one that failed, is answered
    (:func:`_public`): a named error, ``result: False``, a non-zero exit.
    """
    __context__["retcode"] = 1
    return _reply({"result": False, "error": message})


def _reply(ret):
    """A reply to the primary (its protocol), with the damaged state files rebuilt meanwhile."""
    rebuilt = statefile.noticed()
    if rebuilt and isinstance(ret, dict):
        ret["rebuilt"] = rebuilt
        if isinstance(ret.get("inventory"), dict):  # what the primary plans from
            ret["inventory"]["rebuilt"] = rebuilt
    return protocol.reply(ret)


def _public(*extra):
    """
    This module's one wrapper of its public functions
    (:func:`salt_multimaster.guard.public`): any keyword a function does not
    take is answered with every accepted one and the closest match
    (``result: False``), nothing run; whatever it raises is answered as a
    named error, never Salt's traceback.  (Without the core the module does
    not load: see ``__virtual__``.)
    """
    if not HAS_CORE:
        return lambda func: func
    return guard.public(__virtualname__, _answer, extra)


@_public()
def inventory(categories=None, digests=None, topology="shared", config_keys=None, rescan=False,
              sealed=None, epoch=None):
    """
    Report what this peer master holds, for the categories asked; change
    nothing.

    For ``minion_keys``, ``file_roots`` and ``pillar_roots`` the manifests are
    cut in buckets; only the buckets whose digest differs from the primary's
    (``digests``) are returned: an unchanged peer answers with digests only,
    a peer one key behind with one bucket.  Key dirs unchanged since the
    last inventory are not listed again, and files unchanged in size,
    inode and mtime are not read again, unless ``rescan``.

    CLI Example:

    .. code-block:: bash

        salt master02 multimaster_peer.inventory categories='[minion_keys]'
    """
    args = _request("inventory", sealed, {
        "categories": categories, "digests": digests, "topology": topology,
        "config_keys": config_keys, "rescan": rescan, "epoch": epoch})
    categories = args["categories"] or list(replicate.CATEGORIES)
    digests = args["digests"] or {}
    try:
        validate.categories(categories)
        if not isinstance(digests, dict):
            raise validate.InvalidInput(f"digests must be a mapping, not {digests!r}")
        if args["config_keys"] is not None:
            if not isinstance(args["config_keys"], (list, tuple)):
                raise validate.InvalidInput(
                    f"config_keys must be a list, not {args['config_keys']!r}")
            validate.config_keys(args["config_keys"])
    except validate.InvalidInput as exc:
        return _reply(_refused("multimaster_peer.inventory", exc))
    mopts = _master_opts()
    refused = _fenced("multimaster_peer.inventory", mopts, sealed, args["epoch"])
    if refused:
        return refused
    started = time.monotonic()
    try:
        with peer.locked(_state_dir()):
            ret = peer.inventory(mopts, _state_dir(), categories, digests,
                                 args["topology"], args["config_keys"], rescan=args["rescan"])
            ret["master_restart"] = _restart_master().describe(__opts__["id"])
    except peer.PeerError as exc:
        raise CommandExecutionError(str(exc)) from None
    log.debug("multimaster: inventory in %.3f s", time.monotonic() - started)
    return _reply(ret)


def _fetch(ops):
    """
    Fetch file_roots files from the primary's fileserver, point-to-point, a
    few requests in flight at once (one file client per thread).  Return
    ``{id(op): path in the minion's file cache or a PeerError}``.
    """
    local = threading.local()
    clients = []

    def one(op):
        if not hasattr(local, "client"):
            local.client = salt.fileclient.get_file_client(__opts__)
            clients.append(local.client)
        try:
            cached = local.client.cache_file(f"salt://{op['rel']}", op["env"])
            return cached or peer.PeerError("not served by the primary's fileserver")
        except Exception as exc:  # pylint: disable=broad-except
            return peer.PeerError(f"fetch failed: {exc}")

    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=FETCH_THREADS) as pool:
            return dict(zip((id(op) for op in ops), pool.map(one, ops)))
    finally:
        for client in clients:
            client.destroy()


def _pull(request):
    """One ``multimaster.pull`` of the primary, through ``peer_run``."""
    try:
        return __salt__["publish.runner"]("multimaster.pull", arg=[f"request={request}"],
                                          timeout=120)
    except Exception as exc:  # pylint: disable=broad-except
        raise peer.PeerError(f"pull from the primary failed: {exc}") from exc


def _restart_master(cmd=None):
    """
    How the local salt-master restarts (:class:`salt_multimaster.restart.MasterRestart`):
    ``cmd`` (a rotation's ``restart_cmd``), else the minion option
    ``multimaster.master_restart_cmd``, else the service manager.  Calling
    it marks the restart (the running master keeps the old keys/config
    until it restarts: the next inventory says ``restart_pending`` until
    then) and starts it in the background.
    """
    return restart.MasterRestart(
        __opts__,
        lambda: daemon.mark_restart(_master_opts(),
                                    os.path.join(_state_dir(), daemon.RESTART_MARKER)),
        restart.salt_run_bg(__salt__),
        lambda: restart.service_available(__salt__, "salt-master"), cmd=cmd)


@_public()
def apply(ops=None, topology="shared", pull_token=None, pull_chunks=0, sealed=None,
          backup_keep=backup.DEFAULT_KEEP, keys_digest=None, expect=None, config_keys=None,
          confirm=None, epoch=None):
    """
    Apply the operations planned by ``salt-run multimaster.sync``.

    Every file replaced or removed is first copied to
    ``<master cachedir>/multimaster/backup/<timestamp>/``; every write is
    atomic.  Private keys arrive sealed to this minion's key.  With
    ``pull_token``, the operations and the bulk contents are pulled from the
    primary (``pull_chunks`` sealed replies) instead of riding in the
    publish.  ``keys_digest``: the primary's minion key digests, to record
    which ids this peer holds from it.  ``expect``: apply only if this peer
    holds what these digests say (a change sync in one round trip), else
    answer with the inventory (``config_keys``: its replicated options).
    ``confirm``: the primary's digests of the roots and options, to record
    what this peer holds in step with it (the base of the next sync).

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.sync peers=master02
    """
    args = _request("apply", sealed, {"ops": ops, "topology": topology,
                                      "pull_token": pull_token, "pull_chunks": pull_chunks,
                                      "backup_keep": backup_keep, "keys_digest": keys_digest,
                                      "expect": expect, "config_keys": config_keys,
                                      "confirm": confirm, "epoch": epoch})
    mopts = _master_opts()
    refused = _fenced("multimaster_peer.apply", mopts, sealed, args["epoch"])
    if refused:
        return refused
    master_restart = _restart_master()
    try:
        ret = applier.apply(mopts, _state_dir(), args["ops"], args["topology"],
                            args["backup_keep"], _unseal, _fetch, master_restart, pull=_pull,
                            pull_token=args["pull_token"], pull_chunks=args["pull_chunks"],
                            keys_digest=args["keys_digest"], expect=args["expect"],
                            config_keys=args["config_keys"], after=_after_return,
                            confirm=args["confirm"])
    except validate.InvalidInput as exc:
        return _reply(_refused("multimaster_peer.apply", exc))
    except (peer.PeerError, protocol.ProtocolError) as exc:
        raise CommandExecutionError(str(exc)) from None
    # a master still running older keys or config: how its restart went
    for held in (ret, ret.get("inventory")):
        if isinstance(held, dict) and held.get("restart_pending"):
            held["master_restart"] = master_restart.describe(__opts__["id"])
    return _reply(ret)


@_public()
def restore(backup_name=None, test=False, sealed=None, epoch=None):
    """
    Put back on this peer what a sync replaced or removed: every file of the
    backup ``backup_name`` (a timestamp under
    ``<master cachedir>/multimaster/backup``; default: the newest).  What is
    there now is itself backed up first, so a restore can be undone the same
    way.  Files a sync added are left in place.  With ``test``, only list.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.restore peer=master02 test=True
    """
    args = _request("restore", sealed, {"backup_name": backup_name, "test": test,
                                        "epoch": epoch})
    mopts = _master_opts()
    refused = _fenced("multimaster_peer.restore", mopts, sealed, args["epoch"])
    if refused:
        return refused
    try:
        ret = restoring.restore(mopts, _state_dir(), args["backup_name"], args["test"],
                                _restart_master())
    except peer.PeerError as exc:
        raise CommandExecutionError(str(exc)) from None
    return _reply(ret)


@_public()
def collect(items=None, reply_to=None, reply_pub=None, sealed=None, epoch=None):
    """
    The contents of ``items`` (minion keys and roots files, named as
    ``minion_keys/<state>/<id>`` and ``<file_roots|pillar_roots>/<saltenv>/<path>``),
    each sealed to ``reply_pub`` (the primary's master public key) for
    ``reply_to`` (its id): what ``salt-run multimaster.failback`` carries
    from this peer to the primary.  Reads only inside this master's pki_dir
    and roots; changes nothing.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.failback peer=master02 test=True
    """
    args = _request("collect", sealed, {"items": items, "reply_to": reply_to,
                                        "reply_pub": reply_pub, "epoch": epoch})
    if (not isinstance(args["items"], list) or not all(isinstance(i, str) for i in args["items"])
            or not isinstance(args["reply_to"], str) or not isinstance(args["reply_pub"], str)):
        return _reply(_refused("multimaster_peer.collect",
                               "items (a list of item names), reply_to and reply_pub "
                               "are required"))
    mopts = _master_opts()
    refused = _fenced("multimaster_peer.collect", mopts, sealed, args["epoch"])
    if refused:
        return refused
    ret = restoring.collect(mopts, args["items"], args["reply_to"], args["reply_pub"])
    return _reply(ret)


# ---------------------------------------------------------------------------
# Membership (salt-run multimaster.add_peer / remove_peer): the new peer
# host's check.  Logic in salt_multimaster.membership.
# ---------------------------------------------------------------------------
@_public()
def host_check(topology="shared"):
    """
    Report, changing nothing, whether this host can become a peer master:
    its master's id and config file (``multimaster.master_config``),
    interface and ports, whether something listens on them, the running
    salt-master's pid (none: never started or stopped) and the sha256 of
    the master public key it serves for ``topology``.  ``salt-run
    multimaster.add_peer`` calls it first.

    CLI Example:

    .. code-block:: bash

        salt master02 multimaster_peer.host_check
    """
    if topology not in layout.TOPOLOGIES:
        return _refused("multimaster_peer.host_check",
                        f"unknown topology {topology!r} (known: {', '.join(layout.TOPOLOGIES)})")
    ret = membership.host_report(_master_opts(), __grains__, topology)
    ret["master_restart"] = _restart_master().describe(__opts__["id"])
    return ret


@_public()
def restart_master(test=False):
    """
    Restart (or start, when it is stopped) this host's salt-master in the
    background once this job has returned, the way every step of
    salt-multimaster does (a sync of new master keys or options, a restore,
    a key rotation): the minion option ``multimaster.master_restart_cmd``,
    else the service manager.  ``salt-run multimaster.add_peer`` starts a
    new peer's salt-master with it.  A configured command whose program is
    not installed here is refused (``result: False``).

    test
        Only say what would happen.

    Returns ``{"result", "restart", "cmd"}``; ``restart`` is
    ``restarting`` (``would restart``), or ``restart_required`` when
    nothing here can restart it (no service manager knows salt-master and
    no command is configured).

    CLI Example:

    .. code-block:: bash

        salt master02 multimaster_peer.restart_master test=True
    """
    master_restart = _restart_master()
    if master_restart.refused:
        return _refused("multimaster_peer.restart_master",
                        master_restart.why_refused(__opts__["id"]))
    if validate.boolean("test", test):
        return {"result": True, "restart": master_restart.predict(), "cmd": master_restart.cmd}
    how = master_restart()
    ret = {"result": how == "restarting", "restart": how, "cmd": master_restart.cmd}
    if how != "restarting":
        ret["error"] = ("nothing here can restart the salt-master: no service manager knows "
                        "it and the minion option multimaster.master_restart_cmd is not set")
    return ret


# ---------------------------------------------------------------------------
# Master key rotation (salt-run multimaster.rotate_key): the peer's step.
# Everything below this line belongs to the rotation; the logic lives in
# salt_multimaster.rotation.
# ---------------------------------------------------------------------------
@_public()
def rotate_key(topology="signed", keypair=None, restart_only=False, restart_cmd=None,
               test=False, backup_keep=backup.DEFAULT_KEEP, sealed=None):
    """
    Give this peer's salt-master a new master keypair and restart it: the
    peer's step of ``salt-run multimaster.rotate_key``.  The old keypair is
    kept in ``<master cachedir>/multimaster/backup/<timestamp>/master_keys/``
    (0400 in 0700 dirs; ``multimaster.restore`` puts it back).

    topology
        ``signed``: the keypair is generated here (the private key never
        leaves this host); the master signs it with master_sign.pem.
        ``shared``: the primary's new shared keypair, in ``keypair``.
    keypair
        ``{"sealed": <private key sealed to this minion>, "pub": <PEM>}``
        (topology shared, inside the sealed request).
    restart_only
        Write nothing; restart the master (a re-run after a restart that did
        not happen).
    restart_cmd
        The command restarting the salt-master (default: the minion option
        ``multimaster.master_restart_cmd``, else the service manager, else
        the restart is reported ``restart_required``).  A command whose
        program is not installed here is refused before anything is written.
    test
        Change nothing; say what would happen.
    backup_keep
        The backups kept here, the newest (the primary's
        ``multimaster:backup_keep``).

    Returns ``{"result", "old", "new", "backup", "restart"}``; no key
    material, only fingerprints.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.rotate_key test=True
    """
    args = _request("rotate_key", sealed, {
        "topology": topology, "keypair": keypair, "restart_only": restart_only,
        "restart_cmd": restart_cmd, "test": test, "backup_keep": backup_keep})
    ret = _rotate_key(**args)
    ret["protocol"] = protocol.PROTOCOL
    return ret


def _rotate_key(topology, keypair, restart_only, restart_cmd, test, backup_keep):
    mopts = _master_opts()
    reason = rotation.unsupported(mopts, topology)
    if reason:
        return _refused("multimaster_peer.rotate_key", reason)
    if restart_cmd is not None and not isinstance(restart_cmd, str):
        return _refused("multimaster_peer.rotate_key",
                        f"restart_cmd must be a command string, not {restart_cmd!r}")
    master_restart = _restart_master(restart_cmd)
    if master_restart.refused:
        return _refused("multimaster_peer.rotate_key",
                        f"no new key: {master_restart.why_refused(__opts__['id'])}")
    ret = {"result": True, "old": rotation.current_finger(mopts), "new": None, "backup": None,
           "restart": None}
    if test:
        ret["restart"] = master_restart.predict()
        return ret
    if not restart_only:
        try:
            if topology == "shared":
                if not isinstance(keypair, dict) or not keypair.get("sealed"):
                    raise rotation.RotationError(
                        "topology shared: no sealed keypair in the request")
                priv = _unseal(keypair["sealed"], "rotate_key/master.pem")
                pub = str(keypair.get("pub") or "").encode()
            else:
                priv, pub = rotation.gen_keypair(mopts.get("keysize") or rotation.DEFAULT_KEYSIZE)
            root = rotation.backup_root(mopts)
            done = rotation.install(mopts, priv, pub, root)
        except (rotation.RotationError, seal.SealError, OSError, fsutil.PathError) as exc:
            return _refused("multimaster_peer.rotate_key", exc)
        ret.update(old=done["old"], new=done["new"], backup=done["backup"])
        backup.trim(os.path.dirname(root), backup_keep)
    else:
        ret["new"] = ret["old"]
    ret["restart"] = master_restart()
    log.info("multimaster: master key rotated (%s -> %s), restart: %s",
             ret["old"], ret["new"], ret["restart"])
    return ret
