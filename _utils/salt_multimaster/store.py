"""
The state store of one master: ``<state dir>/state.sqlite``, SQLite from
the standard library (WAL, opened 0600 in the 0700 state dir), what the
last scan of its key dirs and roots saw.

Tables (schema :data:`SCHEMA`, in SQLite's ``user_version``):

``keys``
    ``(state, id) -> bucket, inode, size, mtime_ns, ctime_ns, sha256``:
    every usable key file of the last scan (:mod:`salt_multimaster.keyscan`).
``files``, ``dirs``
    ``(category, saltenv, root, dir, name) -> bucket, inode, size,
    mtime_ns, ctime_ns, mode, sha256, error``: every file of each root of
    ``file_roots`` and ``pillar_roots`` (or why it cannot be used), and
    each directory, with whether it held a symlink or an error
    (:mod:`salt_multimaster.rootscan`).
``digests``
    ``(category, bucket) -> digest`` of those rows
    (:func:`salt_multimaster.manifest.bucket_digests`; the roots also as a
    peer in step holds them, ``<category>:safe``).
``meta``
    ``name -> JSON``: what else a scan keeps (the journal's token, the
    errors of the key dirs, the roots and ignore rules scanned); on the
    primary what each peer was last confirmed to hold (``peer:<id>``, the
    digests a conditional apply expects), on a peer its record of the
    replicated options (``confirmed:master_config``).

A peer's records (:mod:`salt_multimaster.confirmed`, the key history of
:mod:`salt_multimaster.history`):

``confirmed``
    ``(category, bucket) -> digest, part (JSON)``: each bucket as the peer
    held it when it equalled the primary's.
``history``
    ``id -> bucket``: the ids this peer received from the primary.

The scans' rows are a cache of the disk, written without a flush of
their own (a crash may lose the last scan, never the data); the peer's
records are flushed (:meth:`Store.write` ``durable``).  A store that
cannot be opened, of another schema version, or damaged, is moved aside
(``state.sqlite.damaged-<time>``) and rebuilt empty: the next scan reads
every key and file again, and a lost record reads as none (a bucket is
planned as before it was recorded, an id as not received: a removal on
the primary as a conflict, never as a deletion).  Never trusted.
"""

import contextlib
import json
import logging
import os
import sqlite3

from salt_multimaster import manifest, statefile

log = logging.getLogger(__name__)

NAME = "state.sqlite"
SCHEMA = 1

_TABLES = """
CREATE TABLE keys (state TEXT NOT NULL, id TEXT NOT NULL, bucket TEXT NOT NULL,
                   ino INTEGER, size INTEGER, mtime_ns INTEGER, ctime_ns INTEGER,
                   sha TEXT NOT NULL, PRIMARY KEY (state, id));
CREATE INDEX keys_bucket ON keys (bucket);
CREATE TABLE files (cat TEXT NOT NULL, env TEXT NOT NULL, root TEXT NOT NULL, dir TEXT NOT NULL,
                    name TEXT NOT NULL, bucket TEXT NOT NULL, ino INTEGER, size INTEGER,
                    mtime_ns INTEGER, ctime_ns INTEGER, mode INTEGER, sha TEXT, error TEXT,
                    PRIMARY KEY (cat, env, root, dir, name));
CREATE INDEX files_bucket ON files (cat, bucket);
CREATE TABLE dirs (cat TEXT NOT NULL, env TEXT NOT NULL, root TEXT NOT NULL, rel TEXT NOT NULL,
                   clean INTEGER NOT NULL, PRIMARY KEY (cat, env, root, rel));
CREATE TABLE digests (cat TEXT NOT NULL, bucket TEXT NOT NULL, digest TEXT NOT NULL,
                      PRIMARY KEY (cat, bucket));
CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE confirmed (cat TEXT NOT NULL, bucket TEXT NOT NULL, digest TEXT NOT NULL,
                        part TEXT NOT NULL, PRIMARY KEY (cat, bucket));
CREATE TABLE history (id TEXT PRIMARY KEY, bucket TEXT NOT NULL);
CREATE INDEX history_bucket ON history (bucket);
"""

#: how long a writer waits for another process's transaction (seconds): a
#: scan holds the store for the whole read of its tree
BUSY_TIMEOUT = 300


class Busy(Exception):
    """
    Another process held the store past :data:`BUSY_TIMEOUT` (a scan of a
    large tree, say): not damage, nothing moved aside.
    """


