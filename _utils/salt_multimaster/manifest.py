"""
Manifests: what a master holds, as ``relative path -> (size, mode, sha256)``.

Hashes are cached keyed on ``(inode, size, mtime_ns)``, so a manifest of an
unchanged tree stats every file and hashes none.
"""

import fnmatch
import hashlib
import json
import logging
import operator
import os
import re
import shutil
import stat
import time
from collections.abc import Mapping

from salt_multimaster import fsutil, replicate, statefile

log = logging.getLogger(__name__)

# The pki_dir subdirectories a sync replicates; the first four are the
# states a minion key is in (salt-key's lists), minions_autosign holds
# autosign grants named by minion id, not keys.
KEY_DIRS = ("minions", "minions_pre", "minions_rejected", "minions_denied", "minions_autosign")
KEY_STATES = KEY_DIRS[:4]
# Key dirs whose files Salt rewrites in place (its dir's mtime unchanged):
# Salt 3006 and 3007 write a denied key over minions_denied/<id> (``w+``)
# when the same id comes back with yet another key.  Each of their keys is
# statted at every snapshot (they hold few).
REWRITTEN_IN_PLACE = ("minions_denied",)
# Hash caches and the key snapshot, in the state directory (cachedir/multimaster)
KEYS_HASHCACHE = "hashcache-keys.json"
# the directories of the last roots walk, with the watcher's token (DirRecords)
ROOTS_DIRS = "roots-dirs.json"
ROOTS_DIRS_BUCKETS = "roots-dirs.d"
ROOTS_DIRS_FORMAT = 3
ROOTS_HASHCACHE = "hashcache-roots.json"
KEYS_SNAPSHOT = "keys-snapshot.json"
# its keys, one file per bucket (key_buckets)
KEYS_SNAPSHOT_BUCKETS = "keys-snapshot.d"
# touched before each listing of the keys: the filesystem's own clock
KEYS_CLOCK = "keys-snapshot.clock"
_ID_BAD = re.compile(r"[\x00/\\]")


class Damaged(str):
    """
    An error about a source that exists but cannot be used (unreadable, or
    not a key): a plain message that also names the item, so a sync keeps
    the peer's copy of it instead of reading it as deleted.  ``name``: the
    minion id, or the path relative to its saltenv (for a directory, with a
    trailing ``/``; ``"/"`` for a whole root); ``where``: the key state or
    the saltenv (set by :func:`roots_manifest`).
    """

    def __new__(cls, message, name, where=None):
        obj = super().__new__(cls, message)
        obj.name, obj.where = name, where
        return obj


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_or_none(path):
    """The sha256 of the file at ``path``, None when it cannot be read."""
    try:
        return sha256_file(path)
    except OSError:
        return None


def key_sha(data):
    """
    sha256 of a key with whitespace removed: Salt stores the same public key
    with or without a trailing newline depending on how it arrived.
    """
    return hashlib.sha256(b"".join(data.split())).hexdigest()


def key_sha_file(path):
    with open(path, "rb") as fh:
        return key_sha(fh.read())


BUCKETS = 64


_BUCKET_NAMES = [str(b) for b in range(256)]


def bucket_of(name):
    """The bucket (a string) a key id or a roots path falls in."""
    return _BUCKET_NAMES[hashlib.sha1(name.encode("utf-8", "surrogateescape")).digest()[0]
                         % BUCKETS]


def split(cat, man):
    """
    Cut a keys or roots manifest into ``BUCKETS`` parts by a hash of the id
    (keys) or of ``saltenv/path`` (roots): ``{bucket: partial manifest}``.
    A change then costs the exchange of one bucket, not the whole manifest.
    """
    ret = {}
    for outer, entries in man.items():
        for name, value in entries.items():
            key = name if cat == "minion_keys" else f"{outer}/{name}"
            ret.setdefault(bucket_of(key), {}).setdefault(outer, {})[name] = value
    return ret


def _part_digest(part):
    """
    sha256 of a partial manifest (``{outer: {name: value}}``): per entry a
    line of its fields (outer, name, each value), each length-prefixed.
    """
    lines = []
    for outer in sorted(part):
        head = f"{len(outer)}:{outer}"
        for name, value in sorted(part[outer].items()):
            if isinstance(value, list):
                tail = "".join([f"{len(v)}:{v}" for v in map(str, value)])
            else:
                v = str(value)
                tail = f"{len(v)}:{v}"
            lines.append(f"{head}{len(name)}:{name}{tail}\n")
    return hashlib.sha256("".join(lines).encode("utf-8", "surrogateescape")).hexdigest()


def bucket_digests(parts):
    """``{bucket: digest}`` of :func:`split`'s parts."""
    return {b: _part_digest(part) for b, part in parts.items()}


def differing(mine, theirs):
    """Buckets whose digests differ (present on one side only included)."""
    return sorted(b for b in set(mine) | set(theirs) if mine.get(b) != theirs.get(b))


def restrict(cat, man, buckets):
    """The entries of a keys or roots manifest that fall in ``buckets``."""
    wanted = set(buckets)
    ret = {}
    for outer, entries in man.items():
        for name, value in entries.items():
            if bucket_of(name if cat == "minion_keys" else f"{outer}/{name}") in wanted:
                ret.setdefault(outer, {})[name] = value
    return ret


def merge(parts, buckets):
    """The union of the partial manifests of ``buckets``."""
    ret = {}
    for b in buckets:
        for outer, entries in parts.get(b, {}).items():
            ret.setdefault(outer, {}).update(entries)
    return ret


#: a walk hashes up to this many changed files, this many bytes, without
#: reading the hash cache; a peer's apply records in it what it wrote from
#: as many on (peer.Applier.commit)
DIRECT_FILES = 64
DIRECT_BYTES = 4 << 20


class HashCache:
    """
    ``path -> [inode, size, mtime_ns, sha256]`` persisted as JSON, read on
    first use (a walk that reuses every directory never opens it).

    ``hashed`` counts the files actually read, for tests and benchmarks.
    ``rehash``: ignore the cached hashes and read every file again (a file
    rewritten with the same size, inode and mtime is found; every byte is
    read).
    """

    def __init__(self, path=None, rehash=False):
        self.path = path
        self._entries = None
        self.dirty = False
        self.hashed = 0
        self.rehash = rehash
        self._direct = [DIRECT_FILES, DIRECT_BYTES]

    def direct(self, size):
        """
        Whether a changed file of ``size`` bytes is to be hashed without
        this cache (read on first use): yes for the first few small ones of a
        walk (fewer than :data:`DIRECT_FILES` files and :data:`DIRECT_BYTES`
        bytes together); past them the cache is read, where a peer's apply
        records what it wrote from that many files or bytes on.
        """
        files, size_left = self._direct
        # fewer than an apply records (it records from DIRECT_FILES files or
        # DIRECT_BYTES bytes on)
        if self._entries is not None or files <= 1 or size >= size_left:
            return False
        self._direct = [files - 1, size_left - size]
        return True

    @property
    def entries(self):
        if self._entries is None:
            self._entries = {}
            if self.path:
                # damaged: every file it would vouch for is hashed again
                self._entries = statefile.load(self.path, "the files are hashed again",
                                               default={}, valid=_valid_hashcache)
        return self._entries

    def sha256(self, path, st, hasher=sha256_file):
        key = [st.st_ino, st.st_size, st.st_mtime_ns]
        entry = self.entries.get(path)
        if entry and entry[:3] == key and not self.rehash:
            return entry[3]
        value = hasher(path)
        self.hashed += 1
        if entry != key + [value]:
            self.entries[path] = key + [value]
            self.dirty = True
        return value

    def save(self, keep=None):
        """
        Persist, dropping entries not in ``keep`` (a set, or any container,
        of the paths seen this run); a cache never read is left as it is.
        """
        if self._entries is None:
            return
        if keep is not None:
            stale = [path for path in self.entries if path not in keep]
            for path in stale:
                del self.entries[path]
            self.dirty = self.dirty or bool(stale)
        if not self.path or not self.dirty:
            return
        # a cache: checked against each file's stat, rebuilt when unreadable
        statefile.write(self.path, json.dumps(self.entries), durable=False)
        self.dirty = False


def _valid_hashcache(entries):
    """Whether a hash cache holds ``{path: [ino, size, mtime_ns, sha256]}``."""
    return isinstance(entries, dict) and all(
        isinstance(e, list) and len(e) == 4 and isinstance(e[3], str) for e in entries.values())


class Ignore:
    """Salt's file_ignore_regex / file_ignore_glob, applied to relative and full paths."""

    def __init__(self, regex=None, glob=None):
        regex = regex or []
        glob = glob or []
        if isinstance(regex, str):
            regex = [regex]
        if isinstance(glob, str):
            glob = [glob]
        self.regex = [re.compile(r) for r in regex]
        self.glob = list(glob)
        # fnmatch.fnmatch of each glob, as one match (POSIX: no case folding)
        self._glob = re.compile("|".join(fnmatch.translate(g) for g in glob)) if glob else None
        #: False when nothing is ignored (no call needed)
        self.active = bool(self.regex or self.glob)

    @classmethod
    def from_opts(cls, opts):
        return cls(opts.get("file_ignore_regex"), opts.get("file_ignore_glob"))

    def __call__(self, rel, full):
        for candidate in (rel, full):
            for regex in self.regex:
                if regex.search(candidate):
                    return True
            if self._glob is not None and self._glob.match(candidate):
                return True
        return False


