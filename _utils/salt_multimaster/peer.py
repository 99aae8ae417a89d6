"""
The peer's side of a sync, without Salt's loader: what a peer master holds
(a read-only inventory), the applier of the operations the primary planned,
the record of the minion ids received from the primary, and the restore of
a backup.

The Salt-specific parts are passed in by ``_modules/multimaster_peer.py``:
``unseal(blob, purpose)`` (this minion's private key), ``fetch(ops)`` (the
primary's fileserver), ``pull(index)`` (``publish.runner multimaster.pull``)
and ``restart()`` (the local salt-master).  ``mopts`` is the peer master's
configuration, ``state_dir`` the minion's ``<cachedir>/multimaster``.
"""

import concurrent.futures
import datetime
import functools
import hashlib
import logging
import os
import time

import salt.utils.yaml

from salt_multimaster import (backup, compat, confirmed, daemon, finger, fsutil, keyscan, layout,
                              lock, manifest, protocol, replicate, revocation, rootscan, seal,
                              statefile, store, validate, watch)

log = logging.getLogger(__name__)

#: the meta entries of the key history (:class:`KeyHistory`): its generation
#: (one more at each change) and the buckets found recorded (:func:`record_history`)
HISTORY = "history"
RECORDED = "history_recorded"

# Errors a peer sends back per category, at most (Salt trims larger returns).
MAX_REPORTED = 100
# Chunk requests in flight while the current chunk is written (the keys and the
# first file chunk).  Smaller chunks with more in flight (5,000 keys or 24 MiB,
# three in flight) measured slower in the benchmark: each peer_run call costs
# the primary a fixed share of CPU, and on two cores CPU is what runs out.
PULL_AHEAD = 2
DROPIN_HEADER = "# Managed by salt-run multimaster.sync on the primary: do not edit.\n"


class PeerError(Exception):
    """An item this peer cannot apply; its message names it."""


# One job at a time reads or writes a peer's sync state (``peer.lock`` in
# state_dir), the key history record an apply leaves running included;
# waited for at most this long.
PEER_LOCK = "peer.lock"
LOCK_WAIT = 60.0
# The key history record of an apply starts this long after the apply
# returned, in the job's process, so that the job's return goes out first.
RECORD_DELAY = 0.05
# Files of one directory an apply checks one stat each before it lists the
# directory once instead (:meth:`Applier._listed`).
STATS_BEFORE_LISTING = 32


def locked(state_dir, wait=LOCK_WAIT):
    """
    ``with locked(state_dir):`` one job at a time on this peer's sync state
    (an inventory, an apply, the key history record an apply left running).
    :class:`PeerError` after ``wait`` seconds.
    """
    fsutil.makedirs(state_dir, mode=0o700)
    return _PeerLock(os.path.join(state_dir, PEER_LOCK), wait)


class _PeerLock(lock.SyncLock):
    def __init__(self, path, wait):
        super().__init__(path, None, wait=wait, poll=0.01)

    def acquire(self):
        try:
            return super().acquire()
        except lock.Busy:
            raise PeerError(f"another multimaster job still holds {self.path} after "
                            f"{self.wait:.0f} s") from None


def record_after_return(state_dir, work, delay=RECORD_DELAY, sleep=time.sleep):
    """
    Run ``work`` (what an apply leaves for after its return) under :func:`locked`,
    ``delay`` seconds from now: what the job's thread started after its
    return runs.  A failure is logged: the next sync records the history
    (the inventory says it is not).
    """
    sleep(delay)
    try:
        with locked(state_dir):
            work()
    except Exception:  # pylint: disable=broad-except
        log.exception("multimaster: the key history of the last apply was not recorded; "
                      "the next sync records it")


# ---------------------------------------------------------------------------
# The key history: ids this peer received from the primary
# ---------------------------------------------------------------------------
def _query(state_dir, sql, args=()):
    """The rows of ``sql`` on the state store of ``state_dir`` (none: no store, or damaged)."""
    return store.read(state_dir, lambda found: found.query(sql, args)) or []


