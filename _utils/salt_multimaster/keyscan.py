"""
The one scanner of a master's minion key dirs: what ``pki_dir/minions``,
``minions_pre``, ``minions_rejected``, ``minions_denied`` and
``minions_autosign`` hold, as ``{state: {id: sha256}}`` cut in buckets
(:func:`salt_multimaster.manifest.bucket_of`), through the state store
(:mod:`salt_multimaster.store`).

A scan re-stats the key dirs, every one or, with the change journal
(:mod:`salt_multimaster.watch`), the dirs and keys it names since the last
scan's token, and reads only the keys whose inode, size, mtime or ctime
changed since (``rescan``: every key read again).  The rows of the keys
and the digests of the buckets they changed are written in one
transaction.  The journal is a trigger, not a proof: without its word (no
engine, a new session, events lost) every dir is listed, and a dir that
held a key that could not be used is listed every time, so that its repair
is seen however it was made.
"""

import os
import stat

from salt_multimaster import manifest, store as state_store

CATEGORY = "minion_keys"
#: what a scan writes in its ``meta`` entry; any other field is :meth:`KeysSnapshot.remember`'s
_SCAN_FIELDS = ("pki_dir", "token", "errors", "damaged")


def _key_sha(state, name, path, st, known, errors):
    """
    The sha256 of one key file whose stat is ``st``, or None when it is not
    a key Salt would use (the reason goes to ``errors``).  ``known(path,
    st)``: a hash recorded for it (a peer's apply), else None.
    """
    sha = known(path, st)
    if sha is not None:
        return sha
    try:
        if state == "minions_autosign":
            return manifest.key_sha_file(path)
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        errors.append(_damaged(state, name, f"unreadable: {exc.strerror}"))
        return None
    if not manifest.looks_like_pem(data[:4096]):
        errors.append(_damaged(state, name, "not a PEM public key, skipped"))
        return None
    return manifest.key_sha(data)


def _damaged(state, name, why):
    """The error of a key that exists but cannot be used: never read as removed."""
    return manifest.Damaged(f"{state}/{name}: {why}", name, state)


def _stat_key(state, name, path, entry, errors):
    """
    The stat of the key file ``name`` (``entry``: its ``os.DirEntry`` when
    listed), or None when it is gone or no key file Salt would use.
    """
    if name.startswith("."):
        return None  # Salt's own .key_cache, a sync's staging: not keys
    if not manifest.valid_minion_id(name):
        errors.append(f"{state}/{name!r}: invalid minion id, skipped")
        return None
    try:
        st = entry.stat(follow_symlinks=False) if entry is not None else os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        errors.append(_damaged(state, name, f"unreadable: {exc.strerror}"))
        return None
    if stat.S_ISLNK(st.st_mode):
        errors.append(f"{state}/{name}: symlinked key file, skipped (Salt ignores it)")
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def _listing(pki_dir, state, names):
    """``[(name, path, DirEntry or None)]`` of one key dir, or of ``names`` in it."""
    directory = os.path.join(pki_dir, state)
    if names is not None:
        return [(name, os.path.join(directory, name), None) for name in names if name]
    try:
        with os.scandir(directory) as listing:
            return [(entry.name, entry.path, entry) for entry in listing]
    except FileNotFoundError:
        return []


def _journal_word(watch, token, pki_dir, errors, rescan):
    """
    ``(what to re-stat, token)`` from the change journal: ``{state: None
    (list it) or [names]}`` for the dirs it names, None when it cannot
    vouch for the pki_dir (no engine, another session, events lost,
    ``rescan``); the token to keep with this scan (None: none).
    """
    reply = watch(token) if watch is not None else None
    tree = os.path.realpath(pki_dir)
    if not isinstance(reply, dict) or not reply.get("session") or (
            tree not in (reply.get("trees") or ()) or tree in (reply.get("unwatched") or ())):
        return None, None
    new_token = {"session": reply["session"], "seq": reply["seq"]}
    changed = (reply.get("changed") or {}).get(tree)
    nested = [t for t in reply["trees"] if t != tree and isinstance(t, str)
              and (t.startswith(tree + os.sep) or tree.startswith(t.rstrip(os.sep) + os.sep))]
    if rescan or token is None or not isinstance(changed, list) or nested:
        return None, new_token
    found = (reply.get("names") or {}).get(tree) or {}
    todo = {}
    for state in manifest.KEY_DIRS:
        if state in changed:
            names = found.get(state)
            # "" is the dir itself: list it
            todo[state] = names if isinstance(names, list) and "" not in names else None
        if errors.get(state):
            todo[state] = None  # held a key that could not be used: listed every time
    return todo, new_token


