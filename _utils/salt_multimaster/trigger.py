"""
Continuous replication: the change journal as a trigger.

The ``multimaster_watch`` engine on a primary (a master whose config names
``multimaster:peers``) reads its own journal (:class:`watch.Watcher`) after
every batch of events and, once the changes have stopped for ``quiet``
seconds (at most ``max_wait`` seconds after the first one), runs
``multimaster.sync only=<what changed>``: a file saved in a root, a key
accepted, rejected or deleted reaches every peer within seconds, without
anyone running ``sync``.  One sync runs at a time; changes made while it
runs start the next one.  A sync that leaves a peer behind is tried again
after :data:`RETRY` seconds, doubled each time up to :data:`RETRY_MAX`.
When the engine starts, and whenever its journal starts a new session,
every watched category is synced once: what changed while nothing watched
(the master stopped, a ``salt-key`` run meanwhile) is not known.

The journal is a trigger only: each sync still reads what it needs (its
own journal token, or everything), and ``salt-run multimaster.sync`` stays
the full reconcile.
"""

import logging
import os
import threading
import time

from salt_multimaster import journal, manifest, validate

log = logging.getLogger(__name__)

#: seconds without a change before a sync starts, and the longest a change waits
QUIET = 1.0
MAX_WAIT = 10.0
#: seconds before a failed sync is tried again (doubled each time, at most RETRY_MAX)
RETRY = 5.0
RETRY_MAX = 300.0
#: what a change of the journal's trees can ask a sync for
WATCHED = ("master_keys", "minion_keys", "file_roots", "pillar_roots")


