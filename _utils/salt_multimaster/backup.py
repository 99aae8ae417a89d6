"""
The backups a sync leaves on a peer, and the way back.

Each apply that replaces or removes anything copies it first to
``<peer master cachedir>/multimaster/backup/<UTC timestamp>/<category>/...``:
``minion_keys/<state dir>/<id>``, ``file_roots/<saltenv>/<path>``,
``pillar_roots/<saltenv>/<path>``, ``master_keys/<file name>``,
``master_config/<drop-in name>``; a master key rotation keeps each
master's old keypair the same way.  Only the newest ``keep`` backups are kept.
"""

import logging
import os
import re
import shutil

log = logging.getLogger(__name__)

DEFAULT_KEEP = 10
STAMP = re.compile(r"^\d{8}T\d{6}(\.\d+)?Z$")


class BackupError(ValueError):
    """A backup that does not exist or an item that cannot be restored."""


def stamps(base):
    """The backups under ``base``, oldest first."""
    try:
        names = os.listdir(base)
    except OSError:  # none yet (or not a directory: a sync moves it aside)
        return []
    return sorted(n for n in names if STAMP.match(n) and os.path.isdir(os.path.join(base, n)))


def prune(base, keep=DEFAULT_KEEP):
    """Remove all but the newest ``keep`` backups; return the names removed."""
    keep = int(keep)
    if keep < 1:
        raise BackupError(f"backup_keep must be at least 1, not {keep}")
    old = stamps(base)[:-keep]
    for name in old:
        shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    return old


def trim(base, keep):
    """
    :func:`prune`, logging what stops it instead of raising: the apply or
    key rotation that made the newest backup is done and stands.
    """
    try:
        pruned = prune(base, keep)
    except (BackupError, OSError, TypeError, ValueError) as exc:
        log.warning("multimaster: old backups not pruned: %s", exc)
        return []
    if pruned:
        log.info("multimaster: removed %d old backup(s), keeping %s", len(pruned), keep)
    return pruned


def choose(base, backup=None):
    """The directory of backup ``backup`` (a timestamp; default: the newest)."""
    names = stamps(base)
    if backup in (None, "", "latest"):
        if not names:
            raise BackupError(f"no backup under {base}")
        return os.path.join(base, names[-1])
    backup = str(backup)
    if not STAMP.match(backup):
        raise BackupError(f"invalid backup name {backup!r}: a timestamp such as "
                          "20261123T221500.123456Z (the sync's 'backup')")
    if backup not in names:
        raise BackupError(
            f"no backup {backup!r} (kept: {', '.join(names[-5:]) or 'none'})")
    return os.path.join(base, backup)


def items(backup_dir):
    """Every file of a backup, as ``category/...`` relative names, sorted."""
    ret = []
    for dirpath, _, files in os.walk(backup_dir):
        for name in files:
            ret.append(os.path.relpath(os.path.join(dirpath, name), backup_dir))
    return sorted(ret)
