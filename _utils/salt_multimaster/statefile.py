"""
The one reader and writer of the files salt-multimaster keeps for itself
(its state: caches, records, markers, locks, on the primary and on the
peers), read defensively.

A state file may be missing, empty, truncated, not UTF-8, not the JSON
shape expected, of another format version, or a directory where a file
should be (a disk error, a careless ``echo >``, an older release).  Every
such case is *unknown*, never "nothing to do": :func:`load` answers the
caller's ``default`` (a cache is then rebuilt from the live state), or
raises :class:`Damaged` naming the file and what to do (a record that
cannot be rebuilt); either way the damage is logged once at WARNING and
noted (:func:`noticed`: a peer reports what it rebuilt).  :func:`write`
and :func:`makedirs` first move aside (``<name>.damaged-<time>``, kept for
inspection, never removed) whatever stands where a state file or directory
must go, so that what is rebuilt can be saved.
"""

import datetime
import json
import logging
import os
import stat

import salt.utils.yaml

from salt_multimaster import compat, fsutil

log = logging.getLogger(__name__)

#: the damage logged in this process: each (path, why) once
_WARNED = set()
#: the damage noticed since :func:`noticing` started (``[(path, why)]``), or None
_NOTICED = compat.ContextVar("multimaster_state_damage", default=None)


class Damaged(ValueError):
    """A state file that cannot be used; the message names it and what to do."""

    def __init__(self, path, why, todo=None):
        self.path, self.why = path, why
        super().__init__(f"{path} is damaged ({why})" + (f": {todo}" if todo else ""))


def notice(path, why, then):
    """Log the damage of ``path`` once (WARNING) and note it for :func:`noticed`."""
    noted = _NOTICED.get()
    if noted is not None and (path, why) not in noted:
        noted.append((path, why))
    if (path, why) not in _WARNED:
        _WARNED.add((path, why))
        log.warning("multimaster: %s is damaged (%s): %s", path, why, then)


def noticing():
    """Start noting damage for :func:`noticed` (in this context: one job)."""
    _NOTICED.set([])


def noticed():
    """``["<path>: <why>"]`` of the damage noted since :func:`noticing`."""
    return [f"{path}: {why}" for path, why in _NOTICED.get() or []]


def read_bytes(path):
    """
    The bytes of the regular file ``path``: None when it does not exist;
    :class:`Damaged` when something else stands there or it cannot be read.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Damaged(path, f"cannot be looked at: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise Damaged(path, "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file")
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise Damaged(path, f"unreadable: {exc.strerror or exc}") from None


def parse_json(data):
    """JSON from bytes, or ValueError naming what is wrong (empty, not UTF-8, not JSON)."""
    if not data.strip():
        raise ValueError("empty")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not UTF-8") from None
    try:
        return json.loads(text)
    except ValueError:
        raise ValueError("not JSON (truncated?)") from None


def parse_yaml(data):
    """YAML from bytes, or ValueError naming what is wrong (not UTF-8, not YAML)."""
    try:
        return salt.utils.yaml.safe_load(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("not UTF-8") from None
    except salt.utils.yaml.YAMLError:
        raise ValueError("not YAML") from None


def read(path, valid=None, parse=parse_json):
    """
    What the state file ``path`` holds, parsed (default JSON): None when it
    does not exist; :class:`Damaged` when it is not a readable file, does
    not parse, or ``valid(value)`` is false (another shape or format).
    """
    data = read_bytes(path)
    if data is None:
        return None
    try:
        value = parse(data)
    except ValueError as exc:
        raise Damaged(path, str(exc)) from None
    if valid is not None and not valid(value):
        raise Damaged(path, "not the expected content (another format version?)")
    return value


def load(path, then, default=None, valid=None, parse=parse_json):
    """
    :func:`read`, with a damaged file answered ``default`` (as a missing
    one): logged once and noted, ``then`` saying what follows (what is
    rebuilt).  For caches and records rebuilt from the live state.
    """
    try:
        value = read(path, valid, parse)
    except Damaged as exc:
        notice(path, exc.why, then)
        return default
    return default if value is None else value


def stamp():
    """The UTC time now as this package names backups and damaged files (``backup.STAMP``)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")


def aside(path, why):
    """
    Move what stands at ``path`` aside (``<path>.damaged-<time>``), so that
    a state file or directory can be made there; return the new name.
    """
    moved = f"{path}.damaged-{stamp()}"
    os.rename(path, moved)
    notice(path, why, f"moved aside to {moved}, made again")
    return moved


def _kind(path):
    try:
        return stat.S_IFMT(os.lstat(path).st_mode)
    except FileNotFoundError:
        return None


def makedirs(path, root, mode=0o700):
    """
    ``fsutil.makedirs(path)``, where what stands in the way below ``root``
    (salt-multimaster's own directory: a file, a link where a directory
    must be) is first moved aside.
    """
    root = os.path.normpath(root)
    rel = os.path.relpath(os.path.normpath(path), root)
    parts = [] if rel.startswith("..") else rel.split(os.sep)
    current = root
    for part in [p for p in parts if p not in ("", ".")]:
        current = os.path.join(current, part)
        kind = _kind(current)
        if kind is not None and kind != stat.S_IFDIR:
            aside(current, "not a directory")
    fsutil.makedirs(path, mode=mode)


def write(path, data, mode=0o600, durable=True, root=None):
    """
    ``fsutil.atomic_write`` of a state file, what stands in its way (a
    directory, a link) moved aside first, its directory made (below
    ``root``, default its own directory).
    """
    makedirs(os.path.dirname(path), root or os.path.dirname(path))
    kind = _kind(path)
    if kind is not None and kind != stat.S_IFREG:
        aside(path, "a directory" if kind == stat.S_IFDIR else "not a regular file")
    fsutil.atomic_write(path, data, mode=mode, durable=durable)


def remove(path):
    """
    Remove the state file ``path`` (missing: nothing to do); a directory
    standing there is moved aside instead (:func:`aside`).  True when
    something was there.
    """
    kind = _kind(path)
    if kind is None:
        return False
    if kind == stat.S_IFDIR:
        aside(path, "a directory")
    else:
        fsutil.remove(path)
    return True