class KeyHistory:
    """
    The ids this peer received from the primary (the ``history`` table of
    its state store, :mod:`salt_multimaster.store`): an apply that writes
    one key reads and writes the ids of its bucket, not the ids of every
    key.  Lost with a damaged store, it reads as no id received (a removal
    on the primary then reads as a conflict here, never as a deletion)
    until the history record finds the keys equal again.
    """

    def __init__(self, state_dir):
        self.state_dir = state_dir
        self.changed = {}
        self._ids = {}

    def ids(self, bucket):
        """The ids of ``bucket`` received (a set)."""
        if bucket in self.changed:
            return set(self.changed[bucket])
        if bucket not in self._ids:
            self._ids[bucket] = {mid for (mid,) in _query(
                self.state_dir, "SELECT id FROM history WHERE bucket = ?", (bucket,))}
        return set(self._ids[bucket])

    def all(self):
        """Every id received (a set)."""
        held = {mid for (mid,) in _query(self.state_dir, "SELECT id FROM history")}
        for bucket, ids in self.changed.items():
            held = {m for m in held if manifest.bucket_of(m) != bucket} | ids
        return held

    def set_ids(self, bucket, ids):
        """Make ``ids`` the ids of ``bucket`` received (saved by :meth:`save`)."""
        if set(ids) != self.ids(bucket):
            self.changed[bucket] = set(ids)

    def save(self, recorded=None):
        """
        Write the changed buckets (the history's generation one more), and
        ``recorded`` (``{bucket: digest}``, :func:`record_history`) at the
        generation saved, in one flushed transaction.
        """
        if not self.changed and recorded is None:
            return
        changed = self.changed

        def write(found):
            generation = found.meta(HISTORY, 0)
            if changed:
                generation = (generation if isinstance(generation, int) else 0) + 1
                for bucket, ids in changed.items():
                    found.db.execute("DELETE FROM history WHERE bucket = ?", (bucket,))
                    found.db.executemany("INSERT OR REPLACE INTO history VALUES (?, ?)",
                                         [(mid, bucket) for mid in sorted(ids)])
                found.set_meta(HISTORY, generation)
            if recorded is not None:
                found.set_meta(RECORDED, {"generation": generation, "buckets": recorded})

        store.record(self.state_dir, write, "the ids received")
        self._ids.update(changed)
        self.changed = {}


def read_history(state_dir):
    """The ids this peer received from the primary (a list)."""
    return sorted(KeyHistory(state_dir).all())


def _generation(state_dir):
    """The key history's generation (None: never saved)."""
    return store.read(state_dir, lambda found: found.meta(HISTORY))


def update_history(state_dir, ops, report):
    """
    Remember the ids received from the primary (``report``: what an apply
    of the ``minion_keys`` ``ops`` did), so that a later removal there reads
    as a deletion, and a key found only here as a conflict.  Reads and
    writes the buckets of those ids only.
    """
    written = {op["id"] for op in ops if op["op"] == replicate.WRITE}
    recorded = _recorded(state_dir)
    added = {r.split("/", 1)[1] for r in report["updated"]}
    dropped = {r.split("/", 1)[1] for r in report["removed"]} - written
    history = KeyHistory(state_dir)
    for bucket in {manifest.bucket_of(mid) for mid in added | dropped}:
        ids = history.ids(bucket)
        history.set_ids(bucket, (ids | {m for m in added if manifest.bucket_of(m) == bucket})
                        - dropped)
    # the buckets of the ids this apply touched are recorded no more
    touched = {manifest.bucket_of(op["id"]) for op in ops}
    history.save({b: d for b, d in recorded.items() if b not in touched})


def _recorded(state_dir):
    """
    ``{bucket: digest}`` of the buckets every id of which, at that digest,
    is in the key history, as the last :func:`record_history` found them
    (valid at the history's generation it saved them with).
    """
    got = store.read(state_dir, lambda found: (found.meta(HISTORY), found.meta(RECORDED)))
    generation, data = got or (None, None)
    if not isinstance(data, dict) or data.get("generation", 0) != (generation or 0) \
            or not isinstance(data.get("buckets"), dict):
        return {}
    return data["buckets"]


