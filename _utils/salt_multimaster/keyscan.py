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


def _key_sha(state, name, path, errors):
    """
    The sha256 of one key file, or None when it is not a key Salt would use
    (the reason goes to ``errors``).
    """
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
        self.pki_dir, self.state_dir = pki_dir, state_dir
        errors, rows = state_store.scanning(state_dir, self._scan, rescan, watch, keep)
        self.parts, self.counts = {}, dict.fromkeys(manifest.KEY_DIRS, 0)
        for bucket, state, mid, sha in rows:
            self.parts.setdefault(bucket, {}).setdefault(state, {})[mid] = sha
            self.counts[state] += 1
        self.errors = [e for state in manifest.KEY_DIRS for e in errors[state]]
        self.damaged = {state: ids for state, ids in self.meta["damaged"].items() if ids}
        # the parts of the buckets it changed as they were before (an empty one left out)
        self._previous = {b: part for b, part in {**self.parts, **self._old_parts}.items() if part}

    def _scan(self, store, rescan, watch):
        """Scan in ``store``'s transaction: ``(errors per state, rows of the keys)``."""
        meta = store.meta("keys", {})
        if meta.get("pki_dir") != self.pki_dir:
            # another pki_dir's scan, or none: start afresh
            store.db.execute("DELETE FROM keys")
            store.db.execute("DELETE FROM digests WHERE cat = ?", (CATEGORY,))
            meta = {}
        old_errors = meta.get("errors") if isinstance(meta.get("errors"), dict) else {}
        tree = os.path.realpath(self.pki_dir)
        word, token = state_store.journal_word(watch, meta.get("token"), [tree], rescan)
        todo = None  # the dirs to stat again: {state: None (list it) or [names]}; None: all
        if word and tree in word:
            (dirs, found), todo = word[tree], {}
            for state in manifest.KEY_DIRS:
                if state in dirs:
                    names = found.get(state)
                    # "" is the dir itself: list it
                    todo[state] = names if isinstance(names, list) and "" not in names else None
                if old_errors.get(state):
                    todo[state] = None  # held a key that could not be used: listed every time
        self.previous_digest = store.digests(CATEGORY)
        errors, damaged, writes, changed = {}, {}, [], set()
        for state in manifest.KEY_DIRS:
            if todo is not None and state not in todo:
                errors[state] = list(old_errors.get(state) or [])
                damaged[state] = list((meta.get("damaged") or {}).get(state) or [])
                continue
            errors[state] = []
            self._rescan_dir(store, state, todo.get(state) if todo else None, rescan,
                             errors[state], writes, changed)
            damaged[state] = manifest.damaged_sources(errors[state]).get(state, [])
        # the parts before this scan of the buckets it changes (previous_parts)
        self._old_parts, new = store.rewrite(writes, changed, lambda b: _part(store, b))
        store.set_digests(CATEGORY, new)
        # what was remembered with the scan (remember()) holds while its keys are the same
        kept = {k: v for k, v in meta.items() if k not in _SCAN_FIELDS} if not changed else {}
        store.set_meta("keys", dict(kept, pki_dir=self.pki_dir, token=token,
                                    errors={s: [str(e) for e in v] for s, v in errors.items()},
                                    damaged=damaged))
        self.digest, self.meta = store.digests(CATEGORY), store.meta("keys", {})
        return errors, store.query("SELECT bucket, state, id, sha FROM keys")

    def _rescan_dir(self, store, state, names, rescan, errors, writes, buckets):
        """
        Stat the keys of one dir again (``names``: only these) and hash the
        changed ones: the statements that bring their rows up to date go
        to ``writes``, the buckets changed to ``buckets``.
        """
        sql = "SELECT id, ino, size, mtime_ns, ctime_ns, sha, bucket FROM keys WHERE state = ?"
        if names is None:
            old = {row[0]: row for row in store.db.execute(sql, (state,))}
        else:
            old = {}
            for name in names:
                old.update((row[0], row) for row in store.db.execute(sql + " AND id = ?",
                                                                     (state, name)))
        seen, put = set(), []
        for name, path, entry in _listing(self.pki_dir, state, names):
            st = _stat_key(state, name, path, entry, errors)
            if st is None:
                continue
            was = old.get(name)
            now = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if was is not None and not rescan and was[1:5] == now:
                seen.add(name)
                continue
            sha = _key_sha(state, name, path, errors)
            if sha is None:
                continue
            seen.add(name)
            bucket = manifest.bucket_of(name)
            put.append((state, name, bucket) + now + (sha,))
            if was is None or was[5] != sha:
                buckets.add(bucket)
        gone = [name for name in old if name not in seen]
        buckets.update(old[name][6] for name in gone)
        writes.append(("DELETE FROM keys WHERE state = ? AND id = ?",
                       [(state, name) for name in gone]))
        writes.append(("INSERT OR REPLACE INTO keys VALUES (?, ?, ?, ?, ?, ?, ?, ?)", put))

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
        state_store.record(self.state_dir, lambda saved: saved.set_meta(
            "keys", dict(saved.meta("keys", {}), **fields)), "the key scan's fields",
            durable=False)


def _part(store, bucket):
    """``{state: {id: sha256}}`` of one bucket as ``store`` holds it (``{}``: empty)."""
    part = {}
    for state, mid, sha in store.db.execute("SELECT state, id, sha FROM keys WHERE bucket = ?",
                                            (bucket,)):
        part.setdefault(state, {})[mid] = sha
    return part
