"""
Peer-side half of ``salt-run multimaster.sync``.

Loads only on a host with a salt-master configuration: the minion running
next to a peer master.  The master configuration is found at the minion
option ``multimaster.master_config`` (default: ``$SALT_MASTER_CONFIG`` or
``/etc/salt/master``); its ``pki_dir``, ``cachedir``, ``file_roots`` and
``pillar_roots`` are the ones managed.

The primary's runner calls these functions; operators rarely need them
directly, except ``multimaster_peer.inventory`` to see what a peer holds.
"""

import datetime
import functools
import hashlib
import logging
import os
import time

import salt.config
import salt.fileclient
import salt.utils.json
import salt.utils.yaml
from salt.exceptions import CommandExecutionError

try:
    from salt_multimaster import (backup, daemon, fsutil, layout, manifest, protocol, replicate, seal,
                                  validate)

    HAS_CORE = True
except ImportError:
    HAS_CORE = False

log = logging.getLogger(__name__)

__virtualname__ = "multimaster_peer"


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


def _history_path():
    return os.path.join(_state_dir(), "minion_keys_history.json")


def _read_json(path, default):
    import json  # pylint: disable=import-outside-toplevel

    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return default


def _sha_or_none(path):
    try:
        return manifest.sha256_file(path)
    except OSError:
        return None


def _fingerprint(path, opts):
    from salt_multimaster import finger  # pylint: disable=import-outside-toplevel

    return finger.file_finger(path, opts.get("hash_type", "sha256")) or None


def _request(fun, sealed, given):
    """
    The keyword arguments of this call: the request the primary sealed to
    this minion (``sealed``, published as ``{peer id: blob}``: the publish
    reaches every minion, the arguments only this one), else those ``given``
    on the command line.
    """
    if sealed is None:
        return given
    with open(os.path.join(__opts__["pki_dir"], "minion.pem"), "rb") as fh:
        key = fh.read()
    try:
        kwargs = protocol.open_request(key, __opts__["id"], f"multimaster_peer.{fun}", sealed)
    except protocol.ProtocolError as exc:
        raise CommandExecutionError(f"multimaster_peer.{fun}: {exc}") from None
    unknown = sorted(set(kwargs) - set(given))
    if unknown:
        raise CommandExecutionError(
            f"multimaster_peer.{fun}: unknown arguments in the request: {', '.join(unknown)}")
    return dict(given, **kwargs)


def _dropin_path(mopts):
    return protocol.dropin_path(mopts)


def _refused(fun, exc):
    """Bad input from the primary or the CLI: a named error, result False, a non-zero exit."""
    log.error("multimaster: %s refused: %s", fun, exc)
    __context__["retcode"] = 1
    return {"result": False, "error": f"{fun}: {exc}"}


