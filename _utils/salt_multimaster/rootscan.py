"""
The one scanner of a master's ``file_roots`` and ``pillar_roots``: the view
Salt's roots fileserver serves, ``{saltenv: {rel: [size, mode, sha256]}}``
(the first root holding a path wins), cut in buckets
(:func:`salt_multimaster.manifest.bucket_of` of ``saltenv/rel``), through
the state store (:mod:`salt_multimaster.store`).

A scan walks every root, or, with the change journal
(:mod:`salt_multimaster.watch`), lists again only the directories it names
since the last scan's token, those that held a symlink or an error, and
the new ones; every file listed is statted, and read only when its inode,
size, mtime or ctime changed (``rescan``: every file read again).  The
rows of the files and the digests of the buckets they changed are written
in one transaction.  Symlinks are followed only while they stay inside
their root (others are reported and left out); Salt's
``file_ignore_regex``/``file_ignore_glob`` apply to relative and full
paths; a sync's temporary files are never listed.
"""

import logging
import os
import stat

from salt_multimaster import fsutil, manifest, replicate, store as state_store

log = logging.getLogger(__name__)

ROOTS = ("file_roots", "pillar_roots")


class RootsScan:
    """
    One scan of the ``cat`` roots (``file_roots`` or ``pillar_roots``) of
    the master whose options are ``opts``, kept in the store of
    ``state_dir``: ``parts`` (``{bucket: {saltenv: {rel: [size, mode,
    sha256]}}}``), their digests ``raw`` and ``safe`` (modes as a peer in
    step holds them, :func:`replicate.safe_tree`), ``errors`` and
    ``damaged`` (``{saltenv: [names]}`` that exist but cannot be read:
    never read as removed), and :meth:`previous`.  ``watch``: the change
    journal (:func:`salt_multimaster.journal.client`); ``keep=False``: the
    store is not changed by the scan (test mode).
    """

    def __init__(self, opts, cat, state_dir, rescan=False, watch=None, keep=True):
        self.cat, self.state_dir = cat, state_dir
        self.roots = {env: [r for r in roots if os.path.isdir(r)]
                      for env, roots in sorted((opts.get(cat) or {}).items())}
        self.ignore = manifest.Ignore(opts)
        rows = state_store.scanning(state_dir, self._scan, rescan, watch, keep)
        self.parts, self.errors = _merged(rows, self.roots)
        self.damaged = manifest.damaged_sources(self.errors)
        # the parts of the buckets it changed as they were before (an empty one left out)
        self._previous = {b: replicate.safe_tree(part) for b, part in
                          {**self.parts, **self._old_parts}.items() if part}

    def previous(self):
        """
        ``(digests, function returning the parts)`` of the scan this one
        replaced, as a peer in step holds them; None when there was none.
        """
        if not self.previous_safe:
            return None
        return self.previous_safe, lambda: self._previous

    def _scan(self, store, rescan, watch):
        """Scan in ``store``'s transaction: the rows of the files."""
        db, cat = store.db, self.cat
        meta = store.meta(cat, {})
        config = {"roots": self.roots,
                  "ignore": [[r.pattern for r in self.ignore.regex], list(self.ignore.glob)]}
        if meta.get("config") != config:
            # other roots or other ignore rules, or no scan: start afresh
            for table in ("files", "dirs"):
                db.execute(f"DELETE FROM {table} WHERE cat = ?", (cat,))
            db.execute("DELETE FROM digests WHERE cat IN (?, ?)", (cat, f"{cat}:safe"))
            meta = {}
        reals = {os.path.realpath(r) for env_roots in self.roots.values() for r in env_roots}
        dirty, token = state_store.journal_word(watch, meta.get("token"), reals, rescan)
        self.previous_safe = store.digests(f"{cat}:safe")
        writes, buckets, unlisted = [], set(), 0
        for env, roots in self.roots.items():
            for root in roots:
                walk = _Walk(self, db, env, root, rescan)
                vouched = (dirty or {}).get(walk.real_root)
                walk.run(None if vouched is None else set(vouched[0]))
                writes.extend(walk.writes)
                buckets |= walk.buckets
                unlisted += len(set(walk.known) - walk.visited)
        if dirty is not None:
            log.debug("multimaster: %s read at journal token %s, %d director(ies) unlisted", cat,
                      token.get("seq"), unlisted)
        self._old_parts, new = store.rewrite(writes, buckets, lambda b: _merged(
            _bucket_rows(db, cat, b), self.roots)[0].get(b, {}))
        store.set_digests(cat, new)
        store.set_digests(f"{cat}:safe", {b: replicate.safe_tree(part) for b, part in new.items()})
        store.set_meta(cat, {"config": config, "token": token})
        self.raw, self.safe = store.digests(cat), store.digests(f"{cat}:safe")
        return store.query("SELECT bucket, env, root, dir, name, size, mode, sha, error FROM "
                           "files WHERE cat = ?", (cat,))


