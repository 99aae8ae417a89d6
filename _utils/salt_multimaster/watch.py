"""
A change journal of directory trees, fed by Linux inotify: "which
directories changed since token T?".

A long-running process (the watcher engine) holds a :class:`Watcher` on some
trees and answers that question over a unix socket (:func:`serve`,
:func:`query`).  A sync that would stat every file of a tree then lists only
the directories named, and takes the others as it last saw them.

The answer is a token (``{"session": str, "seq": int}``) and, for each tree,
the directories (relative to the tree: ``""`` for its top, ``"a/b"`` under
it) in which an entry was created, removed, renamed, written or had its
attributes changed since the token the caller gave.  Guarantees:

* Completeness: every change to a watched directory whose syscall returned
  before :meth:`Watcher.changes` was called is in the reply.  The kernel
  queues an inotify event synchronously with the syscall, and
  :meth:`Watcher.drain` reads every event queued when it is called before
  the reply is made.
* Continuity: a change made after the reply is recorded with a ``seq``
  greater than the reply's, so a caller that keeps the reply's
  ``session``/``seq`` and asks with them next time sees it.  A directory
  created in a watched directory is watched (and recorded as changed) before
  the reply that reports it, whatever was put in it meanwhile.
* When in doubt, no answer: ``changed`` is None ("read everything") rather
  than a list that might be incomplete.  The watcher starts a new session
  (a *reset*: every older token answered None, the trees walked and watched
  anew) when the kernel's event queue overflowed, a directory was renamed
  (the paths of the watches under it are wrong), a tree's top was removed,
  replaced or appeared, the mounts at or under a tree changed, the kernel
  dropped a watch it was not asked to, or more than ``max_changes``
  directories were recorded.  It stops answering altogether (``error``) when
  a directory cannot be watched (``ENOSPC``: ``fs.inotify.max_user_watches``
  is too low).
* A tree that cannot be vouched for is listed in ``unwatched`` and left out
  of ``changed``: a tree that does not exist (yet), whose top is a symlink,
  or which is on (or has under it) a filesystem that may change behind this
  kernel's back (NFS, CIFS, FUSE, cluster filesystems, host shares: only
  the local filesystems of :data:`LOCAL_FS` are trusted).  Symlinked
  directories inside a tree are neither followed nor watched: a caller
  resolving one reads its target as outside every tree.

Not seen by inotify, hence not by the watcher: a file of a tree written
through a hard link in a directory outside the trees, and writes through a
shared memory mapping.  A tree top is checked (same inode at its path) at
every :meth:`Watcher.drain`, which catches an ancestor of it renamed or
replaced; but if its path leads to another directory and back between two
calls, what changed in that other directory meanwhile is not reported.

A :class:`Watcher` is not thread-safe: one thread (:func:`serve`'s) uses it.
"""

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import select
import socket
import stat
import struct
import sys
import termios
import time

from salt_multimaster import statefile

log = logging.getLogger(__name__)

# <sys/inotify.h>
IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_UNMOUNT = 0x00002000
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_EXCL_UNLINK = 0x04000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

#: the events watched on every directory
MASK = (IN_CREATE | IN_DELETE | IN_MODIFY | IN_CLOSE_WRITE | IN_ATTRIB | IN_MOVED_FROM
        | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR | IN_DONT_FOLLOW
        | IN_EXCL_UNLINK)

# struct inotify_event {int wd; uint32_t mask; uint32_t cookie; uint32_t len; char name[len];}
_EVENT = struct.Struct("iIII")
# one read: many events (a name is at most NAME_MAX + 1 bytes, padded)
_READ_SIZE = 256 * 1024

#: Filesystems every change of which is made through this kernel, and so
#: reported by inotify.  A tree on any other (nfs, cifs, fuse.*, ceph,
#: gfs2, ocfs2, 9p, virtiofs, ...) may change behind the watcher's back.
LOCAL_FS = frozenset((
    "ext2", "ext3", "ext4", "xfs", "btrfs", "bcachefs", "zfs", "f2fs", "jfs", "reiserfs",
    "nilfs2", "tmpfs", "ramfs", "overlay", "vfat", "msdos", "exfat", "ntfs3", "hfsplus",
    "squashfs", "erofs", "iso9660", "udf",
))

MOUNTINFO = "/proc/self/mountinfo"