def _busy(path, exc):
    """A :class:`Busy` for the SQLite error ``exc`` when it says the store is locked, else None."""
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11 and later
    locked = code in (5, 6) if code is not None else "locked" in str(exc)  # SQLITE_BUSY, _LOCKED
    if not locked:
        return None
    return Busy(f"{path}: held by another multimaster process for more than {BUSY_TIMEOUT} s "
                "(a scan of a large tree?)")


class Store:
    """
    One connection to the store of ``state_dir`` (its caller closes it).
    ``with store.write():`` makes one transaction, taken at once (a
    concurrent scan waits for it).
    """

    def __init__(self, state_dir):
        self.path = os.path.join(state_dir, NAME)
        if not os.path.isdir(state_dir):
            statefile.makedirs(state_dir, os.path.dirname(state_dir))
        try:
            self.db = self._open()
        except statefile.Damaged as exc:
            set_aside(state_dir, exc.why)
            self.db = self._open()
        except sqlite3.DatabaseError as exc:
            busy = _busy(self.path, exc)
            if busy:
                raise busy from None
            set_aside(state_dir, str(exc))
            self.db = self._open()

    def _open(self):
        if not os.path.lexists(self.path):
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                             0o600))
        elif os.path.islink(self.path) or not os.path.isfile(self.path):
            raise statefile.Damaged(self.path, "not a file")
        db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT, isolation_level=None)
        try:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version == 0 and not db.execute("SELECT 1 FROM sqlite_master").fetchone():
                db.execute("PRAGMA journal_mode=WAL")
                db.executescript(f"BEGIN; {_TABLES} PRAGMA user_version={SCHEMA}; COMMIT;")
            elif version != SCHEMA:
                raise statefile.Damaged(self.path, f"schema version {version}, not {SCHEMA}")
            db.execute("PRAGMA synchronous=NORMAL")
        except BaseException:
            db.close()
            raise
        return db

    def close(self):
        self.db.close()

    @contextlib.contextmanager
    def write(self, durable=False, keep=True):
        """
        A transaction (``with store.write():``), begun at once, rolled back
        on an error; ``durable``: flushed to disk at its commit (a record,
        not a cache); ``keep=False``: rolled back at its end too (a scan in
        test mode reads through the store and changes nothing).
        """
        if durable:
            self.db.execute("PRAGMA synchronous=FULL")
        try:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT" if keep else "ROLLBACK")
        finally:
            if durable:
                with contextlib.suppress(sqlite3.Error):
                    self.db.execute("PRAGMA synchronous=NORMAL")

    def query(self, sql, args=()):
        return self.db.execute(sql, args).fetchall()

    def meta(self, name, default=None):
        """The JSON value ``name`` of the ``meta`` table (``default``: none, or not JSON)."""
        rows = self.query("SELECT value FROM meta WHERE name = ?", (name,))
        try:
            return json.loads(rows[0][0]) if rows else default
        except ValueError:
            return default

    def set_meta(self, name, value):
        self.db.execute("INSERT OR REPLACE INTO meta (name, value) VALUES (?, ?)",
                        (name, json.dumps(value)))

    def digests(self, cat):
        """``{bucket: digest}`` of ``cat``."""
        return dict(self.query("SELECT bucket, digest FROM digests WHERE cat = ?", (cat,)))

    def rewrite(self, writes, buckets, part_of):
        """
        Run a scan's statements ``writes`` (``[(sql, rows)]``), which change
        the buckets ``buckets``: ``(before, after)``, their parts
        (``part_of(bucket)``, ``{}``: empty) before and after.
        """
        before = {bucket: part_of(bucket) for bucket in buckets}
        for statement, rows in writes:
            self.db.executemany(statement, rows)
        return before, {bucket: part_of(bucket) for bucket in buckets}

    def set_digests(self, cat, parts):
        """Replace the digests of the buckets of ``parts`` by theirs (an empty part: none)."""
        for bucket, part in parts.items():
            if not part:
                self.db.execute("DELETE FROM digests WHERE cat = ? AND bucket = ?", (cat, bucket))
            else:
                self.db.execute("INSERT OR REPLACE INTO digests (cat, bucket, digest) "
                                "VALUES (?, ?, ?)", (cat, bucket, manifest.part_digest(part)))