def inventory(categories=None, digests=None, topology="shared", config_keys=None, test=False,
              rescan=False, sealed=None):
    """
    Report what this peer master holds, for the categories asked.

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
        "config_keys": config_keys, "test": test, "rescan": rescan})
    ret = _inventory(**args)
    ret["protocol"] = protocol.PROTOCOL
    return ret


def _inventory(categories, digests, topology, config_keys, test, rescan):
    categories = categories or list(replicate.CATEGORIES)
    digests = digests or {}
    try:
        validate.categories(categories)
        if not isinstance(digests, dict):
            raise validate.InvalidInput(f"digests must be a mapping, not {digests!r}")
        if config_keys is not None:
            if not isinstance(config_keys, (list, tuple)):
                raise validate.InvalidInput(f"config_keys must be a list, not {config_keys!r}")
            validate.config_keys(config_keys)
    except validate.InvalidInput as exc:
        return _refused("multimaster_peer.inventory", exc)
    mopts = _master_opts()
    state_dir = _state_dir()
    running, where = daemon.master_running(mopts)
    ret = {"master_id": mopts["id"], "errors": [],
           "master_running": running, "master_address": where,
           "restart_pending": daemon.restart_pending(
               mopts, os.path.join(state_dir, daemon.RESTART_MARKER))}
    roots, roots_errors = manifest.read_roots(mopts, categories, state_dir, rescan=rescan)
    for cat in categories:
        if cat == "master_keys":
            pem, pub = layout.master_key_files(mopts, topology)
            ret[cat] = {"pem": _sha_or_none(pem), "pub": _sha_or_none(pub),
                        "fingerprint": _fingerprint(pub, mopts)}
            continue
        if cat == "master_config":
            keys = config_keys or list(replicate.DEFAULT_CONFIG_KEYS)
            ret[cat] = {k: mopts.get(k) for k in keys}
            continue
        if cat == "minion_keys":
            started = time.monotonic()
            ret[cat] = _keys_inventory(mopts, state_dir, digests.get(cat) or {}, test, rescan)
            log.debug("multimaster: minion_keys inventory in %.3f s", time.monotonic() - started)
            continue
        if cat not in roots:
            raise CommandExecutionError(f"unknown category: {cat!r}")
        parts = manifest.split(cat, roots[cat])
        mine = manifest.bucket_digests(parts)
        diff = manifest.differing(digests.get(cat) or {}, mine)
        ret[cat] = {"digest": mine, "errors": roots_errors[cat], "buckets": diff,
                    "manifest": manifest.merge(parts, diff), "envs": sorted(mopts.get(cat) or {})}
    return ret


def _history_stamp():
    try:
        st = os.stat(_history_path())
    except OSError:
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def _keys_inventory(mopts, state_dir, digests, test, rescan=False):
    """
    The ``minion_keys`` part of :func:`inventory`: digests, the differing
    buckets, and the ids of those buckets received from the primary before.
    While no key dir changed, no key is looked at.
    """
    snap = manifest.KeysSnapshot(mopts["pki_dir"], state_dir, rescan=rescan)
    diff = manifest.differing(digests, snap.digest)
    entry = {"digest": snap.digest, "errors": list(snap.errors), "buckets": diff,
             "manifest": manifest.merge(snap.parts, diff) if diff else {},
             "counts": snap.counts}
    if not diff and not test and snap.meta.get("history") != _history_stamp():
        # in step with the primary: every id here came from it
        history = _read_json(_history_path(), [])
        ids = sorted({mid for keys in snap.manifest.values() for mid in keys})
        if ids != history:
            fsutil.atomic_write(_history_path(), salt.utils.json.dumps(ids), mode=0o600)
        snap.remember(history=_history_stamp())
    wanted = set(diff)
    entry["history"] = (
        [mid for mid in _read_json(_history_path(), []) if manifest._bucket(mid) in wanted]
        if wanted else []
    )
    return entry


class _Applier:
    """Apply the operations of one sync to this peer, with backups."""

    def __init__(self, mopts):
        self.mopts = mopts
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        self.backup_root = os.path.join(mopts["cachedir"], "multimaster", "backup", stamp)
        self.backed_up = False
        self._minion_key = None
        # staged outside the roots and key dirs (nothing half-synced is ever
        # served), where a batch killed before its commit is found and
        # removed by the next one
        stage_root = os.path.join(mopts["cachedir"], "multimaster", "stage")
        for stale in fsutil.clean_stages(stage_root):
            log.info("multimaster: removed %s, left by a sync that died", stale)
        self.batch = fsutil.Batch(stage_root=stage_root)
        self.puller = None
        self.written = []
        # directories this sync resolved or created: a sync of 20,000 keys
        # writes 20,000 files into one directory
        self.realpath = functools.lru_cache(maxsize=4096)(os.path.realpath)
        self.dirs = set()
        self.listings = {}

    def safe_join(self, root, rel):
        return fsutil.safe_join(root, rel, realpath=self.realpath)

    def makedirs(self, path, mode=0o755):
        if path not in self.dirs:
            fsutil.makedirs(path, mode=mode)
            self.dirs.add(path)

    def minion_key(self):
        if self._minion_key is None:
            with open(os.path.join(__opts__["pki_dir"], "minion.pem"), "rb") as fh:
                self._minion_key = fh.read()
        return self._minion_key

    def open_sealed(self, blob, purpose):
        return seal.unseal(self.minion_key(), blob, __opts__["id"], purpose)

    def _listed(self, path):
        """
        Whether ``path`` exists, from one listing of its directory per sync:
        an initial sync writes 20,000 keys into one directory, and a stat
        of each costs more than the listing.
        """
        directory, name = os.path.split(path)
        names = self.listings.get(directory)
        if names is None:
            try:
                names = self.listings[directory] = frozenset(os.listdir(directory))
            except OSError:
                names = self.listings[directory] = frozenset()
        return name in names

    def backup(self, path, rel):
        if self._listed(path) and fsutil.backup(path, self.backup_root, rel):
            self.backed_up = True

    def write(self, path, data, mode, rel, sha, hasher=None, cache_path=None):
        """
        Stage ``data`` for ``path``; ``cache_path``: the name the manifests
        give the file in the hash cache, so the next inventory stats it
        instead of hashing it again.
        """
        hasher = hasher or (lambda d: hashlib.sha256(d).hexdigest())
        if sha is not None and hasher(data) != sha:
            raise CommandExecutionError(f"{rel}: content does not match its manifest, not written")
        self.backup(path, rel)
        self.makedirs(os.path.dirname(path))
        self.batch.write(path, data, mode=mode)
        if cache_path and sha is not None:
            name = manifest.KEYS_HASHCACHE if rel.startswith("minion_keys/") else manifest.ROOTS_HASHCACHE
            self.written.append((name, path, cache_path, sha))

    def commit(self):
        """Make every staged write durable, then record the written files' hashes."""
        try:
            self.batch.commit()
        except OSError as exc:
            raise CommandExecutionError(
                f"writing on the peer failed, nothing renamed after: {exc}") from exc
        caches = {}
        for name, path, cache_path, sha in self.written:
            try:
                st = os.stat(path)
            except OSError:
                continue
            if name not in caches:
                caches[name] = manifest.open_hashcache(_state_dir(), name)
            caches[name].entries[cache_path] = [st.st_ino, st.st_size, st.st_mtime_ns, sha]
            caches[name].dirty = True
        for cache in caches.values():
            cache.save()
        self.written = []

    def remove(self, path, rel):
        self.backup(path, rel)
        self.batch.remove(path)


