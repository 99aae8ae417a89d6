"""
Coalesce ``salt/key`` events into ``multimaster.sync only=minion_keys`` runs.

The reactor SLS ``salt://salt/multimaster/reactor/key.sls`` (installed on the
primary master by the ``salt.multimaster.master`` state) calls
:py:func:`key_event` for every key accepted, rejected, deleted, pending or
denied.  ``salt-key -A`` fires one event per key: running one full sync per
event would be a sync storm.  Instead at most one sync runs at a time; an
event arriving while it runs marks the keys dirty and the running sync runs
once more when it is done, so the last change is never missed and a burst
costs two syncs at most.
"""

import fcntl
import logging
import os
import time

log = logging.getLogger(__name__)

__virtualname__ = "multimaster_reactor"

KEY_ACTS = ("accept", "reject", "delete", "accepted", "rejected", "pending", "denied")


def __virtual__():
    return __virtualname__


def _state_dir():
    path = os.path.join(__opts__["cachedir"], "multimaster")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def _touch(path):
    with open(path, "a", encoding="utf-8"):
        os.utime(path, None)


def key_event(act=None, minion_id=None, window=0, max_rounds=20, retries=3, retry_delay=2):
    """
    Replicate minion keys to the peers after a ``salt/key`` event, coalescing
    bursts: at most one ``multimaster.sync only=minion_keys`` runs at a time.

    act
        The event's ``act`` (Salt 3007: accept, reject, delete; Salt 3008:
        accepted, rejected, pending, denied, delete).  Other values are
        ignored.

    minion_id
        The minion whose key changed (logged only: the sync mirrors every key).

    window
        Seconds to wait before each sync so that more of a burst is covered
        by one sync.  Default 0: the first event syncs at once; events that
        arrive meanwhile cause one more sync.

    max_rounds
        Upper bound of syncs one call runs while events keep arriving.

    retries, retry_delay
        A sync that fails (a peer briefly unreachable, e.g. while it
        restarts) is tried again up to ``retries`` times, ``retry_delay``
        seconds apart; a periodic full sync (``sync_interval`` of the
        formula) catches anything left over.

    Returns ``{"queued": True}`` when a running sync will cover this event,
    else ``{"syncs": n, "result": bool, "last": <sync return>}``.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster_reactor.key_event act=accepted minion_id=web01
    """
    if act is not None and act not in KEY_ACTS:
        return {"ignored": f"act {act!r}"}
    state_dir = _state_dir()
    dirty = os.path.join(state_dir, "key-sync.dirty")
    lock_path = os.path.join(state_dir, "key-sync.lock")
    # Mark first, lock second: a running sync that has not yet looked at the
    # mark will see it, and one that already released the lock is re-checked
    # below.
    _touch(dirty)
    syncs, last, result, failures = 0, None, True, 0
    while True:
        with open(lock_path, "a", encoding="utf-8") as lock:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.debug("multimaster: key sync running; %s %s queued", act, minion_id)
                return {"queued": True, "syncs": syncs, "result": result, "last": last}
            try:
                while os.path.exists(dirty) and syncs < max_rounds:
                    if window:
                        time.sleep(float(window))
                    os.unlink(dirty)
                    log.info("multimaster: key event %s %s: syncing minion keys", act, minion_id)
                    last = __salt__["multimaster.sync"](only="minion_keys")
                    syncs += 1
                    ok = isinstance(last, dict) and all(
                        not isinstance(v, dict) or v.get("result", True) is not False
                        for v in last.values()
                    )
                    if ok:
                        failures = 0
                        continue
                    failures += 1
                    log.warning("multimaster: key sync failed (%s/%s): %s",
                                failures, retries, last)
                    if failures > retries:
                        result = False
                        failures = 0
                        continue
                    _touch(dirty)
                    time.sleep(float(retry_delay))
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
        if not os.path.exists(dirty) or syncs >= max_rounds:
            break
    return {"queued": False, "syncs": syncs, "result": result, "last": last}
