"""
The peer's side of a sync, without Salt's loader: the lock of a peer's
sync state, and what a peer master holds (a read-only inventory).  The
apply of what the primary planned is :mod:`salt_multimaster.applier`, the
ids received from the primary :mod:`salt_multimaster.history`, a restore
and a failback's collect :mod:`salt_multimaster.restore`.

``mopts`` is the peer master's configuration, ``state_dir`` the minion's
``<cachedir>/multimaster``.
"""

import contextlib
import logging
import os
import time

from salt_multimaster import (confirmed, daemon, finger, fsutil, history, journal, keyscan, layout,
                              lock, manifest, protocol, replicate, rootscan, validate)

log = logging.getLogger(__name__)


class PeerError(Exception):
    """An item this peer cannot apply; its message names it."""


# One job at a time reads or writes a peer's sync state (``peer.lock`` in
# state_dir), the key history record an apply leaves running included;
# waited for at most this long.
PEER_LOCK = "peer.lock"
LOCK_WAIT = 60.0
# The key history record of an apply starts this long after the apply
# returned, in the job's process, so that the job's return goes out first.
RECORD_DELAY = 0.05


@contextlib.contextmanager
def locked(state_dir, wait=LOCK_WAIT):
    """
    ``with locked(state_dir):`` one job at a time on this peer's sync state
    (an inventory, an apply, the key history record an apply left running).
    :class:`PeerError` after ``wait`` seconds.
    """
    fsutil.makedirs(state_dir, mode=0o700)
    path = os.path.join(state_dir, PEER_LOCK)
    try:
        held = lock.SyncLock(path, None, wait=wait, poll=0.01).acquire()
    except lock.Busy:
        raise PeerError(f"another multimaster job still holds {path} after {wait:.0f} s") from None
    try:
        yield
    finally:
        held.release()


def record_after_return(state_dir, work, sleep=time.sleep):
    """
    Run ``work`` (what an apply leaves for after its return) under :func:`locked`,
    :data:`RECORD_DELAY` seconds from now: what the job's thread started after
    its return runs.  A failure is logged: the next sync records the history
    (the inventory says it is not).
    """
    sleep(RECORD_DELAY)
    try:
        with locked(state_dir):
            work()
    except Exception:  # pylint: disable=broad-except
        log.exception("multimaster: the key history of the last apply was not recorded; "
                      "the next sync records it")


# ---------------------------------------------------------------------------
# Inventory (read-only)
# ---------------------------------------------------------------------------
def inventory(mopts, state_dir, categories, digests, topology, config_keys, rescan=False):
    """
    What this peer master holds, for ``categories``.  For the bucketed
    categories only the buckets whose digest differs from ``digests`` (the
    primary's) are detailed: an unchanged peer answers with digests only.
    Changes no key, file or record of the sync.
    """
    running, where = daemon.master_running(mopts)
    ret = {"master_id": mopts["id"], "errors": [],
           "master_running": running, "master_address": where,
           "restart_pending": daemon.restart_pending(
               mopts, os.path.join(state_dir, daemon.RESTART_MARKER))}
    watch = journal.client(layout.state_dir(mopts))
    for cat in categories:
        if cat == "master_keys":
            pem, pub = layout.master_key_files(mopts, topology)
            ret[cat] = {"pem": manifest.sha256_or_none(pem),
                        "pub": manifest.sha256_or_none(pub),
                        "fingerprint": finger.file_finger(
                            pub, mopts.get("hash_type", "sha256")) or None}
        elif cat == "master_config":
            keys = config_keys or list(replicate.DEFAULT_CONFIG_KEYS)
            ret[cat] = {k: mopts.get(k) for k in keys}
            # what the peer last confirmed of each option (sha256 only)
            ret["config_record"] = confirmed.config_record(state_dir)
        elif cat == "minion_keys":
            ret[cat] = keys_inventory(mopts, state_dir, digests.get(cat) or {}, rescan, watch)
        elif cat in rootscan.ROOTS:
            read = rootscan.RootsScan(mopts, cat, state_dir, rescan=rescan, watch=watch)
            diff = manifest.differing(digests.get(cat) or {}, read.raw)
            ret[cat] = {"digest": read.raw, "errors": [str(e) for e in read.errors],
                        "buckets": diff, "manifest": manifest.merge(read.parts, diff),
                        "envs": sorted(mopts.get(cat) or {}),
                        "record": confirmed.since(state_dir, cat, read.raw, diff,
                                                  lambda b, parts=read.parts: parts.get(b, {}))}
    return ret


def keys_inventory(mopts, state_dir, digests, rescan=False, watch=None):
    """
    The ``minion_keys`` part of :func:`inventory`: digests, the differing
    buckets, and the ids of those buckets received from the primary before.
    """
    snap = keyscan.KeysSnapshot(mopts["pki_dir"], state_dir, rescan=rescan,
                                watch=watch or journal.client(layout.state_dir(mopts)))
    diff = manifest.differing(digests, snap.digest)
    return {"digest": snap.digest, "errors": list(snap.errors), "buckets": diff,
            "manifest": manifest.merge(snap.parts, diff),
            "counts": snap.counts,
            "history": history.history_of(state_dir, diff),
            "history_recorded": snap.meta.get("history") == history.generation(state_dir),
            "record": confirmed.since(state_dir, "minion_keys", snap.digest, diff,
                                      lambda b: snap.parts.get(b, {}))}


def check_expected(mopts, state_dir, expect, topology, config_keys):
    """
    ``(held, inventory)``: whether this peer holds what the primary
    expects (``expect``: :func:`protocol.expectation`), and its inventory
    against those digests (what the primary plans from when it does not).
    """
    if not isinstance(expect, dict) or not expect:
        raise validate.InvalidInput(f"expect must be a mapping of category to digests, "
                                    f"not {expect!r}")
    validate.categories(list(expect), "expect")
    if config_keys is not None:
        validate.config_keys(config_keys)
    try:
        digests = protocol.expected_digests(expect)
    except (KeyError, TypeError, AttributeError):
        raise validate.InvalidInput(f"expect: malformed digests {expect!r:.200}") from None
    inv = inventory(mopts, state_dir, list(expect), digests, topology, config_keys)
    try:
        return protocol.holds(expect, inv), inv
    except (KeyError, TypeError, AttributeError):
        raise validate.InvalidInput(f"expect: malformed digests {expect!r:.200}") from None