def _report():
    """A category's report; ``failed`` names the items not applied."""
    report = replicate.empty_report()
    report["failed"] = []
    return report


MAX_REPORTED = 100


def _outcome(report):
    """
    What goes back to the primary: failures only.  The primary already knows
    what it asked for; echoing 20,000 written keys would exceed Salt's
    max_event_size, and Salt would trim the return.
    """
    errors = report["errors"]
    if len(errors) > MAX_REPORTED:
        errors = errors[:MAX_REPORTED] + [f"... and {len(errors) - MAX_REPORTED} more errors"]
    return {"errors": errors, "failed": report["failed"]}


def _op_bytes(app, op, purpose, cat=None):
    """The content of a write operation, however it travelled."""
    if "pull" in op and app.puller is not None:
        return app.puller.get(cat, op)
    if "sealed" in op:
        return app.open_sealed(op["sealed"], purpose)
    if "data" in op:
        return op["data"].encode()
    raise CommandExecutionError("content missing (not pulled from the primary)")


def _apply_minion_keys(app, ops):
    report = _report()
    pki = app.mopts["pki_dir"]
    for op in ops:
        rel = f"{op['state']}/{op['id']}"
        try:
            if not manifest.valid_minion_id(op["id"]) or op["state"] not in manifest.KEY_STATES:
                raise CommandExecutionError(f"{rel}: invalid minion id or key state")
            path = app.safe_join(pki, rel)
            if op["op"] == replicate.WRITE:
                app.makedirs(os.path.dirname(path), mode=fsutil.KEY_DIR_MODE)
                app.write(path, _op_bytes(app, op, f"minion_keys/{rel}", "minion_keys"), 0o644,
                          f"minion_keys/{rel}", op["sha256"], hasher=manifest.key_sha,
                          cache_path=path)
            else:
                app.remove(path, f"minion_keys/{rel}")
            report["removed" if op["op"] == replicate.REMOVE else "updated"].append(rel)
        except (CommandExecutionError, OSError, ValueError) as exc:
            report["errors"].append(f"{rel}: {exc}")
            report["failed"].append(rel)
    return report


def _update_history(ops, report):
    """
    Remember the ids received from the primary, so that a later removal there
    reads as a deletion, and a key found only here as a conflict.
    """
    written = {op["id"] for op in ops if op["op"] == replicate.WRITE}
    history = set(_read_json(_history_path(), []))
    history |= {r.split("/", 1)[1] for r in report["updated"]}
    history -= {r.split("/", 1)[1] for r in report["removed"]} - written
    fsutil.atomic_write(_history_path(), salt.utils.json.dumps(sorted(history)), mode=0o600)


