"""
A change journal of directory trees, fed by Linux inotify: "which
directories changed since token T?".

A long-running process (the watcher engine) holds a :class:`Watcher` on some
trees and answers that question over a unix socket (:func:`journal.serve`,
:func:`journal.query`).  A sync that would stat every file of a tree then lists only
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
  the local filesystems of :data:`inotify.LOCAL_FS` are trusted).  Symlinked
  directories inside a tree are neither followed nor watched: a caller
  resolving one reads its target as outside every tree.

Not seen by inotify, hence not by the watcher: a file of a tree written
through a hard link in a directory outside the trees, and writes through a
shared memory mapping.  A tree top is checked (same inode at its path) at
every :meth:`Watcher.drain`, which catches an ancestor of it renamed or
replaced; but if its path leads to another directory and back between two
calls, what changed in that other directory meanwhile is not reported.

A :class:`Watcher` is not thread-safe: one thread (:func:`journal.serve`'s) uses it.
"""

import errno
import logging
import os
import secrets
import select
import stat

from salt_multimaster import inotify

log = logging.getLogger(__name__)

#: the keys of a reply to :meth:`Watcher.changes`
REPLY_KEYS = ("session", "seq", "trees", "unwatched", "changed", "error")

#: entry names remembered per changed directory; past that, its names are
#: not known (a caller lists the whole directory)
MAX_NAMES = 1000


def _ident(path):
    """``(st_dev, st_ino)`` of ``path`` if it is a directory (not a symlink), else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def _join(rel, name):
    """The relative path of entry ``name`` of the directory ``rel`` ("" for a tree's top)."""
    return f"{rel}/{name}" if rel else name


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
        self.trees = sorted({os.path.abspath(tree) for tree in trees})
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
        :class:`inotify.Unavailable` if inotify cannot be used at all.  A directory
        that cannot be watched does not raise: the watcher answers
        ``changed=None`` with the reason in ``error``.
        """
        try:
            fd = inotify.init()
        except OSError as exc:
            raise inotify.Unavailable(str(exc)) from None
        try:
            mounts_fd = os.open(inotify.MOUNTINFO, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            os.close(fd)
            raise inotify.Unavailable(f"cannot read the mount table: {exc}") from None
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
        table = inotify.read_mounts()
        if table is None:
            self._fail(f"cannot read the mount table ({inotify.MOUNTINFO})")
            return
        self._mount_sig = self._mount_signature(table)
        for tree in self.trees:
            self._watch_tree(tree, table)
            if self.error:
                return

    def _renew(self, quiet=False):
        """A fresh inotify instance at :meth:`fileno`'s number; False if it failed."""
        try:
            new = inotify.init()
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
        problem = inotify.fs_problem(table, os.path.realpath(tree))
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
            # replaced or removed while watched: tried again at the next drain;
            # never reported, the watches made meanwhile dropped by the next reset
            self._refused[tree] = None
            return
        self._watched[tree] = before

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
                wd = inotify.add_watch(self._fd, path, inotify.MASK)
            except OSError as exc:
                if exc.errno == errno.ENOSPC or _ident(path) is not None:
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
                if _ident(path) is not None:
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
        the call, and a steady stream of them cannot hold a reply back.  An
        unable watcher (``error``) reads and drops them (its watches could
        not all be dropped).
        """
        if self._fd is None:
            return
        budget = inotify.queued(self._fd)  # None: read until EAGAIN
        why = None if self.error else self._check_tops() or self._check_mounts()
        if why:
            self._reset(why)
            return
        while budget is None or budget > 0:
            try:
                data = os.read(self._fd, inotify.READ_SIZE)
            except BlockingIOError:
                return
            except OSError as exc:
                if not self.error:
                    self._fail(f"cannot read inotify events: {exc}")
                return
            if not data:
                return
            if budget is not None:
                budget -= len(data)
            why = None if self.error else self._process(data)
            if why:
                self._reset(why)
                return

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
        table = inotify.read_mounts()
        if table is None or self._mount_signature(table) != self._mount_sig:
            return "a filesystem was mounted or unmounted at or under a tree"
        return None

    def _mount_signature(self, table):
        return tuple((tree, tuple(inotify.mounts_of(table, os.path.realpath(tree))))
                     for tree in self.trees)

    def _process(self, data):
        """Process the events of one read; the reason for a reset, or None."""
        offset, size = 0, len(data)
        while offset + inotify.EVENT.size <= size:
            wd, mask, _cookie, length = inotify.EVENT.unpack_from(data, offset)
            start = offset + inotify.EVENT.size
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
        if mask & inotify.IN_Q_OVERFLOW:
            return "inotify queue overflow, events lost"
        entries = self._wds.get(wd)
        if entries is None:
            return None  # a watch dropped already
        if mask & inotify.IN_IGNORED:
            del self._wds[wd]
            if wd in self._deleted:
                self._deleted.discard(wd)
                return None
            return f"the kernel dropped the watch of {self._where(entries)}"
        if mask & inotify.IN_UNMOUNT:
            return f"the filesystem of {self._where(entries)} was unmounted"
        if mask & inotify.IN_MOVE_SELF:
            return f"{self._where(entries)} was moved"
        if mask & inotify.IN_DELETE_SELF:
            if any(rel == "" for _tree, rel in entries):
                return f"{self._where(entries)} was removed"
            # its parent's IN_DELETE records the parent; IN_IGNORED follows
            self._deleted.add(wd)
            return None
        if mask & inotify.IN_ISDIR and mask & (inotify.IN_MOVED_FROM | inotify.IN_MOVED_TO):
            return f"a directory was moved in or out of {self._where(entries)}"
        for tree, rel in sorted(entries):
            # "" for an event on the directory itself (its attributes)
            self._record(tree, rel, name)
        if mask & inotify.IN_ISDIR and mask & inotify.IN_CREATE and name:
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
