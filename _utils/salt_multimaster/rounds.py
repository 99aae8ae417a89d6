"""
The rounds of one sync between the primary and its peers: which publishes
go out, in which order, and what is planned from what came back.

Each peer is synced by one loop (:meth:`Rounds.sync_peer`): plan it from
what it holds, as far as the primary knows, and apply, conditional on what
it last confirmed (:func:`salt_multimaster.memory.remembered`); a peer that
holds something else answers with its inventory, planned from in turn.  A
change sync is one publish; a full sync is that loop with no memory: the
peer's inventory first (one publish to every such peer), then the apply.
A targeted key sync (``minion_ids``) is a sync of ``minion_keys`` whose
plan keeps the keys of those ids only.

Everything Salt does is passed in (``salt``, see :class:`Rounds`): the
runner publishes through ``LocalClient`` and fires progress events; the
unit tests run the real peer over temp dirs.
"""

import concurrent.futures
import dataclasses
import logging

from salt_multimaster import compat, epoch, memory, outage, protocol, statefile, transport
from salt_multimaster import sync as core

log = logging.getLogger(__name__)

#: peers synced at once
MAX_PARALLEL = 8


@dataclasses.dataclass(frozen=True)
class Outcome:
    """
    What :meth:`Rounds.sync_one` came to for one peer: its ``report``
    (applied, planned in test mode, or failed), or, for a conditional
    apply, ``nothing`` to apply, ``refused`` (a peer older than the
    condition: nothing applied; both: the peer is asked) or ``mismatch``
    (the peer does not hold what was expected: nothing applied, its
    ``inventory`` to plan from).
    """

    kind: str
    report: dict = None
    #: a report's: the inventory it was planned from; a mismatch's: to plan from
    inventory: dict = None
    #: a targeted sync left keys of other ids as they differ: the peer
    #: does not hold what the primary does
    partial: bool = False