_entry_name = operator.attrgetter("name")


def _dir_entries(root, rel_dir, dirpath, real_dir, inside, ignore, cache, old=None, skip=None):
    """
    One directory of :func:`tree_manifest`: ``(files, subdirs, clean)``.

    ``files``: ``(name, value, real, error)`` per entry that is no
    directory and not ignored, ``value`` the manifest entry (``[size, mode,
    sha256]``) or None when ``error`` (a message to report) says why not;
    ``subdirs``: ``(name, full path, real path or None for a symlink)``;
    ``clean``: no symlink and no error in it (its result may be reused while
    the directory does not change, :class:`DirRecords`).  ``old``: this
    directory's record from the last walk, whose hashes are reused for
    files with the same inode, size and mtime.  ``skip``: a predicate on
    the relative path of a file left out before it is even statted (a path
    an earlier root already serves); a result with files skipped is not
    complete, and is never recorded.  Raises ``OSError`` when the directory
    cannot be listed.
    """
    entries = sorted(os.scandir(dirpath), key=_entry_name)
    known = {f[0]: f for f in old["files"]} if old else {}
    files, subdirs, clean = [], [], True
    real_prefix = real_dir if real_dir.endswith(os.sep) else real_dir + os.sep
    rel_prefix = f"{rel_dir}/" if rel_dir else ""
    for entry in entries:
        name = entry.name
        if name.startswith(fsutil.TEMP_PREFIX):
            continue  # a sync writing here: its temporary files
        rel = rel_prefix + name
        full = entry.path
        try:
            is_dir = entry.is_dir()  # follows symlinks, as Salt does
        except OSError:
            is_dir = False
        link = entry.is_symlink()
        if is_dir:
            if not ignore.active or not (ignore(rel + "/", full + "/") or ignore(rel, full)):
                subdirs.append((name, full, None if link else real_prefix + name))
                clean = clean and not link
            continue
        if (skip is not None and skip(rel)) or (ignore.active and ignore(rel, full)):
            continue
        clean = clean and not link
        real = os.path.realpath(full) if link else real_prefix + name
        if link and not real.startswith(inside):
            files.append((name, None, real,
                          f"{root}: {rel}: symlink leads outside the root, not replicated"))
            continue
        try:
            st = entry.stat()
        except FileNotFoundError as exc:
            clean = False
            files.append((name, None, real, f"{root}: {rel}: {exc.strerror}"))
            continue
        except OSError as exc:
            clean = False
            files.append((name, None, real, Damaged(f"{root}: {rel}: {exc.strerror}", rel)))
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        was = known.get(name)
        if (was is not None and not link and was[4] == st.st_ino and was[1] == st.st_size
                and was[5] == st.st_mtime_ns and not cache.rehash):
            sha = was[3]
        elif old is not None and not link and cache.direct(st.st_size):
            # the directory's record is its cache: the hash cache (every
            # file of the roots) is neither read nor rewritten for a few files
            try:
                sha = sha256_file(real)
            except OSError as exc:
                clean = False
                files.append((name, None, real,
                              Damaged(f"{root}: {rel}: unreadable: {exc.strerror}", rel)))
                continue
            cache.hashed += 1
        else:
            try:
                sha = cache.sha256(real, st)
            except OSError as exc:
                clean = False
                files.append((name, None, real,
                              Damaged(f"{root}: {rel}: unreadable: {exc.strerror}", rel)))
                continue
        files.append((name, [st.st_size, stat.S_IMODE(st.st_mode), sha, st.st_ino,
                             st.st_mtime_ns], real, None))
    return files, subdirs, clean


def tree_manifest(roots, ignore, cache, seen=None, errors=None, records=None, touched=None,
                  deferred=None):
    """
    The merged view Salt serves for one saltenv: ``rel -> [size, mode, sha256]``.

    The first root holding a path wins, as in Salt's roots fileserver.
    Symlinks are followed only while their target stays inside the root;
    others are reported in ``errors`` and left out.  One ``stat`` per file
    and a ``realpath`` only of a symlink: unchanged files are never read.
    ``records``: a :class:`DirRecords`; a directory it vouches for is taken
    from the last walk without being listed, and every clean directory
    listed is recorded for the next walk.  ``touched``: a :class:`Touched`
    told of every directory listed.  ``deferred``: a :class:`Deferred` (with
    ``records``) the files of the directories taken from their records are
    left to, out of the manifest returned until its ``complete``.
    """
    ret = {}
    errors = errors if errors is not None else []
    for root in roots:
        if not os.path.isdir(root):
            continue
        real_root = os.path.realpath(root)
        inside = real_root.rstrip(os.sep) + os.sep
        # (rel, path, the real paths above it, its real path when known:
        # a directory that is no symlink in a resolved one, whether it is
        # new since the last walk)
        stack = [("", root, frozenset(), real_root, False)]
        while stack:
            rel_dir, dirpath, ancestors, real_dir, new = stack.pop()
            if real_dir is None:
                real_dir = os.path.realpath(dirpath)
            if real_dir != real_root and not real_dir.startswith(inside):
                errors.append(f"{root}: {rel_dir}: symlinked directory leads outside the root, not replicated")
                continue
            if real_dir in ancestors:
                continue  # a symlink loop inside the root
            ancestors = ancestors | {real_dir}
            subdirs = (records.reuse(real_dir, rel_dir, dirpath) if records is not None
                       else None)
            rel_prefix = f"{rel_dir}/" if rel_dir else ""
            last = None  # what the last walk found in a directory listed now
            if subdirs is not None:
                if deferred is None or not deferred.take(rel_dir, rel_prefix, real_dir):
                    _put_recorded(ret, seen, rel_prefix, real_dir, records.entries(real_dir))
            else:
                if deferred is not None:
                    deferred.listing(ret, rel_dir, seen)
                old = records.old(real_dir) if records is not None else None
                try:
                    found = _dir_entries(
                        root, rel_dir, dirpath, real_dir, inside, ignore, cache, old=old,
                        # without records, a path already served is never statted
                        skip=ret.__contains__ if records is None else None)
                except OSError as exc:
                    errors.append(Damaged(f"{root}: {rel_dir or '.'}: {exc.strerror}",
                                          f"{rel_dir}/" if rel_dir else "/"))
                    if touched is not None:
                        touched.complete = False
                    continue
                if records is not None:
                    last = records.listing(real_dir)
                    records.record(real_dir, rel_dir, *found)
                if touched is not None:
                    touched.listed(rel_dir, last, new, found, records.changed_names(real_dir))
                files, subdirs, _clean = found
                for name, value, real, error in files:
                    rel = rel_prefix + name
                    if rel in ret:
                        continue
                    if error is not None:
                        errors.append(error)
                        continue
                    if seen is not None:
                        seen.append(real)
                    ret[rel] = value[:3]
            known = set(last[2]) if last is not None else ()
            stack.extend((rel_prefix + name, full, ancestors, real,
                          new or (last is not None and name not in known))
                         for name, full, real in reversed(subdirs))
    return ret


class Touched:
    """
    What one saltenv's walk (:func:`tree_manifest` with records) listed:
    ``rels``, the paths that may differ from the last walk (every file, then
    and now, of each directory listed), and ``complete``: whether they are
    all of them.  They are not when a listed directory has no record of the
    last walk and is not new since, when a subdirectory went away (its
    files are not listed), or when a directory cannot be listed.
    """

    def __init__(self):
        self.rels = set()
        self.complete = True

    def listed(self, rel_dir, last, new, found, changed=None):
        """
        A directory listed: what the last walk found there (``last``,
        :meth:`DirRecords.listing`), whether it is ``new`` since, what was
        found now, and the names of its entries the watcher says changed
        (``changed``; None: not known).  When they are known and the last
        listing was clean (no symlink, which may lead to a file changed
        elsewhere), only those paths may differ.
        """
        prefix = f"{rel_dir}/" if rel_dir else ""
        files, subdirs, _clean = found
        if last is None:
            self.complete = self.complete and new
        else:
            rel, names, was, clean = last
            if rel != rel_dir or set(was) - {name for name, _full, _real in subdirs}:
                self.complete = False
            if changed is not None and clean and _clean:
                self.rels.update(prefix + name for name in changed)
                return
            self.rels.update(prefix + name for name in names)
        self.rels.update(prefix + name for name, _value, _real, _error in files)


def _valid_dir_records(dirs):
    """A bucket of :class:`DirRecords`: ``{real dir: record}``, each record clean or not."""
    return isinstance(dirs, dict) and all(
        isinstance(rec, dict) and isinstance(rec.get("rel"), str)
        and isinstance(rec.get("subdirs"), list)
        and isinstance(rec.get("names" if rec.get("unclean") else "files"), list)
        for rec in dirs.values())