class KeysSnapshot:
    """
    One scan of the key dirs of ``pki_dir``, kept in the store of
    ``state_dir``: ``digest`` (``{bucket: digest}``), ``counts`` (keys per
    state), ``errors`` (keys skipped, with why), ``damaged`` (``{state:
    [ids]}`` that exist but cannot be used: never read as removed),
    ``parts`` (``{bucket: {state: {id: sha256}}}``) and ``meta`` (what
    :meth:`remember` kept with it).  ``watch``: the change journal
    (:func:`salt_multimaster.journal.client`).  The store is closed once the
    scan is read; ``keep=False``: not changed by the scan (test mode: the
    next sync still plans from the state a peer in step holds).
    """

    def __init__(self, pki_dir, state_dir, rescan=False, watch=None, keep=True):
        self.pki_dir, self.state_dir, self.keep = pki_dir, state_dir, keep
        state_store.scanning(state_dir, self._read, rescan, watch)

    def _read(self, rescan, watch):
        store = state_store.Store(self.state_dir)
        try:
            with store.write(keep=self.keep):
                errors, changed = self._scan(store, rescan, watch)
                rows = store.db.execute("SELECT bucket, state, id, sha FROM keys").fetchall()
                self.digest = store.digests(CATEGORY)
                self.meta = store.meta("keys", {})
        finally:
            store.close()
        self.parts = {}
        for bucket, state, mid, sha in rows:
            self.parts.setdefault(bucket, {}).setdefault(state, {})[mid] = sha
        self.counts = dict.fromkeys(manifest.KEY_DIRS, 0)
        for part in self.parts.values():
            for state, keys in part.items():
                self.counts[state] += len(keys)
        self.errors = [e for state in manifest.KEY_DIRS for e in errors[state]]
        self.damaged = {state: ids for state, ids in self.meta["damaged"].items() if ids}
        old = {b: part for b, part in self._old_parts.items() if part}
        self._previous = {**self.parts, **old}
        for bucket in changed - set(old):
            self._previous.pop(bucket, None)

    def _scan(self, store, rescan, watch):
        """Scan in ``store``'s transaction: ``(errors per state, buckets changed)``."""
        meta = store.meta("keys", {})
        if meta.get("pki_dir") != self.pki_dir:
            # another pki_dir's scan, or none: start afresh
            store.db.execute("DELETE FROM keys")
            store.db.execute("DELETE FROM digests WHERE cat = ?", (CATEGORY,))
            meta = {}
        old_errors = meta.get("errors") if isinstance(meta.get("errors"), dict) else {}
        todo, token = _journal_word(watch, meta.get("token"), self.pki_dir, old_errors, rescan)
        if token is None:
            # no word from the journal: this scan is newer than the token kept,
            # and what changed since that token still covers what changes next
            token = meta.get("token")
        self.previous_digest = store.digests(CATEGORY)
        errors, damaged, found = {}, {}, []
        for state in manifest.KEY_DIRS:
            if todo is not None and state not in todo:
                errors[state] = list(old_errors.get(state) or [])
                damaged[state] = list((meta.get("damaged") or {}).get(state) or [])
                continue
            errors[state] = []
            found.append(self._rescan_dir(store, state, todo.get(state) if todo else None,
                                          rescan, errors[state]))
            damaged[state] = manifest.damaged_sources(errors[state]).get(state, [])
        # the parts before this scan of the buckets it changes (previous_parts)
        changed = set().union(*(buckets for _put, _gone, buckets in found))
        self._old_parts = {bucket: _part(store, bucket) for bucket in changed}
        for put, gone, _buckets in found:
            store.db.executemany("DELETE FROM keys WHERE state = ? AND id = ?", gone)
            store.db.executemany("INSERT OR REPLACE INTO keys VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                                 put)
        new = {bucket: _part(store, bucket) for bucket in changed}
        store.set_digests(CATEGORY, {bucket: manifest.part_digest(part) if part else None
                                     for bucket, part in new.items()})
        if todo is None:
            # every key dir listed: the hashes a peer's apply recorded are spent
            store.forget_hashes(self.pki_dir)
        # what was remembered with the scan (remember()) holds while its keys are the same
        kept = {k: v for k, v in meta.items() if k not in _SCAN_FIELDS} if not changed else {}
        store.set_meta("keys", dict(kept, pki_dir=self.pki_dir, token=token,
                                    errors={s: [str(e) for e in v] for s, v in errors.items()},
                                    damaged=damaged))
        return errors, changed

    def _rescan_dir(self, store, state, names, rescan, errors):
        """
        Stat the keys of one dir again (``names``: only these) and hash the
        changed ones: ``(rows to write, (state, id) to delete, buckets
        changed)``.
        """
        sql = "SELECT id, ino, size, mtime_ns, ctime_ns, sha, bucket FROM keys WHERE state = ?"
        if names is None:
            old = {row[0]: row for row in store.db.execute(sql, (state,))}
        else:
            old = {}
            for name in names:
                old.update((row[0], row) for row in store.db.execute(sql + " AND id = ?",
                                                                     (state, name)))
        known = state_store.no_hash if rescan else store.known_hash
        seen, put, buckets = set(), [], set()
        for name, path, entry in _listing(self.pki_dir, state, names):
            st = _stat_key(state, name, path, entry, errors)
            if st is None:
                continue
            was = old.get(name)
            now = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if was is not None and not rescan and was[1:5] == now:
                seen.add(name)
                continue
            sha = _key_sha(state, name, path, st, known, errors)
            if sha is None:
                continue
            seen.add(name)
            bucket = manifest.bucket_of(name)
            put.append((state, name, bucket) + now + (sha,))
            if was is None or was[5] != sha:
                buckets.add(bucket)
        gone = [name for name in old if name not in seen]
        buckets.update(old[name][6] for name in gone)
        return put, [(state, name) for name in gone], buckets

    def previous_parts(self):
        """
        ``(digests, function returning the parts)`` of the scan this one
        replaced; None when there was none.
        """
        if not self.previous_digest:
            return None
        return self.previous_digest, lambda: self._previous

    def remember(self, **fields):
        """Keep more fields with the scan (:attr:`meta`)."""
        self.meta = dict(self.meta, **fields)
        saved = state_store.Store(self.state_dir)
        try:
            with saved.write():
                saved.set_meta("keys", dict(saved.meta("keys", {}), **fields))
        finally:
            saved.close()

    @staticmethod
    def saved_digest(pki_dir, state_dir):
        """The digests of the last scan of ``pki_dir``, no key looked at (None: none)."""
        def digests(saved):
            return saved.digests(CATEGORY) if saved.meta("keys", {}).get(
                "pki_dir") == pki_dir else None

        return state_store.read(state_dir, digests)


def _part(store, bucket):
    """``{state: {id: sha256}}`` of one bucket as ``store`` holds it (``{}``: empty)."""
    part = {}
    for state, mid, sha in store.db.execute("SELECT state, id, sha FROM keys WHERE bucket = ?",
                                            (bucket,)):
        part.setdefault(state, {})[mid] = sha
    return part


def keys_state(pki_dir, ids, errors=None):
    """
    ``{state: {minion_id: sha256}}`` of the keys of ``ids`` only: a few
    stat calls per id instead of a scan of every key dir (targeted syncs).
    Invalid ids are reported in ``errors`` and left out.
    """
    errors = errors if errors is not None else []
    ret = {state: {} for state in manifest.KEY_DIRS}
    for mid in ids:
        if not manifest.valid_minion_id(mid):
            errors.append(f"{mid!r}: invalid minion id, skipped")
            continue
        for state in manifest.KEY_DIRS:
            path = os.path.join(pki_dir, state, mid)
            st = _stat_key(state, mid, path, None, errors)
            sha = None if st is None else _key_sha(state, mid, path, st, state_store.no_hash,
                                                   errors)
            if sha is not None:
                ret[state][mid] = sha
    return ret


def saved_parts(state_dir, buckets):
    """
    ``{bucket: {state: {id: sha256}}}`` of ``buckets`` as the last scan
    saw them, an empty bucket left out; None when there was no scan.
    """
    def parts(saved):
        if not saved.meta("keys"):
            return None
        found = {bucket: _part(saved, bucket) for bucket in buckets}
        return {bucket: part for bucket, part in found.items() if part}

    return state_store.read(state_dir, parts)