def _journal(mopts):
    """The change journal of this peer master (its engine's socket), for the reads of its state."""
    return watch.client(layout.state_dir(mopts))


def record_history(mopts, state_dir, primary_digest):
    """
    The explicit history step of an apply: every id of a bucket where this
    peer's keys equal the primary's (``primary_digest``: the primary's
    bucket digests) came from the primary.  Stamped in the key scan, so
    the inventory tells the primary whether it is recorded
    (``history_recorded``).  A bucket recorded at its digest before, and
    untouched by an apply since, is not read again.
    """
    snap = keyscan.KeysSnapshot(mopts["pki_dir"], state_dir, watch=_journal(mopts))
    same = [b for b, digest in snap.digest.items() if primary_digest.get(b) == digest]
    recorded = {b: d for b, d in _recorded(state_dir).items() if snap.digest.get(b) == d}
    todo = [b for b in same if b not in recorded]
    if todo:
        held = {}
        for keys in manifest.merge(snap.parts, todo).values():
            for mid in keys:
                held.setdefault(manifest.bucket_of(mid), set()).add(mid)
        history = KeyHistory(state_dir)
        for bucket, ids in held.items():
            history.set_ids(bucket, history.ids(bucket) | ids)
        recorded.update({b: snap.digest[b] for b in todo})
        history.save(recorded)
    snap.remember(history=_generation(state_dir))


# ---------------------------------------------------------------------------
# Inventory (read-only)
# ---------------------------------------------------------------------------
def inventory(mopts, state_dir, categories, digests, topology, config_keys, rescan=False):
    """
    What this peer master holds, for ``categories``.  For the bucketed
    categories only the buckets whose digest differs from ``digests`` (the
    primary's) are detailed: an unchanged peer answers with digests only.
    Changes no key, file or record of the sync.
    """
    running, where = daemon.master_running(mopts)
    ret = {"master_id": mopts["id"], "errors": [],
           "master_running": running, "master_address": where,
           "restart_pending": daemon.restart_pending(
               mopts, os.path.join(state_dir, daemon.RESTART_MARKER))}
    journal = _journal(mopts)
    for cat in categories:
        if cat == "master_keys":
            pem, pub = layout.master_key_files(mopts, topology)
            ret[cat] = {"pem": manifest.sha256_or_none(pem),
                        "pub": manifest.sha256_or_none(pub),
                        "fingerprint": finger.file_finger(
                            pub, mopts.get("hash_type", "sha256")) or None}
        elif cat == "master_config":
            keys = config_keys or list(replicate.DEFAULT_CONFIG_KEYS)
            ret[cat] = {k: mopts.get(k) for k in keys}
            # what the peer last confirmed of each option (sha256 only)
            ret["config_record"] = confirmed.config_record(state_dir)
        elif cat == "minion_keys":
            ret[cat] = keys_inventory(mopts, state_dir, digests.get(cat) or {}, rescan, journal)
        elif cat in rootscan.ROOTS:
            read = rootscan.RootsScan(mopts, cat, state_dir, rescan=rescan, watch=journal)
            diff = manifest.differing(digests.get(cat) or {}, read.raw)
            ret[cat] = {"digest": read.raw, "errors": [str(e) for e in read.errors],
                        "buckets": diff, "manifest": manifest.merge(read.parts, diff),
                        "envs": sorted(mopts.get(cat) or {}),
                        "record": confirmed.since(state_dir, cat, read.raw, diff,
                                                  functools.partial(_part, read.parts))}
    return ret


def _part(parts, bucket):
    """A bucket's part of a read (``{}``: an empty bucket)."""
    try:
        return parts[bucket]
    except KeyError:
        return {}