def _valid_tree_entry(entry):
    """An entry of :attr:`DirRecords.tree`: ``[rel, subdirectory names, clean]``."""
    return (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
            and isinstance(entry[1], list) and all(isinstance(n, str) for n in entry[1])
            and isinstance(entry[2], bool))


class RecordsLost(Exception):
    """
    A directory's record, taken as unchanged, could not be read back
    (:meth:`DirRecords.entries`).
    """


class DirRecords:
    """
    The directories of the last roots walk, saved in ``state_dir``
    (:data:`ROOTS_DIRS`) with the token of the watcher (:mod:`watch`) they
    were read at.  A directory the watcher vouches for (in a watched tree,
    no change in it since that token) is taken as it was, without a
    syscall; any other is listed (:func:`_dir_entries`), and recorded when
    clean.  Only a watcher makes a record trusted: without one the walk
    lists every directory, as it always did.

    The records are kept one file per bucket of their directory's path
    (:data:`ROOTS_DIRS_BUCKETS`, a :class:`BucketFiles`), each named by its
    sha256 in :data:`ROOTS_DIRS`, written after them: a save writes the
    buckets whose records changed, then that file, and a bucket's file that
    is not the one named (lost, torn, another save's) is not used, so its
    directories are listed again.  A record is used as it was written: the
    sha256 vouches for every entry of its file.  :data:`ROOTS_DIRS` also
    holds the shape of the walk (``tree``: each directory's place and
    subdirectories), so a walk through directories the watcher vouches for
    parses no record: the files of such a directory are read from its
    record only when the whole manifest is wanted (:class:`Deferred`).
    """

    def __init__(self, state_dir, ignore):
        self.path = os.path.join(state_dir, ROOTS_DIRS)
        self.ignore_key = [[r.pattern for r in ignore.regex], list(ignore.glob)]
        data = read_json(self.path)
        good = (isinstance(data, dict) and data.get("format") == ROOTS_DIRS_FORMAT
                and data.get("ignore") == self.ignore_key
                and isinstance(data.get("buckets"), dict) and isinstance(data.get("token"), dict)
                and isinstance(data.get("tree"), dict))
        self.files = BucketFiles(os.path.join(state_dir, ROOTS_DIRS_BUCKETS),
                                 data["buckets"] if good else {}, _valid_dir_records)
        # every bucket file read and checked against its sha256, none parsed:
        # the directories of one that does not match are listed again
        matching = self.files.matching()
        #: ``{real dir: [rel, subdirectory names, clean]}`` of the last walk
        self.tree = {d: entry for d, entry in (data["tree"] if good else {}).items()
                     if _valid_tree_entry(entry) and bucket_of(d) in matching}
        #: the watcher's token the saved records were read at (None: none)
        self.token = data["token"] if good else None
        #: the saved records' generation, and this walk's (RootsParts)
        self.gen = data.get("gen") if good else None
        self.next_gen = os.urandom(8).hex()
        self.new = {}  # the records of the directories listed now
        self.kept = set()  # the directories taken from their records
        self._trees = ()
        self._dirty = frozenset()
        self._names = {}
        self.reused = 0

    def use(self, reply):
        """
        Trust what the watcher's ``reply`` (to a query with :attr:`token`)
        vouches for: the trees it watches, none nested in another (one
        directory, one watch), less the directories changed since.
        """
        changed = reply.get("changed")
        if not isinstance(changed, dict) or self.token is None:
            return
        trees = [t for t in reply.get("trees") or () if isinstance(t, str)]
        unwatched = set(reply.get("unwatched") or ())
        nested = {t for t in trees for u in trees
                  if t != u and (t.startswith(u.rstrip(os.sep) + os.sep)
                                 or u.startswith(t.rstrip(os.sep) + os.sep))}
        vouched, dirty = [], set()
        names = reply.get("names") if isinstance(reply.get("names"), dict) else {}
        for tree in trees:
            rels = changed.get(tree)
            if tree in unwatched or tree in nested or not isinstance(rels, list):
                continue
            vouched.append(tree.rstrip(os.sep) + os.sep)
            known = names.get(tree) if isinstance(names.get(tree), dict) else {}
            for rel in rels:
                path = os.path.join(tree, rel) if rel else tree
                dirty.add(path)
                got = known.get(rel)
                # "": the directory itself changed, which names nothing
                if isinstance(got, list) and "" not in got and all(
                        isinstance(n, str) for n in got):
                    self._names[path] = frozenset(got)
        self._trees, self._dirty = tuple(vouched), frozenset(dirty)

    def changed_names(self, real_dir):
        """
        The names of the entries of ``real_dir`` the watcher says changed
        since the token, when it names them all; else None (unknown, or
        not a directory it vouches for).
        """
        if real_dir not in self._dirty or not (real_dir + os.sep).startswith(self._trees):
            return None
        return self._names.get(real_dir)

    def _vouched(self, real_dir):
        return real_dir not in self._dirty and (real_dir + os.sep).startswith(self._trees)

    def _record(self, real_dir):
        """The saved record of ``real_dir`` (None: none, or its bucket's file does not match)."""
        if real_dir not in self.tree:
            return None
        return (self.files.get(bucket_of(real_dir)) or {}).get(real_dir)

    def old(self, real_dir):
        """The saved clean record of ``real_dir`` (None: none, or of a directory listed unclean)."""
        rec = self._record(real_dir)
        return None if rec is None or rec.get("unclean") else rec

    def reuse(self, real_dir, rel_dir, dirpath):
        """
        The subdirectories of ``real_dir`` as recorded, when the watcher
        vouches it did not change and it was recorded clean at the same
        place in its root (its files: :meth:`entries`); else None (list it).
        ``(name, path, real path)`` each, as :func:`_dir_entries` gives them.
        """
        if not self._vouched(real_dir):
            return None
        entry = self.tree.get(real_dir)
        if entry is None or entry[0] != rel_dir or not entry[2]:
            return None
        prefix = real_dir + os.sep
        self.kept.add(real_dir)
        self.reused += 1
        return [(name, os.path.join(dirpath, name), prefix + name) for name in entry[1]]

    def entries(self, real_dir):
        """
        The files of a directory :meth:`reuse` took, as recorded:
        ``[name, size, mode, sha256, inode, mtime_ns]`` each.  Raises
        :class:`RecordsLost` when its record cannot be read back.
        """
        rec = self.old(real_dir)
        if rec is None:
            raise RecordsLost(real_dir)
        return rec["files"]

    def record(self, real_dir, rel_dir, files, subdirs, clean):
        """
        Keep a clean listing for the next walk; of any other (listed again)
        only its names, for :meth:`listing`.
        """
        if clean:
            self.new[real_dir] = {"rel": rel_dir,
                                  "files": [[name] + value for name, value, _r, _e in files],
                                  "subdirs": [name for name, _f, _r in subdirs]}
        else:
            self.new[real_dir] = {"rel": rel_dir, "unclean": True,
                                  "names": [name for name, _v, _r, _e in files],
                                  "subdirs": [name for name, _f, _r in subdirs]}

    def listing(self, real_dir):
        """
        ``(rel, file names, subdirectory names, clean)`` of ``real_dir`` at
        the last walk, clean or not; None when it was not walked.
        """
        rec = self._record(real_dir)
        if rec is None:
            return None
        clean = not rec.get("unclean")
        names = [f[0] for f in rec["files"]] if clean else rec["names"]
        return rec["rel"], names, rec["subdirs"], clean

    def forget(self):
        """Remove the saved records: the next walk lists every directory."""
        statefile.remove(self.path)

    def save(self, token):
        """
        Save the records of this walk, read at the watcher's ``token``: the
        directories listed or taken from their records, no other.  Only the
        buckets of directories listed, gone, or whose file did not match
        are written again.
        """
        walked = self.kept | set(self.new)
        by_bucket = {}
        for real_dir, rec in self.new.items():
            by_bucket.setdefault(bucket_of(real_dir), {})[real_dir] = rec
        dirty = set(by_bucket) | {bucket_of(d) for d in self.tree if d not in walked}
        dirty |= self.files.bad & set(self.files.shas)
        changed = {}
        for bucket in dirty:
            old = self.files.get(bucket)
            part = {d: rec for d, rec in (old or {}).items() if d in self.kept}
            part.update(by_bucket.get(bucket, {}))
            if part != old:
                changed[bucket] = part
        self.files.save(changed)
        tree = {d: self.tree[d] for d in self.kept}
        tree.update({d: [rec["rel"], rec["subdirs"], not rec.get("unclean")]
                     for d, rec in self.new.items()})
        statefile.write(self.path, json.dumps({"format": ROOTS_DIRS_FORMAT, "token": token,
                                                   "ignore": self.ignore_key,
                                                   "gen": self.next_gen,
                                                   "buckets": self.files.shas, "tree": tree}),
                            mode=0o600, durable=False)


