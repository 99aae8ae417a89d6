"""
Safe file operations: atomic writes, backups, path confinement.

Every write goes to a temporary file in the destination directory, is fsynced
and renamed over the destination, so a reader (or a crash) never sees a half
written file.
"""

import errno
import fcntl
import logging
import os
import secrets
import shutil
import stat
import tempfile

log = logging.getLogger(__name__)

KEY_DIR_MODE = 0o700
# Temporary files and staging directories of a sync: never replicated, and
# never read as keys (Salt skips dotfiles in key directories).
STAGE_PREFIX = ".mm-stage-"
TEMP_PREFIX = ".mm-"
PRIVATE_KEY_MODE = 0o400


class PathError(ValueError):
    """A relative path that would leave its root."""


# Never written on a peer: setuid, setgid, sticky, and write for others.
DROPPED_BITS = stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX | stat.S_IWOTH
_BIT_NAMES = ((stat.S_ISUID, "setuid"), (stat.S_ISGID, "setgid"), (stat.S_ISVTX, "sticky"),
              (stat.S_IWOTH, "world-writable"))


def check_mode(mode):
    """``mode`` if it is a file mode (an int in 0..0o7777), else ``ValueError`` naming it."""
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise ValueError(f"invalid file mode: {mode!r}")
    return mode


def safe_mode(mode):
    """
    ``mode`` without the bits a sync never writes (:data:`DROPPED_BITS`):
    no setuid, setgid or sticky bit, no write for others; the rest kept.
    """
    return check_mode(mode) & ~DROPPED_BITS


def dropped_bits(mode):
    """The names of the bits :func:`safe_mode` takes out of ``mode`` (``[]``: none)."""
    return [name for bit, name in _BIT_NAMES if check_mode(mode) & bit]


def confine(root, path, realpath=os.path.realpath):
    """
    ``path`` if its parent directory resolves (symlinks followed) inside
    ``root``, else :class:`PathError`.  The file itself may be a symlink: a
    write renames over it and a removal unlinks it, neither follows it.
    """
    real_root = realpath(root).rstrip(os.sep)
    real_parent = realpath(os.path.dirname(path))
    if real_parent.rstrip(os.sep) != real_root and not real_parent.startswith(real_root + os.sep):
        raise PathError(f"{path}: its directory resolves to {real_parent}, outside {root}")
    return path


def rel_parts(rel):
    """
    The components of a relative path, or :class:`PathError` for an absolute
    path, a ``..``, ``.`` or empty component, or a NUL.
    """
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or "\x00" in rel:
        raise PathError(f"invalid relative path: {rel!r}")
    parts = rel.replace("\\", "/").split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise PathError(f"invalid relative path: {rel!r}")
    return parts


def safe_join(root, rel, realpath=os.path.realpath):
    """
    Join ``rel`` under ``root``, refusing absolute paths, ``..`` components
    and symlinked parents that lead outside ``root``.  ``realpath``: a
    memoized ``os.path.realpath`` when joining many paths at once.
    """
    path = os.path.join(root, *rel_parts(rel))
    try:
        confine(root, path, realpath=realpath)
    except PathError:
        raise PathError(f"path leaves its root through a symlink: {rel!r}") from None
    return path


def makedirs(path, mode=0o755):
    """``os.makedirs`` that tolerates an existing directory."""
    os.makedirs(path, mode=mode, exist_ok=True)


