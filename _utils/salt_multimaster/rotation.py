"""
Master key rotation (``salt-run multimaster.rotate_key``): the steps on one
master, the rotation record that lets a re-run resume, the plan, and the
verdict on each minion.

Sequence (docs/key-rotation.rst):

- ``signed``: each master in turn (the peers, then the primary) generates a
  new keypair itself (the private key never leaves the host), keeps the old
  one in its protected backup, and restarts; the next master is rotated only
  once this one serves its new key.  Minions with
  ``verify_master_pubkey_sign`` accept each new key, signed with the shared
  master_sign key, by themselves.
- ``shared``: the primary generates the new shared keypair into a staging
  dir (0400 in 0700); each peer in turn receives it sealed to its minion key
  and restarts (minions keep trusting the old key, still served by the
  primary); then every minion is told the new public key (it now trusts the
  key the peers serve, while its session with the primary lives on); then
  the primary installs it and restarts.  At every moment each reachable
  minion trusts a key that a running master serves.

The step machine (:class:`Rotation`) asks Salt for what it needs through
one small object (:class:`SaltOps`) that the runner builds: plain
functions, no Salt loader, unit-tested without daemons and on a fake clock.
"""

import datetime
import json
import logging
import os
import subprocess
import time

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from salt_multimaster import backup, daemon, finger, fsutil, layout, seal, statefile

log = logging.getLogger(__name__)

RECORD_NAME = "rotation.json"
STAGE_NAME = "rotation-staged"
MINIONS_STEP = "@minions"
# what a master step goes through
PENDING, WRITTEN, SERVING = "pending", "written", "serving"
DEFAULT_KEYSIZE = 4096


class RotationError(ValueError):
    """A master that cannot be rotated as asked (named, with what to do)."""


def backup_stamp():
    """A backup folder name, as a sync names them."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")


def gen_keypair(bits=DEFAULT_KEYSIZE):
    """A new RSA keypair as Salt writes it: ``(private PEM, public PEM)`` bytes."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=int(bits))
    priv = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    pub = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return priv, pub


def public_of(priv):
    """The public PEM of a private PEM (bytes); RotationError when it is no RSA key."""
    try:
        key = serialization.load_pem_private_key(priv, password=None)
    except (TypeError, ValueError) as exc:
        raise RotationError(f"not an unencrypted PEM private key: {exc}") from None
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def own_key_files(mopts):
    """``(pem, pub)``: the files this master loads for its own keypair."""
    return layout.master_key_files(mopts, "shared")


def unsupported(mopts, topology):
    """Why this master's key cannot be rotated by rotate_key, or None."""
    if topology not in layout.TOPOLOGIES:
        return f"unknown topology {topology!r} (known: {', '.join(layout.TOPOLOGIES)})"
    if mopts.get("key_pass"):
        return ("the master key is encrypted (key_pass): rotate_key writes unencrypted "
                "keys only; rotate it by hand")
    if mopts.get("cluster_id"):
        return "a Salt cluster (cluster_id) uses cluster.pem: rotate_key does not manage it"
    if topology == "signed":
        if not mopts.get("master_sign_pubkey"):
            return ("topology signed needs master_sign_pubkey: True on every master (else "
                    "minions with verify_master_pubkey_sign refuse it)")
        if mopts.get("master_use_pubkey_signature"):
            return ("master_use_pubkey_signature is set: the master serves a precomputed "
                    "signature file that rotate_key does not regenerate; unset it (the "
                    "master then signs with master_sign.pem) or rotate by hand")
        sign_pem, _ = layout.master_key_files(mopts, "signed")
        if not os.path.isfile(sign_pem):
            return (f"{sign_pem} is missing: the master cannot sign its new key; run "
                    "salt-run multimaster.sync only=master_keys topology=signed first")
    return None


def key_finger(path, mopts):
    """The fingerprint (``salt-key -F master`` form) of the public key file at ``path``."""
    return finger.file_finger(path, mopts.get("hash_type", "sha256")) or None


def current_finger(mopts):
    """The fingerprint of this master's own public key, as on disk."""
    return key_finger(own_key_files(mopts)[1], mopts)