def keys_inventory(mopts, state_dir, digests, rescan=False, journal=None):
    """
    The ``minion_keys`` part of :func:`inventory`: digests, the differing
    buckets, and the ids of those buckets received from the primary before.
    """
    snap = keyscan.KeysSnapshot(mopts["pki_dir"], state_dir, rescan=rescan,
                                watch=journal or _journal(mopts))
    diff = manifest.differing(digests, snap.digest)
    wanted = set(diff)
    return {"digest": snap.digest, "errors": list(snap.errors), "buckets": diff,
            "manifest": manifest.merge(snap.parts, diff) if diff else {},
            "counts": snap.counts,
            "history": _history_of(state_dir, wanted),
            "history_recorded": snap.meta.get("history") == _generation(state_dir),
            "record": confirmed.since(state_dir, "minion_keys", snap.digest, diff,
                                      functools.partial(_part, snap.parts))}


def _history_of(state_dir, buckets):
    """The ids of ``buckets`` received from the primary (a sorted list): their files only."""
    if not buckets:
        return []
    history = KeyHistory(state_dir)
    return sorted(mid for bucket in buckets for mid in history.ids(bucket))


def targeted_inventory(mopts, state_dir, ids):
    """
    The keys of ``ids`` only (a targeted sync): their manifest and which of
    them this peer received from the primary.
    """
    errors = []
    here = keyscan.keys_state(mopts["pki_dir"], list(ids), errors=errors)
    history = set(_history_of(state_dir, {manifest.bucket_of(mid) for mid in ids}))
    return {"master_id": mopts["id"], "errors": [],
            "minion_keys": {"manifest": here, "errors": [str(e) for e in errors],
                            "history": sorted(history & set(ids)),
                            "record": confirmed.since_ids(state_dir, ids, here)}}