class Deferred:
    """
    The directories of one saltenv's walk (:func:`tree_manifest`) taken
    from their records (:meth:`DirRecords.reuse`) whose files are not put
    in the manifest yet: a change sync with the journal needs only the
    paths of the directories listed (:class:`Touched`,
    :meth:`RootsParts.update`).  :meth:`complete` puts them in, as the walk
    would have, when the whole manifest is wanted.

    The first root serving a path wins: a directory listed at a place
    (``rel``) where an earlier root's directory was taken from its record
    has that one put in first, and none is deferred at a place listed in
    this saltenv, so every path of a listed place is in the manifest.
    """

    def __init__(self, records):
        self.records = records
        self.dirs = {}  # rel dir -> [(rel prefix, real dir)], in walk order
        self.order = []  # rel dirs, as first deferred
        self.listed = set()
        #: the real paths of the directories deferred, put in or not
        self.real_dirs = set()

    def take(self, rel_dir, rel_prefix, real_dir):
        """Defer a directory taken from its record; False: put its files in now."""
        if rel_dir in self.listed:
            return False
        if rel_dir not in self.dirs:
            self.dirs[rel_dir] = []
            self.order.append(rel_dir)
        self.dirs[rel_dir].append((rel_prefix, real_dir))
        self.real_dirs.add(real_dir)
        return True

    def listing(self, ret, rel_dir, seen):
        """A directory is listed at ``rel_dir``: put in what was deferred there first."""
        self.listed.add(rel_dir)
        for rel_prefix, real_dir in self.dirs.pop(rel_dir, ()):
            _put_recorded(ret, seen, rel_prefix, real_dir, self.records.entries(real_dir))

    def complete(self, ret, seen):
        """Put every deferred directory's files in ``ret`` (its saltenv's manifest)."""
        for rel_dir in self.order:
            for rel_prefix, real_dir in self.dirs.pop(rel_dir, ()):
                _put_recorded(ret, seen, rel_prefix, real_dir, self.records.entries(real_dir))
        self.order = []


def _put_recorded(ret, seen, rel_prefix, real_dir, recorded):
    """The files of a directory taken from its record, into the manifest ``ret``."""
    prefix = real_dir + os.sep
    for entry in recorded:
        rel = rel_prefix + entry[0]
        if rel in ret:
            continue
        if seen is not None:
            seen.append(prefix + entry[0])
        ret[rel] = entry[1:4]


def roots_manifest(roots_by_env, ignore, cache, seen=None, errors=None, records=None,
                   touched=None, deferred=None):
    """
    ``{saltenv: tree_manifest}`` for a ``file_roots``/``pillar_roots``
    mapping.  ``touched``: a dict given each saltenv's :class:`Touched`;
    ``deferred`` (with ``records``): a dict given each saltenv's
    :class:`Deferred`.
    """
    ret = {}
    for env, roots in sorted((roots_by_env or {}).items()):
        found = []
        if touched is not None:
            touched[env] = Touched()
        if deferred is not None:
            deferred[env] = Deferred(records)
        ret[env] = tree_manifest(roots, ignore, cache, seen=seen, errors=found, records=records,
                                 touched=touched[env] if touched is not None else None,
                                 deferred=deferred[env] if deferred is not None else None)
        for error in found:
            if isinstance(error, Damaged):
                error.where = env
        if errors is not None:
            errors.extend(found)
    return ret


def damaged_sources(errors):
    """
    ``{where: [name]}`` of the :class:`Damaged` among ``errors``: the key
    states or saltenvs, and the items there a sync must not remove.
    """
    ret = {}
    for error in errors or ():
        if isinstance(error, Damaged):
            ret.setdefault(error.where, []).append(error.name)
    return ret


class _Kept:
    """
    The paths a roots read keeps in its hash cache: the files it saw, and
    those of the directories it took from their records (unchanged).
    """

    def __init__(self, seen, dirs):
        self.seen = set(seen)
        self.dirs = dirs

    def __contains__(self, path):
        return path in self.seen or os.path.dirname(path) in self.dirs


def _complete(mans, deferred, seen):
    """Put the files :class:`Deferred` left out into each saltenv's manifest of ``mans``."""
    for env, left in (deferred or {}).items():
        left.complete(mans[env], seen)


def read_roots(opts, categories, state_dir, rescan=False, later=None, watch=None,
               buckets=None, manifests=True):
    """
    ``({category: roots_manifest}, {category: errors})`` of the
    ``file_roots``/``pillar_roots`` among ``categories``, through the roots
    hash cache in ``state_dir`` (entries of files no longer served dropped
    when both were read).  ``rescan``: hash every file again, whatever the
    cache says (like ``rsync -c``).  ``later``: a :class:`fsutil.Later`
    the cache's save is put off to.  ``watch``: a function asking the
    watcher which directories changed since a token (:func:`watch.query`
    bound to its socket); when it answers, the directories it vouches for
    are not listed (:class:`DirRecords`).  ``buckets``: a dict given each
    category's :class:`RootsParts` (the one it holds is used), updated by
    this read and saved with it.  ``manifests``: False when only the
    ``buckets`` are wanted: each manifest returned is None, and the files of
    the directories the watcher vouches for are read from their records only
    when the buckets cannot be cut from the paths listed (:class:`Deferred`).
    """
    cats = [c for c in categories if c in ("file_roots", "pillar_roots")]
    if not cats:
        return {}, {}
    cache = open_hashcache(state_dir, ROOTS_HASHCACHE)
    cache.rehash = bool(rescan)
    ignore = Ignore.from_opts(opts)
    records = reply = None
    if watch is not None:
        records = DirRecords(state_dir, ignore)
        reply = watch(records.token)
        if not isinstance(reply, dict) or not reply.get("session"):
            records = reply = None  # no watcher: every directory listed
        elif not rescan:
            records.use(reply)
    try:
        return _read_roots(opts, cats, state_dir, later, cache, ignore, records, reply,
                           buckets, manifests)
    except RecordsLost as exc:
        # a record with the sha256 its index names that does not parse:
        # never written so; the records go, and every directory is listed
        log.warning("multimaster: the record of %s could not be read back: "
                    "listing every directory of the roots", exc)
        records.forget()
        return read_roots(opts, categories, state_dir, rescan=rescan, later=later,
                          buckets=buckets, manifests=manifests)


def _read_roots(opts, cats, state_dir, later, cache, ignore, records, reply, buckets,
                manifests):
    """:func:`read_roots` once its watcher is asked (``records``, ``reply``: None without)."""
    seen, mans, errors, deferred, saves = [], {}, {}, {}, []
    for cat in cats:
        errors[cat] = []
        touched = {} if records is not None and buckets is not None else None
        deferred[cat] = {} if touched is not None else None
        mans[cat] = roots_manifest(opts.get(cat), ignore, cache, seen=seen,
                                   errors=errors[cat], records=records, touched=touched,
                                   deferred=deferred[cat])
        if buckets is not None:
            parts = buckets.setdefault(cat, RootsParts(state_dir, cat))
            changed = parts.update(
                opts.get(cat), mans[cat], touched, records.gen if records is not None else None,
                complete=lambda cat=cat: _complete(mans[cat], deferred[cat], seen))
            saves.append((parts.save, changed))
    for cat in cats:
        if manifests:
            _complete(mans[cat], deferred[cat], seen)
        else:
            mans[cat] = None
    # saved only once every record needed was read back (RecordsLost)
    for save, changed in saves:
        fsutil.now_or_later(later, save, changed,
                            records.next_gen if records is not None else None)
    if records is not None:
        log.debug("multimaster: roots read at watcher token %s, %d director(ies) unlisted",
                  reply.get("seq"), records.reused)
        # only what this walk listed or vouched for is saved (the records of
        # a category not read now would be trusted at a token later than theirs)
        fsutil.now_or_later(later, records.save,
                            {"session": reply["session"], "seq": reply.get("seq")})
    keep = None
    if len(cats) == 2:
        keep = _Kept(seen, {real_dir for by_env in deferred.values()
                            for left in (by_env or {}).values() for real_dir in left.real_dirs})
    fsutil.now_or_later(later, cache.save, keep=keep)
    return mans, errors


def forget_fileserver_hashes(cachedir):
    """
    Drop the hashes Salt's roots fileserver keeps in ``cachedir/roots/hash``
    (``hash:mtime`` per file): like this module's hash cache, they trust an
    unchanged mtime, and would keep serving the old hash of a file rewritten
    behind it, which makes a minion keep its cached old copy.  Salt hashes
    each file again when next asked.  The tree is renamed away first, so a
    fileserver writing an entry meanwhile writes into the old tree.
    """
    path = os.path.join(cachedir, "roots", "hash")
    if not os.path.isdir(path):
        return False
    gone = os.path.join(cachedir, "roots", f"{fsutil.TEMP_PREFIX}hash-{os.getpid()}-{time.time_ns()}")
    try:
        os.rename(path, gone)
    except OSError:
        return False
    shutil.rmtree(gone, ignore_errors=True)
    return True


