"""
Manifests: what a master holds, as ``{state: {id: sha256}}`` (minion keys)
and ``{saltenv: {rel: [size, mode, sha256]}}`` (roots), cut in buckets and
digested; the hashes, ids and paths they are made of.  The scanners that
read them are :mod:`salt_multimaster.keyscan` and
:mod:`salt_multimaster.rootscan`.
"""

import fnmatch
import hashlib
import logging
import os
import re
import shutil
import time

from salt_multimaster import fsutil

log = logging.getLogger(__name__)

# The pki_dir subdirectories a sync replicates; the first four are the
# states a minion key is in (salt-key's lists), minions_autosign holds
# autosign grants named by minion id, not keys.
KEY_DIRS = ("minions", "minions_pre", "minions_rejected", "minions_denied", "minions_autosign")
KEY_STATES = KEY_DIRS[:4]
_ID_BAD = re.compile(r"[\x00/\\]")


class Damaged(str):
    """
    An error about a source that exists but cannot be used (unreadable, or
    not a key): a plain message that also names the item, so a sync keeps
    the peer's copy of it instead of reading it as deleted.  ``name``: the
    minion id, or the path relative to its saltenv (for a directory, with a
    trailing ``/``; ``"/"`` for a whole root); ``where``: the key state or
    the saltenv.
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


def bucket_of(name):
    """The bucket (a string) a key id or a roots path falls in."""
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
            ret.setdefault(bucket_of(key), {}).setdefault(outer, {})[name] = value
    return ret


def part_digest(part):
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
    return {b: part_digest(part) for b, part in parts.items()}


def differing(mine, theirs):
    """Buckets whose digests differ (present on one side only included)."""
    return sorted(b for b in set(mine) | set(theirs) if mine.get(b) != theirs.get(b))


def restrict(cat, man, buckets):
    """The entries of a keys or roots manifest that fall in ``buckets``."""
    return merge(split(cat, man), buckets)


def merge(parts, buckets):
    """The union of the partial manifests of ``buckets``."""
    ret = {}
    for b in buckets:
        for outer, entries in parts.get(b, {}).items():
            ret.setdefault(outer, {}).update(entries)
    return ret


class Ignore:
    """
    Salt's ``file_ignore_regex`` / ``file_ignore_glob`` of the master
    options ``opts``, applied to relative and full paths.
    """

    def __init__(self, opts):
        regex = opts.get("file_ignore_regex") or []
        glob = opts.get("file_ignore_glob") or []
        if isinstance(regex, str):
            regex = [regex]
        if isinstance(glob, str):
            glob = [glob]
        self.regex = [re.compile(r) for r in regex]
        self.glob = list(glob)
        # fnmatch.fnmatch of each glob, as one match (POSIX: no case folding)
        self._glob = re.compile("|".join(fnmatch.translate(g) for g in glob)) if glob else None

    def __call__(self, rel, full):
        for candidate in (rel, full):
            for regex in self.regex:
                if regex.search(candidate):
                    return True
            if self._glob is not None and self._glob.match(candidate):
                return True
        return False


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
    gone = os.path.join(cachedir, "roots",
                        f"{fsutil.TEMP_PREFIX}hash-{os.getpid()}-{time.time_ns()}")
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


def utf8(name):
    """Whether ``name`` (a file name, surrogate-escaped where its bytes are not UTF-8) is UTF-8."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def valid_minion_id(minion_id):
    """
    Minion ids as Salt accepts them for key files (salt.utils.verify.valid_id),
    in UTF-8.
    """
    return (
        isinstance(minion_id, str)
        and bool(minion_id)
        and utf8(minion_id)
        and minion_id not in (".", "..")
        and not _ID_BAD.search(minion_id)
        and not minion_id.startswith(fsutil.TEMP_PREFIX)
    )


def looks_like_pem(data):
    return data.lstrip().startswith(b"-----BEGIN ") and b"-----END " in data
