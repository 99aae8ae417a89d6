"""
The rounds of one sync between the primary and its peers: which publishes
go out, in which order, and what is planned from what came back.

A full sync asks every peer for its inventory, plans on the primary, then
applies (two publishes).  When the primary knows what a peer holds (what it
last confirmed, :func:`salt_multimaster.memory.remembered`), a change sync is
one publish: the apply goes out with the digests the peer is expected to
hold, and a peer that holds something else answers with its inventory (the
second round).  A targeted key sync (``minion_ids``) is a sync of
``minion_keys`` whose plan keeps the keys of those ids only.

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
    condition: nothing applied) or ``mismatch`` (the peer does not hold what
    was expected: nothing applied, its ``inventory`` to plan from).
    """

    kind: str
    report: dict = None
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
    def read_primary(self, categories):
        conf = self.conf
        return core.read_primary(self.opts, categories, conf["topology"],
                                 conf["master_config_keys"], conf["rescan"], keep=not self.test)

    def ask(self, peers, categories, digests=None):
        """
        Every peer's inventory of ``categories`` against ``digests``:
        ``{peer: (reply, error)}``.
        """
        return self._publish_inventory(peers, categories, digests).replies(
            self._inventory_wait(peers))

    def _publish_inventory(self, peers, categories, digests):
        conf = self.conf
        request = protocol.request(
            "multimaster_peer.inventory", categories=categories, digests=digests,
            topology=conf["topology"], config_keys=conf["master_config_keys"],
            rescan=conf["rescan"] or None, epoch=self.claim)
        return self.salt.publish(peers, "multimaster_peer.inventory", request, conf["timeout"])

    def _inventory_wait(self, peers):
        """The ``on_wait`` of an inventory job: one progress line now and then."""
        names = ", ".join(peers)
        self.salt.progress(f"multimaster: asking {names} for an inventory", phase="inventory")
        return lambda seconds: self.salt.progress(
            f"multimaster: waiting for the inventory of {names}, {seconds:.0f} s",
            phase="inventory")

    def inventories(self, categories, peers):
        """
        The primary's state and the inventory ``{peer: (reply, error)}`` of
        each of ``peers``, asked with the digests of that state: a peer in
        step answers with digests only.
        """
        primary = self.read_primary(categories)
        if not peers:
            return primary, {}
        return primary, self.ask(peers, categories, core.current_digests(primary, categories))

    # ----- applying ----------------------------------------------------------
    def apply(self, peer, ops, primary, how, keys_digest=None, expect=None, confirm=None):
        """Publish the apply of ``ops`` to ``peer``: ``(reply, error)``."""
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
            got = self.salt.publish([peer], "multimaster_peer.apply", kwarg, wait).wait(
                still).get(peer)
        finally:
            if token:
                transport.revoke(opts, token, self.salt.jid_dir)
        if expect is not None and protocol.refused(got):
            # nothing applied (a peer older than this expectation refuses it)
            log.info("multimaster: %s refused the conditional apply: %s", peer, got["error"])
            return Outcome("refused"), None
        applied, error = protocol.check_reply(peer, "multimaster_peer.apply", got)
        if expect is not None and applied is not None and "inventory" in applied:
            return Outcome("mismatch", inventory=applied["inventory"]), None
        return applied, error

    def sync_one(self, peer, categories, primary, inv, expect=None):
        """
        Plan ``peer`` from its inventory ``inv`` and apply: an
        :class:`Outcome`, a ``report`` unless the apply is
        conditional (``expect``: ``inv`` is then what the primary last
        confirmed it held) and came to ``nothing`` (nothing to apply; a
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
        how = transport.transport(self.opts, peer, ops, conf["inline_limit"],
                                  conf["pull_min_files"]) if ops else None
        if how and how["error"]:
            ret["result"] = False
            ret["error"] = how["error"]
            if not test:
                core.unconfirmed(ret, categories)
            return Outcome("report", ret)
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
            applied, error = self.apply(peer, ops, primary, how, keys_digest, expect, confirm)
            if error:
                ret["result"] = False
                ret["error"] = error
                core.unconfirmed(ret, categories)
                return Outcome("report", ret)
            if isinstance(applied, Outcome):
                return dataclasses.replace(applied, partial=partial)
            core.merge(plan_report, applied)
            for key in ("restart", "backup", "aes_rotation"):
                if applied.get(key):
                    ret[key] = applied[key]
            if applied.get("rebuilt"):
                ret["rebuilt"] = list(applied["rebuilt"])
            if expect is not None:
                # the peer's master as the peer found it before applying
                inv = dict(inv, **{k: applied.get(k) for k in
                                   ("master_running", "master_address", "restart_pending",
                                    "master_restart")})
        return Outcome("report", core.finish(peer, ret, inv, categories, test=test),
                       partial=partial)

    def sync_remembered(self, peer, categories, primary, held):
        """
        A change sync in one publish: plan ``peer`` as holding what it was
        last confirmed to hold (``held``) and publish the apply conditional
        on it.  A peer that holds something else answers with its
        inventory, and is planned from it (the usual second round).  Returns
        ``(report outcome, the inventory planned from)``.
        """
        inv = memory.expected_inventory(held)
        sent = protocol.expected_digests(protocol.expectation(held))
        out = None
        if not core.unplannable(categories, primary, inv, sent):
            out = self.sync_one(peer, categories, primary, inv,
                                expect=protocol.expectation(held))
            if out.kind == "report":
                return out, inv
        if out is not None and out.kind == "mismatch":
            log.info("multimaster: %s does not hold what it was last sent", peer)
            inv = out.inventory
        if (out is None or out.kind != "mismatch"
                or core.unplannable(categories, primary, inv, sent)):
            inv, error = self.ask([peer], categories,
                                  core.current_digests(primary, categories))[peer]
            if error:
                return Outcome("report", {"result": False, "error": error}), {}
        return self.sync_one(peer, categories, primary, inv), inv

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
        # a peer whose state is known gets one publish (sync_remembered)
        primary, invs = self.inventories(categories, [p for p in peers if not held.get(p)])

        def one(peer):
            inv, out = {}, None
            try:
                if held.get(peer):
                    out, inv = self.sync_remembered(peer, categories, primary, held[peer])
                else:
                    inv, error = invs[peer]
                    out = (Outcome("report", {"result": False, "error": error}) if error else
                           self.sync_one(peer, categories, primary, inv))
                res = out.report
            except Exception as exc:  # pylint: disable=broad-except
                log.exception("multimaster: sync of %s failed", peer)
                res = {"result": False, "error": f"{exc.__class__.__name__}: {exc}"}
            if test:
                pass
            elif out is not None and out.partial:
                # the keys of other ids left as they differ: not a replica of them
                memory.forget(opts, peer, ["minion_keys"])
            else:
                memory.remember(opts, peer, categories, primary, inv or {}, res)
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
