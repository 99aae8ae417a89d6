"""
One sync at a time per primary: an exclusive ``flock`` on a lock file in the
primary's state directory (``cachedir/multimaster/sync.lock``).

The holder writes its jid (and pid) into the file; a second sync waits up to
``wait`` seconds for the lock, then gives up naming that jid.  The kernel
drops the lock when its holder exits, however it exits (a ``salt-run``
killed with SIGKILL leaves no stale lock behind).
"""

import errno
import fcntl
import os
import time

from salt_multimaster import statefile

LOCK_NAME = "sync.lock"


class Busy(RuntimeError):
    """Another sync holds the lock; ``holder``: its jid (or None)."""

    def __init__(self, holder):
        self.holder = holder
        super().__init__(f"a sync is already running, jid {holder or 'unknown'}")


class SyncLock:
    """
    ``with SyncLock(path, jid, wait=30):`` holds the lock for the block, or
    raises :class:`Busy`.  Each instance opens the file anew, so threads of
    one process exclude each other as processes do.
    """

    def __init__(self, path, holder, wait=0.0, poll=0.2, clock=time.monotonic, sleep=time.sleep):
        self.path = path
        self.holder = str(holder) if holder is not None else None
        self.wait = max(0.0, float(wait))
        self.poll = poll
        self.clock, self.sleep = clock, sleep
        self.fd = None

    def acquire(self):
        if os.path.lexists(self.path) and not os.path.isfile(self.path):
            statefile.aside(self.path, "not a regular file")  # a lock is made again there
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        deadline = self.clock() + self.wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
            if self.clock() >= deadline:
                holder = read_holder(self.path)
                os.close(fd)
                raise Busy(holder)
            self.sleep(self.poll)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{self.holder or ''} {os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self):
        if self.fd is not None:
            try:
                os.ftruncate(self.fd, 0)
            finally:
                os.close(self.fd)  # closing drops the flock
                self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
        return False


def read_holder(path):
    """The jid written by the lock's holder, or None."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            words = fh.read().split()
    except OSError:
        return None
    return words[0] if len(words) > 1 else None
