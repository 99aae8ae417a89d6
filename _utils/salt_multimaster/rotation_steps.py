"""
The steps of a master key rotation (``salt-run multimaster.rotate_key``) on
the primary: :class:`Rotation`, the step machine that rotates each master
in turn, records each step in the rotation record and resumes a re-run
where the last one stopped, and :class:`SaltOps`, the one small object
through which it asks Salt for what it needs (:func:`salt_ops` builds this
master's, through :mod:`salt_multimaster.jobs`; :func:`rotate_key`: the
runner's call, its input checked): plain functions, no Salt loader,
unit-tested without daemons and on a fake clock.
The keys, the record, the staged keypair and the verdict on each minion:
:mod:`salt_multimaster.rotation`.
"""

import functools
import logging
import os
import time

import salt.utils.systemd

from salt_multimaster import (backup, daemon, finger, jobs, layout, lock, restart, rotation, seal,
                              validate)

log = logging.getLogger(__name__)

POLL = 2  # seconds between two looks at a restarting master, or at the minions
CHECK_TRIES, CHECK_PAUSE = 3, 5  # the pre-checks: a peer's minion reconnecting


class SaltOps:
    """
    What a :class:`Rotation` asks of Salt on the primary; :func:`salt_ops`
    builds it from the runner's ``__opts__`` and LocalClient, a unit test
    from fakes.

    opts
        The primary's master opts.
    call_peer(peer, fun, kwarg, timeout)
        The reply of ``peer``'s minion to ``fun`` (``kwarg`` sealed to it,
        :mod:`salt_multimaster.protocol`); None when it did not answer;
        ``{"result": False, "error": ...}`` when it refused or runs another
        protocol version.
    minions(tgt, tgt_type, fun, kwarg, timeout)
        ``(expected ids, {id: return})`` of ``fun`` on the targeted minions,
        within ``timeout`` seconds.
    status(peers, topology)
        ``multimaster.status`` of ``peers`` for the master keys.
    restart_primary(restart_cmd)
        Restart this master (:func:`rotation.restart_primary`): ``"restarting"`` or
        ``"restart_required"``.
    restart_failed()
        Why the last restart command of this master failed
        (:func:`command_failure`), None while it runs or when it did not.
    primary_serving()
        ``(serving, detail)`` of this master's daemon (:func:`serving`).
    reconnect_events()
        This master restarted under the run: drop its event connection.
    sleep(seconds), monotonic()
        The clock of every wait.
    """

    def __init__(self, opts, *, call_peer, minions, status, restart_primary, primary_serving,
                 reconnect_events, restart_failed=lambda: None, sleep=time.sleep,
                 monotonic=time.monotonic):
        self.opts = opts
        self.call_peer, self.minions, self.status = call_peer, minions, status
        self.restart_primary, self.primary_serving = restart_primary, primary_serving
        self.restart_failed = restart_failed
        self.reconnect_events = reconnect_events
        self.sleep, self.monotonic = sleep, monotonic


def refused(message):
    """Bad input or a refused rotation: nothing changed, logged, a non-zero exit."""
    log.error("multimaster: %s", message)
    return {"result": False, "error": message, "retcode": 1}


def reconnect_events(jid_event):
    """
    This master restarted under the running salt-run: its job's connection
    to the master event bus (``jid_event``: the runner's ``__jid_event__``)
    is gone (Salt 3006 dies firing the job's return on it,
    StreamClosedError).  Drop it: the next event connects again.
    """
    try:
        jid_event.event.close_pull()
    except Exception as exc:  # pylint: disable=broad-except
        log.debug("multimaster: event connection not reset: %s", exc)