def check_seconds(name, value):
    """``value`` as a float in [0, 3600]; ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 3600:
        raise ValueError(f"multimaster_watch: {name} must be seconds in [0, 3600], "
                         f"not {value!r:.50}")
    return float(value)


def replicated(opts):
    """
    The categories a change may trigger on the master of ``opts``: the
    watched ones (:data:`WATCHED`) among ``multimaster:replicate``; none
    when the config names no peer (a peer master, which runs the engine
    for its journal only).
    """
    conf = opts.get("multimaster")
    if not isinstance(conf, dict):
        return []
    try:
        if not validate.as_list("multimaster:peers", conf.get("peers")):
            return []
        wanted = validate.as_list("multimaster:replicate", conf.get("replicate")) or WATCHED
    except validate.InvalidInput as exc:
        log.error("multimaster_watch: no continuous replication: %s", exc)
        return []
    return [cat for cat in WATCHED if cat in wanted]


def replicates_keys(opts, state_dir):
    """
    Whether the ``multimaster_watch`` engine of the master of ``opts``
    (state dir ``state_dir``) replicates its key changes now: it is in
    ``engines`` without ``replicate: false``, ``minion_keys`` is among
    :func:`replicated`, and its journal answers for the ``pki_dir`` (a
    journal that cannot watch, or lost its watches, triggers nothing).
    The reactor then leaves key events to it: one sync per change, not two.
    """
    confs = [entry.get(journal.ENGINE) if isinstance(entry, dict) else None
             for entry in opts.get("engines") or [] if journal.engine_name(entry) == journal.ENGINE]
    if not confs or (isinstance(confs[0], dict) and confs[0].get("replicate") is False):
        return False
    if "minion_keys" not in replicated(opts) or not opts.get("pki_dir"):
        return False
    ask = journal.client(state_dir)
    token = ask(None)
    if token is None or token["session"] is None:
        return False
    reply = ask({"session": token["session"], "seq": token["seq"]})
    return reply is not None and os.path.realpath(opts["pki_dir"]) in (reply["changed"] or {})


def categories_of(opts):
    """
    ``(tree, rel_dir) -> set of categories``: what a change in directory
    ``rel_dir`` of ``tree`` (a path of :func:`journal.master_trees`) asks a
    sync for (none for another path).  The pki_dir's top holds the master keys, its key dirs the
    minion keys; a root is a ``file_roots`` or a ``pillar_roots`` root.
    """
    kinds = {}
    for cat in ("file_roots", "pillar_roots"):
        for roots in (opts.get(cat) or {}).values():
            for root in roots or ():
                if isinstance(root, str) and root:
                    kinds.setdefault(os.path.realpath(root), set()).add(cat)
    pki = os.path.realpath(opts["pki_dir"]) if opts.get("pki_dir") else None

    def of(tree, rel):
        found = set(kinds.get(tree, ()))
        if tree == pki:
            if rel == "":
                found.add("master_keys")
            elif rel.split("/", 1)[0] in manifest.KEY_DIRS:
                found.add("minion_keys")
        return found

    return of


class Trigger:
    """
    Syncs started from the changes of a journal.

    ``changes(since)``: :meth:`watch.Watcher.changes`; ``of(tree, rel)``:
    :func:`categories_of`; ``wanted``: the categories to sync (the others
    are ignored); ``sync(categories)``: runs one sync, True when every
    peer is a replica after it (run in a thread of its own).  Call
    :meth:`tick` after each batch of events and whenever the seconds it
    returned have passed.
    """

    def __init__(self, changes, of, wanted, sync, quiet=QUIET, max_wait=MAX_WAIT,
                 clock=time.monotonic):
        self.changes, self.of, self.wanted, self.sync = changes, of, set(wanted), sync
        self.quiet, self.max_wait, self.clock = quiet, max_wait, clock
        self.since = None
        self.pending = set()
        self.first = self.last = None
        self.hold = 0.0
        self.retry = RETRY
        self.thread = None
        self.outcome = None  # (categories, ok) of the last sync, taken by tick

    def _look(self, now):
        """Add what changed since the last look to ``pending``."""
        reply = self.changes(self.since)
        token = {"session": reply["session"], "seq": reply["seq"]}
        if reply["session"] is None or token == self.since:
            return  # not watching (nothing to trigger on), or nothing new
        if reply["changed"] is None:
            # the first look or a new session (events lost, a tree replaced):
            # what changed before it is not known (the master stopped, a
            # salt-key run meanwhile), anything may have changed
            new = set(self.wanted)
        else:
            new = {cat for tree, rels in reply["changed"].items() for rel in rels
                   for cat in self.of(tree, rel)} & self.wanted
        self.since = token
        if new:
            self.pending |= new
            self.first = self.first if self.first is not None else now
            self.last = now

    def _run(self, categories):
        ok = False
        try:
            ok = bool(self.sync(sorted(categories)))
        except Exception:  # pylint: disable=broad-except
            log.exception("multimaster_watch: the sync of %s failed", ", ".join(sorted(categories)))
        self.outcome = (categories, ok)

    def tick(self):
        """Read the journal, start a sync when one is due; seconds until the next tick is needed."""
        now = self.clock()
        self._look(now)
        if self.thread is not None:
            if self.thread.is_alive():
                return self.quiet
            self.thread = None
            categories, ok = self.outcome
            if ok:
                self.retry = RETRY
            else:
                log.warning("multimaster_watch: the sync of %s left a peer behind: again in "
                            "%g s", ", ".join(sorted(categories)), self.retry)
                self.pending |= categories
                self.first = self.first if self.first is not None else now
                self.last = self.last if self.last is not None else now
                self.hold = now + self.retry
                self.retry = min(self.retry * 2, RETRY_MAX)
        if not self.pending:
            return None
        due = max(min(self.last + self.quiet, self.first + self.max_wait), self.hold)
        if now < due:
            return due - now
        categories, self.pending, self.first, self.last = self.pending, set(), None, None
        log.info("multimaster_watch: changes on this master: syncing %s",
                 ", ".join(sorted(categories)))
        self.thread = threading.Thread(target=self._run, args=(categories,),
                                       name="multimaster-replicate", daemon=True)
        self.thread.start()
        return self.quiet