#: a request to :func:`serve` is one line of at most this many bytes
MAX_REQUEST = 64 * 1024
#: a reply read by :func:`query` is at most this many bytes
MAX_REPLY = 256 * 1024 * 1024
#: seconds :func:`serve` gives a client to send its request
CLIENT_TIMEOUT = 2.0

#: the keys of a reply to :meth:`Watcher.changes`
REPLY_KEYS = ("session", "seq", "trees", "unwatched", "changed", "error")


class Unavailable(Exception):
    """inotify cannot be used (not Linux, init failed, ...)."""


_LIBC = None


def _libc():
    """libc with the inotify functions bound, or :class:`Unavailable`."""
    global _LIBC  # pylint: disable=global-statement
    if _LIBC is None:
        if not sys.platform.startswith("linux"):
            raise Unavailable(f"inotify needs Linux, not {sys.platform}")
        libc = None
        for name in (None, "libc.so.6"):
            try:
                candidate = ctypes.CDLL(name, use_errno=True)
                candidate.inotify_init1  # pylint: disable=pointless-statement
                candidate.inotify_add_watch  # pylint: disable=pointless-statement
            except (OSError, AttributeError):
                continue
            libc = candidate
            break
        if libc is None:
            raise Unavailable("no inotify functions in libc")
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_init1.restype = ctypes.c_int
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        libc.inotify_add_watch.restype = ctypes.c_int
        _LIBC = libc
    return _LIBC


def _inotify_init():
    """A new non-blocking, close-on-exec inotify fd (``OSError`` on failure)."""
    fd = _libc().inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"inotify_init1: {os.strerror(err)}")
    return fd


def _add_watch(fd, path, mask):
    """``inotify_add_watch(2)``: the watch descriptor of ``path``, or ``OSError``."""
    wd = _libc().inotify_add_watch(fd, os.fsencode(path), mask)
    if wd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"inotify_add_watch: {os.strerror(err)}", path)
    return wd


def _queued(fd):
    """How many bytes of events ``fd`` holds (``FIONREAD``), or None if it cannot tell."""
    buf = bytearray(4)
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf, True)
    except OSError:
        return None
    return struct.unpack("i", buf)[0]


