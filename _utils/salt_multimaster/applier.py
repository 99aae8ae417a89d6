"""
The apply of the operations the primary planned, on a peer, without
Salt's loader: every write staged and checked before it is renamed into
place, with backups; then the records of what the peer holds in step
(:mod:`salt_multimaster.confirmed`, :mod:`salt_multimaster.history`).

The Salt-specific parts are passed in by ``_modules/multimaster_peer.py``:
``unseal(blob, purpose)`` (this minion's private key), ``fetch(ops)`` (the
primary's fileserver), ``pull(index)`` (``publish.runner multimaster.pull``)
and ``restart()`` (the local salt-master).  ``mopts`` is the peer master's
configuration, ``state_dir`` the minion's ``<cachedir>/multimaster``.
"""

import concurrent.futures
import functools
import hashlib
import logging
import os

import salt.utils.yaml

from salt_multimaster import (backup, compat, confirmed, fsutil, history, journal, keyscan,
                              layout, manifest, protocol, replicate, revocation, rootscan, seal,
                              statefile, validate)
from salt_multimaster.peer import PeerError, check_expected, locked

log = logging.getLogger(__name__)

# Errors a peer sends back per category, at most (Salt trims larger returns).
MAX_REPORTED = 100
# Chunk requests in flight while the current chunk is written (the keys and the
# first file chunk).  Smaller chunks with more in flight (5,000 keys or 24 MiB,
# three in flight) measured slower in the benchmark: each peer_run call costs
# the primary a fixed share of CPU, and on two cores CPU is what runs out.
PULL_AHEAD = 2
DROPIN_HEADER = "# Managed by salt-run multimaster.sync on the primary: do not edit.\n"


class Applier:
    """
    Apply the operations of one sync to this peer, with backups: every
    write staged outside the roots and key dirs, renamed in :meth:`commit`.
    ``unseal(blob, purpose)`` opens what was sealed to this peer.
    """

    def __init__(self, mopts, unseal):
        self.mopts = mopts
        self.unseal = unseal
        self.backup_root = os.path.join(mopts["cachedir"], "multimaster", "backup",
                                        statefile.stamp())
        self.backed_up = False
        # staged outside the roots and key dirs (nothing half-synced is ever
        # served), where a batch killed before its commit is found and
        # removed by the next one
        stage_root = os.path.join(mopts["cachedir"], "multimaster", "stage")
        # what stands where the stage and backup dirs go is moved aside first
        for path in (stage_root, os.path.dirname(self.backup_root)):
            if not os.path.isdir(path):
                statefile.makedirs(path, mopts["cachedir"])
        for stale in fsutil.clean_stages(stage_root):
            log.info("multimaster: removed %s, left by a sync that died", stale)
        self.batch = fsutil.Batch(stage_root=stage_root)
        self.puller = None
        # directories this sync resolved or created: a sync of 20,000 keys
        # writes 20,000 files into one directory
        self.realpath = functools.lru_cache(maxsize=4096)(os.path.realpath)
        self.dirs = set()

    def makedirs(self, path, mode=0o755):
        if path not in self.dirs:
            fsutil.makedirs(path, mode=mode)
            self.dirs.add(path)

    def backup(self, path, rel):
        if fsutil.backup(path, self.backup_root, rel):
            self.backed_up = True

    def write(self, path, data, mode, rel, sha, hasher=None):
        """Stage ``data`` for ``path``, checked against its manifest's ``sha``."""
        hasher = hasher or (lambda d: hashlib.sha256(d).hexdigest())
        if sha is not None and hasher(data) != sha:
            raise PeerError(f"{rel}: content does not match its manifest, not written")
        self.backup(path, rel)
        self.makedirs(os.path.dirname(path))
        self.batch.write(path, data, mode=mode)

    def commit(self):
        """Make every staged write durable (:meth:`fsutil.Batch.commit`)."""
        try:
            self.batch.commit()
        except OSError as exc:
            raise PeerError(f"writing on the peer failed, nothing renamed after: {exc}") from exc

    def remove(self, path, rel):
        self.backup(path, rel)
        self.batch.remove(path)

    def content(self, cat, op):
        """The content of a write operation, however it travelled."""
        if "pull" in op and self.puller is not None:
            return self.puller.get(cat, op)
        if "sealed" in op:
            return self.unseal(op["sealed"], protocol.item_name(cat, op))
        if "data" in op:
            return op["data"].encode()
        raise PeerError("content missing (not pulled from the primary)")