def locate(roots, rel):
    """The path serving ``rel`` in a merged view, or None."""
    for root in roots:
        path = os.path.join(root, rel)
        if os.path.isfile(path):
            return path
    return None


def locate_confined(roots, rel, realpath=os.path.realpath):
    """
    :func:`locate` for a write or a removal on a peer: the path serving
    ``rel`` (validated as :func:`fsutil.safe_join` does), or None.  A path
    found through a symlinked directory that leads outside the root it was
    found under is :class:`fsutil.PathError`: never written, never removed.
    """
    for root in roots:
        path = os.path.join(root, *fsutil.rel_parts(rel))
        if os.path.isfile(path):
            try:
                return fsutil.confine(root, path, realpath=realpath)
            except fsutil.PathError:
                raise fsutil.PathError(
                    f"{rel!r} is found in {root} through a symlinked directory that leads "
                    f"outside it ({realpath(os.path.dirname(path))}): not written, not removed"
                ) from None
    return None


def valid_minion_id(minion_id):
    """Minion ids as Salt accepts them for key files (salt.utils.verify.valid_id)."""
    return (
        isinstance(minion_id, str)
        and bool(minion_id)
        and minion_id not in (".", "..")
        and not _ID_BAD.search(minion_id)
        and not minion_id.startswith(fsutil.TEMP_PREFIX)
    )


def looks_like_pem(data):
    return data.lstrip().startswith(b"-----BEGIN ") and b"-----END " in data


class _NotPem(ValueError):
    """A file in a key dir that is not a PEM public key."""


def _pem_key_sha_file(path):
    """:func:`key_sha_file` of a PEM key; :class:`_NotPem` for anything else."""
    with open(path, "rb") as fh:
        data = fh.read()
    if not looks_like_pem(data[:4096]):
        raise _NotPem(path)
    return key_sha(data)


def _key_entry(state, name, full, cache, errors, entry=None):
    """
    The sha256 of one key file, or None when it is not a key Salt would use
    (the reason goes to ``errors``; dotfiles and non-regular files silently).
    ``entry``: the file's ``os.DirEntry`` when listed (saves a syscall).
    """
    if name.startswith("."):
        return None  # Salt's own .key_cache, our temp files: not keys
    if not valid_minion_id(name):
        errors.append(f"{state}/{name!r}: invalid minion id, skipped")
        return None
    if entry.is_symlink() if entry is not None else os.path.islink(full):
        errors.append(f"{state}/{name}: symlinked key file, skipped (Salt ignores it)")
        return None
    try:
        st = entry.stat() if entry is not None else os.stat(full)
        if not stat.S_ISREG(st.st_mode):
            return None
        # checked once, when hashed (one read); a rejected file is never cached
        sha = cache.sha256(full, st, hasher=key_sha_file if state == "minions_autosign"
                           else _pem_key_sha_file)
    except _NotPem:
        cache.hashed += 1  # read, like a key hashed
        errors.append(Damaged(f"{state}/{name}: not a PEM public key, skipped", name, state))
        return None
    except FileNotFoundError:
        return None
    except OSError as exc:
        errors.append(Damaged(f"{state}/{name}: unreadable: {exc.strerror}", name, state))
        return None
    return sha


def _key_dir_entries(pki_dir, state):
    """The ``os.DirEntry`` of one key dir but its dotfiles (Salt's .key_cache, a sync's staging)."""
    try:
        listing = os.scandir(os.path.join(pki_dir, state))
    except FileNotFoundError:
        return
    with listing:
        for entry in listing:
            if not entry.name.startswith("."):
                yield entry


def _same_key_file(was, st):
    """Whether a key file's ``st`` is the one its snapshot entry ``was`` recorded."""
    return (stat.S_ISREG(st.st_mode) and was[0] == st.st_ino and was[1] == st.st_size
            and was[2] == st.st_mtime_ns)


def _list_key_dir(pki_dir, state, known, get_cache, errors):
    """
    ``{minion_id: [inode, size, mtime_ns, sha256]}`` of one key dir.  A key
    whose stat is the one in ``known`` keeps its hash; any other is hashed
    through ``get_cache()`` (called only then).
    """
    ret = {}
    for entry in _key_dir_entries(pki_dir, state):
        was = known.get(entry.name)
        if was is not None and not entry.is_symlink():
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            if _same_key_file(was, st):
                ret[entry.name] = was
                continue
        cache = get_cache()
        if _key_entry(state, entry.name, entry.path, cache, errors, entry) is not None:
            ret[entry.name] = cache.entries[entry.path]
    return ret


def keys_state(pki_dir, ids, errors=None):
    """
    ``{state_dir: {minion_id: sha256}}`` of the keys of ``ids`` only: a few
    stat calls per id instead of a listing of every key dir (targeted syncs).
    Invalid ids are reported in ``errors`` and left out.
    """
    errors = errors if errors is not None else []
    cache = HashCache()
    ret = {state: {} for state in KEY_DIRS}
    for mid in ids:
        if not valid_minion_id(mid):
            errors.append(f"{mid!r}: invalid minion id, skipped")
            continue
        for state in KEY_DIRS:
            sha = _key_entry(state, mid, os.path.join(pki_dir, state, mid), cache, errors)
            if sha is not None:
                ret[state][mid] = sha
    return ret


# A key dir changed less than this long before it was listed is listed again
# next time: two changes within one tick of the filesystem's clock can leave
# its mtime as it was.  Used when the filesystem's own clock is not known
# (the state dir on another filesystem than the key dir, see _fs_clock).
RACY_NS = 2 * 10**9


#: how long a listing waits at most for the filesystem's clock to pass the
#: last change of the key dirs it lists (one tick: a few ms; a filesystem
#: with coarser timestamps is listed again next time instead)
FS_CLOCK_WAIT = 0.02


def _fs_clock(state_dir, stamps=()):
    """
    ``[st_dev, mtime_ns]`` of :data:`KEYS_CLOCK` in ``state_dir``, touched
    now: the time of the filesystem's own clock (its tick, not the wall
    clock) before a listing.  A key dir on the same filesystem whose mtime is
    older than that was last changed before the listing, and any later change
    gives it a later mtime; one whose mtime is not older may change again
    within the same tick unseen (racy, as in git's index).  So while a dir of
    ``stamps`` (:func:`_dir_stamp`, the dirs about to be listed) changed in
    the current tick, wait for the next one, up to :data:`FS_CLOCK_WAIT`.
    None when the file cannot be touched.
    """
    path = os.path.join(state_dir, KEYS_CLOCK)
    deadline = time.monotonic() + FS_CLOCK_WAIT
    while True:
        try:
            try:
                os.utime(path)
            except FileNotFoundError:
                fsutil.makedirs(state_dir, mode=0o700)
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
            st = os.stat(path)
        except OSError:
            return None
        clock = [st.st_dev, st.st_mtime_ns]
        if not any(s and s[0] == clock[0] and s[2] >= clock[1] for s in stamps) or (
                time.monotonic() > deadline):
            return clock
        time.sleep(0.0005)


def _dir_stamp(path):
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return [st.st_dev, st.st_ino, st.st_mtime_ns]


def read_json(path):
    """
    What the JSON state file ``path`` holds; None when it is missing or
    damaged (:func:`statefile.load`: logged, what it vouched for read again).
    """
    return statefile.load(path, "what it vouched for is read again")


def _key_part(entries):
    """The bucket part (``{state: {id: sha256}}``) of a bucket's snapshot entries."""
    return {state: {mid: e[3] for mid, e in keys.items()} for state, keys in entries.items() if keys}


def _valid_key_entries(entries):
    return isinstance(entries, dict) and all(
        state in KEY_DIRS and isinstance(keys, dict)
        and all(isinstance(e, list) and len(e) == 4 and isinstance(e[3], str)
                for e in keys.values())
        for state, keys in entries.items())