def _ident(path):
    """``(st_dev, st_ino)`` of ``path`` if it is a directory (not a symlink), else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def _is_dir(path):
    return _ident(path) is not None


def _join(rel, name):
    """The relative path of entry ``name`` of the directory ``rel`` ("" for a tree's top)."""
    return f"{rel}/{name}" if rel else name


def _under(path, top):
    """Whether ``path`` is ``top`` or under it (both absolute and normalised)."""
    return path == top or path.startswith(top.rstrip("/") + "/")


_OCTAL = re.compile(rb"\\([0-7]{3})")


def _read_mounts(path=MOUNTINFO):
    """
    ``[(mount_id, mount_point, fstype)]`` of this process' mount namespace,
    in the kernel's order, or None if it cannot be read.
    """
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    table = []
    for line in data.splitlines():
        # 36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue
        fields = line.split(b" ")
        try:
            sep = fields.index(b"-", 6)
            point = _OCTAL.sub(lambda m: bytes([int(m.group(1), 8)]), fields[4])
            table.append((int(fields[0]), os.fsdecode(point), os.fsdecode(fields[sep + 1])))
        except (ValueError, IndexError):
            return None  # a format this code does not know: cannot tell
    return table


def _mounts_of(table, real):
    """The entries of ``table`` for the mount holding ``real`` and every mount under it."""
    holding = None
    for entry in table:
        # the last of the mounts stacked on one point is the one seen
        if _under(real, entry[1]) and (holding is None or len(entry[1]) >= len(holding[1])):
            holding = entry
    under = [e for e in table if e[1] != real and _under(e[1], real)]
    return ([holding] if holding is not None else []) + under


def _fs_problem(table, real):
    """Why the tree at ``real`` (a real path) cannot be vouched for, or None."""
    mounts = _mounts_of(table, real)
    if not mounts:
        return "its filesystem is unknown"
    for _mid, point, fstype in mounts:
        if fstype not in LOCAL_FS:
            return (f"{point} is a {fstype} filesystem: it may change without this host's "
                    f"kernel seeing it")
    return None


class Watcher:
    """
    The change journal of ``trees`` (absolute directory paths, each watched
    recursively; symlinked directories under them are neither followed nor
    watched).  Paths are normalised with ``os.path.abspath``, duplicates
    dropped.  A tree that does not exist yet is allowed: it is unwatched
    until it appears (checked at every :meth:`drain`).  More than
    ``max_changes`` directories recorded as changed: reset.

    Attributes: ``trees`` (sorted), ``session`` (a random token, new at
    :meth:`start` and at every reset), ``seq`` (+1 per recorded change),
    ``error`` (None, or why the watcher no longer answers).
    """

    def __init__(self, trees, max_changes=100000):
        if isinstance(trees, (str, bytes, os.PathLike)):
            trees = [trees]
        paths = set()
        for tree in trees:
            tree = os.fsdecode(os.fspath(tree))
            if not tree:
                raise ValueError("empty tree path")
            paths.add(os.path.abspath(tree))
        if isinstance(max_changes, bool) or not isinstance(max_changes, int) or max_changes < 1:
            raise ValueError(f"invalid max_changes: {max_changes!r}")
        self.trees = sorted(paths)
        self.max_changes = max_changes
        self.session = None
        self.seq = 0
        self.error = None
        self._fd = None
        self._mounts_fd = None
        self._poller = None
        self._mount_sig = None
        self._why = None
        self._warned = set()
        self._clear()

    def _clear(self):
        #: {tree: {rel_dir: seq of its last change}}
        self._changed = {tree: {} for tree in self.trees}
        #: {tree: {rel_dir: {entry name: seq of its last change}}}, and the seq
        #: after which they are all known ({tree: {rel_dir: seq}}: a directory
        #: whose names were dropped, more than MAX_NAMES, or new)
        self._names = {tree: {} for tree in self.trees}
        self._names_from = {tree: {} for tree in self.trees}
        self._count = 0
        #: {wd: {(tree, rel_dir)}}: one directory may be in two trees
        self._wds = {}
        #: wds whose directory was removed (IN_DELETE_SELF): their IN_IGNORED is expected
        self._deleted = set()
        #: {tree: (st_dev, st_ino) of its top} of the trees watched
        self._watched = {}
        #: {tree: the top's identity when it was last found unusable (None: missing)}
        self._refused = {}

    def fileno(self):
        """
        The inotify fd, for ``select()``: readable when events are queued
        (then call :meth:`drain`).  The same number from :meth:`start` to
        :meth:`close`, resets included; None outside them.
        """
        return self._fd

    def start(self):
        """
        Create the inotify fd and watch every tree; a new session.
        :class:`Unavailable` if inotify cannot be used at all.  A directory
        that cannot be watched does not raise: the watcher answers
        ``changed=None`` with the reason in ``error``.  No-op if started.
        """
        if self._fd is not None:
            return
        _libc()
        try:
            fd = _inotify_init()
        except OSError as exc:
            raise Unavailable(str(exc)) from None
        try:
            mounts_fd = os.open(MOUNTINFO, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            os.close(fd)
            raise Unavailable(f"cannot read the mount table: {exc}") from None
        self._fd, self._mounts_fd = fd, mounts_fd
        # the kernel flags this file (POLLPRI) when a filesystem is mounted
        # or unmounted in this namespace
        self._poller = select.poll()
        self._poller.register(mounts_fd, select.POLLPRI)
        self.error = None
        self._reset("started", renew=False)

    def close(self):
        """Drop every watch and close the fds; :meth:`changes` then answers None."""
        for fd in (self._fd, self._mounts_fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._mounts_fd = self._poller = None
        self._clear()

    # -- resets ------------------------------------------------------------

    def _reset(self, why, renew=True):
        """
        A new session: every recorded change forgotten, every tree walked
        and watched anew.  ``renew``: replace the inotify instance by a new
        one at the same fd number, which drops every old watch and every
        event still queued at once (the changes they tell of are before the
        new session, whose first token is given after the walk).
        """
        if why != "started":
            why = f"was reset: {why}"
            log.info("multimaster: change journal %s; older tokens answered 'cannot tell'", why)
        self.session = secrets.token_hex(8)
        self.seq = 0
        self._why = why
        self._clear()
        if renew and not self._renew():
            return
        table = _read_mounts()
        if table is None:
            self._fail(f"cannot read the mount table ({MOUNTINFO})")
            return
        self._mount_sig = self._mount_signature(table)
        for tree in self.trees:
            self._watch_tree(tree, table)
            if self.error:
                return

    def _renew(self, quiet=False):
        """A fresh inotify instance at :meth:`fileno`'s number; False if it failed."""
        try:
            new = _inotify_init()
            try:
                os.dup2(new, self._fd, inheritable=False)
            finally:
                os.close(new)
        except OSError as exc:
            if not quiet:
                self._fail(str(exc))
            return False
        return True

    def _fail(self, why):
        """No more answers: ``error`` set, every watch dropped."""
        log.warning("multimaster: change journal disabled, every sync reads every "
                    "directory: %s", why)
        self.error = why
        self._clear()
        self._renew(quiet=True)  # give the watches back to the user's budget

    # -- walking -----------------------------------------------------------

    def _watch_tree(self, tree, table):
        """Watch ``tree`` (a reset's walk, nothing recorded), or leave it unwatched."""
        before = _ident(tree)
        if before is None:
            if os.path.islink(tree) and tree not in self._warned:
                self._warned.add(tree)
                log.warning("multimaster: %s is a symlink: not watched (name its target)", tree)
            self._refused[tree] = None
            return
        problem = _fs_problem(table, os.path.realpath(tree))
        if problem:
            if tree not in self._warned:
                self._warned.add(tree)
                log.warning("multimaster: %s not watched: %s", tree, problem)
            self._refused[tree] = before
            return
        watched = self._walk(tree, "", tree, record=False)
        if self.error:
            return
        if not watched or _ident(tree) != before:
            # replaced or removed while watched: tried again at the next drain
            self._forget(tree)
            self._refused[tree] = None
            return
        self._watched[tree] = before

    def _forget(self, tree):
        for wd in list(self._wds):
            entries = {e for e in self._wds[wd] if e[0] != tree}
            if entries:
                self._wds[wd] = entries
            else:
                del self._wds[wd]

    def _walk(self, tree, rel, path, record):
        """
        Watch the directory ``path`` (``rel`` in ``tree``) and every
        directory under it, each before it is listed: a subdirectory made
        after the listing is reported by the watch.  ``record``: record
        each as changed once watched (a directory new in a watched tree).
        True if ``path`` itself was watched; an error makes the watcher
        unable (``error``).
        """
        stack = [(rel, path)]
        first = True
        watched = False
        while stack:
            rel, path = stack.pop()
            top, first = first, False
            try:
                wd = _add_watch(self._fd, path, MASK)
            except OSError as exc:
                if exc.errno == errno.ENOSPC or _is_dir(path):
                    self._fail(f"cannot watch {path}: {exc.strerror}"
                               + (" (raise fs.inotify.max_user_watches)"
                                  if exc.errno == errno.ENOSPC else ""))
                    return False
                continue  # gone, or not a directory now: its parent's watch tells
            watched = watched or top
            entries = self._wds.setdefault(wd, set())
            known = (tree, rel) in entries
            entries.add((tree, rel))
            if record:
                self._record(tree, rel)
            if known:
                # watched here already, so listed once its watch was on:
                # whatever was made in it since is in the queue
                continue
            try:
                with os.scandir(path) as found:
                    subdirs = [e.name for e in found if e.is_dir(follow_symlinks=False)]
            except OSError as exc:
                if _is_dir(path):
                    self._fail(f"cannot list {path}: {exc.strerror}")
                    return False
                continue
            for name in sorted(subdirs, reverse=True):
                stack.append((_join(rel, name), os.path.join(path, name)))
        return watched

    def _record(self, tree, rel, name=None):
        """
        ``rel`` in ``tree`` changed: its entry ``name``, or (None) entries
        not known by name, as in a directory new to the watcher.
        """
        changed = self._changed[tree]
        if rel not in changed:
            self._count += 1
        self.seq += 1
        changed[rel] = self.seq
        names = self._names[tree].setdefault(rel, {})
        if name is None or len(names) >= MAX_NAMES:
            # names known only from here on
            self._count -= len(names)
            names.clear()
            self._names_from[tree][rel] = self.seq
        else:
            if name not in names:
                self._count += 1
            names[name] = self.seq

    # -- events ------------------------------------------------------------

    def drain(self):
        """
        Read and process every event queued when called (non-blocking),
        after checking the tree tops (reset if one was removed, replaced or
        appeared) and the mounts (reset if one at or under a tree changed).
        Events queued meanwhile are left for the next call: they are after
        the call, and a steady stream of them cannot hold a reply back.
        """
        if self._fd is None:
            return
        budget = _queued(self._fd)  # None: read until EAGAIN
        if self.error:
            self._discard(budget)
            return
        why = self._check_tops() or self._check_mounts()
        if why:
            self._reset(why)
            return
        while budget is None or budget > 0:
            try:
                data = os.read(self._fd, _READ_SIZE)
            except BlockingIOError:
                return
            except OSError as exc:
                self._fail(f"cannot read inotify events: {exc}")
                return
            if not data:
                return
            if budget is not None:
                budget -= len(data)
            why = self._process(data)
            if why:
                self._reset(why)
                return
            if self.error:
                return

    def _discard(self, budget):
        """Read and drop queued events (an unable watcher whose watches could not be dropped)."""
        while budget is None or budget > 0:
            try:
                data = os.read(self._fd, _READ_SIZE)
            except OSError:
                return
            if not data:
                return
            if budget is not None:
                budget -= len(data)

    def _check_tops(self):
        """Why a reset is due from the tree tops (removed, replaced, appeared), or None."""
        for tree in self.trees:
            ident = _ident(tree)
            if tree in self._watched:
                if ident != self._watched[tree]:
                    return f"{tree} removed or replaced"
            elif ident is not None and ident != self._refused.get(tree):
                return f"{tree} appeared"
        return None

    def _check_mounts(self):
        """Why a reset is due from the mount table (a mount at or under a tree), or None."""
        try:
            ready = self._poller.poll(0)
        except OSError as exc:
            return f"cannot poll the mount table: {exc}"
        if not ready:
            return None
        table = _read_mounts()
        if table is None or self._mount_signature(table) != self._mount_sig:
            return "a filesystem was mounted or unmounted at or under a tree"
        return None

    def _mount_signature(self, table):
        return tuple((tree, tuple(_mounts_of(table, os.path.realpath(tree))))
                     for tree in self.trees)

    def _process(self, data):
        """Process the events of one read; the reason for a reset, or None."""
        offset, size = 0, len(data)
        while offset + _EVENT.size <= size:
            wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
            start = offset + _EVENT.size
            name = data[start:start + length].split(b"\0", 1)[0]
            offset = start + length
            why = self._event(wd, mask, os.fsdecode(name))
            if why:
                return why
            if self.error:
                return None
            if self._count > self.max_changes:
                return f"more than {self.max_changes} changed directories recorded"
        return None

    def _event(self, wd, mask, name):
        """Process one event; the reason for a reset, or None."""
        if mask & IN_Q_OVERFLOW:
            return "inotify queue overflow, events lost"
        entries = self._wds.get(wd)
        if entries is None:
            return None  # a watch dropped already
        if mask & IN_IGNORED:
            del self._wds[wd]
            if wd in self._deleted:
                self._deleted.discard(wd)
                return None
            return f"the kernel dropped the watch of {self._where(entries)}"
        if mask & IN_UNMOUNT:
            return f"the filesystem of {self._where(entries)} was unmounted"
        if mask & IN_MOVE_SELF:
            return f"{self._where(entries)} was moved"
        if mask & IN_DELETE_SELF:
            if any(rel == "" for _tree, rel in entries):
                return f"{self._where(entries)} was removed"
            # its parent's IN_DELETE records the parent; IN_IGNORED follows
            self._deleted.add(wd)
            return None
        if mask & IN_ISDIR and mask & (IN_MOVED_FROM | IN_MOVED_TO):
            return f"a directory was moved in or out of {self._where(entries)}"
        for tree, rel in sorted(entries):
            # "" for an event on the directory itself (its attributes)
            self._record(tree, rel, name)
        if mask & IN_ISDIR and mask & IN_CREATE and name:
            for tree, rel in sorted(entries):
                self._walk(tree, _join(rel, name), os.path.join(self._path(tree, rel), name),
                           record=True)
                if self.error:
                    return None
        return None

    def _where(self, entries):
        return ", ".join(sorted(self._path(tree, rel) for tree, rel in entries))

    @staticmethod
    def _path(tree, rel):
        return os.path.join(tree, rel) if rel else tree

    # -- answers -----------------------------------------------------------

    def changes(self, since):
        """
        Which directories changed since the token ``since`` (None, or
        ``{"session": str, "seq": int}`` from an earlier reply); calls
        :meth:`drain` first.  A JSON-serialisable dict::

            {"session": <current session>, "seq": <current seq>,
             "trees": [<tree paths, sorted>],
             "unwatched": [<trees not vouched for now, sorted>],
             "changed": None or {tree: sorted [rel_dir changed after since]},
             "names": None or {tree: {rel_dir: sorted [entry names] or None}},
             "error": None or <why changed is None>}

        ``changed`` is None ("read everything") when ``since`` is None,
        malformed, of another session or ahead of ``seq``, or when the
        watcher is unable or not started.  Trees in ``unwatched`` are never
        in ``changed``.  Keep the reply's ``session``/``seq`` as the next
        ``since``.
        """
        self.drain()
        reply = {"session": self.session, "seq": self.seq, "trees": list(self.trees),
                 "unwatched": [t for t in self.trees if t not in self._watched],
                 "changed": None, "names": None, "error": None}
        if self._fd is None:
            reply["error"] = "the watcher is not running"
        elif self.error:
            reply["error"] = self.error
        else:
            reply["error"] = self._refuse(since)
        if reply["error"] is None:
            after = since["seq"]
            reply["changed"] = {
                tree: sorted(rel for rel, seq in self._changed[tree].items() if seq > after)
                for tree in self.trees if tree in self._watched
            }
            reply["names"] = {tree: {rel: self._names_since(tree, rel, after) for rel in rels}
                              for tree, rels in reply["changed"].items()}
        return reply

    def _names_since(self, tree, rel, after):
        """The entries of ``rel`` changed after seq ``after``, sorted; None if not all known."""
        if self._names_from[tree].get(rel, 0) > after:
            return None
        return sorted(name for name, seq in self._names[tree].get(rel, {}).items() if seq > after)

    def _refuse(self, since):
        """Why ``since`` cannot be answered, or None."""
        if since is None:
            return "no token given"
        if not isinstance(since, dict) or not isinstance(since.get("session"), str):
            return f"malformed token: {since!r:.200}"
        seq = since.get("seq")
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            return f"malformed token: {since!r:.200}"
        if since["session"] != self.session:
            return f"token of another session; this one {self._why}"
        if seq > self.seq:
            return f"token ahead of the watcher (seq {seq} > {self.seq})"
        return None


# -- the socket --------------------------------------------------------------


def _listen(sock_path):
    """
    A listening unix socket at ``sock_path``, mode 0600 whatever the umask
    (chmod before ``listen``: nobody connects in between); a stale socket
    there is removed first, anything else there (a damaged state file) is
    moved aside (``statefile.aside``: kept, never removed).  Returns the
    socket and the ``(st_dev, st_ino)`` of its file.
    """
    try:
        st = os.lstat(sock_path)
    except FileNotFoundError:
        pass
    else:
        if stat.S_ISSOCK(st.st_mode):
            os.unlink(sock_path)
        else:
            statefile.aside(sock_path, "not a socket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _short(sock_path) as short:
            sock.bind(short)
        os.chmod(sock_path, 0o600)
        st = os.lstat(sock_path)
        sock.listen(16)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock, (st.st_dev, st.st_ino)


#: entry names remembered per changed directory; past that, its names are
#: not known (a caller lists the whole directory)
MAX_NAMES = 1000

#: a unix socket's path is at most 107 bytes (sun_path)
_SUN_PATH_MAX = 107


@contextlib.contextmanager
def _short(sock_path):
    """
    ``sock_path``, or when it is too long for a unix socket the same file
    reached through this process's descriptor of its directory
    (``/proc/self/fd/N/name``, Linux), valid while in the block.
    """
    if len(os.fsencode(sock_path)) <= _SUN_PATH_MAX:
        yield sock_path
        return
    fd = os.open(os.path.dirname(sock_path) or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{os.path.basename(sock_path)}"
    finally:
        os.close(fd)


def _read_line(conn, limit, deadline):
    """
    One line (without its newline) read from ``conn`` by ``deadline``, or
    what came before EOF; ValueError if longer than ``limit`` bytes.
    """
    data = bytearray()
    scanned = 0
    while True:
        end = data.find(b"\n", scanned)
        if end >= 0 or len(data) > limit:
            line = bytes(data[:end]) if end >= 0 else data
            if len(line) > limit:
                raise ValueError(f"line longer than {limit} bytes")
            return bytes(line)
        scanned = len(data)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise socket.timeout("timed out")
        conn.settimeout(remaining)
        chunk = conn.recv(min(1024 * 1024, limit + 1))
        if not chunk:
            return bytes(data)  # EOF: the line is what came
        data += chunk


def _parse_request(line):
    """The ``since`` of a request line, or ValueError."""
    try:
        request = json.loads(line.decode("utf-8"))
    except RecursionError:
        raise ValueError("nested too deep") from None
    if not isinstance(request, dict) or "since" not in request:
        raise ValueError('a request is {"since": <token or null>}')
    return request["since"]


def _answer(watcher, conn):
    """Read one request from ``conn``, write one reply line."""
    deadline = time.monotonic() + CLIENT_TIMEOUT
    try:
        line = _read_line(conn, MAX_REQUEST, deadline)
    except (OSError, ValueError) as exc:  # socket.timeout is an OSError
        log.debug("multimaster: change journal client: %s", exc)
        if not isinstance(exc, ValueError):
            return
        reply = {"error": f"bad request: {exc}", "changed": None}
    else:
        try:
            since = _parse_request(line)
        except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError too
            log.debug("multimaster: change journal client: bad request: %s", exc)
            reply = {"error": f"bad request: {exc}", "changed": None}
        else:
            reply = watcher.changes(since)
    try:
        conn.settimeout(max(0.1, deadline - time.monotonic()))
        conn.sendall(json.dumps(reply, separators=(",", ":")).encode("ascii") + b"\n")
    except OSError as exc:
        log.debug("multimaster: change journal client: reply not sent: %s", exc)


def serve(watcher, sock_path, stop=None, poll=1.0, tick=None):
    """
    Answer :func:`query` on the unix socket ``sock_path`` (its directory
    must exist; mode 0600) with ``watcher.changes(since)``, and drain the
    watcher whenever it has events, until ``stop`` (an object with
    ``is_set()``, such as a ``threading.Event``) is set; checked every
    ``poll`` seconds.  ``tick()`` (:meth:`trigger.Trigger.tick`), when
    given, is called after each batch of events and when the seconds it
    last returned have passed.  One client at a time: one request line
    (``{"since": <token or null>}``, at most :data:`MAX_REQUEST` bytes, sent
    within :data:`CLIENT_TIMEOUT` seconds), one reply line, closed.  A
    malformed request is answered ``{"error": ..., "changed": null}``; a
    client that fails is logged (debug) and forgotten.  On exit the socket
    file is removed, if it is still this server's.
    """
    sock, ident = _listen(sock_path)
    due = None  # when tick() asked to be called again (monotonic)
    if tick is not None:
        tick()  # from now on: what changes is seen
    try:
        while stop is None or not stop.is_set():
            fd = watcher.fileno()
            readers = [sock] if fd is None else [sock, fd]
            wait = poll if due is None else max(0.0, min(poll, due - time.monotonic()))
            ready = select.select(readers, [], [], wait)[0]
            if fd is not None and fd in ready:
                watcher.drain()
            if tick is not None and ((fd is not None and fd in ready)
                                     or (due is not None and time.monotonic() >= due)):
                later = tick()
                due = None if later is None else time.monotonic() + later
            if sock in ready:
                try:
                    conn = sock.accept()[0]
                except OSError as exc:  # the client went away already
                    log.debug("multimaster: change journal: accept: %s", exc)
                    continue
                with conn:
                    _answer(watcher, conn)
    finally:
        sock.close()
        try:
            st = os.lstat(sock_path)
            if (st.st_dev, st.st_ino) == ident:
                os.unlink(sock_path)
        except OSError:
            pass


def query(sock_path, since, timeout=2.0):
    """
    Ask the watcher serving ``sock_path`` which directories changed since
    ``since`` (see :meth:`Watcher.changes`): its reply, or None on any
    error (no socket, refused, ``timeout`` seconds passed, a malformed
    reply).  Never raises.  Check ``reply["trees"]`` against the trees
    meant: the watcher vouches for those only.
    """
    deadline = time.monotonic() + timeout
    try:
        request = json.dumps({"since": since}, separators=(",", ":")).encode("ascii") + b"\n"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout)
            with _short(sock_path) as short:
                conn.connect(short)
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            conn.sendall(request)
            line = _read_line(conn, MAX_REPLY, deadline)
        reply = json.loads(line.decode("utf-8"))
    except (OSError, ValueError, TypeError) as exc:
        log.debug("multimaster: change journal at %s not asked: %s", sock_path, exc)
        return None
    if not _valid_reply(reply):
        log.debug("multimaster: change journal at %s: malformed reply", sock_path)
        return None
    return reply


def _valid_reply(reply):
    if not isinstance(reply, dict) or any(key not in reply for key in REPLY_KEYS):
        return False
    seq = reply["seq"]
    return (isinstance(reply["session"], (str, type(None)))
            and isinstance(seq, int) and not isinstance(seq, bool)
            and isinstance(reply["trees"], list) and isinstance(reply["unwatched"], list)
            and isinstance(reply["changed"], (dict, type(None)))
            and isinstance(reply.get("names"), (dict, type(None)))
            and isinstance(reply["error"], (str, type(None))))


# ---------------------------------------------------------------------------
# Where a master's watcher is, and what it watches
# ---------------------------------------------------------------------------
#: the watcher's socket, in a master's state dir (layout.state_dir: 0700)
SOCKET_NAME = "watch.sock"


def supported():
    """``(True, None)`` where inotify can be used, else ``(False, reason)``."""
    if not sys.platform.startswith("linux"):
        return False, "inotify is Linux only"
    try:
        _libc()
    except Unavailable as exc:
        return False, str(exc)
    return True, None


#: the engine's ``poll`` (seconds between checks for a stop), and its bounds
POLL = 1.0
POLL_MAX = 60.0


def check_poll(poll):
    """``poll`` as a float: seconds in (0, :data:`POLL_MAX`]; ``ValueError`` naming it otherwise."""
    if isinstance(poll, bool) or not isinstance(poll, (int, float)) or not 0 < poll <= POLL_MAX:
        raise ValueError(f"multimaster_watch: poll must be seconds in (0, {POLL_MAX:g}], "
                         f"not {poll!r:.50}")
    return float(poll)


def socket_path(state_dir):
    """The watcher's socket in a master's state dir."""
    return os.path.join(state_dir, SOCKET_NAME)


def master_trees(opts):
    """
    The real paths of every ``file_roots`` and ``pillar_roots`` root and of
    the ``pki_dir`` of a master's ``opts``, sorted, each once: what its
    watcher watches (a sync checks each against the watcher's reply).
    """
    trees = {os.path.realpath(opts["pki_dir"])} if opts.get("pki_dir") else set()
    for cat in ("file_roots", "pillar_roots"):
        for roots in (opts.get(cat) or {}).values():
            for root in roots or ():
                if isinstance(root, str) and root:
                    trees.add(os.path.realpath(root))
    return sorted(trees)


def client(state_dir, timeout=CLIENT_TIMEOUT):
    """
    ``since -> reply or None``: :func:`query` of the watcher of the master
    whose state dir is ``state_dir`` (None at once when no watcher runs).
    """
    path = socket_path(state_dir)

    def ask(since):
        if not os.path.exists(path):
            return None
        return query(path, since, timeout=timeout)

    return ask


#: the engine's name in a master's ``engines`` option
ENGINE = "multimaster_watch"


def _engine_name(entry):
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and len(entry) == 1:
        return next(iter(entry))
    return None


def engines_config(main, dropins):
    """
    The ``engines`` option a master.d drop-in must hold so that the master
    runs the engines it runs now plus :data:`ENGINE`; None when it runs it
    already (the drop-in then sets no ``engines``).  Salt merges the
    ``engines`` lists of the master.d files and lets them replace the master
    file's: a drop-in listing only this engine would stop the others.
    ``main``: the master file's ``engines`` (None: none); ``dropins``: the
    ``engines`` of every other master.d file.  ``ValueError`` naming the
    option when one is not a list.
    """
    lists = []
    for where, value in [("the master file", main)] + [
            (f"master.d drop-in #{i + 1}", v) for i, v in enumerate(dropins)]:
        if value is None:
            lists.append([])
        elif isinstance(value, list):
            lists.append(value)
        else:
            raise ValueError(f"engines in {where} is not a list: {value!r:.100}")
    others = [e for value in lists[1:] for e in value]
    running = others if others else lists[0]
    if ENGINE in {_engine_name(e) for e in running}:
        return None
    # the drop-ins' lists are merged with this one: only the master file's
    # must be repeated
    return ([] if others else list(lists[0])) + [{ENGINE: {}}]
