"""
Coalesce ``salt/key`` events into ``multimaster.sync`` runs of the keys that
changed.

The reactor SLS ``salt://salt/multimaster/reactor/key.sls`` (installed on the
primary master by the ``salt.multimaster.master`` state) calls
:py:func:`key_event` for every key accepted, rejected, deleted, pending or
denied.  Each event's minion id is queued; at most one sync runs at a time
and it takes every id queued so far (``multimaster.sync minion_ids=...``: one
publish, no listing of every key).  ``salt-key -A`` fires one event per key:
the first event syncs its key at once, the ones arriving meanwhile are synced
together by one more round once the events have stopped for
``key_event_quiet`` seconds (3 by default; at most a minute later), so the
last change is never missed and a burst costs two syncs.  A coalesced sync
of more keys than fit in ``inline_limit`` (about a hundred) needs the pull
channel that ``salt.multimaster.master``
grants (``peer_run``); without it that sync is refused, retried, and the
keys wait for the next full sync.
"""

import fcntl
import logging
import os
import time

try:
    from salt_multimaster import guard
except ImportError:  # the file_roots install, its utils not synced yet: see _public
    guard = None

log = logging.getLogger(__name__)

__virtualname__ = "multimaster_reactor"


def _answer(fun, message, args, kwargs):  # pylint: disable=unused-argument
    """How a call with bad arguments, or one that failed, is answered (:func:`_public`)."""
    log.error("multimaster: %s", message)
    return {"result": False, "error": message, "retcode": 1}


def _public(*extra):
    """
    This runner's one wrapper of its public functions
    (:func:`salt_multimaster.guard.public`); without the core (the
    file_roots install before ``saltutil.sync_runners`` brought it) Salt's
    own checks only.
    """
    if guard is None:
        return lambda func: func
    return guard.public(__virtualname__, _answer, extra)


KEY_ACTS = ("accept", "reject", "delete", "accepted", "rejected", "pending", "denied")
ALL = "*"


def __virtual__():
    return __virtualname__


def _valid_event_id(minion_id):
    """Whether a key event's minion id may be queued (``salt_multimaster.validate``)."""
    # the multimaster runner brings the core onto sys.path when loaded
    "multimaster.sync" in __salt__  # pylint: disable=pointless-statement
    from salt_multimaster import validate  # pylint: disable=import-outside-toplevel

    return validate.event_minion_id(minion_id)


def _replicas(ret):
    """Whether a sync's return says every peer is a replica (``salt_multimaster.report``)."""
    from salt_multimaster import report  # pylint: disable=import-outside-toplevel

    return report.replicas(ret)


def _regular(path):
    """``path``, what stands there that is no regular file moved aside (a damaged state file)."""
    from salt_multimaster import statefile  # pylint: disable=import-outside-toplevel

    if os.path.lexists(path) and not os.path.isfile(path):
        statefile.aside(path, "not a regular file")
    return path


def _locked(queue):
    """The lock of the queue file ``queue`` (``<queue>.lock``), held until closed."""
    # pylint: disable-next=consider-using-with
    fh = open(_regular(queue + ".lock"), "a", encoding="utf-8")
    fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
    return fh


def _put(queue, ids):
    """Queue minion ids in ``queue``, a file shared by reactor threads and processes."""
    with _locked(queue):
        with open(_regular(queue), "a", encoding="utf-8") as fh:
            fh.write("".join(f"{mid}\n" for mid in ids))


def _take(queue):
    """
    Every id queued in ``queue`` (``*``: all keys), emptying it; None when
    empty.  A damaged queue (not a file, not text, an id no key event
    gives) is taken as every key: what it held is not known.
    """
    from salt_multimaster import statefile  # pylint: disable=import-outside-toplevel

    with _locked(queue):
        try:
            data = statefile.read_bytes(queue)
            ids = {line.strip() for line in data.decode("utf-8").splitlines()
                   if line.strip()} if data is not None else None
            if ids is not None and not all(mid == ALL or _valid_event_id(mid) for mid in ids):
                raise statefile.Damaged(queue, "not a list of minion ids")
        except (statefile.Damaged, UnicodeDecodeError) as exc:
            statefile.notice(queue, getattr(exc, "why", "not UTF-8"), "every key is synced")
            ids = {ALL}
        if ids is None:
            return None
        statefile.remove(queue)
    return ids


# A burst (salt-key -A: Salt's reactor starts about 8 key_event calls a
# second) is covered by the first sync and one more, taken once the events
# have stopped for QUIET seconds (at most MAX_WAIT after the first sync):
# 3 s, as a loaded master's reactor can pause over a second within a burst.
QUIET = 3.0
MAX_WAIT = 60.0


def _settle(queue, quiet, max_wait):
    """Wait until no event was queued in ``queue`` for ``quiet`` seconds, at most ``max_wait``."""
    end = time.time() + max_wait
    while time.time() < end:
        try:
            idle = time.time() - os.stat(queue).st_mtime
        except FileNotFoundError:
            return
        if idle >= quiet:
            return
        time.sleep(min(quiet - idle, end - time.time(), 0.2) + 0.01)