def mirror_keys(keys=None, force=False, test=False, sealed=None):
    """
    Make the keys of a few minion ids mirror the primary's, in one round trip:
    what the primary's reactor sends after ``salt/key`` events.

    ``keys`` maps each minion id to its keys on the primary,
    ``{state_dir: {"sha256": ..., "data": <public key>}}`` (``{}``: deleted
    there).  The peer plans these ids as a full sync would (same conflicts,
    same history of ids received from the primary) and applies the plan
    unless ``test``.  Returns the report of the ``minion_keys`` category.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.sync only=minion_keys minion_ids=web01
    """
    args = _request("mirror_keys", sealed, {"keys": keys, "force": force, "test": test})
    ret = _mirror_keys(**args)
    ret["protocol"] = protocol.PROTOCOL
    return ret


def _mirror_keys(keys, force, test):
    try:
        validate.mirror_keys(keys)
    except validate.InvalidInput as exc:
        return _refused("multimaster_peer.mirror_keys", exc)
    mopts = _master_opts()
    errors = []
    primary = {state: {} for state in manifest.KEY_STATES}
    contents = {}
    for mid, states in (keys or {}).items():
        for state, entry in (states or {}).items():
            if state not in manifest.KEY_STATES or not isinstance(entry, dict):
                errors.append(f"{state}/{mid}: unknown key state, skipped")
                continue
            primary[state][mid] = entry.get("sha256")
            contents[(state, mid)] = entry.get("data")
    here = manifest.keys_state(mopts["pki_dir"], list(keys or {}), errors=errors)
    history = _read_json(_history_path(), [])
    ops, report = replicate.plan_keys(primary, here, history, force=force)
    report["errors"].extend(errors)
    if test or not ops:
        return report
    for op in ops:
        if op["op"] == replicate.WRITE and contents.get((op["state"], op["id"])) is not None:
            op["data"] = contents[(op["state"], op["id"])]
    app = _Applier(mopts)
    applied = _apply_minion_keys(app, ops)
    app.commit()
    _update_history(ops, applied)
    failed = set(applied["failed"])
    for kind in ("added", "updated", "removed"):
        report[kind] = [item for item in report[kind] if item not in failed]
    report["errors"].extend(applied["errors"])
    report["backup"] = app.backup_root if app.backed_up else None
    return report


FETCH_THREADS = 4


def _fetch(ops):
    """
    Fetch file_roots files from the primary's fileserver, point-to-point, a
    few requests in flight at once (one file client per thread).  Return
    ``{id(op): path in the minion's file cache or an exception}``.
    """
    import concurrent.futures  # pylint: disable=import-outside-toplevel
    import threading  # pylint: disable=import-outside-toplevel

    local = threading.local()
    clients = []

    def one(op):
        if not hasattr(local, "client"):
            local.client = salt.fileclient.get_file_client(__opts__)
            clients.append(local.client)
        try:
            cached = local.client.cache_file(f"salt://{op['rel']}", op["env"])
            return cached or CommandExecutionError("not served by the primary's fileserver")
        except Exception as exc:  # pylint: disable=broad-except
            return CommandExecutionError(f"fetch failed: {exc}")

    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=FETCH_THREADS) as pool:
            return dict(zip((id(op) for op in ops), pool.map(one, ops)))
    finally:
        for client in clients:
            client.destroy()


def _apply_tree(app, cat, ops):
    report = _report()
    roots = app.mopts.get(cat) or {}
    fetched = _fetch([op for op in ops if op["op"] == replicate.WRITE
                      and "sealed" not in op and "pull" not in op and op.get("env") in roots])
    for op in ops:
        rel = f"{op['env']}:{op['rel']}"
        try:
            env_roots = roots.get(op["env"])
            if not env_roots:
                raise CommandExecutionError(f"saltenv {op['env']!r} is not configured on the peer")
            fresh = app.safe_join(env_roots[0], op["rel"])  # validates rel
            # inside the root it is found under, or an error: nothing written
            current = manifest.locate_confined(env_roots, op["rel"], realpath=app.realpath)
            if op["op"] == replicate.REMOVE:
                if current:
                    app.remove(current, f"{cat}/{op['env']}/{op['rel']}")
                report["removed"].append(rel)
                continue
            target = current or fresh
            if "sealed" in op or "pull" in op:
                data = _op_bytes(app, op, f"{cat}/{op['env']}/{op['rel']}", cat)
            else:
                cached = fetched[id(op)]
                if isinstance(cached, Exception):
                    raise cached
                with open(cached, "rb") as fh:
                    data = fh.read()
            app.write(target, data, fsutil.safe_mode(op["mode"]), f"{cat}/{op['env']}/{op['rel']}",
                      op["sha256"],
                      cache_path=os.path.join(app.realpath(os.path.dirname(target)),
                                              os.path.basename(target)))
            report["updated"].append(rel)
        except (CommandExecutionError, OSError, ValueError, seal.SealError) as exc:
            report["errors"].append(f"{rel}: {exc}")
            report["failed"].append(rel)
    return report