def atomic_write(path, data, mode=0o644, durable=True):
    """
    Write ``data`` (bytes or str) to ``path`` atomically with ``mode``.

    A symlink at ``path`` is replaced by a regular file, never followed.
    ``durable=False``, for a cache whose reader takes a missing, empty or
    malformed file for no cache and checks what it reads against the disk:
    still atomic for readers, without the two disk flushes (after a crash
    the file may be the old one, or empty).
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=TEMP_PREFIX, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.rename(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise
    if durable:
        _fsync_dir(directory)


#: a batch of up to this many files flushes each; a larger one syncs once
FSYNC_EACH_MAX = 64


class Batch:
    """
    Many atomic writes and removals, made durable with one ``sync`` (up to
    :data:`FSYNC_EACH_MAX` files, one ``fsync`` each instead: a ``sync``
    flushes every filesystem of the host, whatever else is writing there).

    ``write`` puts the content in a staging directory of this batch in
    ``stage_root`` (a directory outside every served tree, such as
    ``<master cachedir>/multimaster/stage``): ``.mm-stage-<random>``, with
    one small subdirectory per destination directory (creating thousands of
    files in a directory that already holds thousands, such as a pki_dir
    with 20,000 keys, costs ext4 ten times more than creating them in a
    small one and renaming them in); ``commit`` flushes every staged file to
    disk at once, then renames each over its destination, then removes,
    then fsyncs the directories touched.  A reader never sees a half-written
    file, and a crash before the renames leaves every destination as it
    was.  Per-file fsync costs a disk flush per file; a sync of 20,000 keys
    would spend minutes on it.

    A batch killed before its commit leaves nothing where Salt serves or
    reads keys, and :func:`clean_stages` removes what it left at the next
    batch.  The batch holds an exclusive ``flock`` on ``<its dir>.lock``
    while it lives: the kernel drops it when the process dies, which is how
    a stale batch is told from a live one.  A destination on another
    filesystem (a rename cannot cross filesystems) is staged in a
    ``.mm-stage-*`` directory beside it, named in the batch's journal
    (``beside``) so that a cleanup removes it too.
    """

    def __init__(self, stage_root):
        self.staged = []
        self.removals = []
        self.stages = {}
        self.stage_root = stage_root
        self.home = None
        self._lock_fd = None
        self._root_dev = None

    def _home(self):
        """This batch's directory in ``stage_root``, created and locked on first use."""
        if self.home is None:
            makedirs(self.stage_root, mode=KEY_DIR_MODE)
            while True:
                home = os.path.join(self.stage_root, STAGE_PREFIX + secrets.token_hex(8))
                fd = os.open(home + ".lock", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                             0o600)
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    same = os.fstat(fd).st_ino == os.stat(home + ".lock").st_ino
                except FileNotFoundError:
                    same = False  # taken for stale and removed by a cleanup: again
                if same:
                    break
                os.close(fd)
            os.mkdir(home, 0o700)
            self.home, self._lock_fd = home, fd
            self._root_dev = os.stat(home).st_dev
        return self.home

    def _stage_dir(self, directory):
        stage = self.stages.get(directory)
        if stage is None:
            if self._same_fs(directory):
                stage = os.path.join(self._home(), str(len(self.stages)))
                os.mkdir(stage, 0o700)
            else:
                stage = tempfile.mkdtemp(dir=directory, prefix=STAGE_PREFIX)
                # named in this batch's journal: removed with it if it dies
                with open(os.path.join(self._home(), BESIDE_JOURNAL), "a",
                          encoding="utf-8") as fh:
                    fh.write(stage + "\n")
            self.stages[directory] = stage
        return stage

    def _same_fs(self, directory):
        self._home()
        try:
            return os.stat(directory).st_dev == self._root_dev
        except OSError:
            return False

    def write(self, path, data, mode=0o644):
        if isinstance(data, str):
            data = data.encode("utf-8")
        tmp = os.path.join(self._stage_dir(os.path.dirname(path) or "."), str(len(self.staged)))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            # plain os.write: no buffered file object per file (tens of
            # thousands of small keys in a sync); never a setuid/setgid,
            # sticky or world-writable file, whatever mode was asked
            os.fchmod(fd, safe_mode(mode))
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        os.close(fd)
        self.staged.append((tmp, path))

    def remove(self, path):
        self.removals.append(path)

    def commit(self):
        dirs = set()
        done = 0
        try:
            if len(self.staged) > FSYNC_EACH_MAX:
                os.sync()
            else:
                for tmp, _ in self.staged:
                    _fsync_path(tmp)
            for tmp, path in self.staged:
                try:
                    os.rename(tmp, path)
                except OSError as exc:
                    if exc.errno != errno.EXDEV:
                        raise
                    # same filesystem, another mount (a bind mount): copy
                    with open(tmp, "rb") as fh:
                        atomic_write(path, fh.read(), mode=stat.S_IMODE(os.stat(tmp).st_mode))
                    _unlink(tmp)
                done += 1
                dirs.add(os.path.dirname(path))
            # right after the renames: a key moved from minions_pre to
            # minions is in both for as short a time as possible (never in
            # neither, which a retrying minion's auth would answer by
            # writing it to minions_pre again)
            for path in self.removals:
                if remove(path):
                    dirs.add(os.path.dirname(path))
        finally:
            # on an error, the files not yet renamed are dropped
            del self.staged[:done]
            self.removals = []
            self.abort()
        for directory in dirs:
            _fsync_dir(directory)

    def abort(self):
        for tmp, _ in self.staged:
            _unlink(tmp)
        self.staged = []
        self.stages = {}
        if self.home is not None:  # its staging dirs, in it and beside destinations
            _remove_beside(self.home)
            shutil.rmtree(self.home, ignore_errors=True)
            _unlink(self.home + ".lock")
            os.close(self._lock_fd)
            self.home = self._lock_fd = None


