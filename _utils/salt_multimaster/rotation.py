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

This module holds the pieces: the keys, the rotation record, the staged
shared keypair and the verdict on each minion.  The step machine that runs
the sequence: :mod:`salt_multimaster.rotation_steps`.
"""

import json
import logging
import os
import subprocess

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from salt_multimaster import daemon, finger, fsutil, layout, statefile

log = logging.getLogger(__name__)

RECORD_NAME = "rotation.json"
STAGE_NAME = "rotation-staged"
MINIONS_STEP = "@minions"
# what a master step goes through
PENDING, WRITTEN, SERVING = "pending", "written", "serving"
DEFAULT_KEYSIZE = 4096


class RotationError(ValueError):
    """A master that cannot be rotated as asked (named, with what to do)."""


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
    return key_finger(layout.master_key_files(mopts, "shared")[1], mopts)


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
    pem_path, pub_path = layout.master_key_files(mopts, "shared")
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


def backup_root(mopts):
    """A new backup folder of this master: ``<cachedir>/multimaster/backup/<stamp>``."""
    return os.path.join(mopts["cachedir"], "multimaster", "backup", statefile.stamp())


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
        "started": statefile.stamp(),
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
