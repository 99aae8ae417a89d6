"""
Manifests: what a master holds, as ``relative path -> (size, mode, sha256)``.

Hashes are cached keyed on ``(inode, size, mtime_ns)``, so a manifest of an
unchanged tree stats every file and hashes none.
"""

import fnmatch
import hashlib
import json
import logging
import os
import re
import stat

from salt_multimaster import fsutil

log = logging.getLogger(__name__)

KEY_STATES = ("minions", "minions_pre", "minions_rejected", "minions_denied", "minions_autosign")
_ID_BAD = re.compile(r"[\x00/\\]")


def digest(obj):
    """A stable sha256 of a JSON-able object."""
    return hashlib.sha256(
        json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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


def _bucket(name):
    return str(hashlib.sha1(name.encode("utf-8", "surrogateescape")).digest()[0] % BUCKETS)


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
            ret.setdefault(_bucket(key), {}).setdefault(outer, {})[name] = value
    return ret


def bucket_digests(parts):
    """``{bucket: digest}`` of :func:`split`'s parts."""
    return {b: digest(part) for b, part in parts.items()}


def differing(mine, theirs):
    """Buckets whose digests differ (present on one side only included)."""
    return sorted(b for b in set(mine) | set(theirs) if mine.get(b) != theirs.get(b))


def merge(parts, buckets):
    """The union of the partial manifests of ``buckets``."""
    ret = {}
    for b in buckets:
        for outer, entries in parts.get(b, {}).items():
            ret.setdefault(outer, {}).update(entries)
    return ret


class HashCache:
    """
    ``path -> [inode, size, mtime_ns, sha256]`` persisted as JSON.

    ``hashed`` counts the files actually read, for tests and benchmarks.
    """

    def __init__(self, path=None):
        self.path = path
        self.entries = {}
        self.dirty = False
        self.hashed = 0
        if path and os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as fh:
                    self.entries = json.load(fh)
            except (OSError, ValueError):
                self.entries = {}

    def sha256(self, path, st, hasher=sha256_file):
        key = [st.st_ino, st.st_size, st.st_mtime_ns]
        entry = self.entries.get(path)
        if entry and entry[:3] == key:
            return entry[3]
        value = hasher(path)
        self.hashed += 1
        self.entries[path] = key + [value]
        self.dirty = True
        return value

    def save(self, keep=None):
        """Persist, dropping entries not in ``keep`` (the paths seen this run)."""
        if keep is not None:
            stale = set(self.entries) - set(keep)
            for path in stale:
                del self.entries[path]
            self.dirty = self.dirty or bool(stale)
        if not self.path or not self.dirty:
            return
        fsutil.makedirs(os.path.dirname(self.path), mode=0o700)
        fsutil.atomic_write(self.path, json.dumps(self.entries), mode=0o600)
        self.dirty = False


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


def tree_manifest(roots, ignore, cache, seen=None, errors=None):
    """
    The merged view Salt serves for one saltenv: ``rel -> [size, mode, sha256]``.

    The first root holding a path wins, as in Salt's roots fileserver.
    Symlinks are followed only while their target stays inside the root;
    others are reported in ``errors`` and left out.  One ``stat`` per file
    and one ``realpath`` per directory: unchanged files are never read.
    """
    ret = {}
    errors = errors if errors is not None else []
    for root in roots:
        if not os.path.isdir(root):
            continue
        real_root = os.path.realpath(root)
        inside = real_root.rstrip(os.sep) + os.sep
        stack = [("", root, frozenset())]
        while stack:
            rel_dir, dirpath, ancestors = stack.pop()
            real_dir = os.path.realpath(dirpath)
            if real_dir != real_root and not real_dir.startswith(inside):
                errors.append(f"{root}: {rel_dir}: symlinked directory leads outside the root, not replicated")
                continue
            if real_dir in ancestors:
                continue  # a symlink loop inside the root
            ancestors = ancestors | {real_dir}
            try:
                entries = sorted(os.scandir(dirpath), key=lambda e: e.name)
            except OSError as exc:
                errors.append(f"{root}: {rel_dir or '.'}: {exc.strerror}")
                continue
            subdirs = []
            for entry in entries:
                name = entry.name
                if name.startswith(fsutil.TEMP_PREFIX):
                    continue  # a sync writing here: its temporary files
                rel = f"{rel_dir}/{name}" if rel_dir else name
                full = entry.path
                try:
                    is_dir = entry.is_dir()  # follows symlinks, as Salt does
                except OSError:
                    is_dir = False
                if is_dir:
                    if not (ignore(rel + "/", full + "/") or ignore(rel, full)):
                        subdirs.append((rel, full, ancestors))
                    continue
                if rel in ret or ignore(rel, full):
                    continue
                link = entry.is_symlink()
                real = os.path.realpath(full) if link else os.path.join(real_dir, name)
                if link and not real.startswith(inside):
                    errors.append(f"{root}: {rel}: symlink leads outside the root, not replicated")
                    continue
                try:
                    st = entry.stat()
                except OSError as exc:
                    errors.append(f"{root}: {rel}: {exc.strerror}")
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                try:
                    sha = cache.sha256(real, st)
                except OSError as exc:
                    errors.append(f"{root}: {rel}: unreadable: {exc.strerror}")
                    continue
                if seen is not None:
                    seen.append(real)
                ret[rel] = [st.st_size, stat.S_IMODE(st.st_mode), sha]
            stack.extend(reversed(subdirs))
    return ret


def roots_manifest(roots_by_env, ignore, cache, seen=None, errors=None):
    """``{saltenv: tree_manifest}`` for a ``file_roots``/``pillar_roots`` mapping."""
    return {
        env: tree_manifest(roots, ignore, cache, seen=seen, errors=errors)
        for env, roots in sorted((roots_by_env or {}).items())
    }


def locate(roots, rel):
    """The path serving ``rel`` in a merged view, or None."""
    for root in roots:
        path = os.path.join(root, rel)
        if os.path.isfile(path):
            return path
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
        before = cache.hashed
        sha = cache.sha256(full, st, hasher=key_sha_file)
        if cache.hashed != before and state != "minions_autosign":
            # checked once, when hashed; a rejected file is never cached
            with open(full, "rb") as fh:
                if not looks_like_pem(fh.read(4096)):
                    del cache.entries[full]
                    errors.append(f"{state}/{name}: not a PEM public key, skipped")
                    return None
    except FileNotFoundError:
        return None
    except OSError as exc:
        errors.append(f"{state}/{name}: unreadable: {exc.strerror}")
        return None
    return sha


def keys_manifest(pki_dir, cache, seen=None, errors=None):
    """
    ``{state_dir: {minion_id: sha256}}`` for a master's minion key dirs.

    Invalid ids and non-PEM files are reported in ``errors`` and left out.
    ``minions_autosign`` holds autosign grain files, not keys, and is copied
    as it is.
    """
    errors = errors if errors is not None else []
    ret = {}
    for state in KEY_STATES:
        path = os.path.join(pki_dir, state)
        entries = {}
        try:
            listing = sorted(os.scandir(path), key=lambda e: e.name)
        except FileNotFoundError:
            ret[state] = entries
            continue
        for entry in listing:
            sha = _key_entry(state, entry.name, entry.path, cache, errors, entry)
            if sha is None:
                continue
            if seen is not None:
                seen.append(entry.path)
            entries[entry.name] = sha
        ret[state] = entries
    return ret


def keys_state(pki_dir, ids, errors=None):
    """
    :py:func:`keys_manifest` restricted to ``ids``: a few stat calls per id
    instead of a listing of every key dir (the reactor's one-key syncs).
    Invalid ids are reported in ``errors`` and left out.
    """
    errors = errors if errors is not None else []
    cache = HashCache()
    ret = {state: {} for state in KEY_STATES}
    for mid in ids:
        if not valid_minion_id(mid):
            errors.append(f"{mid!r}: invalid minion id, skipped")
            continue
        for state in KEY_STATES:
            sha = _key_entry(state, mid, os.path.join(pki_dir, state, mid), cache, errors)
            if sha is not None:
                ret[state][mid] = sha
    return ret