BESIDE_JOURNAL = "beside"


def _remove_beside(home):
    """Remove the staging dirs a batch made beside destinations (its journal in ``home``)."""
    try:
        with open(os.path.join(home, BESIDE_JOURNAL), encoding="utf-8",
                  errors="surrogateescape") as fh:
            paths = [line.rstrip("\n") for line in fh if line.strip()]
    except OSError:
        return
    for path in paths:
        if os.path.basename(path).startswith(STAGE_PREFIX) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)


def clean_stages(stage_root):
    """
    Remove what batches that died (their process killed before the commit)
    left in ``stage_root``: each ``.mm-stage-*`` directory whose ``.lock``
    no live batch holds, and a lock whose batch died before making its
    directory.  Return the directories removed.
    """
    try:
        names = os.listdir(stage_root)
    except OSError:  # none yet (or not a directory: moved aside by the applier)
        return []
    removed = []
    for name in sorted({n[: -len(".lock")] if n.endswith(".lock") else n
                        for n in names if n.startswith(STAGE_PREFIX)}):
        home = os.path.join(stage_root, name)
        lock = home + ".lock"
        try:
            fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            fd = None  # no lock: its batch is gone (or never locked it)
        except OSError:
            if name in names:
                raise
            continue
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue  # a live batch
        try:
            if name in names:
                if os.path.isdir(home) and not os.path.islink(home):
                    _remove_beside(home)
                    shutil.rmtree(home, ignore_errors=True)
                else:
                    _unlink(home)  # not what a batch makes: a damaged leftover
                removed.append(home)
            if fd is not None:
                _unlink(lock)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def _unlink(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def _fsync_path(path):
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory):
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def backup(path, backup_root, rel):
    """
    Copy ``path`` (if it exists) to ``backup_root/rel`` before it is replaced
    or removed.  Return the backup path or None.  ``rel`` must stay inside
    ``backup_root`` (:class:`PathError` otherwise); the copy is owned by
    whoever runs the sync, so it never keeps a setuid, setgid, sticky or
    world-writable bit.
    """
    if not os.path.lexists(path):
        return None
    dest = safe_join(backup_root, rel)
    makedirs(os.path.dirname(dest), mode=KEY_DIR_MODE)
    if os.path.islink(path):
        os.symlink(os.readlink(path), dest)
    else:
        shutil.copy2(path, dest)
        os.chmod(dest, safe_mode(stat.S_IMODE(os.stat(dest).st_mode)))
    return dest


def remove(path):
    """Remove a file; a missing file is not an error."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