APPLY_ERRORS = (PeerError, OSError, ValueError, seal.SealError, protocol.ProtocolError)


def _report():
    """A category's report; ``failed`` names the items not applied."""
    report = replicate.empty_report()
    report["failed"] = []
    return report


def outcome(report):
    """
    What goes back to the primary: failures only.  The primary already knows
    what it asked for; echoing 20,000 written keys would exceed Salt's
    max_event_size, and Salt would trim the return.
    """
    errors = report["errors"]
    if len(errors) > MAX_REPORTED:
        errors = errors[:MAX_REPORTED] + [f"... and {len(errors) - MAX_REPORTED} more errors"]
    return {"errors": errors, "failed": report["failed"]}


def apply_minion_keys(app, ops):
    report = _report()
    pki = app.mopts["pki_dir"]
    for op in ops:
        rel = f"{op['state']}/{op['id']}"
        try:
            if not manifest.valid_minion_id(op["id"]) or op["state"] not in manifest.KEY_DIRS:
                raise PeerError(f"{rel}: invalid minion id or key state")
            path = fsutil.safe_join(pki, rel, realpath=app.realpath)
            if op["op"] == replicate.WRITE:
                app.makedirs(os.path.dirname(path), mode=fsutil.KEY_DIR_MODE)
                app.write(path, app.content("minion_keys", op), 0o644, f"minion_keys/{rel}",
                          op["sha256"], hasher=manifest.key_sha)
            else:
                app.remove(path, f"minion_keys/{rel}")
            report["removed" if op["op"] == replicate.REMOVE else "updated"].append(rel)
        except APPLY_ERRORS as exc:
            report["errors"].append(f"{rel}: {exc}")
            report["failed"].append(rel)
    return report


def apply_tree(app, cat, ops, fetch):
    """
    Apply the operations of a roots category; ``fetch(ops)``: ``{id(op):
    path of the fetched file, or an exception}`` for the file_roots files
    whose content travels neither sealed nor pulled.
    """
    report = _report()
    roots = app.mopts.get(cat) or {}
    # a fetch that failed: a PeerError in place of the path
    fetched = fetch([op for op in ops if op["op"] == replicate.WRITE
                     and "sealed" not in op and "pull" not in op and op.get("env") in roots])
    for op in ops:
        rel = f"{op['env']}:{op['rel']}"
        item = protocol.item_name(cat, op)
        try:
            env_roots = roots.get(op["env"])
            if not env_roots:
                raise PeerError(f"saltenv {op['env']!r} is not configured on the peer")
            fresh = fsutil.safe_join(env_roots[0], op["rel"], realpath=app.realpath)
            # inside the root it is found under, or an error: nothing written
            current = manifest.locate_confined(env_roots, op["rel"], realpath=app.realpath)
            if op["op"] == replicate.REMOVE:
                if current:
                    app.remove(current, item)
                report["removed"].append(rel)
                continue
            target = current or fresh
            if "sealed" in op or "pull" in op:
                data = app.content(cat, op)
            else:
                cached = fetched[id(op)]
                if isinstance(cached, Exception):
                    raise cached
                with open(cached, "rb") as fh:
                    data = fh.read()
            app.write(target, data, fsutil.safe_mode(op["mode"]), item, op["sha256"])
            report["updated"].append(rel)
        except APPLY_ERRORS as exc:
            report["errors"].append(f"{rel}: {exc}")
            report["failed"].append(rel)
    return report