def _apply_master_keys(app, ops, topology):
    report = _report()
    pem_path, pub_path = layout.master_key_files(app.mopts, topology)
    pki = app.mopts["pki_dir"]
    fsutil.makedirs(pki, mode=fsutil.KEY_DIR_MODE)
    os.chmod(pki, fsutil.KEY_DIR_MODE)
    for op in ops:
        try:
            # the files Salt loads, never through a link leading out of pki_dir
            if op["kind"] == "pem":
                data = app.open_sealed(op["sealed"], f"master_keys/{op['name']}")
                app.write(fsutil.confine(pki, pem_path), data, fsutil.PRIVATE_KEY_MODE,
                          f"master_keys/{op['name']}", op["sha256"])
            else:
                app.write(fsutil.confine(pki, pub_path), op["data"].encode(), 0o644,
                          f"master_keys/{op['name']}", op["sha256"])
            report["updated"].append(op["name"])
        except (CommandExecutionError, OSError, ValueError, seal.SealError) as exc:
            report["errors"].append(f"{op['name']}: {exc}")
            report["failed"].append(op["name"])
    return report


def _apply_master_config(app, ops):
    report = _report()
    path = _dropin_path(app.mopts)
    for op in ops:
        try:
            fsutil.makedirs(os.path.dirname(path))
            data = "# Managed by salt-run multimaster.sync on the primary: do not edit.\n"
            data += salt.utils.yaml.safe_dump(op["values"], default_flow_style=False)
            # 0600: external_auth and the like may hold credentials
            app.write(path, data.encode(), 0o600, f"master_config/{protocol.DROPIN_NAME}", None)
            report["updated"].append(os.path.basename(path))
        except (CommandExecutionError, OSError) as exc:
            report["errors"].append(f"{path}: {exc}")
            report["failed"].append(os.path.basename(path))
    return report


def _restart_master():
    """
    Restart the local salt-master in the background through systemd when the
    host runs it; otherwise say a restart is required.
    """
    import salt.utils.systemd  # pylint: disable=import-outside-toplevel

    # the running master keeps the old keys/config until it restarts: the
    # next inventory says so (restart_pending) until then
    fsutil.atomic_write(os.path.join(_state_dir(), daemon.RESTART_MARKER),
                        f"{time.time()}\n", mode=0o600)

    if salt.utils.systemd.booted(__context__) and __salt__["service.available"]("salt-master"):
        __salt__["cmd.run_bg"]("sleep 1; systemctl restart salt-master", python_shell=True)
        return "restarting"
    return "restart_required"


# Chunk requests in flight while the current chunk is written (the keys and the
# first file chunk).  Smaller chunks with more in flight (5,000 keys or 24 MiB,
# three in flight) measured slower in the benchmark: each peer_run call costs
# the primary a fixed share of CPU, and on two cores CPU is what runs out.
PULL_AHEAD = 2


