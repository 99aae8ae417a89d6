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

Enable it on every master (the formula's ``multimaster.master`` state writes
it with pillar ``multimaster:master:watch: True``):

.. code-block:: yaml

    engines:
      - multimaster_watch: {}

Linux only (inotify).  Trees on a network filesystem (NFS, CIFS, FUSE) are
not vouched for: changes made on another host raise no event here.
"""

import logging
import threading

from salt_multimaster import layout, watch

log = logging.getLogger(__name__)

__virtualname__ = "multimaster_watch"


def __virtual__():
    ok, reason = watch.supported()
    if not ok:
        return False, f"multimaster_watch: {reason}"
    return __virtualname__


def start(poll=watch.POLL):
    """
    Watch this master's roots and key dirs and serve the change journal
    until the master stops.

    poll
        Seconds between checks for a stop; events are read as they come.

    Configured in the master config, not called:

    .. code-block:: yaml

        engines:
          - multimaster_watch: {}
    """
    try:
        poll = watch.check_poll(poll)
    except ValueError as exc:
        log.error("%s: using %g", exc, watch.POLL)
        poll = watch.POLL
    trees = watch.master_trees(__opts__)
    watcher = watch.Watcher(trees)
    try:
        watcher.start()
    except watch.Unavailable as exc:
        # serve anyway: every query is answered "cannot tell", at once
        log.error("multimaster_watch: cannot watch (%s): syncs read everything", exc)
    log.info("multimaster_watch: watching %s", ", ".join(trees))
    try:
        watch.serve(watcher, watch.socket_path(layout.state_dir(__opts__)),
                    stop=threading.Event(), poll=poll)
    finally:
        watcher.close()