class BucketFiles:
    """
    A cache of bucket parts (``{bucket: data}``), one JSON file per bucket
    in ``directory``: a change reads and writes the files of its buckets
    only.  Its owner saves ``shas`` (``{bucket: sha256 of its file}``, which
    :meth:`save` keeps up to date) after the files, and gives them back: a
    file is read on first use and used only when it is the one named there
    (and ``valid(data)``); one lost, torn, stale or altered reads as None.
    What was read stays: :meth:`save` reads the files it replaces first, so
    they are still the answer for the ``shas`` given.  ``files_read``: how
    many files were read, ``parsed``: how many of them were parsed.
    ``durable``: not a cache (the files flushed to disk, as
    :func:`fsutil.atomic_write` does by default).
    """

    def __init__(self, directory, shas, valid, durable=False):
        self.dir = directory
        self.durable = durable  # each file flushed before and after its rename
        self.shas = dict(shas) if isinstance(shas, dict) else {}
        self.files_read = 0
        self.parsed = 0
        self.bad = set()  # buckets whose file did not match
        self._given = dict(self.shas)
        self._valid = valid
        self._read = {}
        self._texts = {}  # read and checked by matching(), not parsed yet

    def _path(self, bucket):
        return os.path.join(self.dir, f"{bucket}.json")

    def _text(self, bucket):
        """The bytes of ``bucket``'s file when it is the one named, else None."""
        if bucket in self._texts:
            return self._texts.pop(bucket)
        self.files_read += 1
        path = self._path(bucket)
        try:
            text = statefile.read_bytes(path)
        except statefile.Damaged as exc:
            statefile.notice(path, exc.why, "not used: what it holds is read again")
            return None
        if text is None or hashlib.sha256(text).hexdigest() != self._given[bucket]:
            statefile.notice(path, "missing" if text is None else "not the file named (torn, "
                             "altered or of another save)", "not used: read again")
            return None
        return text

    def matching(self):
        """
        The buckets whose file is the one named (each read and checked, its
        data parsed only when :meth:`get` asks for it); the others are in
        ``bad``.
        """
        for bucket in self._given:
            if bucket not in self._read and bucket not in self._texts:
                text = self._text(bucket)
                if text is None:
                    self._read[bucket] = None
                    self.bad.add(bucket)
                else:
                    self._texts[bucket] = text
        return {b for b in self._given if b in self._texts or self._read.get(b) is not None}

    def get(self, bucket):
        """One bucket's data (``{}``: an empty bucket), None when its file does not match."""
        if bucket not in self._read:
            want = self._given.get(bucket)
            data = {}
            if want is not None:
                data = None
                text = self._text(bucket)
                try:
                    if text is not None:
                        self.parsed += 1
                        data = json.loads(text).get("bucket")
                except (ValueError, AttributeError):
                    pass
                if not self._valid(data):
                    data = None
                    self.bad.add(bucket)
            self._read[bucket] = data
        return self._read[bucket]

    def every(self):
        """``{bucket: data}`` of every bucket; None when one does not match."""
        ret = {}
        for bucket in self._given:
            ret[bucket] = self.get(bucket)
            if ret[bucket] is None:
                return None
        return ret

    def save(self, changed):
        """Write the buckets of ``changed`` (``{bucket: data}``); an empty one is removed."""
        statefile.makedirs(self.dir, os.path.dirname(self.dir))
        for bucket, data in changed.items():
            self.get(bucket)
            data = {outer: inner for outer, inner in data.items() if inner}
            if data:
                text = json.dumps({"bucket": data}).encode("utf-8")
                statefile.write(self._path(bucket), text, mode=0o600, durable=self.durable)
                self.shas[bucket] = hashlib.sha256(text).hexdigest()
            else:
                statefile.remove(self._path(bucket))
                self.shas.pop(bucket, None)


def key_buckets(state_dir, shas):
    """The :class:`BucketFiles` of a key snapshot: ``{state: {id: [ino, size, mtime_ns, sha256]}}`` each."""
    return BucketFiles(os.path.join(state_dir, KEYS_SNAPSHOT_BUCKETS), shas, _valid_key_entries)


class _LazyParts(Mapping):
    """
    Bucket parts, ``{bucket: part}``, each made by ``part(bucket)`` when
    first looked up (None: not known, read as missing).  ``digest()``: the
    digests, which name the non-empty buckets.
    """

    def __init__(self, digest, part):
        self._digest = digest
        self._part = part
        self._made = {}

    def __getitem__(self, bucket):
        if bucket not in self._digest():
            raise KeyError(bucket)
        if bucket not in self._made:
            self._made[bucket] = self._part(bucket)
        if self._made[bucket] is None:
            raise KeyError(bucket)
        return self._made[bucket]

    def __iter__(self):
        return iter([bucket for bucket in list(self._digest()) if bucket in self])

    def __len__(self):
        return len(list(iter(self)))


def saved_key_parts(state_dir, buckets):
    """
    ``{bucket: {state: {id: sha256}}}`` of ``buckets`` in the key snapshot
    saved in ``state_dir`` (:class:`KeysSnapshot`), an empty bucket left
    out; None when there is none or a bucket's file does not match it.
    """
    meta = read_json(os.path.join(state_dir, KEYS_SNAPSHOT))
    if not isinstance(meta, dict) or not isinstance(meta.get("digest"), dict):
        return None
    store = key_buckets(state_dir, meta.get("buckets"))
    ret = {}
    for bucket in buckets:
        entries = store.get(bucket)
        if entries is None:
            return None
        if entries:
            ret[bucket] = _key_part(entries)
    return ret