def _bucket_rows(db, cat, bucket):
    return db.execute("SELECT bucket, env, root, dir, name, size, mode, sha, error FROM files "
                      "WHERE cat = ? AND bucket = ?", (cat, bucket)).fetchall()


def _merged(rows, roots):
    """
    ``(parts, errors)`` of file rows: per saltenv, the first root with a
    usable file at a path serves it; an error is reported unless an earlier
    root serves its path.
    """
    order = {(env, root): i for env, env_roots in roots.items()
             for i, root in enumerate(env_roots)}
    by_rank = {}
    for row in rows:
        rank = order.get((row[1], row[2]))
        if rank is not None:
            by_rank.setdefault(rank, []).append(row)
    parts, served, failed = {}, {}, []
    for rank in sorted(by_rank):
        for bucket, env, _root, directory, name, size, mode, sha, error in by_rank[rank]:
            rel = f"{directory}/{name}" if directory and name else directory or name
            if error is not None:
                failed.append((env, rel, rank, error))
            elif (env, rel) not in served:
                served[env, rel] = rank
                parts.setdefault(bucket, {}).setdefault(env, {})[rel] = [size, mode, sha]
    errors = []
    for env, rel, rank, error in sorted(failed):
        if served.get((env, rel), rank + 1) > rank:
            message, _sep, damaged = error.partition("\0")
            errors.append(manifest.Damaged(message, damaged, env) if damaged else message)
    return parts, errors


def _parent(rel):
    return rel.rsplit("/", 1)[0] if "/" in rel else ""