def apply_master_keys(app, ops, topology):
    report = _report()
    pem_path, pub_path = layout.master_key_files(app.mopts, topology)
    pki = app.mopts["pki_dir"]
    fsutil.makedirs(pki, mode=fsutil.KEY_DIR_MODE)
    os.chmod(pki, fsutil.KEY_DIR_MODE)
    for op in ops:
        try:
            # the files Salt loads, never through a link leading out of pki_dir
            pem = op["kind"] == "pem"
            app.write(fsutil.confine(pki, pem_path if pem else pub_path),
                      app.content("master_keys", op), fsutil.PRIVATE_KEY_MODE if pem else 0o644,
                      protocol.item_name("master_keys", op), op["sha256"])
            report["updated"].append(op["name"])
        except APPLY_ERRORS as exc:
            report["errors"].append(f"{op['name']}: {exc}")
            report["failed"].append(op["name"])
    return report


def _parse_dropin(data):
    """The options of the drop-in: a YAML mapping of replicable options (ValueError else)."""
    values = statefile.parse_yaml(data)
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError("not a mapping of options")
    return values


def dropin_damaged(conf_file, state_dir):
    """
    The drop-in a sync writes beside the master config ``conf_file``
    (``master.d/``, :data:`protocol.DROPIN_NAME`), when damaged (Salt cannot
    load the master config then): moved aside (kept, never removed), so
    that the config loads and the next sync writes it again.  What the
    peer's record (in ``state_dir``) says it confirmed of it is forgotten
    with it: the options are unknown, no change of the peer's operator.
    """
    path = os.path.join(os.path.dirname(conf_file), "master.d", protocol.DROPIN_NAME)
    try:
        statefile.read(path, parse=_parse_dropin)
    except statefile.Damaged as exc:
        statefile.aside(path, exc.why)
        confirmed.forget_config(state_dir)


def apply_master_config(app, ops):
    report = _report()
    path = protocol.dropin_path(app.mopts)
    for op in ops:
        try:
            data = DROPIN_HEADER + salt.utils.yaml.safe_dump(op["values"],
                                                             default_flow_style=False)
            # 0600: external_auth and the like may hold credentials
            app.write(path, data.encode(), 0o600, protocol.item_name("master_config", op),
                      None)
            report["updated"].append(protocol.DROPIN_NAME)
        except APPLY_ERRORS as exc:
            report["errors"].append(f"{path}: {exc}")
            report["failed"].append(protocol.DROPIN_NAME)
    return report


def apply_categories(app, ops, topology, fetch):
    ret = {}
    for cat, cat_ops in ops.items():
        if cat == "minion_keys":
            ret[cat] = apply_minion_keys(app, cat_ops)
        elif cat in ("file_roots", "pillar_roots"):
            ret[cat] = apply_tree(app, cat, cat_ops, fetch)
        elif cat == "master_keys":
            ret[cat] = apply_master_keys(app, cat_ops, topology)
        else:
            ret[cat] = apply_master_config(app, cat_ops)
    return ret


class Puller:
    """
    The operations of a sync and the contents marked ``pull`` (with the
    index of their chunk), fetched from the primary: ``request(index)``
    returns the reply of ``multimaster.pull`` for chunk ``index``.  The
    first chunk carries the operations; the next chunks are fetched while
    the current one is written: two requests in flight, at most three chunks
    held.
    """

    def __init__(self, app, token, count, request):
        self.app, self.token, self.count = app, token, int(count)
        self.request = request
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=PULL_AHEAD)
        self.futures = {}
        self.loaded, self.contents = None, {}

    def _fetch(self, index):
        reply = self.request(protocol.pull_request(self.token, index))
        return protocol.open_pull_reply(self.app.unseal, self.token, reply)

    def _load(self, index):
        if index != self.loaded:
            future = self._future(index)
            for ahead in range(1, PULL_AHEAD + 1):
                self._future(index + ahead)
            self.contents = None
            self.contents = future.result()
            self.futures.pop(index, None)
            self.loaded = index
        return self.contents

    def ops(self):
        """The operations of this sync, from the first chunk."""
        ops = self._load(0).get("ops")
        if not isinstance(ops, dict):
            raise PeerError("the primary sent no operations with the first chunk")
        return ops

    def _future(self, index):
        if index not in self.futures and index < self.count:
            # Salt's loader dunders (__salt__, __opts__) live in context
            # variables: run the request in a copy of this thread's context
            self.futures[index] = self.pool.submit(compat.copy_context().run, self._fetch, index)
        return self.futures.get(index)

    def get(self, cat, op):
        index = op.get("pull")
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < self.count:
            raise PeerError("content missing (not pulled from the primary)")
        data = self._load(index)["contents"].get(protocol.item_name(cat, op))
        if data is None:
            raise PeerError("the primary did not serve it (changed during the sync?)")
        return data

    def close(self):
        for future in self.futures.values():
            future.cancel()
        self.pool.shutdown(wait=True)