def install(mopts, priv, pub, backup_root):
    """
    Keep this master's keypair in ``backup_root/master_keys/`` (0400 private
    key, 0700 dirs: where a sync keeps what it replaces, so
    ``multimaster.restore`` puts it back), then write ``priv`` (0400) and
    ``pub`` into the files Salt loads (never through a link leading out of
    pki_dir), each atomically.  Returns ``{"old", "new", "backup"}``.
    """
    if public_of(priv).strip() != pub.strip():
        raise RotationError("the new public key does not belong to the new private key")
    pki = mopts["pki_dir"]
    pem_path, pub_path = own_key_files(mopts)
    pem_path, pub_path = fsutil.confine(pki, pem_path), fsutil.confine(pki, pub_path)
    old = key_finger(pub_path, mopts)
    fsutil.makedirs(backup_root, mode=fsutil.KEY_DIR_MODE)
    os.chmod(backup_root, fsutil.KEY_DIR_MODE)
    saved = None
    for path, rel in ((pem_path, "master_keys/master.pem"), (pub_path, "master_keys/master.pub")):
        if fsutil.backup(path, backup_root, rel):
            saved = backup_root
    backed = os.path.join(backup_root, "master_keys", "master.pem")
    if os.path.isfile(backed):
        os.chmod(backed, fsutil.PRIVATE_KEY_MODE)
    fsutil.atomic_write(pem_path, priv, mode=fsutil.PRIVATE_KEY_MODE)
    fsutil.atomic_write(pub_path, pub, mode=0o644)
    return {"old": old, "new": key_finger(pub_path, mopts), "backup": saved}


def prune_backups(mopts, keep=backup.DEFAULT_KEEP):
    """Keep the newest ``keep`` backups of this master (sync and rotation alike)."""
    return backup.prune(os.path.join(mopts["cachedir"], "multimaster", "backup"), keep)


def backup_root(mopts):
    """A new backup folder of this master: ``<cachedir>/multimaster/backup/<stamp>``."""
    return os.path.join(mopts["cachedir"], "multimaster", "backup", backup_stamp())


def serving(mopts, marker):
    """
    ``(serving, detail)``: whether this master runs, started after the key
    write recorded in ``marker`` (:data:`salt_multimaster.daemon.RESTART_MARKER`).
    """
    running, where = daemon.master_running(mopts)
    if not running:
        return False, f"its salt-master does not answer on {where}"
    pending = daemon.restart_pending(mopts, marker)
    if pending is None:
        return False, (f"the start time of its salt-master (pidfile {mopts.get('pidfile')}) "
                       f"is unknown")
    if pending:
        return False, "its salt-master still runs with the old key (not restarted since)"
    return True, None