def salt_ops(opts, status, jid_event):
    """
    What the rotation asks of Salt on this master (:class:`SaltOps`):
    ``status``: the runner's ``multimaster.status``, ``jid_event``: its
    job's event connection (``__jid_event__``, or None).
    """
    state_dir = layout.state_dir(opts)
    started = []
    return SaltOps(
        opts, call_peer=functools.partial(jobs.call_peer, opts),
        minions=functools.partial(jobs.minion_returns, opts),
        status=lambda peers, topology: status(peers=",".join(peers), topology=topology,
                                              replicate="master_keys"),
        restart_primary=lambda cmd: rotation.restart_primary(
            opts, cmd, not cmd and salt.utils.systemd.booted({}), started.append),
        restart_failed=lambda: rotation.command_failure(started[-1] if started else None),
        primary_serving=lambda: rotation.serving(
            opts, os.path.join(state_dir, daemon.RESTART_MARKER)),
        reconnect_events=lambda: reconnect_events(jid_event))


def rotate_key(opts, jid, jid_event, status, *, peers, topology, test, fresh, tgt, tgt_type,
               restart_cmd, restart_wait, verify_wait, timeout):
    """
    ``salt-run multimaster.rotate_key`` (its arguments): the input checked
    before anything is sent, then the :class:`Rotation` with this master's
    Salt (:func:`salt_ops`), under the sync lock held as ``jid`` (the
    runner's ``__jid__``).
    """
    conf = opts.get("multimaster") if isinstance(opts.get("multimaster"), dict) else {}
    topology = topology or conf.get("topology") or "shared"
    restart_cmd = restart_cmd or conf.get("master_restart_cmd") or None
    try:
        configured = validate.as_list("multimaster:peers", conf.get("peers"))
        conf_peers = validate.as_list("peers", peers) or configured
        test = validate.boolean("test", test)
        fresh = validate.boolean("fresh", fresh)
        validate.peers(conf_peers, configured)
        waits = {k: validate.timeout(k, v, maximum=3600) for k, v in
                 (("restart_wait", restart_wait), ("verify_wait", verify_wait),
                  ("timeout", timeout))}
        keep = validate.keep("multimaster:backup_keep",
                             conf.get("backup_keep", backup.DEFAULT_KEEP))
    except validate.InvalidInput as exc:
        return refused(f"multimaster.rotate_key: {exc}")
    reason = rotation.unsupported(opts, topology)
    if reason:
        return refused(f"multimaster.rotate_key: {opts['id']}: {reason}")
    if restart_cmd is not None and not isinstance(restart_cmd, str):
        return refused(f"multimaster.rotate_key: restart_cmd must be a command, "
                       f"not {restart_cmd!r}")
    # the same command restarts this primary last: refused before any master is touched
    why = restart.impossible(restart_cmd, "salt-master", runs="salt-master") \
        if restart_cmd else None
    if why:
        return refused(f"multimaster.rotate_key: {opts['id']}: {why}")
    if not conf_peers:
        return refused("multimaster.rotate_key: no peers: set multimaster:peers or pass "
                       "peers=")
    rot = Rotation(salt_ops(opts, status, jid_event), topology, conf_peers, restart_cmd, tgt,
                   tgt_type, backup_keep=keep, **waits)
    ret = rot.check(fresh, test)
    if ret["result"] and not test:
        try:
            with lock.SyncLock(os.path.join(rot.state_dir, lock.LOCK_NAME), jid, wait=0):
                ret = rot.run(ret)
        except lock.Busy as exc:
            return refused(f"multimaster.rotate_key: {exc}")
    if not ret["result"]:
        ret["retcode"] = 1
    return ret


