"""
Safe file operations: atomic writes, backups, path confinement.

Every write goes to a temporary file in the destination directory, is fsynced
and renamed over the destination, so a reader (or a crash) never sees a half
written file.
"""

import errno
import os
import shutil
import tempfile

KEY_DIR_MODE = 0o700
PRIVATE_KEY_MODE = 0o400


class PathError(ValueError):
    """A relative path that would leave its root."""


def safe_join(root, rel):
    """
    Join ``rel`` under ``root``, refusing absolute paths, ``..`` components
    and symlinked parents that lead outside ``root``.
    """
    if not rel or os.path.isabs(rel) or "\x00" in rel:
        raise PathError(f"invalid relative path: {rel!r}")
    parts = rel.replace("\\", "/").split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise PathError(f"invalid relative path: {rel!r}")
    path = os.path.join(root, *parts)
    parent = os.path.dirname(path)
    real_root = os.path.realpath(root)
    real_parent = os.path.realpath(parent)
    if real_parent != real_root and not real_parent.startswith(real_root + os.sep):
        raise PathError(f"path leaves its root through a symlink: {rel!r}")
    return path


def makedirs(path, mode=0o755):
    """``os.makedirs`` that tolerates an existing directory."""
    try:
        os.makedirs(path, mode=mode)
    except OSError as exc:
        if exc.errno != errno.EEXIST or not os.path.isdir(path):
            raise


def atomic_write(path, data, mode=0o644):
    """
    Write ``data`` (bytes or str) to ``path`` atomically with ``mode``.

    A symlink at ``path`` is replaced by a regular file, never followed.
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".mm-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)


class Batch:
    """
    Many atomic writes and removals, made durable with one ``sync``.

    ``write`` puts the content in a temporary file beside its destination;
    ``commit`` flushes every staged file to disk at once, then renames each
    over its destination, then removes, then fsyncs the directories touched.
    A reader never sees a half-written file, and a crash before the renames
    leaves every destination as it was.  Per-file fsync costs a disk flush per
    file; a sync of 20,000 keys would spend minutes on it.
    """

    def __init__(self):
        self.staged = []
        self.removals = []

    def write(self, path, data, mode=0o644):
        if isinstance(data, str):
            data = data.encode("utf-8")
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".mm-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                os.fchmod(fh.fileno(), mode)
                fh.write(data)
        except BaseException:
            _unlink(tmp)
            raise
        self.staged.append((tmp, path))

    def remove(self, path):
        self.removals.append(path)

    def commit(self):
        dirs = set()
        done = 0
        try:
            if self.staged:
                os.sync()
            for tmp, path in self.staged:
                os.rename(tmp, path)
                done += 1
                dirs.add(os.path.dirname(path))
        finally:
            # on an error, the files not yet renamed are dropped
            del self.staged[:done]
            self.abort()
        for path in self.removals:
            if remove(path):
                dirs.add(os.path.dirname(path))
        self.removals = []
        for directory in dirs:
            _fsync_dir(directory)

    def abort(self):
        for tmp, _ in self.staged:
            _unlink(tmp)
        self.staged = []


def _unlink(path):
    try:
        os.unlink(path)
    except OSError:
        pass


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
    or removed.  Return the backup path or None.
    """
    if not os.path.lexists(path):
        return None
    dest = os.path.join(backup_root, rel)
    makedirs(os.path.dirname(dest), mode=KEY_DIR_MODE)
    if os.path.islink(path):
        os.symlink(os.readlink(path), dest)
    else:
        shutil.copy2(path, dest)
    return dest


def remove(path):
    """Remove a file; a missing file is not an error."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