def restart_primary(mopts, restart_cmd, systemd_booted, started=None):
    """
    Restart the master this runs on (options ``mopts``), in the background:
    ``restart_cmd``, else ``systemctl restart salt-master`` where systemd
    runs; the restart marker is written first (:func:`daemon.mark_restart`).
    Returns ``"restarting"`` or ``"restart_required"`` (nothing could
    restart it).  ``started(proc)``, when given, is called with the
    command's process (:func:`command_failure`).
    """
    daemon.mark_restart(mopts, os.path.join(layout.state_dir(mopts), daemon.RESTART_MARKER))
    cmd = restart_cmd or ("systemctl restart salt-master" if systemd_booted else None)
    if not cmd:
        return "restart_required"
    # its own session: the restart outlives this salt-run
    proc = subprocess.Popen(  # pylint: disable=consider-using-with
        cmd, shell=True, cwd="/", start_new_session=True, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if started is not None:
        started(proc)
    return "restarting"


def command_failure(proc):
    """
    Why the restart command ``proc`` (a ``Popen``, or None) failed: its exit
    status once it exited non-zero, else None (running, done, or killed by
    a signal, as a restart may kill it).
    """
    code = proc.poll() if proc is not None else None
    if code is None or code <= 0:
        return None
    return f"its restart command {proc.args!r} exited {code}"


def restart_remedy(name, restart):
    """The error of a master step whose restart did not happen or not in time."""
    if restart == "restart_required":
        return (f"{name}'s salt-master holds its new key but must restart to serve it and no "
                "service manager restarted it (set the minion option "
                f"multimaster.master_restart_cmd on {name}'s host, or multimaster:"
                "master_restart_cmd for every master, or restart it yourself); then run "
                "salt-run multimaster.rotate_key again")
    return (f"{name}'s salt-master was asked to restart but does not serve its new key yet "
            f"({restart}): check it (service status, its log), start it, then run "
            "salt-run multimaster.rotate_key again")


# ----- staged shared keypair (primary) ---------------------------------------
def stage_dir(state_dir):
    return os.path.join(state_dir, STAGE_NAME)


def stage_keypair(state_dir, bits):
    """
    The staged new shared keypair ``(priv, pub)``: generated once (0400 in a
    0700 dir under the primary's state dir) and reused by a re-run.
    """
    path = stage_dir(state_dir)
    statefile.makedirs(path, state_dir, mode=fsutil.KEY_DIR_MODE)
    os.chmod(path, fsutil.KEY_DIR_MODE)
    pem, pub = os.path.join(path, "master.pem"), os.path.join(path, "master.pub")
    try:
        priv, pubdata = statefile.read_bytes(pem), statefile.read_bytes(pub)
        if (priv is None) != (pubdata is None) or (priv is not None and not (
                b"PRIVATE KEY-----" in priv and b"-----BEGIN PUBLIC KEY-----" in pubdata)):
            raise statefile.Damaged(path, "not a whole PEM keypair")
    except statefile.Damaged as exc:
        # some masters may hold it already: never replaced by another one here
        raise RotationError(
            f"the staged keypair {exc}: the rotation cannot go on with it; check which "
            "master serves which key (salt-run multimaster.status replicate=master_keys), "
            "then run salt-run multimaster.rotate_key fresh=True") from None
    if priv is not None:
        return priv, pubdata
    priv, pubdata = gen_keypair(bits)
    fsutil.atomic_write(pem, priv, mode=fsutil.PRIVATE_KEY_MODE)
    fsutil.atomic_write(pub, pubdata, mode=0o644)
    return priv, pubdata


def drop_stage(state_dir):
    """Remove the staged keypair (the primary's key files hold it by then)."""
    path = stage_dir(state_dir)
    for name in ("master.pem", "master.pub"):
        fsutil.remove(os.path.join(path, name))
    try:
        os.rmdir(path)
    except OSError:
        pass


# ----- the rotation record (primary) -------------------------------------------
def steps_for(topology, peers, primary):
    """The steps in order: each peer, (shared) the minions, then the primary."""
    steps = list(peers)
    if topology == "shared":
        steps.append(MINIONS_STEP)
    steps.append(primary)
    return steps


def new_record(topology, peers, primary):
    return {
        "started": backup_stamp(),
        "topology": topology,
        "primary": primary,
        "steps": steps_for(topology, peers, primary),
        "state": {step: {"state": PENDING} for step in steps_for(topology, peers, primary)},
        "unconfirmed": None,
        "done": False,
    }


def _valid_record(record):
    return isinstance(record, dict) and isinstance(record.get("topology"), str) and isinstance(
        record.get("steps"), list) and isinstance(record.get("state"), dict) and all(
        isinstance(record["state"].get(step), dict) for step in record["steps"])


def load_record(state_dir):
    """
    The rotation in progress (a dict), or None.  A damaged record is an
    unfinished rotation whose steps are unknown: :class:`RotationError`
    naming it and what to do (never a fresh start behind the operator's back).
    """
    path = os.path.join(state_dir, RECORD_NAME)
    try:
        record = statefile.read(path, valid=_valid_record)
    except statefile.Damaged as exc:
        statefile.notice(path, exc.why, "rotate_key refused until it is replaced")
        raise RotationError(
            f"the rotation record {exc}: what an unfinished rotation did is unknown; check "
            "which master serves which key (salt-run multimaster.status "
            "replicate=master_keys), then run salt-run multimaster.rotate_key fresh=True "
            "(a new record replaces it)") from None
    return record if record is not None and not record.get("done") else None


def save_record(state_dir, record):
    statefile.write(os.path.join(state_dir, RECORD_NAME),
                    json.dumps(record, indent=1, sort_keys=True))


def resumable(record, topology, peers, primary):
    """Why ``record`` cannot be resumed with these settings, or None."""
    if record["topology"] != topology:
        return (f"a {record['topology']} rotation started {record['started']} is unfinished; "
                f"finish it (topology={record['topology']}) or pass fresh=True")
    if record["steps"] != steps_for(topology, peers, primary):
        return (f"the rotation started {record['started']} covers "
                f"{', '.join(s for s in record['steps'] if s != MINIONS_STEP)}; finish it "
                "with the same peers or pass fresh=True")
    return None


def plan(record):
    """The steps with what each still needs: ``[{"step", "state", "todo"}]``."""
    todo = {PENDING: "new key, restart, confirm it serves the key",
            WRITTEN: "restart, confirm it serves the key", SERVING: "done"}
    ret = []
    for step in record["steps"]:
        state = record["state"][step]["state"]
        if step == MINIONS_STEP:
            what = "tell every minion the new public key" if state != SERVING else "done"
        else:
            what = todo[state]
        ret.append({"step": "minions" if step == MINIONS_STEP else step, "state": state,
                    "todo": what})
    ret.append({"step": "verify", "state": PENDING,
                "todo": "every minion trusts the new key (multimaster.audit)"})
    return ret


# ----- minions -----------------------------------------------------------------
def minion_verdict(ret):
    """
    None when the audit return ``ret`` of a minion shows it trusts the
    expected key (no ``master_pubkey`` error), else the reason.
    """
    if not isinstance(ret, dict) or "findings" not in ret:
        return f"no audit return ({str(ret)[:200]})"
    for item in ret["findings"]:
        if item.get("check") == "master_pubkey" and item.get("severity") == "error":
            return item.get("message") or "master_pubkey error"
    return None


def remedy(minion_id, topology, new_finger=None):
    """What to do for a minion that did not confirm the new key."""
    if topology == "signed":
        return (f"start the salt-minion on {minion_id}: with verify_master_pubkey_sign it "
                "accepts each master's new key, signed with master_sign, by itself; then run "
                "salt-run multimaster.rotate_key again to confirm it")
    return (f"{minion_id} still trusts the old master key: on {minion_id}, copy the primary's "
            f"new master.pub (fingerprint {new_finger}) over <minion pki_dir>/minion_master.pub "
            "(default /etc/salt/pki/minion/minion_master.pub), or run there `salt-call --local "
            "multimaster.master_key_apply contents=\"$(cat master.pub)\" "
            f"master_finger={new_finger} topology=shared`; restart its salt-minion, then run "
            "salt-run multimaster.rotate_key again to confirm it")


# ----- the steps (primary) -----------------------------------------------------
POLL = 2  # seconds between two looks at a restarting master, or at the minions
CHECK_TRIES, CHECK_PAUSE = 3, 5  # the pre-checks: a peer's minion reconnecting


class SaltOps:
    """
    What a :class:`Rotation` asks of Salt on the primary; the runner builds
    it from its ``__opts__`` and LocalClient, a unit test from fakes.

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
        Restart this master (:func:`restart_primary`): ``"restarting"`` or
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
    """The return of a refused rotation (nothing changed); logged."""
    log.error("multimaster: %s", message)
    return {"result": False, "error": message}


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
                 restart_wait=120, verify_wait=60, timeout=15):
        self.salt, self.opts = salt, salt.opts
        self.topology, self.peers, self.primary = topology, list(peers), salt.opts["id"]
        self.restart_cmd, self.tgt, self.tgt_type = restart_cmd, tgt, tgt_type
        self.restart_wait, self.verify_wait, self.timeout = restart_wait, verify_wait, timeout
        self.state_dir = layout.state_dir(self.opts)
        self.record, self.fresh = None, False
        # the new keypair (shared; priv None once installed here) and fingerprints
        self.priv = self.pub = self.new_finger = self.expect_finger = None

    def save(self):
        save_record(self.state_dir, self.record)

    # ----- before anything changes ------------------------------------------
    def check(self, fresh=False, test=False):
        """
        The return of a dry run: the record to resume (none with ``fresh``)
        or a new one, the pre-checks' errors, the plan.  Writes nothing.
        """
        self.fresh = fresh
        try:
            record = None if fresh else load_record(self.state_dir)
        except RotationError as exc:
            return refused(f"multimaster.rotate_key: {exc}")
        if record:
            reason = resumable(record, self.topology, self.peers, self.primary)
            if reason:
                return refused(f"multimaster.rotate_key: {reason}")
        errors = self._checks(record is None)
        self.record = record or new_record(self.topology, self.peers, self.primary)
        ret = {"result": not errors, "topology": self.topology, "test": test,
               "resumed": record is not None, "started": self.record["started"],
               "plan": plan(self.record)}
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
            drop_stage(self.state_dir)  # a new rotation, a new key
        self.save()
        self._new_key()
        error = None
        for name in self.record["steps"]:
            step = self.record["state"][name]
            if step["state"] == SERVING:
                continue
            log.info("multimaster: rotate_key: %s", name)
            if name == MINIONS_STEP:
                self._tell_minions(step)
            elif name == self.primary:
                error = self._primary(step)
            else:
                error = self._peer(name, step)
            if error:
                break
        ret["steps"] = {("minions" if n == MINIONS_STEP else n): dict(self.record["state"][n])
                        for n in self.record["steps"]}
        if error:
            self.save()
            ret.update(result=False, error=error)
            return ret
        confirmed, unconfirmed = self._verify()
        ret["minions"] = {"confirmed": confirmed, "unconfirmed": unconfirmed}
        ret["fingerprints"] = {n: self.record["state"][n].get("new") for n in self.record["steps"]
                               if n != MINIONS_STEP}
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
        ret["plan"] = plan(self.record)
        return ret

    def _keysize(self):
        return self.opts.get("keysize") or DEFAULT_KEYSIZE

    def _new_key(self):
        """The fingerprint every minion must trust afterwards; (shared) the new keypair."""
        if self.topology == "signed":
            self.expect_finger = key_finger(layout.master_key_files(self.opts, "signed")[1],
                                            self.opts)
            return
        if self.record["state"][self.primary]["state"] == PENDING:
            self.priv, self.pub = stage_keypair(self.state_dir, self._keysize())
        else:
            # installed here: the staged copy is gone, the key files hold it
            with open(own_key_files(self.opts)[1], "rb") as fh:
                self.priv, self.pub = None, fh.read()
        self.new_finger = self.expect_finger = finger.master_finger(
            self.pub.decode(), self.opts.get("hash_type", "sha256"))

    def _peer(self, peer, step):
        """Rotate one peer: new key, restart, wait until it serves it.  Error or None."""
        restart = None
        if step["state"] == PENDING:
            kwarg = {"topology": self.topology, "restart_cmd": self.restart_cmd}
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
            step.update(state=WRITTEN, old=got["old"], new=got["new"], backup=got["backup"])
            self.save()
            restart = got["restart"]
        return self._wait(peer, step, restart)

    def _peer_serving(self, peer, step):
        """``(serving, detail)`` of a peer after its key write."""
        got = self.salt.call_peer(peer, "multimaster_peer.inventory",
                                  {"categories": ["master_keys"], "topology": "shared",
                                   "test": True}, self.timeout)
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
        if current_finger(self.opts) != step["new"]:
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
                step["state"] = SERVING
                self.save()
                return None
            restart = self._restart(name)
            if not restart:
                return f"{name}: {detail}; its salt-minion did not answer the restart"
        step["restart"] = restart
        if restart == "restart_required":
            return restart_remedy(name, restart)
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
                step["state"] = SERVING
                step.pop("restart", None)
                self.save()
                if is_primary:
                    self.salt.reconnect_events()
                return None
            failed = self.salt.restart_failed() if is_primary else None
            if failed:
                # the service manager said no: no use waiting for the rest
                return restart_remedy(name, f"{failed}: {detail}")
        return restart_remedy(name, f"after {self.restart_wait} s: {detail}")

    def _primary(self, step):
        """Rotate the primary itself (last): new key, restart, wait.  Error or None."""
        restart = None
        if step["state"] == PENDING:
            try:
                if self.topology == "shared":
                    priv, pub = self.priv, self.pub
                else:
                    priv, pub = gen_keypair(self._keysize())
                done = install(self.opts, priv, pub, backup_root(self.opts))
            except (RotationError, OSError, ValueError) as exc:
                return f"{self.primary}: no new key: {exc}"
            step.update(state=WRITTEN, old=done["old"], new=done["new"], backup=done["backup"])
            self.save()
            if self.topology == "shared":
                drop_stage(self.state_dir)
            restart = self.salt.restart_primary(self.restart_cmd)
        return self._wait(self.primary, step, restart)

    def _tell_minions(self, step):
        """topology shared: every targeted minion now trusts the new public key."""
        expected, got = self.salt.minions(
            self.tgt, self.tgt_type, "multimaster.master_key_apply",
            {"contents": self.pub.decode(), "master_finger": self.new_finger,
             "topology": "shared"}, self.timeout)
        told = sorted(m for m, r in got.items() if isinstance(r, dict) and r.get("expected"))
        step.update(state=SERVING, told=len(told), not_told=sorted(set(expected) - set(told)))
        self.save()

    def _verify(self):
        """``(confirmed ids, {id: {"reason", "remedy"}})``: the targeted minions' verdicts."""
        kwarg = {"master_finger": self.expect_finger, "topology": self.topology}
        expected, got = self.salt.minions(self.tgt, self.tgt_type, "multimaster.audit", kwarg,
                                          self.timeout)
        verdicts = {mid: minion_verdict(got.get(mid)) for mid in expected}
        deadline = self.salt.monotonic() + self.verify_wait
        while any(verdicts.values()) and self.salt.monotonic() < deadline:
            # minions reconnect to a restarted master after a while: ask again
            self.salt.sleep(POLL)
            again = sorted(m for m, v in verdicts.items() if v)
            _, more = self.salt.minions(again, "list", "multimaster.audit", kwarg, self.timeout)
            for mid in again:
                verdicts[mid] = minion_verdict(more.get(mid))
        unconfirmed = {mid: {"reason": reason,
                             "remedy": remedy(mid, self.topology, self.new_finger)}
                       for mid, reason in sorted(verdicts.items()) if reason}
        self.record["unconfirmed"] = sorted(unconfirmed)
        return sorted(m for m, v in verdicts.items() if not v), unconfirmed