class KeysSnapshot:
    """
    The minion keys manifest of a pki_dir with its buckets' digests, saved in
    ``state_dir`` and reused while no key dir changed.

    Salt accepts, rejects and deletes keys by creating, renaming and unlinking
    files, and each of these changes the mtime of the key dir.  A key dir
    found as it was at the last listing is not listed again: its keys are
    taken from the snapshot, and when no dir changed the saved digests are
    the answer, a bucket's keys being read back (:func:`key_buckets`) only
    if it has to be exchanged.  A changed dir is listed, each key statted,
    and only new or changed keys (inode, size, mtime) are read.  The keys of
    the dirs Salt rewrites in place (:data:`REWRITTEN_IN_PLACE`) are statted
    every time; any other key file rewritten in place is seen at the next
    change of its directory, or with ``rescan``.

    With ``watch`` (:func:`watch.client` of the master's watcher, which
    watches its pki_dir), a key dir the watcher vouches did not change since
    the snapshot is taken from it whatever its stamp, and in a changed one
    only the keys it names are statted (no listing of the dir), unless the
    dir held a key that could not be used.  Then only the buckets of those
    keys are read, digested again and saved.

    ``digest``, ``counts`` (keys per state dir) and ``errors`` are set at
    once; ``manifest`` and ``parts`` on first use.  ``reused``: no key dir
    was listed; ``hashed``: keys read.  ``later``: a :class:`fsutil.Later`
    the save of a new listing is put off to.
    """

    def __init__(self, pki_dir, state_dir, rescan=False, later=None, watch=None):
        self.pki_dir = pki_dir
        self.state_dir = state_dir
        self.meta_path = os.path.join(state_dir, KEYS_SNAPSHOT)
        self.hashed = 0
        self._entries = {}  # {bucket: entries} made by this snapshot
        self._full = False  # every bucket is in _entries
        self._parts = None
        self._previous = None
        self._later = later
        meta = read_json(self.meta_path)
        self.meta = (meta if isinstance(meta, dict) and meta.get("pki_dir") == pki_dir
                     and all(isinstance(meta.get(k), dict)
                             for k in ("errors", "digest", "counts", "damaged", "buckets"))
                     # a file named for each bucket of the digests, and no other
                     and set(meta["buckets"]) == set(meta["digest"])
                     else {})
        self._store = key_buckets(state_dir, self.meta.get("buckets"))
        # rescan: every dir listed and every key statted; still only new or
        # changed keys are read
        unchanged, names, self._token = None, {}, None
        if watch is not None:
            unchanged, names, self._token = self._watched(watch, rescan)
        # the stamps after the journal's token: a change made in between is
        # named by the journal next time, whatever the stamps say now
        stamps = self._stamps()
        if unchanged is None:
            # no watcher's word: the stamps of the key dirs
            unchanged = set() if rescan else self._unchanged(stamps)
        self.reused = bool(self.meta) and len(unchanged) == len(KEY_DIRS)
        if self.reused:
            self.digest = self.meta["digest"]
            self.counts = self.meta["counts"]
            self.errors = [e for state in KEY_DIRS for e in self.meta["errors"][state]]
            self.damaged = {state: list(self.meta["damaged"].get(state) or [])
                            for state in KEY_DIRS if self.meta["damaged"].get(state)}
        else:
            self._scan(stamps, unchanged, names)

    def _watched(self, watch, rescan):
        """
        ``(unchanged dirs, {dir: names of its changed keys}, token)`` from
        the watcher; unchanged None when it cannot vouch for the pki_dir (a
        new session, events lost, ``rescan``...), token None too when there
        is no watcher.
        """
        reply = watch(self.meta.get("watch") if self.meta else None)
        tree = os.path.realpath(self.pki_dir)
        if not isinstance(reply, dict) or not reply.get("session") or (
                tree not in (reply.get("trees") or ()) or tree in (reply.get("unwatched") or ())):
            return None, {}, None
        token = {"session": reply["session"], "seq": reply["seq"]}
        changed = (reply.get("changed") or {}).get(tree)
        others = [t for t in reply["trees"] if t != tree and isinstance(t, str)
                  and (t.startswith(tree + os.sep) or tree.startswith(t.rstrip(os.sep) + os.sep))]
        if rescan or not isinstance(changed, list) or others:
            return None, {}, token
        found = ((reply.get("names") or {}).get(tree)) or {}
        errors = self.meta.get("errors") or {}
        unchanged, names = set(), {}
        for state in KEY_DIRS:
            if state not in changed:
                unchanged.add(state)
                continue
            known = found.get(state)
            # a dir holding a key that could not be used is listed (its
            # errors are per dir); "" is the dir itself
            if isinstance(known, list) and "" not in known and not errors.get(state):
                names[state] = known
        return unchanged, names, token

    def _stamps(self):
        return {state: _dir_stamp(os.path.join(self.pki_dir, state)) for state in KEY_DIRS}

    def _unchanged(self, stamps):
        """
        The key dirs as they were when the snapshot was taken, last changed
        before it was taken: by the filesystem's clock (:func:`_fs_clock`)
        when it is known for that dir, else :data:`RACY_NS` before by the
        wall clock.
        """
        dirs, taken = self.meta.get("dirs") or {}, self.meta.get("taken_ns", 0)
        clock = self.meta.get("clock")
        # a dir holding a key that could not be used is listed every time:
        # repaired in place (its dir unchanged), it is found at once
        errors = self.meta.get("errors") or {}

        def settled(stamp):
            if stamp is None:
                return True
            if isinstance(clock, list) and len(clock) == 2 and clock[0] == stamp[0]:
                return stamp[2] < clock[1]
            return stamp[2] + RACY_NS < taken

        files = self.meta.get("files") or {}
        return {state for state, stamp in stamps.items()
                if state in dirs and dirs[state] == stamp and settled(stamp)
                and not errors.get(state)
                and (state not in REWRITTEN_IN_PLACE
                     or files.get(state) == _file_stamps(self.pki_dir, state))}

    @staticmethod
    def saved_digest(pki_dir, state_dir):
        """The digests of the last snapshot of ``pki_dir``, without looking at a key (None: none)."""
        meta = read_json(os.path.join(state_dir, KEYS_SNAPSHOT))
        if isinstance(meta, dict) and meta.get("pki_dir") == pki_dir:
            return meta.get("digest")
        return None

    def previous_parts(self):
        """
        The snapshot this one replaced, ``(digests, function returning its
        bucket parts)``, or None when there was none (a reused snapshot is its
        own previous).
        """
        if self.reused:
            return self.digest, lambda: self.parts
        return self._previous

    def _scan(self, stamps, unchanged=(), names=None):
        """
        List the key dirs not in ``unchanged``; of those in ``names``
        (``{state: [ids]}``: what changed in it, from the watcher), only
        these keys are statted, the others taken from the snapshot.  When
        every changed dir is in ``names``, only their buckets are read.
        """
        if not self.meta:
            unchanged, names = set(), {}
        names = names or {}
        listed = [state for state in KEY_DIRS if state not in unchanged]
        clock = _fs_clock(self.state_dir, [stamps[state] for state in listed])
        taken = time.time_ns()
        written = _Lazy(lambda: open_hashcache(self.state_dir, KEYS_HASHCACHE))
        done = None
        if listed and all(state in names for state in listed):
            done = self._update(names, written)
        if done is None:
            done = self._list(unchanged, written)
        changed, errors, damaged, files = done
        # keys that exist but cannot be used: never read as deleted
        self.damaged = {state: ids for state, ids in damaged.items() if ids}
        self.hashed = written.value.hashed if written.value is not None else 0
        self._parts = None
        self.errors = [e for state in KEY_DIRS for e in errors[state]]
        if self._token is None and self._stamps() != stamps:
            # a key dir changed while it was listed: list it again next time
            # (with a watcher, its token was taken before: it tells next time)
            return
        # what was remembered of these keys (remember()) holds while they are
        # the same: a key dir listed again only because it changed moments
        # before the last listing (RACY_NS) keeps it
        kept = {k: v for k, v in self.meta.items() if k not in _SCAN_FIELDS} if (
            self.meta.get("digest") == self.digest) else {}
        self.meta = dict(kept, **{"pki_dir": self.pki_dir, "dirs": stamps, "taken_ns": taken,
                                  "clock": clock, "digest": self.digest, "counts": self.counts,
                                  "errors": errors, "damaged": damaged, "files": files,
                                  # listed without the journal's word, the
                                  # snapshot is newer than the last token:
                                  # what changed since that one still covers it
                                  "watch": self._token or self.meta.get("watch")})
        fsutil.now_or_later(self._later, self._save, changed, self.meta)

    def _update(self, names, written):
        """
        The keys ``names`` (``{state: [ids]}``) statted again in the buckets
        they fall in, the other buckets as saved: ``(buckets to save,
        errors, damaged, files)``; None when a bucket's file does not match.
        """
        where = {}
        for state, ids in names.items():
            for name in ids:
                where.setdefault(bucket_of(name), {}).setdefault(state, []).append(name)
        old = {bucket: self._store.get(bucket) for bucket in where}
        if any(entries is None for entries in old.values()):
            return None
        meta = self.meta
        errors = {state: [] if state in names else list(meta["errors"][state])
                  for state in KEY_DIRS}
        digest, counts = dict(meta["digest"]), {s: meta["counts"].get(s, 0) for s in KEY_DIRS}
        files = {state: dict((meta.get("files") or {}).get(state) or {})
                 for state in REWRITTEN_IN_PLACE}
        for bucket, changed in where.items():
            entries = dict(old[bucket])
            for state, ids in changed.items():
                entries[state] = _update_key_dir(self.pki_dir, state, old[bucket].get(state) or {},
                                                 ids, written.get, errors[state])
                counts[state] += len(entries[state]) - len(old[bucket].get(state) or {})
                if state in files:
                    for name in ids:
                        files[state].pop(name, None)
                        if name in entries[state]:
                            files[state][name] = entries[state][name][:3]
            self._entries[bucket] = entries = {s: keys for s, keys in entries.items() if keys}
            part = _key_part(entries)
            if part:
                digest[bucket] = _part_digest(part)
            else:
                digest.pop(bucket, None)
        damaged = {state: damaged_sources(errors[state]).get(state, []) if state in names
                   else list(meta["damaged"].get(state) or []) for state in KEY_DIRS}
        was = meta["digest"]
        previous = _LazyParts(lambda: was, lambda b: _key_part(old[b] if b in old else self._entries_of(b)))
        self._previous = (was, lambda: previous)
        self.digest, self.counts = digest, counts
        return {bucket: self._entries[bucket] for bucket in where}, errors, damaged, files

    def _list(self, unchanged, written):
        """
        List the key dirs not in ``unchanged``, the others taken from the
        saved buckets: ``(buckets to save, errors, damaged, files)``.
        """
        saved = self._store.every() if self.meta else {}
        if saved is None:
            # a bucket's file does not match: every dir listed, every key read
            saved, unchanged = {}, set()
        previous = {}
        for entries in saved.values():
            for state, keys in entries.items():
                previous.setdefault(state, {}).update(keys)
        if saved:
            self._previous = (self.meta["digest"], _Lazy(lambda: {
                bucket: _key_part(entries) for bucket, entries in saved.items()}).get)
        errors, damaged, new = {}, {}, {}
        for state in KEY_DIRS:
            if state in unchanged:
                errors[state] = list(self.meta["errors"][state])
                damaged[state] = list(self.meta["damaged"].get(state) or [])
                for bucket, entries in saved.items():
                    if entries.get(state):
                        new.setdefault(bucket, {})[state] = entries[state]
                continue
            errors[state] = []
            keys = _list_key_dir(self.pki_dir, state, previous.get(state) or {},
                                 written.get, errors[state])
            damaged[state] = damaged_sources(errors[state]).get(state, [])
            for mid, entry in keys.items():
                new.setdefault(bucket_of(mid), {}).setdefault(state, {})[mid] = entry
        self._entries, self._full = new, True
        self.digest = {bucket: _part_digest(_key_part(entries)) for bucket, entries in new.items()}
        self.counts = {state: sum(len(entries.get(state) or {}) for entries in new.values())
                       for state in KEY_DIRS}
        files = {state: {mid: entry[:3] for entries in new.values()
                         for mid, entry in (entries.get(state) or {}).items()}
                 for state in REWRITTEN_IN_PLACE}
        changed = {bucket: entries for bucket, entries in new.items()
                   if saved.get(bucket) != entries}
        changed.update({bucket: {} for bucket in saved if bucket not in new})
        return changed, errors, damaged, files

    def _save(self, changed, meta):
        # a cache of the key dirs: checked against their stamps, each
        # bucket's file against the sha256 the meta names (BucketFiles),
        # listed again when one does not match
        self._store.save(changed)
        meta["buckets"] = {b: sha for b, sha in self._store.shas.items() if b in meta["digest"]}
        statefile.write(self.meta_path, json.dumps(meta), mode=0o600, durable=False)
        # every key is in the snapshot now: the cache of the keys a sync wrote is spent
        statefile.remove(os.path.join(self.state_dir, KEYS_HASHCACHE))

    def _entries_of(self, bucket):
        """
        One bucket's entries: made by this snapshot, else read from its
        file; a file that does not match has every key dir listed again.
        """
        if bucket in self._entries or self._full:
            return self._entries.get(bucket, {})
        entries = self._store.get(bucket)
        if entries is not None:
            return entries
        log.info("multimaster: key snapshot %s unreadable or stale, listing the keys",
                 self._store.dir)
        self.meta, self._store, self._entries = {}, key_buckets(self.state_dir, {}), {}
        self._scan(self._stamps())
        return self._entries.get(bucket, {})

    @property
    def manifest(self):
        """``{state: {id: sha256}}`` of every key (every bucket read)."""
        for bucket in list(self.digest):
            self._entries_of(bucket)  # a listing if one does not match
        ret = {state: {} for state in KEY_DIRS}
        for bucket in self.digest:
            for state, keys in self._entries_of(bucket).items():
                ret[state].update((mid, entry[3]) for mid, entry in keys.items())
        return ret

    @property
    def buckets_read(self):
        """How many saved buckets this snapshot read (not the ones it made)."""
        return self._store.files_read

    @property
    def parts(self):
        """``{bucket: {state: {id: sha256}}}``, each bucket read when first looked up."""
        if self._parts is None:
            self._parts = _LazyParts(lambda: self.digest, lambda b: _key_part(self._entries_of(b)))
        return self._parts

    def remember(self, **fields):
        """Save more fields with the snapshot (when it was saved at all)."""
        if self.meta.get("dirs") is None or "buckets" not in self.meta:
            return
        self.meta.update(fields)
        statefile.write(self.meta_path, json.dumps(self.meta), mode=0o600, durable=False)


