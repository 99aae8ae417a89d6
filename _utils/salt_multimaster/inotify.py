"""
Linux inotify through libc (``ctypes``), and this process' mount table:
the kernel interface :class:`salt_multimaster.watch.Watcher` is built on.
"""

import ctypes
import fcntl
import os
import re
import struct
import sys
import termios

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
EVENT = struct.Struct("iIII")
# one read: many events (a name is at most NAME_MAX + 1 bytes, padded)
READ_SIZE = 256 * 1024

#: Filesystems every change of which is made through this kernel, and so
#: reported by inotify.  A tree on any other (nfs, cifs, fuse.*, ceph,
#: gfs2, ocfs2, 9p, virtiofs, ...) may change behind the watcher's back.
LOCAL_FS = frozenset((
    "ext2", "ext3", "ext4", "xfs", "btrfs", "bcachefs", "zfs", "f2fs", "jfs", "reiserfs",
    "nilfs2", "tmpfs", "ramfs", "overlay", "vfat", "msdos", "exfat", "ntfs3", "hfsplus",
    "squashfs", "erofs", "iso9660", "udf",
))

MOUNTINFO = "/proc/self/mountinfo"


class Unavailable(Exception):
    """inotify cannot be used (not Linux, init failed, ...)."""


_LIBC = None


def libc():
    """libc with the inotify functions bound, or :class:`Unavailable`."""
    global _LIBC  # pylint: disable=global-statement
    if _LIBC is None:
        if not sys.platform.startswith("linux"):
            raise Unavailable("inotify is Linux only")
        # this process' own symbols: the libc it runs on (glibc or musl)
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            libc.inotify_init1.argtypes = [ctypes.c_int]
            libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        except AttributeError:
            raise Unavailable("no inotify functions in libc") from None
        libc.inotify_init1.restype = ctypes.c_int
        libc.inotify_add_watch.restype = ctypes.c_int
        _LIBC = libc
    return _LIBC


def init():
    """A new non-blocking, close-on-exec inotify fd (``OSError`` on failure)."""
    fd = libc().inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"inotify_init1: {os.strerror(err)}")
    return fd


def add_watch(fd, path, mask):
    """``inotify_add_watch(2)``: the watch descriptor of ``path``, or ``OSError``."""
    wd = libc().inotify_add_watch(fd, os.fsencode(path), mask)
    if wd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"inotify_add_watch: {os.strerror(err)}", path)
    return wd


def queued(fd):
    """How many bytes of events ``fd`` holds (``FIONREAD``), or None if it cannot tell."""
    buf = bytearray(4)
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf, True)
    except OSError:
        return None
    return struct.unpack("i", buf)[0]


def _under(path, top):
    """Whether ``path`` is ``top`` or under it (both absolute and normalised)."""
    return path == top or path.startswith(top.rstrip("/") + "/")


_OCTAL = re.compile(rb"\\([0-7]{3})")


def read_mounts(path=MOUNTINFO):
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


def mounts_of(table, real):
    """The entries of ``table`` for the mount holding ``real`` and every mount under it."""
    holding = None
    for entry in table:
        # the last of the mounts stacked on one point is the one seen
        if _under(real, entry[1]) and (holding is None or len(entry[1]) >= len(holding[1])):
            holding = entry
    under = [e for e in table if e[1] != real and _under(e[1], real)]
    return ([holding] if holding is not None else []) + under


def fs_problem(table, real):
    """Why the tree at ``real`` (a real path) cannot be vouched for, or None."""
    mounts = mounts_of(table, real)
    if not mounts:
        return "its filesystem is unknown"
    for _mid, point, fstype in mounts:
        if fstype not in LOCAL_FS:
            return (f"{point} is a {fstype} filesystem: it may change without this host's "
                    f"kernel seeing it")
    return None
