"""
Peer-side half of ``salt-run multimaster.sync``.

Loads only on a host with a salt-master configuration: the minion running
next to a peer master.  The master configuration is found at the minion
option ``multimaster.master_config`` (default: ``$SALT_MASTER_CONFIG`` or
``/etc/salt/master``); its ``pki_dir``, ``cachedir``, ``file_roots`` and
``pillar_roots`` are the ones managed.

The primary's runner calls these functions; operators rarely need them
directly, except ``multimaster_peer.inventory`` to see what a peer holds.
The logic lives in :mod:`salt_multimaster.peer`; this module opens the
sealed requests and passes in the Salt-specific parts (unseal with this
minion's key, fetch from the primary's fileserver, pull through
``publish.runner``, restart the local salt-master).
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
    from salt_multimaster import (backup, daemon, fsutil, layout, membership, peer, protocol,
                                  replicate, restart, rotation, seal, validate)

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


def inventory(categories=None, digests=None, topology="shared", config_keys=None, test=False,
              rescan=False, minion_ids=None, sealed=None):
    """
    Report what this peer master holds, for the categories asked; change
    nothing.

    For ``minion_keys``, ``file_roots`` and ``pillar_roots`` the manifests are
    cut in buckets; only the buckets whose digest differs from the primary's
    (``digests``) are returned: an unchanged peer answers with digests only,
    a peer one key behind with one bucket.  Key dirs unchanged since the
    last inventory are not listed again, and files unchanged in size,
    inode and mtime are not read again, unless ``rescan``.  With
    ``minion_ids``: the keys of these ids only (a targeted sync).  ``test``
    is accepted for older primaries: an inventory never changes anything.

    CLI Example:

    .. code-block:: bash

        salt master02 multimaster_peer.inventory categories='[minion_keys]'
        salt master02 multimaster_peer.inventory minion_ids='[web01]'
    """
    args = _request("inventory", sealed, {
        "categories": categories, "digests": digests, "topology": topology,
        "config_keys": config_keys, "test": test, "rescan": rescan, "minion_ids": minion_ids})
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
        if args["minion_ids"] is not None:
            ids = validate.minion_ids(args["minion_ids"])
    except validate.InvalidInput as exc:
        return protocol.reply(_refused("multimaster_peer.inventory", exc))
    mopts = _master_opts()
    started = time.monotonic()
    try:
        with peer.locked(_state_dir()):
            if args["minion_ids"] is not None:
                ret = peer.targeted_inventory(mopts, _state_dir(), ids)
            else:
                ret = peer.inventory(mopts, _state_dir(), categories, digests,
                                     args["topology"], args["config_keys"],
                                     rescan=args["rescan"])
    except peer.PeerError as exc:
        raise CommandExecutionError(str(exc)) from None
    log.debug("multimaster: inventory in %.3f s", time.monotonic() - started)
    return protocol.reply(ret)


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

    if not ops:
        return {}
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
    Restart the local salt-master in the background with the one restart
    helper (:mod:`salt_multimaster.restart`): with ``cmd`` (a rotation's
    ``restart_cmd``), else through the service manager when it knows the
    salt-master; otherwise say a restart is required.
    """
    # the running master keeps the old keys/config until it restarts: the
    # next inventory says so (restart_pending) until then
    daemon.mark_restart(_master_opts(), os.path.join(_state_dir(), daemon.RESTART_MARKER))
    available = None
    if not cmd:
        cmd = restart.default_cmd("salt-master")
        available = ("service.available" in __salt__
                     and bool(__salt__["service.available"]("salt-master")))
    if restart.impossible(cmd, "salt-master", service_available=available) is None:
        restart.schedule(__opts__, restart.salt_run_bg(__salt__), cmd, delay=1,
                         service="salt-master")
        return "restarting"
    return "restart_required"