_SCAN_FIELDS = ("pki_dir", "dirs", "taken_ns", "clock", "digest", "counts", "errors",
                "damaged", "files", "watch", "buckets")


def _update_key_dir(pki_dir, state, known, names, get_cache, errors):
    """
    :func:`_list_key_dir`'s result for one key dir from the last one
    (``known``), with only the keys ``names`` statted again: the ones the
    watcher says changed.
    """
    ret = dict(known)
    for name in names:
        ret.pop(name, None)
        if name.startswith("."):
            continue
        full = os.path.join(pki_dir, state, name)
        was = known.get(name)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            continue  # removed
        except OSError:
            st = None
        if st is not None and was is not None and _same_key_file(was, st):
            ret[name] = was
            continue
        cache = get_cache()
        if _key_entry(state, name, full, cache, errors) is not None:
            ret[name] = cache.entries[full]
    return ret


def _file_stamps(pki_dir, state):
    """``{id: [inode, size, mtime_ns]}`` of the keys of one key dir, as a snapshot saves them."""
    ret = {}
    for entry in _key_dir_entries(pki_dir, state):
        if not valid_minion_id(entry.name):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            ret[entry.name] = [st.st_ino, st.st_size, st.st_mtime_ns]
    return ret


class _Lazy:
    """A value made on first use."""

    def __init__(self, make):
        self.make = make
        self.value = None

    def get(self):
        if self.value is None:
            self.value = self.make()
        return self.value


def open_hashcache(state_dir, name):
    """A :class:`HashCache` in ``state_dir``."""
    return HashCache(os.path.join(state_dir, name))


def _valid_roots_part(part):
    return isinstance(part, dict) and all(
        isinstance(files, dict) and all(isinstance(e, list) and len(e) == 3 for e in files.values())
        for files in part.values())


def _safe_digest(part, raw):
    """The digest of a bucket part as a peer in step holds it (``raw``: the part's own)."""
    safe = replicate.safe_tree(part)
    return raw if safe is part else _part_digest(safe)


class RootsParts:
    """
    A roots category's manifest cut in buckets (:func:`split`) as the last
    read of this master found it: ``roots-<category>.json`` (the digests,
    raw and as a peer in step holds them: ``safe``, modes through
    :func:`replicate.safe_tree`) and one file per bucket in
    ``roots-<category>.d`` (:class:`BucketFiles`).  On the primary it is
    the previous state a plan reads (:meth:`previous`).

    :meth:`update` sets this read's ``parts``, ``raw`` and ``safe``
    digests.  When the read walked with the change journal, every listed
    directory's paths are known (:class:`Touched`) and the saved buckets
    were cut from the records it walked from (their generation, ``gen``),
    only the buckets of those paths are cut and digested again, from their
    saved files; any other read cuts the whole manifest.  :meth:`save`
    writes the buckets whose digest changed.
    """

    FORMAT = 3

    def __init__(self, state_dir, cat):
        self.cat = cat
        self.path = os.path.join(state_dir, f"roots-{cat}.json")
        data = read_json(self.path)
        good = (isinstance(data, dict) and data.get("format") == self.FORMAT
                and all(isinstance(data.get(k), dict) for k in ("digest", "safe", "buckets"))
                # a file named for each bucket of the digests, and no other
                and set(data["digest"]) == set(data["safe"]) == set(data["buckets"]))
        self.data = data if good else {}
        self._files = BucketFiles(os.path.join(state_dir, f"roots-{cat}.d"),
                                  self.data.get("buckets"), _valid_roots_part)
        self.parts = self.raw = self.safe = None
        self.cut = None  # how update() cut: "buckets" or "all"
        self._roots = None

    @property
    def digest(self):
        """The digests of the last read as a peer in step holds them (None: none)."""
        return self.data.get("safe")

    def previous(self):
        """
        ``(digests, function returning the parts)`` of the last read, as a
        peer in step holds them; None without one.  A bucket whose file does
        not match is missing from the parts (a peer holding it is asked).
        """
        if self.digest is None:
            return None
        raw, files = self.data["digest"], self._files

        def part(bucket):
            got = files.get(bucket)
            return None if got is None else replicate.safe_tree(got)

        parts = _LazyParts(lambda: raw, part)
        return self.digest, lambda: parts

    def saved_part(self, bucket):
        """
        The part of ``bucket`` as the last read found it (``{}``: empty),
        modes as they are; None without a saved read or when its file does
        not match.
        """
        if self.digest is None:
            return None
        if bucket not in self.data["digest"]:
            return {}
        return self._files.get(bucket)

    def update(self, roots_by_env, man, touched, gen, complete=None):
        """
        This read's ``parts``, ``raw`` and ``safe`` digests from its
        manifest ``man``; ``touched``: ``{saltenv: Touched}`` of a walk with
        records (else None), ``gen``: the generation of the records it
        walked from.  ``complete``: called before the whole of ``man`` is
        read (it holds the paths of the directories listed until then,
        :class:`Deferred`).  Returns the buckets to save, ``{bucket: part}``.
        """
        self._roots = {env: [r for r in roots if os.path.isdir(r)]
                       for env, roots in (roots_by_env or {}).items()}
        changed = None
        if (touched is not None and gen is not None and self.data.get("gen") == gen
                and self.data.get("roots") == self._roots and set(touched) == set(man)
                and all(t.complete for t in touched.values())):
            changed = self._cut_buckets(man, touched)
        if changed is None:
            if complete is not None:
                complete()
            parts = split(self.cat, man)
            raw = bucket_digests(parts)
            old = self.data.get("digest") or {}
            changed = {b: part for b, part in parts.items()
                       if old.get(b) != raw[b] or b in self._files.bad}
            changed.update({b: {} for b in old if b not in raw})
            self.parts, self.raw, self.cut = parts, raw, "all"
            self.safe = {b: _safe_digest(part, raw[b]) for b, part in parts.items()}
        return changed

    def _cut_buckets(self, man, touched):
        """:meth:`update` of the buckets of the touched paths only; None when it cannot."""
        where = {}
        for env, paths in touched.items():
            for rel in paths.rels:
                where.setdefault(bucket_of(f"{env}/{rel}"), []).append((env, rel))
        if len(where) > BUCKETS // 2:
            return None  # most buckets: the whole manifest is cut
        raw, safe, new = dict(self.data["digest"]), dict(self.data["safe"]), {}
        for bucket, paths in where.items():
            old = self._files.get(bucket)
            if old is None:
                return None
            part = {env: dict(files) for env, files in old.items()}
            for env, rel in paths:
                value = man[env].get(rel)
                if value is not None:
                    part.setdefault(env, {})[rel] = value
                elif rel in part.get(env, ()):
                    del part[env][rel]
            new[bucket] = part = {env: files for env, files in part.items() if files}
            if part:
                raw[bucket] = _part_digest(part)
                safe[bucket] = _safe_digest(part, raw[bucket])
            else:
                raw.pop(bucket, None)
                safe.pop(bucket, None)
        files = self._files
        self.parts = _LazyParts(lambda: raw,
                                lambda b: new[b] if b in new else files.get(b))
        self.raw, self.safe, self.cut = raw, safe, "buckets"
        return new

    def save(self, changed, gen):
        """Write the ``changed`` buckets and the digests of :meth:`update`, cut at records ``gen``."""
        # what the primary plans from only for a peer whose digests equal
        # these, each bucket checked: a lost or stale file costs a second
        # round, never a wrong plan
        self._files.save(changed)
        statefile.write(self.path, json.dumps({
            "format": self.FORMAT, "gen": gen, "roots": self._roots, "digest": self.raw,
            "safe": self.safe,
            "buckets": {b: sha for b, sha in self._files.shas.items() if b in self.raw}}),
            mode=0o600, durable=False)