# ---------------------------------------------------------------------------
# Applying
# ---------------------------------------------------------------------------
class Applier:
    """
    Apply the operations of one sync to this peer, with backups: every
    write staged outside the roots and key dirs, renamed in :meth:`commit`.
    ``unseal(blob, purpose)`` opens what was sealed to this peer.
    """

    def __init__(self, mopts, state_dir, unseal):
        self.mopts = mopts
        self.state_dir = state_dir
        self.unseal = unseal
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        self.backup_root = os.path.join(mopts["cachedir"], "multimaster", "backup", stamp)
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
        self.written = []
        # directories this sync resolved or created: a sync of 20,000 keys
        # writes 20,000 files into one directory
        self.realpath = functools.lru_cache(maxsize=4096)(os.path.realpath)
        self.dirs = set()
        self.listings = {}
        self.stats = {}

    def safe_join(self, root, rel):
        return fsutil.safe_join(root, rel, realpath=self.realpath)

    def makedirs(self, path, mode=0o755):
        if path not in self.dirs:
            fsutil.makedirs(path, mode=mode)
            self.dirs.add(path)

    def _listed(self, path):
        """
        Whether ``path`` exists: a stat for the first :data:`STATS_BEFORE_LISTING`
        files of a directory, then one listing of it for the rest of the
        sync.  An initial sync writes 20,000 keys into one directory, where
        a stat of each costs more than the listing; a change sync writes one
        or two, where the listing of 20,000 names costs more than the stats.
        """
        directory, name = os.path.split(path)
        names = self.listings.get(directory)
        if names is None:
            stats = self.stats[directory] = self.stats.get(directory, 0) + 1
            if stats <= STATS_BEFORE_LISTING:
                return os.path.lexists(path)
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
        give the file, so the next inventory stats it instead of hashing it
        again.
        """
        hasher = hasher or (lambda d: hashlib.sha256(d).hexdigest())
        if sha is not None and hasher(data) != sha:
            raise PeerError(f"{rel}: content does not match its manifest, not written")
        self.backup(path, rel)
        self.makedirs(os.path.dirname(path))
        self.batch.write(path, data, mode=mode)
        if cache_path and sha is not None:
            self.written.append((path, cache_path, sha))

    def commit(self):
        """
        Make every staged write durable, then record the written files'
        hashes in the state store (the next read then does not read them
        again).
        """
        try:
            self.batch.commit()
        except OSError as exc:
            raise PeerError(f"writing on the peer failed, nothing renamed after: {exc}") from exc
        written, self.written = self.written, []
        stats = []
        for path, cache_path, sha in written:
            try:
                stats.append((cache_path, os.stat(path), sha))
            except OSError:
                pass
        if stats:
            store.record_hashes(self.state_dir, stats)

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
            path = app.safe_join(pki, rel)
            if op["op"] == replicate.WRITE:
                app.makedirs(os.path.dirname(path), mode=fsutil.KEY_DIR_MODE)
                app.write(path, app.content("minion_keys", op), 0o644, f"minion_keys/{rel}",
                          op["sha256"], hasher=manifest.key_sha, cache_path=path)
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
            fresh = app.safe_join(env_roots[0], op["rel"])  # validates rel
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
            app.write(target, data, fsutil.safe_mode(op["mode"]), item, op["sha256"],
                      cache_path=os.path.join(app.realpath(os.path.dirname(target)),
                                              os.path.basename(target)))
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
            if op["kind"] == "pem":
                app.write(fsutil.confine(pki, pem_path), app.content("master_keys", op),
                          fsutil.PRIVATE_KEY_MODE, protocol.item_name("master_keys", op),
                          op["sha256"])
            else:
                app.write(fsutil.confine(pki, pub_path), op["data"].encode(), 0o644,
                          protocol.item_name("master_keys", op), op["sha256"])
            report["updated"].append(op["name"])
        except APPLY_ERRORS as exc:
            report["errors"].append(f"{op['name']}: {exc}")
            report["failed"].append(op["name"])
    return report


def _parse_dropin(data):
    """The options of the drop-in: a YAML mapping of replicable options (ValueError else)."""
    try:
        values = salt.utils.yaml.safe_load(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("not UTF-8") from None
    except salt.utils.yaml.YAMLError:
        raise ValueError("not YAML") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError("not a mapping of options")
    return values


def dropin_damaged(conf_file, state_dir):
    """
    Whether the drop-in a sync writes beside the master config ``conf_file``
    (``master.d/``, :data:`protocol.DROPIN_NAME`) is damaged (Salt cannot
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
        return True
    return False


def apply_master_config(app, ops):
    report = _report()
    path = protocol.dropin_path(app.mopts)
    for op in ops:
        try:
            fsutil.makedirs(os.path.dirname(path))
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


def check_expected(mopts, state_dir, expect, topology, config_keys):
    """
    ``(held, inventory)``: whether this peer holds what the primary
    expects (``expect``: :func:`protocol.expectation`), and its inventory
    against those digests (what the primary plans from when it does not).
    A targeted expectation (:func:`protocol.targeted_expectation`) is
    checked against this peer's keys of its ids only
    (:func:`targeted_inventory`: no listing of every key).
    """
    if not isinstance(expect, dict) or not expect:
        raise validate.InvalidInput(f"expect must be a mapping of category to digests, "
                                    f"not {expect!r}")
    try:
        ids = protocol.targeted_ids(expect)
    except protocol.ProtocolError as exc:
        raise validate.InvalidInput(f"expect: {exc}") from None
    if ids is not None:
        # a targeted key sync: the keys of these ids only, a few stats each
        inv = targeted_inventory(mopts, state_dir, validate.minion_ids(ids))
        return protocol.holds(expect, inv), inv
    validate.categories(list(expect), "expect")
    if config_keys is not None:
        validate.config_keys(config_keys)
    try:
        digests = protocol.expected_digests(expect)
    except (KeyError, TypeError, AttributeError):
        raise validate.InvalidInput(f"expect: malformed digests {expect!r:.200}") from None
    inv = inventory(mopts, state_dir, list(expect), digests, topology, config_keys)
    try:
        return protocol.holds(expect, inv), inv
    except (KeyError, TypeError, AttributeError):
        raise validate.InvalidInput(f"expect: malformed digests {expect!r:.200}") from None


def apply(mopts, state_dir, ops, topology, backup_keep, unseal, fetch, restart,
          pull=None, pull_token=None, pull_chunks=0, keys_digest=None, expect=None,
          config_keys=None, after=None, confirm=None):
    """
    Apply ``ops`` (``None`` with ``pull_token``: pulled with the first
    chunk, through ``pull(request)``); return the reply without its
    protocol: per category the failures, ``restart``, ``backup``.  Raise
    :class:`validate.InvalidInput` for operations it refuses (nothing
    applied).  ``keys_digest``: the primary's minion key digests, for the
    history record (:func:`record_history`).  That record, and the keys
    Salt made pending again while they were accepted (:func:`keep_accepted`),
    are handed to ``after`` to run once the job has returned
    (:func:`record_after_return`; default: run before this returns).

    ``confirm``: the primary's digests of the other categories
    (``{category: bucket digests}``, ``master_config``: ``{option:
    sha256}``), for the record of what this peer holds in step with it
    (:func:`record_confirmed`).

    ``expect`` (a change sync, or a targeted key sync, in one round trip):
    apply only if this peer holds what the primary expects
    (:func:`check_expected`); else apply nothing and answer ``{"backup":
    None, "inventory": ...}``.  When it does, the reply of a full sync
    carries what the inventory says of the master (``master_running``,
    ``master_address``, ``restart_pending``).
    """
    if ops is not None:
        ops = validate.ops(ops)  # refused before anything is read, locked or written
    if topology not in layout.TOPOLOGIES:
        raise validate.InvalidInput(f"unknown topology {topology!r}")
    with locked(state_dir):
        return _apply(mopts, state_dir, ops, topology, backup_keep, unseal, fetch, restart, pull,
                      pull_token, pull_chunks, keys_digest, expect, config_keys, after, confirm)


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


def _run_all(work):
    for one in work:
        one()


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
    primary (:mod:`salt_multimaster.confirmed`), from what its last
    inventory read (its saved state) and what the apply did (``ret``).
    """
    confirm = confirm if isinstance(confirm, dict) else {}
    digests = {cat: _digests(confirm.get(cat)) for cat in confirmed.BUCKETED}
    digests["minion_keys"] = _digests(keys_digest)
    for cat in confirmed.BUCKETED:
        if not ops.get(cat) and digests[cat] is None:
            continue
        done = confirmed.applied(cat, ops.get(cat) or [],
                                 set((ret.get(cat) or {}).get("failed") or ()))
        now = None
        if cat == "minion_keys":
            held = keyscan.KeysSnapshot.saved_digest(mopts["pki_dir"], state_dir)

            def part(bucket):
                parts = keyscan.saved_parts(state_dir, [bucket])
                return None if parts is None else parts.get(bucket, {})

            def now(ids):
                return keyscan.keys_state(mopts["pki_dir"], sorted(ids))
        else:
            held = rootscan.saved_digests(state_dir, cat, safe=False)

            def part(bucket, cat=cat):
                return rootscan.saved_part(state_dir, cat, bucket)
        confirmed.record_apply(state_dir, cat, done, digests[cat], held, part, now)
    shas = _digests(confirm.get("master_config"))
    if shas is not None:
        values = {key: mopts.get(key) for key in shas}
        for op in ops.get("master_config") or ():
            if protocol.DROPIN_NAME not in ((ret.get("master_config") or {}).get("failed") or ()):
                values.update({k: v for k, v in op["values"].items() if k in shas})
        confirmed.record_config(state_dir, values, shas)


def _apply(mopts, state_dir, ops, topology, backup_keep, unseal, fetch, restart, pull,
           pull_token, pull_chunks, keys_digest, expect, config_keys, after, confirm):
    status = {}
    if expect is not None:
        held, inv = check_expected(mopts, state_dir, expect, topology, config_keys)
        if not held:
            return {"backup": None, "inventory": inv}
        status = {k: inv[k] for k in ("master_running", "master_address", "restart_pending")
                  if k in inv}
    app = Applier(mopts, state_dir, unseal)
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
        update_history(state_dir, ops["minion_keys"], ret["minion_keys"])
    # once the job has returned: keys Salt demoted meanwhile put back, the
    # record of what this peer holds in step with the primary, then the
    # history record (a listing of every key dir the apply changed)
    work = [functools.partial(keep_accepted, mopts, ops["minion_keys"])] \
        if "minion_keys" in ops else []
    work.append(functools.partial(record_confirmed, mopts, state_dir, ops, ret, keys_digest,
                                  confirm))
    if isinstance(keys_digest, dict):
        work.append(functools.partial(record_history, mopts, state_dir, keys_digest))
    if work and after is None:
        _run_all(work)
    elif work:
        after(functools.partial(_run_all, work))
    daemon_changed = any(ret.get(c, {}).get("updated") for c in ("master_keys", "master_config"))
    # a key taken out of minions/: this master rotates its AES key, as salt-key does
    rotation = revocation.after_apply(mopts, ret["minion_keys"]) if "minion_keys" in ops else {}
    for cat in ops:
        ret[cat] = outcome(ret[cat])
    ret["restart"] = restart() if daemon_changed else None
    ret["backup"] = app.backup_root if app.backed_up else None
    ret.update(rotation)
    try:
        pruned = backup.prune(os.path.dirname(app.backup_root), backup_keep)
        if pruned:
            log.info("multimaster: removed %d old backup(s), keeping %s", len(pruned), backup_keep)
    except (backup.BackupError, OSError, TypeError, ValueError) as exc:
        log.warning("multimaster: old backups not pruned: %s", exc)
    ret.update(status)
    return ret


# ---------------------------------------------------------------------------
# Restore
# ---------------------------------------------------------------------------
def restore_target(mopts, rel):
    """Where the backed-up item ``rel`` (``category/...``) goes back, and its mode."""
    try:
        cat, fields = protocol.parse_item(rel)
    except protocol.ProtocolError:
        raise backup.BackupError(f"{rel}: unknown category") from None
    if cat == "minion_keys":
        if fields["state"] not in manifest.KEY_DIRS or not manifest.valid_minion_id(fields["id"]):
            raise backup.BackupError(f"{rel}: not a minion key")
        return fsutil.safe_join(mopts["pki_dir"], f"{fields['state']}/{fields['id']}"), 0o644
    if cat in ("file_roots", "pillar_roots"):
        roots = (mopts.get(cat) or {}).get(fields["env"])
        if not roots:
            raise backup.BackupError(f"{rel}: saltenv {fields['env']!r} is not configured here")
        return (manifest.locate_confined(roots, fields["rel"])
                or fsutil.safe_join(roots[0], fields["rel"])), None
    if cat == "master_keys":
        topology = "signed" if fields["name"].startswith("master_sign.") else "shared"
        pem, pub = layout.master_key_files(mopts, topology)
        if fields["name"].endswith(".pem"):
            return pem, fsutil.PRIVATE_KEY_MODE
        return pub, 0o644
    return protocol.dropin_path(mopts), 0o600


def restore(mopts, state_dir, backup_name, test, restart):
    """
    Put back every file of the backup ``backup_name`` (default: the newest),
    what is there now backed up first; with ``test``, only list.
    """
    base = os.path.join(mopts["cachedir"], "multimaster", "backup")
    try:
        source = backup.choose(base, backup_name)
    except backup.BackupError as exc:
        return {"result": False, "error": str(exc), "restored": [], "errors": []}
    ret = {"result": True, "backup_restored": os.path.basename(source), "restored": [],
           "errors": []}
    app = None if test else Applier(mopts, state_dir, None)
    refused = restart.why_refused() if getattr(restart, "refused", None) else None
    for rel in backup.items(source):
        try:
            target, mode = restore_target(mopts, rel)
            if refused and rel.split("/", 1)[0] in DAEMON_CATEGORIES:
                raise PeerError(refused)
            if app is not None:
                with open(os.path.join(source, rel), "rb") as fh:
                    data = fh.read()
                if mode is None:
                    mode = os.stat(os.path.join(source, rel)).st_mode & 0o7777
                if rel.startswith("master_keys/"):
                    fsutil.makedirs(os.path.dirname(target), mode=fsutil.KEY_DIR_MODE)
                app.write(target, data, mode, rel, None)
            ret["restored"].append(rel)
        except (backup.BackupError, fsutil.PathError, PeerError, OSError) as exc:
            ret["errors"].append(f"{rel}: {exc}")
    if app is not None:
        app.commit()
        ret["backup"] = app.backup_root if app.backed_up else None
        daemon_files = any(r.split("/", 1)[0] in ("master_keys", "master_config")
                           for r in ret["restored"])
        ret["restart"] = restart() if daemon_files else None
    elif hasattr(restart, "predict") and any(
            r.split("/", 1)[0] in DAEMON_CATEGORIES for r in ret["restored"]):
        ret["restart"] = restart.predict()
    ret["result"] = not ret["errors"]
    return ret


# ---------------------------------------------------------------------------
# Failback: the contents of what this peer changed, for the primary
# ---------------------------------------------------------------------------
#: what one collect returns at most: the primary asks in batches below it.
#: A return is an event on the primary's bus, trimmed past its
#: ``max_event_size`` (1 MiB by default), and sealed content travels base64.
COLLECT_MAX_BYTES = 512 * 1024


def _collect_path(mopts, cat, fields):
    """Where this peer holds the item, confined to its pki_dir or roots."""
    if cat == "minion_keys":
        if fields["state"] not in manifest.KEY_DIRS or not manifest.valid_minion_id(
                fields["id"]):
            raise PeerError("not a minion key")
        return fsutil.safe_join(mopts["pki_dir"], f"{fields['state']}/{fields['id']}")
    roots = (mopts.get(cat) or {}).get(fields["env"])
    if not roots:
        raise PeerError(f"saltenv {fields['env']!r} is not configured here")
    fsutil.safe_join(roots[0], fields["rel"])  # validates the path
    found = manifest.locate_confined(roots, fields["rel"])
    if not found:
        raise PeerError("not found")
    return found


def collect(mopts, items, receiver, reply_pub):
    """
    The contents of ``items`` (:func:`protocol.item_name`: minion keys and
    roots files), each sealed to ``reply_pub`` (the primary's master public
    key) for ``receiver`` (its id): what ``multimaster.failback`` carries
    from this peer to the primary.  Returns ``{"items": {item: {"sha256",
    "size", "mode", "sealed"}}, "errors": [...]}``; an item it cannot read
    or that lies outside its pki_dir or roots is an error, never read.
    Changes nothing.
    """
    ret = {"items": {}, "errors": []}
    total = 0
    for item in items:
        try:
            cat, fields = protocol.parse_item(item)
            if cat not in ("minion_keys", "file_roots", "pillar_roots"):
                raise PeerError("only minion keys and roots files are collected")
            path = _collect_path(mopts, cat, fields)
            if os.path.getsize(path) > COLLECT_MAX_BYTES:
                raise PeerError(f"larger than {COLLECT_MAX_BYTES // 1024} KiB, more than a "
                                "return carries: copy it to the primary by hand, or keep it")
            with open(path, "rb") as fh:
                data = fh.read()
            total += len(data)
            if total > COLLECT_MAX_BYTES:
                raise PeerError(f"past {COLLECT_MAX_BYTES // 1024} KiB in one collect: ask "
                                "again")
            st = os.stat(path)
            sha = manifest.key_sha(data) if cat == "minion_keys" else \
                hashlib.sha256(data).hexdigest()
            ret["items"][item] = {"sha256": sha, "size": len(data),
                                  "mode": fsutil.safe_mode(st.st_mode & 0o7777),
                                  "sealed": seal.seal(reply_pub, data, receiver,
                                                      f"failback/{item}")}
        except (PeerError, OSError, fsutil.PathError, protocol.ProtocolError,
                seal.SealError, ValueError) as exc:
            ret["errors"].append(f"{item}: {exc}")
    return ret