#: the categories whose writes the salt-master loads only when it restarts
DAEMON_CATEGORIES = ("master_keys", "master_config")


def held_back(ops, restart):
    """
    ``{category: report}`` of the master_keys and master_config ``ops`` not
    applied because this master could not restart to load them
    (``restart.refused``, :class:`salt_multimaster.restart.MasterRestart`: a
    configured restart command whose program is not installed): each item
    failed, naming why, nothing of it written.
    """
    why = restart.why_refused() if getattr(restart, "refused", None) else None
    held = {}
    for cat in DAEMON_CATEGORIES:
        if why and ops.get(cat):
            report = held[cat] = _report()
            for op in ops[cat]:
                name = op.get("name") if cat == "master_keys" else protocol.DROPIN_NAME
                report["errors"].append(f"{name}: {why}")
                report["failed"].append(name)
    return held


def keep_accepted(mopts, ops):
    """
    Put back in ``minions/`` each key the ``minion_keys`` ``ops`` accepted
    that is now pending with the very content written; return their ids.
    Salt 3008 stores a key as pending by deleting its other states first
    (``salt/cache/localfs_key.py``, ``store``): a minion whose sign-in to
    this master was in flight while the apply accepted its key ends up
    pending here again, although the primary accepted it.
    """
    pki, kept = mopts["pki_dir"], []
    for op in ops:
        if op["op"] != replicate.WRITE or op["state"] != "minions":
            continue
        accepted = os.path.join(pki, "minions", op["id"])
        pending = os.path.join(pki, "minions_pre", op["id"])
        try:
            if os.path.lexists(accepted) or manifest.key_sha_file(pending) != op["sha256"]:
                continue
            os.rename(pending, accepted)
        except OSError:
            continue
        log.warning("multimaster: %s was made pending again by this master while the sync "
                    "accepted it (a sign-in in flight): accepted again", op["id"])
        kept.append(op["id"])
    return kept