class _Puller:
    """
    The operations of a sync and the contents marked ``pull`` (with the
    index of their chunk), fetched from the primary through
    ``multimaster.pull`` (peer_run: a request-channel round trip to the
    primary only, its reply sealed to this minion's key).  The first chunk
    carries the operations; the next chunks are fetched while the current
    one is written: two requests in flight, at most three chunks held.
    """

    def __init__(self, app, token, count):
        import concurrent.futures  # pylint: disable=import-outside-toplevel

        self.app, self.token, self.count = app, token, int(count)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=PULL_AHEAD)
        self.futures = {}
        self.loaded, self.contents = None, {}

    def _request(self, index):
        import base64  # pylint: disable=import-outside-toplevel
        import json  # pylint: disable=import-outside-toplevel

        import msgpack  # pylint: disable=import-outside-toplevel

        request = base64.urlsafe_b64encode(
            json.dumps({"token": self.token, "chunk": index}).encode()
        ).decode().rstrip("=")
        try:
            reply = __salt__["publish.runner"]("multimaster.pull", arg=[f"request={request}"], timeout=120)
        except Exception as exc:  # pylint: disable=broad-except
            raise CommandExecutionError(f"pull from the primary failed: {exc}") from exc
        if isinstance(reply, dict) and set(reply) == {"outputter", "data"}:
            reply = reply["data"]
        if not isinstance(reply, dict) or "sealed" not in reply:
            raise CommandExecutionError(
                "the primary refused multimaster.pull "
                f"({reply.get('error') if isinstance(reply, dict) and reply else 'check its peer_run'})"
            )
        return msgpack.unpackb(self.app.open_sealed(reply["sealed"], f"pull/{self.token}"), raw=False)

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
            raise CommandExecutionError("the primary sent no operations with the first chunk")
        return ops

    def _future(self, index):
        from salt_multimaster import compat  # pylint: disable=import-outside-toplevel

        if index not in self.futures and index < self.count:
            # Salt's loader dunders (__salt__, __opts__) live in context
            # variables: run the request in a copy of this thread's context
            self.futures[index] = self.pool.submit(
                compat.copy_context().run, self._request, index)
        return self.futures.get(index)

    def get(self, cat, op):
        index = op.get("pull")
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < self.count:
            raise CommandExecutionError("content missing (not pulled from the primary)")
        data = self._load(index)["contents"].get(replicate.item_name(cat, op))
        if data is None:
            raise CommandExecutionError("the primary did not serve it (changed during the sync?)")
        return data

    def close(self):
        for future in self.futures.values():
            future.cancel()
        self.pool.shutdown(wait=True)


def _apply_categories(app, ops, topology):
    ret = {}
    for cat, cat_ops in ops.items():
        if cat == "minion_keys":
            ret[cat] = _apply_minion_keys(app, cat_ops)
        elif cat in ("file_roots", "pillar_roots"):
            ret[cat] = _apply_tree(app, cat, cat_ops)
        elif cat == "master_keys":
            ret[cat] = _apply_master_keys(app, cat_ops, topology)
        elif cat == "master_config":
            ret[cat] = _apply_master_config(app, cat_ops)
        else:
            ret[cat] = _report()
            ret[cat]["errors"].append(f"unknown category: {cat!r}")
    return ret


def apply(ops=None, topology="shared", pull_token=None, pull_chunks=0, sealed=None,
          backup_keep=10):
    """
    Apply the operations planned by ``salt-run multimaster.sync``.

    Every file replaced or removed is first copied to
    ``<master cachedir>/multimaster/backup/<timestamp>/``; every write is
    atomic.  Private keys arrive sealed to this minion's key.  With
    ``pull_token``, the operations and the bulk contents are pulled from the
    primary (``pull_chunks`` sealed replies) instead of riding in the
    publish.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.sync peers=master02
    """
    args = _request("apply", sealed, {"ops": ops, "topology": topology,
                                      "pull_token": pull_token, "pull_chunks": pull_chunks,
                                      "backup_keep": backup_keep})
    ret = _apply(**args)
    ret["protocol"] = protocol.PROTOCOL
    return ret


def _apply(ops, topology, pull_token, pull_chunks, backup_keep):
    mopts = _master_opts()
    app = _Applier(mopts)
    if pull_token:
        app.puller = _Puller(app, pull_token, pull_chunks)
    try:
        if app.puller is not None and ops is None:
            ops = app.puller.ops()
        ops = ops or {}
        try:
            validate.ops(ops)
            if topology not in layout.TOPOLOGIES:
                raise validate.InvalidInput(f"unknown topology {topology!r}")
        except validate.InvalidInput as exc:
            return _refused("multimaster_peer.apply", exc)
        ret = _apply_categories(app, ops, topology)
    except BaseException:
        app.batch.abort()  # no temporary file left behind
        raise
    finally:
        if app.puller is not None:
            app.puller.close()
    app.commit()
    if "minion_keys" in ops:
        _update_history(ops["minion_keys"], ret["minion_keys"])
    changed_daemon_config = any(
        ret.get(c, {}).get("updated") for c in ("master_keys", "master_config")
    )
    for cat in ops:
        ret[cat] = _outcome(ret[cat])
    ret["restart"] = _restart_master() if changed_daemon_config else None
    ret["backup"] = app.backup_root if app.backed_up else None
    try:
        pruned = backup.prune(os.path.dirname(app.backup_root), backup_keep)
        if pruned:
            log.info("multimaster: removed %d old backup(s), keeping %s", len(pruned), backup_keep)
    except (backup.BackupError, OSError, TypeError, ValueError) as exc:
        log.warning("multimaster: old backups not pruned: %s", exc)
    return ret


