"""
Keep a change journal of this master's ``file_roots``, ``pillar_roots`` and
key dirs for ``multimaster.sync``.

A salt-master engine: it watches every directory of the roots and of the
``pki_dir`` with inotify and answers, on a unix socket in the master's
``<cachedir>/multimaster`` (0700, the socket 0600), which directories (and
which entries in them) changed since a token.  A sync (on the primary, and
the peer's check of what it holds when the peer master runs this engine
too) then lists only those directories instead of statting every file, and
stats only the keys named instead of every key.  Without the engine, or
whenever it cannot vouch for a tree (restarted, events lost, a directory
renamed, out of inotify watches), a sync reads everything, as it always did.

On a primary (a master whose config names ``multimaster:peers``) the
journal is also a trigger: a change in a root or a key dir is replicated to
every peer within seconds (``multimaster.sync only=<what changed>``, once
the changes have stopped for ``quiet`` seconds, at most ``max_wait``
seconds after the first; ``salt_multimaster.trigger``).  ``replicate:
False`` keeps the journal only.

Enable it on every master (the formula's ``multimaster.master`` state writes
it with pillar ``multimaster:master:watch: True``):

.. code-block:: yaml

    engines:
      - multimaster_watch: {}

Linux only (inotify).  Trees on a network filesystem (NFS, CIFS, FUSE) are
not vouched for: changes made on another host raise no event here.
"""

import logging

import salt.runner

from salt_multimaster import inotify, journal, layout, report, trigger, watch

log = logging.getLogger(__name__)

__virtualname__ = "multimaster_watch"


def __virtual__():
    try:
        inotify.libc()
    except inotify.Unavailable as exc:
        return False, f"multimaster_watch: {exc}"
    return __virtualname__


def _sync(opts):
    """``categories -> bool``: ``multimaster.sync only=<categories>``; True: all replicas."""
    client = salt.runner.RunnerClient(opts)

    def sync(categories):
        ret = client.cmd("multimaster.sync", kwarg={"only": ",".join(categories)},
                         print_event=False)
        ok = report.replicas(ret)
        if not ok:
            log.warning("multimaster_watch: sync of %s: %s", ", ".join(categories), ret)
        return ok

    return sync


def start(poll=journal.POLL, replicate=True, quiet=trigger.QUIET, max_wait=trigger.MAX_WAIT):
    """
    Watch this master's roots and key dirs and serve the change journal
    until the master stops; on a primary, replicate what changes.

    poll
        Seconds between checks for a stop; events are read as they come.

    replicate
        On a primary (``multimaster:peers`` set): sync what changes to the
        peers (default True).  False: the journal only.

    quiet, max_wait
        A sync starts once no change came for ``quiet`` seconds (default
        1), at most ``max_wait`` seconds (default 10) after the first change.

    Configured in the master config, not called:

    .. code-block:: yaml

        engines:
          - multimaster_watch: {}
          # or: - multimaster_watch: {replicate: false}
    """
    try:
        poll = journal.check_poll(poll)
    except ValueError as exc:
        log.error("%s: using %g", exc, journal.POLL)
        poll = journal.POLL
    try:
        quiet = trigger.check_seconds("quiet", quiet)
        max_wait = trigger.check_seconds("max_wait", max_wait)
    except ValueError as exc:
        log.error("%s: using quiet %g, max_wait %g", exc, trigger.QUIET, trigger.MAX_WAIT)
        quiet, max_wait = trigger.QUIET, trigger.MAX_WAIT
    trees = journal.master_trees(__opts__)
    watcher = watch.Watcher(trees)
    try:
        watcher.start()
    except inotify.Unavailable as exc:
        # serve anyway: every query is answered "cannot tell", at once
        log.error("multimaster_watch: cannot watch (%s): syncs read everything", exc)
    log.info("multimaster_watch: watching %s", ", ".join(trees))
    tick = None
    wanted = trigger.replicated(__opts__) if replicate is not False else []
    if wanted:
        log.info("multimaster_watch: replicating changes of %s to the peers", ", ".join(wanted))
        tick = trigger.Trigger(watcher.changes, trigger.categories_of(__opts__), wanted,
                               _sync(__opts__), quiet, max_wait).tick
    try:
        journal.serve(watcher, journal.socket_path(layout.state_dir(__opts__)), poll=poll,
                      tick=tick)
    finally:
        watcher.close()