def apply(ops=None, topology="shared", pull_token=None, pull_chunks=0, sealed=None,
          backup_keep=10, keys_digest=None, expect=None, config_keys=None):
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

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.sync peers=master02
    """
    args = _request("apply", sealed, {"ops": ops, "topology": topology,
                                      "pull_token": pull_token, "pull_chunks": pull_chunks,
                                      "backup_keep": backup_keep, "keys_digest": keys_digest,
                                      "expect": expect, "config_keys": config_keys})
    try:
        ret = peer.apply(_master_opts(), _state_dir(), args["ops"], args["topology"],
                         args["backup_keep"], _unseal, _fetch, _restart_master, pull=_pull,
                         pull_token=args["pull_token"], pull_chunks=args["pull_chunks"],
                         keys_digest=args["keys_digest"], expect=args["expect"],
                         config_keys=args["config_keys"], after=_after_return)
    except validate.InvalidInput as exc:
        return protocol.reply(_refused("multimaster_peer.apply", exc))
    except (peer.PeerError, protocol.ProtocolError) as exc:
        raise CommandExecutionError(str(exc)) from None
    return protocol.reply(ret)


def restore(backup_name=None, test=False, sealed=None):
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
    args = _request("restore", sealed, {"backup_name": backup_name, "test": test})
    try:
        ret = peer.restore(_master_opts(), _state_dir(), args["backup_name"], args["test"],
                           _restart_master)
    except peer.PeerError as exc:
        raise CommandExecutionError(str(exc)) from None
    return protocol.reply(ret)


# ---------------------------------------------------------------------------
# Membership (salt-run multimaster.add_peer / remove_peer): the new peer
# host's check.  Logic in salt_multimaster.membership.
# ---------------------------------------------------------------------------
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
    return membership.host_report(_master_opts(), __grains__, topology)


# ---------------------------------------------------------------------------
# Master key rotation (salt-run multimaster.rotate_key): the peer's step.
# Everything below this line belongs to the rotation; the logic lives in
# salt_multimaster.rotation.
# ---------------------------------------------------------------------------
def rotate_key(topology="signed", keypair=None, restart_only=False, restart_cmd=None,
               test=False, backup_keep=10, sealed=None):
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
        The command restarting the salt-master (default: systemd where it
        runs it, else the restart is reported ``restart_required``).
    test
        Change nothing; say what would happen.

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
    if restart_cmd is not None and (not isinstance(restart_cmd, str) or not restart_cmd.strip()):
        return _refused("multimaster_peer.rotate_key",
                        f"restart_cmd must be a command string, not {restart_cmd!r}")
    ret = {"result": True, "old": rotation.current_finger(mopts), "new": None, "backup": None,
           "restart": None}
    if test:
        ret["restart"] = "would restart"
        return ret
    if not restart_only:
        try:
            if topology == "shared":
                if not isinstance(keypair, dict) or not keypair.get("sealed"):
                    raise rotation.RotationError("topology shared: no sealed keypair in the request")
                with open(os.path.join(__opts__["pki_dir"], "minion.pem"), "rb") as fh:
                    priv = seal.unseal(fh.read(), keypair["sealed"], __opts__["id"],
                                       "rotate_key/master.pem")
                pub = str(keypair.get("pub") or "").encode()
            else:
                priv, pub = rotation.gen_keypair(mopts.get("keysize") or rotation.DEFAULT_KEYSIZE)
            done = rotation.install(mopts, priv, pub, rotation.backup_root(mopts))
        except (rotation.RotationError, seal.SealError, OSError, fsutil.PathError) as exc:
            return _refused("multimaster_peer.rotate_key", exc)
        ret.update(old=done["old"], new=done["new"], backup=done["backup"])
        try:
            rotation.prune_backups(mopts, backup_keep)
        except (backup.BackupError, OSError, TypeError, ValueError) as exc:
            log.warning("multimaster: old backups not pruned: %s", exc)
    else:
        ret["new"] = ret["old"]
    ret["restart"] = _restart_master(restart_cmd)
    log.info("multimaster: master key rotated (%s -> %s), restart: %s",
             ret["old"], ret["new"], ret["restart"])
    return ret