def _restore_target(mopts, rel):
    """Where the backed-up item ``rel`` (``category/...``) goes back, and its mode."""
    cat, _, rest = rel.partition("/")
    if cat == "minion_keys":
        state, _, mid = rest.partition("/")
        if state not in manifest.KEY_STATES or not manifest.valid_minion_id(mid):
            raise backup.BackupError(f"{rel}: not a minion key")
        return fsutil.safe_join(mopts["pki_dir"], f"{state}/{mid}"), 0o644
    if cat in ("file_roots", "pillar_roots"):
        env, _, path = rest.partition("/")
        roots = (mopts.get(cat) or {}).get(env)
        if not roots:
            raise backup.BackupError(f"{rel}: saltenv {env!r} is not configured here")
        return manifest.locate_confined(roots, path) or fsutil.safe_join(roots[0], path), None
    if cat == "master_keys":
        topology = "signed" if rest.startswith("master_sign.") else "shared"
        pem, pub = layout.master_key_files(mopts, topology)
        if rest.endswith(".pem"):
            return pem, fsutil.PRIVATE_KEY_MODE
        return pub, 0o644
    if cat == "master_config":
        return _dropin_path(mopts), 0o600
    raise backup.BackupError(f"{rel}: unknown category")


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
    ret = _restore(**args)
    ret["protocol"] = protocol.PROTOCOL
    return ret


def _restore(backup_name, test):
    mopts = _master_opts()
    base = os.path.join(mopts["cachedir"], "multimaster", "backup")
    try:
        source = backup.choose(base, backup_name)
    except backup.BackupError as exc:
        return {"result": False, "error": str(exc), "restored": [], "errors": []}
    ret = {"result": True, "backup_restored": os.path.basename(source), "restored": [],
           "errors": []}
    app = None if test else _Applier(mopts)
    for rel in backup.items(source):
        try:
            target, mode = _restore_target(mopts, rel)
            if app is not None:
                with open(os.path.join(source, rel), "rb") as fh:
                    data = fh.read()
                if mode is None:
                    mode = os.stat(os.path.join(source, rel)).st_mode & 0o7777
                if rel.startswith("master_keys/"):
                    fsutil.makedirs(os.path.dirname(target), mode=fsutil.KEY_DIR_MODE)
                app.write(target, data, mode, rel, None)
            ret["restored"].append(rel)
        except (backup.BackupError, fsutil.PathError, CommandExecutionError, OSError) as exc:
            ret["errors"].append(f"{rel}: {exc}")
    if app is not None:
        app.commit()
        ret["backup"] = app.backup_root if app.backed_up else None
        daemon_files = any(r.split("/", 1)[0] in ("master_keys", "master_config")
                           for r in ret["restored"])
        ret["restart"] = _restart_master() if daemon_files else None
    ret["result"] = not ret["errors"]
    return ret


# ---------------------------------------------------------------------------
# Master key rotation (salt-run multimaster.rotate_key): the peer's step.
# Everything below this line belongs to the rotation; the logic lives in
# salt_multimaster.rotation.
# ---------------------------------------------------------------------------
try:
    from salt_multimaster import rotation  # pylint: disable=wrong-import-position
except ImportError:  # pragma: no cover  (reported by __virtual__)
    rotation = None


def _rotate_restart(restart_cmd):
    """Restart the peer's salt-master with ``restart_cmd``, else as a sync does."""
    if not restart_cmd:
        return _restart_master()
    fsutil.atomic_write(os.path.join(_state_dir(), daemon.RESTART_MARKER),
                        f"{time.time()}\n", mode=0o600)
    __salt__["cmd.run_bg"](restart_cmd, python_shell=True, cwd="/")
    return "restarting"


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
    ret["restart"] = _rotate_restart(restart_cmd)
    log.info("multimaster: master key rotated (%s -> %s), restart: %s",
             ret["old"], ret["new"], ret["restart"])
    return ret