class Rounds:
    """
    One sync (or status) of ``conf`` (the runner's resolved
    ``multimaster`` settings) from the primary whose options are ``opts``.

    ``salt`` gives what only Salt does:

    - ``publish(peers, fun, request, timeout)``: a job whose
      ``wait(on_wait)`` is ``{peer: return}`` of the peers that returned and
      ``replies(on_wait)`` ``{peer: (reply, error)}``
      (:func:`protocol.check_reply`) of every peer; ``on_wait(seconds)`` is
      called now and then while they work; the request is sealed to each
      peer on the way;
    - ``progress(message, **data)``: one progress line;
    - ``jid_dir(jid)``: a job's directory in the job cache.
    """

    def __init__(self, opts, conf, salt, test=False, force=False, ids=None):
        self.opts = opts
        self.conf = conf
        self.salt = salt
        self.test = test
        self.force = force
        #: a targeted key sync of these minion ids
        self.ids = ids
        # this primary's epoch, in every request: a peer promoted away from
        # it refuses it
        self.claim = epoch.claim(opts, conf.get("configured_peers") or conf["peers"],
                                 conf.get("topology"))

    # ----- asking the peers ------------------------------------------------
    def ask(self, peers, categories, primary):
        """
        Every peer's inventory of ``categories`` against the digests of
        ``primary`` (:meth:`inventories`): ``{peer: (reply, error)}``, one
        progress line now and then.
        """
        conf = self.conf
        request = protocol.request(
            "multimaster_peer.inventory", categories=categories,
            digests=core.current_digests(primary, categories),
            topology=conf["topology"], config_keys=conf["master_config_keys"],
            rescan=conf["rescan"] or None, epoch=self.claim)
        names = ", ".join(peers)
        self.salt.progress(f"multimaster: asking {names} for an inventory", phase="inventory")
        return self.salt.publish(peers, "multimaster_peer.inventory", request,
                                 conf["timeout"]).replies(
            lambda seconds: self.salt.progress(
                f"multimaster: waiting for the inventory of {names}, {seconds:.0f} s",
                phase="inventory"))

    def inventories(self, categories, peers):
        """
        The primary's state and the inventory ``{peer: (reply, error)}`` of
        each of ``peers``, asked with the digests of that state: a peer in
        step answers with digests only.
        """
        conf = self.conf
        primary = core.read_primary(self.opts, categories, conf["topology"],
                                    conf["master_config_keys"], conf["rescan"],
                                    keep=not self.test)
        if not peers:
            return primary, {}
        return primary, self.ask(peers, categories, primary)

    # ----- applying ----------------------------------------------------------
    def apply(self, peer, ops, primary, how, keys_digest, expect, confirm):
        """Publish the apply of ``ops`` to ``peer``: its return (None: it did not answer)."""
        conf, opts = self.conf, self.opts
        chunks = transport.attach_contents(opts, peer, ops, primary, how) if ops else None
        kwarg = protocol.request("multimaster_peer.apply", ops=ops, topology=conf["topology"],
                                 backup_keep=conf["backup_keep"], keys_digest=keys_digest,
                                 expect=expect, confirm=confirm, epoch=self.claim,
                                 config_keys=conf["master_config_keys"] if expect else None)
        token = None
        if chunks is not None:
            # the operations travel with the first chunk, pulled point-to-point
            token = transport.grant(opts, peer, ops, chunks)
            kwarg.update(ops=None, pull_token=token, pull_chunks=len(chunks))
        # a large apply (an initial sync) takes longer than an inventory:
        # allow for 10 operations a second on top of the timeout
        total = sum(len(o) for o in ops.values())
        wait = conf["timeout"] + total // 10
        if total:
            self.salt.progress(f"multimaster: {peer}: applying {total} change(s)"
                               + (f" ({len(chunks)} pull chunk(s))" if chunks else ""),
                               peer=peer, phase="apply", done=0, total=total)

        def still(seconds):
            if chunks:
                served, done = transport.pulled(opts, token, chunks)
                self.salt.progress(f"multimaster: {peer}: applying, {done}/{total} pulled "
                                   f"({served}/{len(chunks)} chunks), {seconds:.0f} s",
                                   peer=peer, phase="apply", done=done, total=total)
            else:
                self.salt.progress(f"multimaster: {peer}: applying {total} change(s), "
                                   f"{seconds:.0f} s", peer=peer, phase="apply", total=total)

        try:
            return self.salt.publish([peer], "multimaster_peer.apply", kwarg, wait).wait(
                still).get(peer)
        finally:
            if token:
                transport.revoke(opts, token, self.salt.jid_dir)

    def sync_one(self, peer, categories, primary, inv, expect):
        """
        One round of :meth:`sync_peer`: plan ``peer`` from its inventory
        ``inv`` and apply: an :class:`Outcome`, a ``report`` unless the
        apply is conditional (``expect``: ``inv`` is then what the primary
        last confirmed it held) and came to ``nothing`` (nothing to apply; a
        targeted key sync publishes it all the same: the peer confirms the
        keys of the ids in one publish), ``refused`` or ``mismatch``.
        """
        conf, test = self.conf, self.test
        found = []
        ops, plan_report = core.plan(conf["topology"], categories, primary, inv, self.force,
                                     found, self.ids)
        # a targeted sync leaves the peer a replica when the plan of every id is its plan
        partial = self.ids is not None and core.plan(
            conf["topology"], categories, primary, inv, self.force) != (ops, plan_report)
        ops = {c: o for c, o in ops.items() if o}
        if expect is not None and not ops and self.ids is None:
            return Outcome("nothing")
        ret = {"result": True}
        ret.update(plan_report)

        def failed(error):
            ret.update(result=False, error=error)
            if not test:
                core.unconfirmed(ret, categories)
            return Outcome("report", ret, inv)

        how = transport.transport(self.opts, peer, ops, conf["inline_limit"],
                                  conf["pull_min_files"]) if ops else None
        if how and how["error"]:
            return failed(how["error"])
        keys = inv.get("minion_keys") or {}
        keys_digest = (primary["minion_keys"].get("digest")
                       if "minion_keys" in categories else None)
        confirm = outage.confirm_digests(primary, categories)
        # an apply of nothing records what the peer holds in step (a full
        # sync's work: a targeted one publishes only what it plans)
        record = self.ids is None and (
            (keys_digest and keys.get("history_recorded") is False)
            or outage.stale(inv, categories, primary) or outage.converged(found))
        if not test and (ops or expect is not None or record):
            got = self.apply(peer, ops, primary, how, keys_digest, expect, confirm)
            if expect is not None and protocol.refused(got):
                # nothing applied (a peer older than this expectation refuses it)
                log.info("multimaster: %s refused the conditional apply: %s", peer, got["error"])
                return Outcome("refused")
            applied, error = protocol.check_reply(peer, "multimaster_peer.apply", got)
            if error:
                return failed(error)
            if expect is not None and "inventory" in applied:
                # nothing applied: the peer's inventory against the expected digests
                return Outcome("mismatch", inventory=applied["inventory"])
            core.merge(plan_report, applied)
            for key in ("restart", "backup", "aes_rotation", "rebuilt"):
                if applied.get(key):
                    ret[key] = applied[key]
            if expect is not None:
                # the peer's master as the peer found it before applying
                inv = dict(inv, **{k: applied.get(k) for k in
                                   ("master_running", "master_address", "restart_pending",
                                    "master_restart")})
        return Outcome("report", core.finish(peer, ret, inv, categories, test=test), inv,
                       partial)

    def sync_peer(self, peer, categories, primary, held, asked=None):
        """
        The one sync loop of ``peer``: plan it from what it holds, apply, and
        when the peer holds something else plan again from what it answered.
        ``held``: what it was last confirmed to hold
        (:func:`memory.remembered`), planned from with the apply conditional
        on it; None (a full sync: no memory), or a peer that could not be
        planned from it (buckets whose previous content the primary lost),
        refused the condition or had nothing to apply: it is asked for its
        inventory (``asked``: its ``(reply, error)`` to the inventory already
        published), planned from without a condition.  Returns the report
        :class:`Outcome`.
        """
        expect = protocol.expectation(held) if held else None
        inv = memory.expected_inventory(held) if held else None
        # the digests the peer compared its buckets with
        sent = protocol.expected_digests(expect) if held else None
        # at most three rounds: the condition, the peer's answer, its inventory
        while True:
            if inv is None:
                inv, error = asked or self.ask([peer], categories, primary)[peer]
                if error:
                    return Outcome("report", {"result": False, "error": error})
                expect = None
            elif core.unplannable(categories, primary, inv, sent):
                inv = None
                continue
            out = self.sync_one(peer, categories, primary, inv, expect)
            if out.kind == "report":
                return out
            if out.kind == "mismatch":
                log.info("multimaster: %s does not hold what it was last sent", peer)
            inv, expect = out.inventory, None

    # ----- a whole sync --------------------------------------------------------
    def run(self, peers, categories):
        """
        Sync ``peers`` (all valid, reachable as far as the primary knows):
        ``{peer: report}``, each peer in parallel.
        """
        opts, test = self.opts, self.test
        self.salt.progress(f"multimaster: reading the primary's state for "
                           f"{', '.join(categories)}")
        held = {} if test or self.conf["rescan"] else {
            peer: memory.remembered(opts, peer, categories) for peer in peers}
        # a peer whose state is known gets one publish, the others are asked first
        primary, invs = self.inventories(categories, [p for p in peers if not held.get(p)])

        def one(peer):
            out = Outcome("report")
            try:
                out = self.sync_peer(peer, categories, primary, held.get(peer), invs.get(peer))
                res = out.report
            except Exception as exc:  # pylint: disable=broad-except
                log.exception("multimaster: sync of %s failed", peer)
                res = {"result": False, "error": f"{exc.__class__.__name__}: {exc}"}
            if not test:
                # the keys of other ids left as they differ (partial): not a replica of them
                memory.remember(opts, peer, categories, primary, out.inventory or {},
                                {} if out.partial else res)
            return res

        ret = {}
        # each peer in a copy of this context: the damaged state files met
        # there are noted with this sync's (statefile.noticing)
        contexts = [compat.copy_context() for _ in peers]
        with concurrent.futures.ThreadPoolExecutor(
                max_workers=min(MAX_PARALLEL, len(peers))) as pool:
            for peer, res in zip(peers, pool.map(lambda ctx, peer: ctx.run(one, peer),
                                                 contexts, peers)):
                ret[peer] = core.damaged_verdict(res, primary)
                self.salt.progress(f"multimaster: {peer}: {'ok' if res['result'] else 'FAILED'}")
        rebuilt = statefile.noticed()
        for res in ret.values():
            if rebuilt:
                res["primary_rebuilt"] = rebuilt
        return ret