def _digests(value):
    """``value`` when it is ``{name: str}``, else None."""
    if isinstance(value, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return value
    return None


def record_confirmed(mopts, state_dir, ops, ret, keys_digest, confirm):
    """
    After an apply: record what this peer now holds in step with the
    primary (:mod:`salt_multimaster.confirmed`), from a scan of what it
    holds now and what the apply did (``ret``).  Returns the scan of the
    keys (None: not scanned), for the history record.
    """
    confirm = confirm if isinstance(confirm, dict) else {}
    digests = {cat: _digests(confirm.get(cat)) for cat in protocol.BUCKETED}
    digests["minion_keys"] = _digests(keys_digest)
    watch, keys = journal.client(layout.state_dir(mopts)), None
    for cat in protocol.BUCKETED:
        if not ops.get(cat) and digests[cat] is None:
            continue
        done = confirmed.applied(cat, ops.get(cat) or [],
                                 set((ret.get(cat) or {}).get("failed") or ()))
        if cat == "minion_keys":
            keys = keyscan.KeysSnapshot(mopts["pki_dir"], state_dir, watch=watch)
            now = keys.digest, keys.parts
        else:
            scan = rootscan.RootsScan(mopts, cat, state_dir, watch=watch)
            now = scan.raw, scan.parts
        confirmed.record_apply(state_dir, cat, done, digests[cat], *now)
    shas = _digests(confirm.get("master_config"))
    if shas is not None:
        values = {key: mopts.get(key) for key in shas}
        for op in ops.get("master_config") or ():
            if protocol.DROPIN_NAME not in ((ret.get("master_config") or {}).get("failed") or ()):
                values.update({k: v for k, v in op["values"].items() if k in shas})
        confirmed.record_config(state_dir, values, shas)
    return keys


def apply(mopts, state_dir, ops, topology, backup_keep, unseal, fetch, restart,
          pull=None, pull_token=None, pull_chunks=0, keys_digest=None, expect=None,
          config_keys=None, after=None, confirm=None):
    """
    Apply ``ops`` (``None`` with ``pull_token``: pulled with the first
    chunk, through ``pull(request)``); return the reply without its
    protocol: per category the failures, ``restart``, ``backup``.  Raise
    :class:`validate.InvalidInput` for operations it refuses (nothing
    applied).  ``keys_digest``: the primary's minion key digests, for the
    history record (:func:`salt_multimaster.history.record_history`).
    That record, and the keys Salt made pending again while they were
    accepted (:func:`keep_accepted`), are handed to ``after`` to run once
    the job has returned (:func:`salt_multimaster.peer.record_after_return`;
    default: run before this returns).

    ``confirm``: the primary's digests of the other categories
    (``{category: bucket digests}``, ``master_config``: ``{option:
    sha256}``), for the record of what this peer holds in step with it
    (:func:`record_confirmed`).

    ``expect`` (a change sync, or a targeted key sync, in one round trip):
    apply only if this peer holds what the primary expects
    (:func:`salt_multimaster.peer.check_expected`); else apply nothing and
    answer ``{"backup": None, "inventory": ...}``.  When it does, the reply
    of a full sync carries what the inventory says of the master
    (``master_running``, ``master_address``, ``restart_pending``).
    """
    if ops is not None:
        ops = validate.ops(ops)  # refused before anything is read, locked or written
    if topology not in layout.TOPOLOGIES:
        raise validate.InvalidInput(f"unknown topology {topology!r}")
    with locked(state_dir):
        status = {}
        if expect is not None:
            held, inv = check_expected(mopts, state_dir, expect, topology, config_keys)
            if not held:
                return {"backup": None, "inventory": inv}
            status = {k: inv[k] for k in ("master_running", "master_address", "restart_pending")
                      if k in inv}
        app = Applier(mopts, unseal)
        if pull_token:
            app.puller = Puller(app, pull_token, pull_chunks, pull)
        try:
            if app.puller is not None and ops is None:
                ops = validate.ops(app.puller.ops())
            ops = ops or {}
            held = held_back(ops, restart)
            ret = apply_categories(app, {c: o for c, o in ops.items() if c not in held}, topology,
                                   fetch)
            ret.update(held)
        except BaseException:
            app.batch.abort()  # no temporary file left behind
            raise
        finally:
            if app.puller is not None:
                app.puller.close()
        app.commit()
        if "minion_keys" in ops:
            history.update_history(state_dir, ops["minion_keys"], ret["minion_keys"])

        # once the job has returned: keys Salt demoted meanwhile put back, the
        # record of what this peer holds in step with the primary, then the
        # history record (a listing of every key dir the apply changed)
        def work():
            if "minion_keys" in ops:
                keep_accepted(mopts, ops["minion_keys"])
            keys = record_confirmed(mopts, state_dir, ops, ret, keys_digest, confirm)
            if isinstance(keys_digest, dict):
                history.record_history(mopts, state_dir, keys_digest, keys)

        if after is None:
            work()
        else:
            after(work)
        daemon_changed = any(ret.get(c, {}).get("updated") for c in DAEMON_CATEGORIES)
        # a key taken out of minions/: this master rotates its AES key, as salt-key does
        rotation = revocation.after_apply(mopts, ret["minion_keys"]) if "minion_keys" in ops else {}
        for cat in ops:
            ret[cat] = outcome(ret[cat])
        ret["restart"] = restart() if daemon_changed else None
        ret["backup"] = app.backup_root if app.backed_up else None
        ret.update(rotation)
        backup.trim(os.path.dirname(app.backup_root), backup_keep)
        ret.update(status)
        return ret