def journal_word(watch, token, trees, rescan):
    """
    ``(word, token)`` of the change journal ``watch`` asked since the last
    scan's ``token``, for a scanner's ``trees`` (real paths): ``{tree:
    (dirs changed, {dir: names changed, or None})}`` of the trees it vouches
    for (watched, none nested in another), None when it gives no word (no
    engine, another session, events lost, ``rescan``); the token to keep
    with this scan: the reply's, else ``token`` (what changed since it
    still covers what changes next).
    """
    reply = watch(token) if watch is not None else None
    if not isinstance(reply, dict) or not reply.get("session"):
        return None, token
    new_token = {"session": reply["session"], "seq": reply["seq"]}
    changed, names = reply.get("changed"), reply.get("names") or {}
    if rescan or token is None or not isinstance(changed, dict):
        return None, new_token
    watched = [t for t in reply.get("trees") or () if isinstance(t, str)]
    unwatched = set(reply.get("unwatched") or ())
    word = {}
    for tree in trees:
        nested = any(t != tree and (t.startswith(tree + os.sep) or tree.startswith(
            t.rstrip(os.sep) + os.sep)) for t in watched)
        if (tree in watched and tree not in unwatched and not nested
                and isinstance(changed.get(tree), list)):
            word[tree] = (changed[tree], names.get(tree) or {})
    return word, new_token


def scanning(state_dir, scan, rescan, watch, keep):
    """
    ``scan(store, rescan, watch)``, a scanner's read of its tree into the
    store of ``state_dir``, in one transaction (``keep=False``: rolled back
    at its end, test mode), and its result; when the store proves damaged
    under it, the store is moved aside (:func:`set_aside`) and everything
    is read again, without the journal's word.  :class:`Busy` when another
    process held it too long.
    """
    for attempt, journal in ((1, watch), (2, None)):
        found = Store(state_dir)
        try:
            with found.write(keep=keep):
                return scan(found, rescan, journal)
        except sqlite3.DatabaseError as exc:
            error = exc
        finally:
            found.close()
        busy = _busy(found.path, error)
        if busy:
            raise busy from None
        if attempt == 2:
            raise error
        set_aside(state_dir, error)


def set_aside(state_dir, why):
    """
    The store of ``state_dir`` found damaged (``why``): logged once, moved
    aside (``state.sqlite.damaged-<time>``, its WAL files with it); the
    next :class:`Store` starts empty, so that every key and file is read
    again.
    """
    path = os.path.join(state_dir, NAME)
    statefile.notice(path, str(why), "rebuilt: every key and file is read again")
    for suffix in ("-wal", "-shm", ""):
        if os.path.lexists(path + suffix):
            statefile.aside(path + suffix, str(why))


def read(state_dir, query):
    """
    ``query(store)`` on the store of ``state_dir``, closed after; None when
    there is none (nothing is created) or it cannot be read (what it
    vouched for is unknown: the caller reads or asks again).
    """
    path = os.path.join(state_dir, NAME)
    if not os.path.isfile(path):
        return None
    try:
        found = Store(state_dir)
    except Busy as exc:
        log.warning("multimaster: %s: not used", exc)
        return None
    try:
        return query(found)
    except sqlite3.DatabaseError as exc:
        busy = _busy(path, exc)
        if busy:
            log.warning("multimaster: %s: not used", busy)
        else:
            statefile.notice(path, str(exc), "not used: what it holds is read again")
        return None
    finally:
        found.close()


def select(state_dir, sql, args=()):
    """The rows of ``sql`` on the store of ``state_dir`` (``[]``: none, or unreadable)."""
    return read(state_dir, lambda found: found.query(sql, args)) or []


def record(state_dir, write, what, durable=True):
    """
    ``write(store)`` in one transaction on the store of ``state_dir``,
    flushed (``durable``: a peer's record).  A store found damaged is moved
    aside (:func:`set_aside`) and ``write`` runs once more on the new one: the
    rows it writes, and no other (what the old store held reads as not
    recorded); a store another process holds past :data:`BUSY_TIMEOUT`, or
    that cannot be written at all, is logged (``what`` not recorded).
    """
    path = os.path.join(state_dir, NAME)
    for attempt in (1, 2):
        try:
            found = Store(state_dir)
        except Busy as exc:
            log.warning("multimaster: %s: %s not recorded", exc, what)
            return
        except (OSError, sqlite3.DatabaseError, statefile.Damaged) as exc:
            log.warning("multimaster: %s: %s: %s not recorded", path, exc, what)
            return
        try:
            with found.write(durable=durable):
                write(found)
            return
        except sqlite3.DatabaseError as exc:
            error = exc
        finally:
            found.close()
        busy = _busy(path, error)
        if busy:
            log.warning("multimaster: %s: %s not recorded", busy, what)
            return
        if attempt == 1:
            set_aside(state_dir, error)
        else:
            log.warning("multimaster: %s: %s: %s not recorded", path, error, what)