def _conf_float(name, value, default):
    conf = __opts__.get("multimaster")
    if value is None:
        value = conf.get(name, default) if isinstance(conf, dict) else default
    return float(value)


@_public()
def key_event(act=None, minion_id=None, window=0, max_rounds=20, retries=3, retry_delay=2,
              quiet=None, max_wait=None):
    """
    Replicate a minion's keys to the peers after a ``salt/key`` event,
    coalescing bursts: at most one ``multimaster.sync minion_ids=...`` runs at
    a time.

    act
        The event's ``act`` (Salt 3007: accept, reject, delete; Salt 3008:
        accepted, rejected, pending, denied, delete).  Other values are
        ignored.

    minion_id
        The minion whose key changed: its keys (in every state dir) are
        synced, with those of the events queued meanwhile.  Without it, every
        key is synced.

    window
        Seconds to wait before each sync so that more of a burst is covered
        by one sync.  Default 0: the first event syncs at once; events that
        arrive meanwhile cause one more sync.

    quiet, max_wait
        After the first sync, the next one waits until no event arrived for
        ``quiet`` seconds (default 3, or ``multimaster:key_event_quiet`` in
        the master config), at most ``max_wait`` seconds (default 60,
        ``multimaster:key_event_max_wait``): a ``salt-key -A`` of hundreds of
        keys, whose events Salt's reactor delivers over tens of seconds,
        costs two syncs.  A single accept is synced at once.

    max_rounds
        Upper bound of syncs one call runs while events keep arriving.

    retries, retry_delay
        A sync that fails (a peer briefly unreachable, e.g. while it
        restarts, or a master too busy to pass on its return) is tried again
        up to ``retries`` times, after ``retry_delay`` seconds, then twice
        as long each time (2, 4, 8 s by default); a periodic full sync
        (``sync_interval`` of the formula) catches anything left over.

    On a master whose ``multimaster_watch`` engine replicates key changes
    (its journal answers: docs/watch.rst), the event is left to the engine
    and ignored: one sync per change, not two.

    Returns ``{"queued": True}`` when a running sync will cover this event,
    else ``{"syncs": n, "result": bool, "last": <sync return>}``.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster_reactor.key_event act=accepted minion_id=web01
    """
    if act is not None and act not in KEY_ACTS:
        return {"ignored": f"act {act!r}"}
    if isinstance(minion_id, (int, float)) and not isinstance(minion_id, bool):
        minion_id = str(minion_id)  # an id such as 1234, read as a number on the CLI
    if minion_id is not None and not _valid_event_id(minion_id):
        # a queued line "*" means every key: a key named "x\n*" must not
        # trigger a full sync
        log.warning("multimaster: key event %s with invalid minion id %r dropped", act, minion_id)
        return {"ignored": f"invalid minion id {minion_id!r}", "result": False, "retcode": 1}
    quiet = _conf_float("key_event_quiet", quiet, QUIET)
    max_wait = _conf_float("key_event_max_wait", max_wait, MAX_WAIT)
    from salt_multimaster import layout, trigger  # pylint: disable=import-outside-toplevel

    state_dir = layout.state_dir(__opts__)
    if trigger.replicates_keys(__opts__, state_dir):
        log.debug("multimaster: key event %s %s: left to the multimaster_watch engine",
                  act, minion_id)
        return {"ignored": "the multimaster_watch engine replicates key changes on this master"}
    queue = os.path.join(state_dir, "key-sync.pending")
    lock_path = os.path.join(state_dir, "key-sync.lock")
    # Queue first, lock second: a running sync that has not yet taken the
    # queue will see this id, and one that already released the lock is
    # re-checked below.
    _put(queue, [str(minion_id) if minion_id is not None else ALL])
    syncs, last, result, failures = 0, None, True, 0
    while True:
        with open(_regular(lock_path), "a", encoding="utf-8") as lock:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.debug("multimaster: key sync running; %s %s queued", act, minion_id)
                return {"queued": True, "syncs": syncs, "result": result, "last": last}
            try:
                while os.path.exists(queue) and syncs < max_rounds:
                    if window:
                        time.sleep(float(window))
                    if syncs:
                        _settle(queue, quiet, max_wait)
                    ids = _take(queue)
                    if not ids:
                        break
                    log.info("multimaster: key event %s %s: syncing the keys of %s",
                             act, minion_id, "every minion" if ALL in ids else sorted(ids))
                    last = __salt__["multimaster.sync"](
                        only="minion_keys",
                        minion_ids=None if ALL in ids else sorted(ids),
                    )
                    syncs += 1
                    if _replicas(last):
                        failures = 0
                        continue
                    failures += 1
                    log.warning("multimaster: key sync failed (%s/%s): %s",
                                failures, retries, last)
                    if failures > retries:
                        result = False
                        failures = 0
                        continue
                    _put(queue, ids)
                    time.sleep(float(retry_delay) * 2 ** (failures - 1))
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
        if not os.path.exists(queue) or syncs >= max_rounds:
            break
    return {"queued": False, "syncs": syncs, "result": result, "last": last}