class Rotation:
    """
    One ``salt-run multimaster.rotate_key`` on the primary: :meth:`check`
    (the record to resume, the pre-checks, the plan: a dry run ends there),
    then :meth:`run` (under the sync lock): each step not serving yet, in
    order, then the minions' verdicts.  A step's progress is saved in the
    record as soon as it is made, so that a re-run resumes where this one
    stopped.
    """

    def __init__(self, salt, topology, peers, restart_cmd=None, tgt="*", tgt_type="glob",
                 restart_wait=120, verify_wait=60, timeout=15, backup_keep=backup.DEFAULT_KEEP):
        self.salt, self.opts, self.backup_keep = salt, salt.opts, backup_keep
        self.topology, self.peers, self.primary = topology, list(peers), salt.opts["id"]
        self.restart_cmd, self.tgt, self.tgt_type = restart_cmd, tgt, tgt_type
        self.restart_wait, self.verify_wait, self.timeout = restart_wait, verify_wait, timeout
        self.state_dir = layout.state_dir(self.opts)
        self.record, self.fresh = None, False
        # the new keypair (shared; priv None once installed here) and fingerprints
        self.priv = self.pub = self.new_finger = self.expect_finger = None

    def save(self):
        rotation.save_record(self.state_dir, self.record)

    # ----- before anything changes ------------------------------------------
    def check(self, fresh=False, test=False):
        """
        The return of a dry run: the record to resume (none with ``fresh``)
        or a new one, the pre-checks' errors, the plan.  Writes nothing.
        """
        self.fresh = fresh
        try:
            record = None if fresh else rotation.load_record(self.state_dir)
        except rotation.RotationError as exc:
            return refused(f"multimaster.rotate_key: {exc}")
        if record:
            reason = rotation.resumable(record, self.topology, self.peers, self.primary)
            if reason:
                return refused(f"multimaster.rotate_key: {reason}")
        errors = self._checks(record is None)
        self.record = record or rotation.new_record(self.topology, self.peers, self.primary)
        ret = {"result": not errors, "topology": self.topology, "test": test,
               "resumed": record is not None, "started": self.record["started"],
               "plan": rotation.plan(self.record)}
        if errors:
            ret["error"] = "; ".join(errors)
        return ret

    def _checks(self, fresh_start):
        """Errors that stop a rotation before it changes anything: peers down, keys not in step."""
        errors = self._status_errors(fresh_start)
        for _ in range(CHECK_TRIES - 1):
            if not errors:
                break
            # a peer's minion reconnecting to a master restarted a moment ago
            self.salt.sleep(CHECK_PAUSE)
            errors = self._status_errors(fresh_start)
        return errors

    def _status_errors(self, fresh_start):
        st = self.salt.status(self.peers, self.topology)
        if not isinstance(st, dict):
            return [f"multimaster.status failed: {st}"]
        if "error" in st and "result" in st:
            return [st["error"]]
        errors = []
        for peer in self.peers:
            res = st.get(peer) or {}
            if not res.get("reachable") or res.get("master_running") is False:
                errors.append(f"{peer}: {res.get('error') or 'not reachable'}")
            elif (self.topology == "signed" or fresh_start) and any(
                    (res.get("drift") or {}).get("master_keys", {}).values()):
                errors.append(
                    f"{peer}: its {'master_sign' if self.topology == 'signed' else 'master'} "
                    "keypair differs from the primary's: run salt-run multimaster.sync "
                    f"only=master_keys topology={self.topology} first")
        return errors

    # ----- the run ------------------------------------------------------------
    def run(self, ret):
        """Each step not serving yet, then the verdicts: ``ret`` of :meth:`check`, completed."""
        if self.fresh:
            rotation.drop_stage(self.state_dir)  # a new rotation, a new key
        self.save()
        self._new_key()
        error = None
        for name in self.record["steps"]:
            step = self.record["state"][name]
            if step["state"] == rotation.SERVING:
                continue
            log.info("multimaster: rotate_key: %s", name)
            if name == rotation.MINIONS_STEP:
                self._tell_minions(step)
            elif name == self.primary:
                error = self._primary(step)
            else:
                error = self._peer(name, step)
            if error:
                break
        ret["steps"] = {("minions" if n == rotation.MINIONS_STEP else n):
                        dict(self.record["state"][n])
                        for n in self.record["steps"]}
        if error:
            self.save()
            ret.update(result=False, error=error)
            return ret
        confirmed, unconfirmed = self._verify()
        ret["minions"] = {"confirmed": confirmed, "unconfirmed": unconfirmed}
        ret["fingerprints"] = {n: self.record["state"][n].get("new") for n in self.record["steps"]
                               if n != rotation.MINIONS_STEP}
        if unconfirmed:
            ret.update(result=False,
                       error=f"{len(unconfirmed)} minion(s) did not confirm the new key: "
                             + ", ".join(sorted(unconfirmed)) + " (see minions:unconfirmed)")
        else:
            self.record["done"] = True
        self.save()
        if self.topology == "shared":
            ret["next"] = (f"set pillar multimaster:master_finger to {self.new_finger} (and "
                           "multimaster:master_pub, if used, to the new master.pub) before the "
                           "next state.apply of salt.multimaster, which would otherwise put the "
                           "old key back")
        ret["plan"] = rotation.plan(self.record)
        return ret

    def _keysize(self):
        return self.opts.get("keysize") or rotation.DEFAULT_KEYSIZE

    def _new_key(self):
        """The fingerprint every minion must trust afterwards; (shared) the new keypair."""
        if self.topology == "signed":
            self.expect_finger = rotation.key_finger(
                layout.master_key_files(self.opts, "signed")[1], self.opts)
            return
        if self.record["state"][self.primary]["state"] == rotation.PENDING:
            self.priv, self.pub = rotation.stage_keypair(self.state_dir, self._keysize())
        else:
            # installed here: the staged copy is gone, the key files hold it
            with open(layout.master_key_files(self.opts, "shared")[1], "rb") as fh:
                self.priv, self.pub = None, fh.read()
        self.new_finger = self.expect_finger = finger.master_finger(
            self.pub.decode(), self.opts.get("hash_type", "sha256"))

    def _peer(self, peer, step):
        """Rotate one peer: new key, restart, wait until it serves it.  Error or None."""
        restart = None
        if step["state"] == rotation.PENDING:
            kwarg = {"topology": self.topology, "restart_cmd": self.restart_cmd,
                     "backup_keep": self.backup_keep}
            if self.topology == "shared":
                with open(os.path.join(self.opts["pki_dir"], "minions", peer),
                          encoding="utf-8") as fh:
                    kwarg["keypair"] = {"pub": self.pub.decode(), "sealed": seal.seal(
                        fh.read(), self.priv, peer, "rotate_key/master.pem")}
            got = self.salt.call_peer(peer, "multimaster_peer.rotate_key", kwarg, self.timeout)
            if not isinstance(got, dict) or not got.get("result"):
                return (f"{peer}: no new key: "
                        + (got.get("error", str(got)) if isinstance(got, dict)
                           else "its salt-minion did not answer (start it, check salt-run "
                                "manage.status), then run salt-run multimaster.rotate_key again"))
            step.update(state=rotation.WRITTEN, old=got["old"], new=got["new"],
                        backup=got["backup"])
            self.save()
            restart = got["restart"]
        return self._wait(peer, step, restart)

    def _peer_serving(self, peer, step):
        """``(serving, detail)`` of a peer after its key write."""
        got = self.salt.call_peer(peer, "multimaster_peer.inventory",
                                  {"categories": ["master_keys"], "topology": "shared"},
                                  self.timeout)
        if not isinstance(got, dict) or "master_keys" not in got:
            return False, "its salt-minion did not answer"
        if got["master_keys"].get("fingerprint") != step["new"]:
            return False, (f"its key on disk is {got['master_keys'].get('fingerprint')}, not "
                           f"the new {step['new']} (restored or replaced since?)")
        if not got.get("master_running"):
            return False, f"its salt-master does not answer on {got.get('master_address')}"
        if got.get("restart_pending") is not False:
            return False, "its salt-master still runs with the old key (not restarted since)"
        return True, None

    def _primary_serving(self, step):
        if rotation.current_finger(self.opts) != step["new"]:
            return False, (f"its key on disk is not the new {step['new']} (restored or "
                           f"replaced since?)")
        return self.salt.primary_serving()

    def _restart(self, name):
        """Ask master ``name`` to restart (its key is written): how, or None (no answer)."""
        if name == self.primary:
            return self.salt.restart_primary(self.restart_cmd)
        got = self.salt.call_peer(name, "multimaster_peer.rotate_key",
                                  {"topology": self.topology, "restart_only": True,
                                   "restart_cmd": self.restart_cmd}, self.timeout)
        return got.get("restart") if isinstance(got, dict) else None

    def _wait(self, name, step, restart):
        """
        Wait until master ``name`` serves its new key (asking for a restart
        when none was asked in this run); mark the step serving.  Error or None.
        """
        is_primary = name == self.primary
        check = ((lambda: self._primary_serving(step)) if is_primary
                 else (lambda: self._peer_serving(name, step)))
        if restart is None:
            ok, detail = check()
            if ok:
                step["state"] = rotation.SERVING
                self.save()
                return None
            restart = self._restart(name)
            if not restart:
                return f"{name}: {detail}; its salt-minion did not answer the restart"
        step["restart"] = restart
        if restart == "restart_required":
            return rotation.restart_remedy(name, restart)
        deadline = self.salt.monotonic() + self.restart_wait
        detail = None
        while self.salt.monotonic() < deadline:
            self.salt.sleep(POLL)
            try:
                ok, detail = check()
            except Exception as exc:  # pylint: disable=broad-except
                # the primary's own restart: its sockets go away for a while
                ok, detail = False, f"{exc.__class__.__name__}: {exc}"
            if ok:
                step["state"] = rotation.SERVING
                step.pop("restart", None)
                self.save()
                if is_primary:
                    self.salt.reconnect_events()
                return None
            failed = self.salt.restart_failed() if is_primary else None
            if failed:
                # the service manager said no: no use waiting for the rest
                return rotation.restart_remedy(name, f"{failed}: {detail}")
        return rotation.restart_remedy(name, f"after {self.restart_wait} s: {detail}")

    def _primary(self, step):
        """Rotate the primary itself (last): new key, restart, wait.  Error or None."""
        restart = None
        if step["state"] == rotation.PENDING:
            try:
                if self.topology == "shared":
                    priv, pub = self.priv, self.pub
                else:
                    priv, pub = rotation.gen_keypair(self._keysize())
                root = rotation.backup_root(self.opts)
                done = rotation.install(self.opts, priv, pub, root)
            except (rotation.RotationError, OSError, ValueError) as exc:
                return f"{self.primary}: no new key: {exc}"
            backup.trim(os.path.dirname(root), self.backup_keep)
            step.update(state=rotation.WRITTEN, old=done["old"], new=done["new"],
                        backup=done["backup"])
            self.save()
            if self.topology == "shared":
                rotation.drop_stage(self.state_dir)
            restart = self.salt.restart_primary(self.restart_cmd)
        return self._wait(self.primary, step, restart)

    def _tell_minions(self, step):
        """topology shared: every targeted minion now trusts the new public key."""
        expected, got = self.salt.minions(
            self.tgt, self.tgt_type, "multimaster.master_key_apply",
            {"contents": self.pub.decode(), "master_finger": self.new_finger,
             "topology": "shared"}, self.timeout)
        told = sorted(m for m, r in got.items() if isinstance(r, dict) and r.get("expected"))
        step.update(state=rotation.SERVING, told=len(told),
                    not_told=sorted(set(expected) - set(told)))
        self.save()

    def _verify(self):
        """``(confirmed ids, {id: {"reason", "remedy"}})``: the targeted minions' verdicts."""
        kwarg = {"master_finger": self.expect_finger, "topology": self.topology}
        expected, got = self.salt.minions(self.tgt, self.tgt_type, "multimaster.audit", kwarg,
                                          self.timeout)
        verdicts = {mid: rotation.minion_verdict(got.get(mid)) for mid in expected}
        deadline = self.salt.monotonic() + self.verify_wait
        while any(verdicts.values()) and self.salt.monotonic() < deadline:
            # minions reconnect to a restarted master after a while: ask again
            self.salt.sleep(POLL)
            again = sorted(m for m, v in verdicts.items() if v)
            _, more = self.salt.minions(again, "list", "multimaster.audit", kwarg, self.timeout)
            for mid in again:
                verdicts[mid] = rotation.minion_verdict(more.get(mid))
        unconfirmed = {mid: {"reason": reason,
                             "remedy": rotation.remedy(mid, self.topology, self.new_finger)}
                       for mid, reason in sorted(verdicts.items()) if reason}
        self.record["unconfirmed"] = sorted(unconfirmed)
        return sorted(m for m, v in verdicts.items() if not v), unconfirmed