class _Walk:
    """
    The walk of one root of one saltenv against the rows of the last scan:
    the statements that bring them up to date (:attr:`writes`) and the
    buckets whose content changed.  A row is ``(cat, env, root, dir, name,
    bucket, inode, size, mtime_ns, ctime_ns, mode, sha256, error)``; a
    directory's own error is a row of it with the name ``""``.
    """

    def __init__(self, scan, db, env, root, rescan):
        self.scan, self.db, self.env, self.root = scan, db, env, root
        self.key = (scan.cat, env, root)
        self.rescan = rescan
        self.real_root = os.path.realpath(root)
        self.inside = self.real_root.rstrip(os.sep) + os.sep
        self.writes, self.buckets = [], set()
        self.known, self.children, self.visited = {}, {}, set()

    def bucket(self, rel):
        return manifest.bucket_of(f"{self.env}/{rel}")

    def run(self, dirty):
        """Walk the whole root (``dirty`` None), or list its ``dirty``, unclean and new dirs."""
        self.known = dict(self.db.execute(
            "SELECT rel, clean FROM dirs WHERE cat = ? AND env = ? AND root = ?", self.key))
        for rel in self.known:
            if rel:
                self.children.setdefault(_parent(rel), []).append(rel)
        if dirty is None or "" not in self.known:
            self._walk("", self.root, frozenset(), self.real_root, walk_all=True)
            for rel in self.known:
                if rel not in self.visited:
                    self._drop(rel, under=False)  # gone
            return
        for rel in sorted(self.known):
            if rel in self.visited or not (rel in dirty or not self.known[rel]):
                continue
            path = os.path.join(self.root, *rel.split("/")) if rel else self.root
            real = os.path.realpath(path)
            if os.path.isdir(path) and (real == self.real_root or real.startswith(self.inside)):
                self._list(rel, path, real, frozenset(), walk_all=False)
            # else gone or moved: its parent, changed too, lists it (or not) again

    def _drop(self, rel, under=True):
        """The rows of the directory ``rel`` go (``under``: and of every directory below)."""
        where, args = "dir = ?", (rel,)
        if under:
            # every dir below: from "rel/" up to "rel0" ("0" follows "/"), byte-wise
            where, args = "(dir = ? OR (dir >= ? AND dir < ?))", (rel, f"{rel}/", f"{rel}0")
        cond = "cat = ? AND env = ? AND root = ? AND "
        for directory, name in self.db.execute(
                f"SELECT dir, name FROM files WHERE {cond}{where}", self.key + args):
            self.buckets.add(self.bucket(f"{directory}/{name}" if directory and name
                                         else directory or name))
        self.writes.append((f"DELETE FROM files WHERE {cond}{where}", [self.key + args]))
        self.writes.append((f"DELETE FROM dirs WHERE {cond}{where.replace('dir', 'rel')}",
                            [self.key + args]))

    def _walk(self, rel, path, ancestors, real, walk_all):
        """List ``rel`` and, ``walk_all`` or not, every directory under it not known yet."""
        if real != self.real_root and not real.startswith(self.inside):
            self._store(rel, {"": self._row(rel, "", error=(
                f"{self.root}: {rel}: symlinked directory leads outside the root, not "
                "replicated"))}, clean=False)
            return
        if real not in ancestors:  # else a symlink loop inside the root
            self._list(rel, path, real, ancestors, walk_all)

    def _list(self, rel, path, real, ancestors, walk_all):
        """
        List the directory ``rel`` again: its files statted (read when
        changed); its subdirectories walked when new, behind a symlink or
        ``walk_all``, their rows dropped when gone.
        """
        self.visited.add(rel)
        ancestors = ancestors | {real}
        prefix = f"{rel}/" if rel else ""
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError as exc:
            self._store(rel, {"": self._row(rel, "", error=f"{self.root}: {rel or '.'}: "
                                            f"{exc.strerror}", damaged=prefix or "/")},
                        clean=False)
            return
        old = {row[4]: row for row in self.db.execute(
            "SELECT * FROM files WHERE cat = ? AND env = ? AND root = ? AND dir = ?",
            self.key + (rel,))}
        now, clean, subdirs = {}, True, []
        ignore = self.scan.ignore
        for entry in entries:
            name, full = entry.name, entry.path
            if name.startswith(fsutil.TEMP_PREFIX):
                continue  # a sync writing here: its temporary files
            sub = prefix + name
            if not manifest.utf8(name):
                shown = name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
                now[shown] = self._row(rel, shown, error=f"{self.root}: {prefix}{shown}: not a "
                                                         "UTF-8 name, not replicated")
                clean = False
                continue
            try:
                is_dir = entry.is_dir()  # follows symlinks, as Salt does
            except OSError:
                is_dir = False
            link = entry.is_symlink()
            if is_dir:
                if not (ignore(sub + "/", full + "/") or ignore(sub, full)):
                    subdirs.append((sub, full, link))
                    clean = clean and not link
                continue
            if ignore(sub, full):
                continue
            row = self._file(rel, name, full, real, entry, link, old.get(name))
            if row is not None:
                now[name] = row
                clean = clean and not link and row[12] is None
        self._store(rel, now, clean, old)
        listed = {sub for sub, _full, _link in subdirs}
        for known in self.children.get(rel, ()):
            if known not in listed:
                self._drop(known)  # gone
        for sub, full, link in subdirs:
            if walk_all or link or sub not in self.known:
                sub_real = os.path.realpath(full) if link else os.path.join(real, sub.rsplit(
                    "/", 1)[-1])
                self._walk(sub, full, ancestors, sub_real, walk_all or link)

    def _file(self, rel, name, full, real_dir, entry, link, was):
        """
        The row of one file of the directory ``rel`` (None: no regular
        file); ``real_dir``: the real path of that directory.
        """
        path = f"{rel}/{name}" if rel else name
        real = os.path.realpath(full) if link else None
        if link and not real.startswith(self.inside):
            return self._row(rel, name, error=f"{self.root}: {path}: symlink leads outside the "
                                              "root, not replicated")
        try:
            st = entry.stat()
        except FileNotFoundError as exc:
            return self._row(rel, name, error=f"{self.root}: {path}: {exc.strerror}")
        except OSError as exc:
            return self._row(rel, name, error=f"{self.root}: {path}: {exc.strerror}",
                             damaged=path)
        if not stat.S_ISREG(st.st_mode):
            return None
        if (was is not None and not self.rescan and was[12] is None
                and was[6:10] == (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)):
            return self._row(rel, name, st, was[11])
        real = real or os.path.join(real_dir, name)
        try:
            sha = manifest.sha256_file(real)
        except OSError as exc:
            return self._row(rel, name, error=f"{self.root}: {path}: unreadable: "
                                              f"{exc.strerror}", damaged=path)
        return self._row(rel, name, st, sha)

    def _row(self, directory, name, st=None, sha=None, error=None, damaged=None):
        rel = f"{directory}/{name}" if directory and name else directory or name
        if error is not None and damaged:
            error = f"{error}\0{damaged}"
        if st is None:
            return self.key + (directory, name, self.bucket(rel)) + (None,) * 6 + (error,)
        return self.key + (directory, name, self.bucket(rel), st.st_ino, st.st_size,
                           st.st_mtime_ns, st.st_ctime_ns, stat.S_IMODE(st.st_mode), sha, None)

    def _store(self, rel, now, clean, old=None):
        """Write the rows of the directory ``rel`` that changed; note the buckets changed."""
        old = old if old is not None else {row[4]: row for row in self.db.execute(
            "SELECT * FROM files WHERE cat = ? AND env = ? AND root = ? AND dir = ?",
            self.key + (rel,))}
        put = [row for name, row in now.items() if old.get(name) != row]
        for row in put:
            was = old.get(row[4])
            compared = (7, 10, 11, 12)  # size, mode, sha256, error: what a peer is sent
            if was is None or [was[i] for i in compared] != [row[i] for i in compared]:
                self.buckets.add(row[5])
        gone = [self.key + (rel, name) for name in old if name not in now]
        self.buckets.update(old[name][5] for name in old if name not in now)
        self.writes.append(("DELETE FROM files WHERE cat = ? AND env = ? AND root = ? AND dir = ? "
                            "AND name = ?", gone))
        self.writes.append(("INSERT OR REPLACE INTO files VALUES "
                            "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", put))
        if self.known.get(rel) != int(clean):
            self.writes.append(("INSERT OR REPLACE INTO dirs VALUES (?, ?, ?, ?, ?)",
                                [self.key + (rel, int(clean))]))
