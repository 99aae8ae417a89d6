"""salt_multimaster.rotation: the steps on one master, the record, the plan, the verdicts."""

import importlib.util
import os
import pathlib
import stat

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from salt_multimaster import daemon, finger, layout, protocol, rotation, rotation_steps, seal
from tests.conftest import REPO


@pytest.fixture(scope="module")
def keypair():
    return rotation.gen_keypair(2048)


def _mopts(tmp_path, **extra):
    pki = tmp_path / "pki"
    pki.mkdir(mode=0o700, exist_ok=True)
    opts = {"pki_dir": str(pki), "cachedir": str(tmp_path / "cache"), "id": "m1_master",
            "hash_type": "sha256", "master_sign_key_name": "master_sign"}
    opts.update(extra)
    return opts


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_gen_keypair_is_a_pair(keypair):
    priv, pub = keypair
    # the formats Salt writes: traditional OpenSSL for the private key, SPKI for the public
    key = serialization.load_pem_private_key(priv, password=None)
    assert isinstance(key, rsa.RSAPrivateKey)
    assert priv == key.private_bytes(serialization.Encoding.PEM,
                                     serialization.PrivateFormat.TraditionalOpenSSL,
                                     serialization.NoEncryption())
    assert pub == key.public_key().public_bytes(serialization.Encoding.PEM,
                                                serialization.PublicFormat.SubjectPublicKeyInfo)
    assert rotation.public_of(priv) == pub
    with pytest.raises(rotation.RotationError, match="not an unencrypted PEM private key"):
        rotation.public_of(b"nope")


def test_install_backs_up_and_writes_the_files_salt_loads(tmp_path, keypair):
    """Salt 3008 layout: master.pem/.pub link to <id>.pem/.pub, which are replaced."""
    opts = _mopts(tmp_path)
    pki = tmp_path / "pki"
    old_priv, old_pub = rotation.gen_keypair(2048)
    (pki / "m1.pem").write_bytes(old_priv)
    (pki / "m1.pem").chmod(0o400)
    (pki / "m1.pub").write_bytes(old_pub)
    os.symlink(pki / "m1.pem", pki / "master.pem")
    os.symlink(pki / "m1.pub", pki / "master.pub")
    root = tmp_path / "cache" / "multimaster" / "backup" / "20261124T000000.000000Z"
    priv, pub = keypair
    ret = rotation.install(opts, priv, pub, str(root))
    assert ret == {"old": finger.master_finger(old_pub.decode()),
                   "new": finger.master_finger(pub.decode()), "backup": str(root)}
    assert (pki / "m1.pem").read_bytes() == priv and _mode(pki / "m1.pem") == 0o400
    assert (pki / "m1.pub").read_bytes() == pub and _mode(pki / "m1.pub") == 0o644
    assert os.path.islink(pki / "master.pem")  # the links Salt made are kept
    assert (root / "master_keys" / "master.pem").read_bytes() == old_priv
    assert (root / "master_keys" / "master.pub").read_bytes() == old_pub
    assert _mode(root / "master_keys" / "master.pem") == 0o400
    assert _mode(root) == 0o700 and _mode(root / "master_keys") == 0o700
    assert rotation.current_finger(opts) == ret["new"]


def test_install_refuses_a_mismatched_pair(tmp_path, keypair):
    opts = _mopts(tmp_path)
    (tmp_path / "pki" / "master.pub").write_bytes(b"old")
    other = rotation.gen_keypair(2048)[1]
    with pytest.raises(rotation.RotationError, match="does not belong"):
        rotation.install(opts, keypair[0], other, str(tmp_path / "b"))
    assert (tmp_path / "pki" / "master.pub").read_bytes() == b"old"
    assert not (tmp_path / "b").exists()


def test_unsupported(tmp_path):
    opts = _mopts(tmp_path)
    assert rotation.unsupported(opts, "shared") is None
    assert "unknown topology 'x'" in rotation.unsupported(opts, "x")
    assert "key_pass" in rotation.unsupported(dict(opts, key_pass="s"), "shared")
    assert "master_sign_pubkey: True" in rotation.unsupported(opts, "signed")
    signed = dict(opts, master_sign_pubkey=True)
    assert "master_sign.pem is missing" in rotation.unsupported(signed, "signed")
    (tmp_path / "pki" / "master_sign.pem").write_text("k")
    assert rotation.unsupported(signed, "signed") is None
    assert "master_use_pubkey_signature" in rotation.unsupported(
        dict(signed, master_use_pubkey_signature=True), "signed")


def test_record_resume_and_plan(tmp_path):
    state = str(tmp_path)
    assert rotation.load_record(state) is None
    record = rotation.new_record("shared", ["p1", "p2"], "m1")
    assert record["steps"] == ["p1", "p2", rotation.MINIONS_STEP, "m1"]
    record["state"]["p1"].update(state=rotation.SERVING, new="aa")
    record["state"]["p2"]["state"] = rotation.WRITTEN
    rotation.save_record(state, record)
    assert _mode(tmp_path / rotation.RECORD_NAME) == 0o600
    loaded = rotation.load_record(state)
    assert loaded == record
    assert rotation.resumable(loaded, "shared", ["p1", "p2"], "m1") is None
    assert "fresh=True" in rotation.resumable(loaded, "signed", ["p1", "p2"], "m1")
    assert "covers p1, p2, m1" in rotation.resumable(loaded, "shared", ["p1"], "m1")
    assert [(s["step"], s["todo"]) for s in rotation.plan(loaded)] == [
        ("p1", "done"),
        ("p2", "restart, confirm it serves the key"),
        ("minions", "tell every minion the new public key"),
        ("m1", "new key, restart, confirm it serves the key"),
        ("verify", "every minion trusts the new key (multimaster.audit)"),
    ]
    record["done"] = True
    rotation.save_record(state, record)
    assert rotation.load_record(state) is None  # a finished rotation is not resumed
    assert rotation.steps_for("signed", ["p1"], "m1") == ["p1", "m1"]


def test_stage_keypair_is_reused_then_dropped(tmp_path):
    priv, pub = rotation.stage_keypair(str(tmp_path), 2048)
    stage = tmp_path / rotation.STAGE_NAME
    assert _mode(stage) == 0o700 and _mode(stage / "master.pem") == 0o400
    assert rotation.stage_keypair(str(tmp_path), 2048) == (priv, pub)
    rotation.drop_stage(str(tmp_path))
    assert not stage.exists()


def test_restart_primary(tmp_path, monkeypatch):
    launched = []
    monkeypatch.setattr(rotation.subprocess, "Popen", lambda cmd, **kw: launched.append(cmd))
    opts = _mopts(tmp_path, pidfile=str(tmp_path / "master.pid"))
    assert rotation.restart_primary(opts, None, False) == "restart_required"
    marker = tmp_path / "cache" / "multimaster" / daemon.RESTART_MARKER
    assert marker.is_file() and _mode(marker) == 0o600 and launched == []
    assert rotation.restart_primary(opts, None, True) == "restarting"
    assert rotation.restart_primary(opts, "service salt-master restart", False) == \
        "restarting"
    assert launched == ["systemctl restart salt-master", "service salt-master restart"]
    assert "master_restart_cmd" in rotation.restart_remedy("m1", "restart_required")
    assert "after 5 s" in rotation.restart_remedy("m1", "after 5 s")


def test_serving(tmp_path, monkeypatch):
    opts = _mopts(tmp_path)
    marker = str(tmp_path / "marker")
    monkeypatch.setattr(daemon, "master_running", lambda o: (False, "127.0.0.2:4506"))
    assert rotation.serving(opts, marker) == (
        False, "its salt-master does not answer on 127.0.0.2:4506")
    monkeypatch.setattr(daemon, "master_running", lambda o: (True, "127.0.0.2:4506"))
    monkeypatch.setattr(daemon, "restart_pending", lambda o, m: True)
    assert "not restarted since" in rotation.serving(opts, marker)[1]
    monkeypatch.setattr(daemon, "restart_pending", lambda o, m: None)
    assert "unknown" in rotation.serving(opts, marker)[1]
    monkeypatch.setattr(daemon, "restart_pending", lambda o, m: False)
    assert rotation.serving(opts, marker) == (True, None)


def test_minion_verdict_and_remedy():
    ok = {"result": False, "findings": [
        {"check": "master_alive_interval", "severity": "error", "message": "x"},
        {"check": "master_pubkey", "severity": "info", "message": "fine"}]}
    assert rotation.minion_verdict(ok) is None
    bad = {"findings": [{"check": "master_pubkey", "severity": "error",
                         "message": "The cached master key has fingerprint aa, expected bb."}]}
    assert rotation.minion_verdict(bad) == "The cached master key has fingerprint aa, expected bb."
    assert rotation.minion_verdict(None) == "no audit return (None)"
    assert "start the salt-minion on web1" in rotation.remedy("web1", "signed")
    shared = rotation.remedy("web1", "shared", "ab:cd")
    assert "minion_master.pub" in shared and "master_finger=ab:cd" in shared


# ----- the step machine (Rotation) on a fake Salt and a fake clock ---------------
class FakeSalt:
    """
    The Salt side of a rotation (:class:`rotation_steps.SaltOps`) on a fake clock:
    peers that write their new key when asked and serve it ``serve_after``
    seconds after a restart (never when None), minions that answer (or not,
    ``silent``; or from a time on, ``answer_at``), a status per call.
    """

    def __init__(self, opts, peers, minions, serve_after=4):
        self.opts, self.now = opts, 0.0
        self.serve_after = serve_after
        self.peer_restart = "restarting"
        self.primary_restart = "restarting"
        self.restart_failure = None  # why the primary's restart command failed
        self.disk = {p: f"old-{p}" for p in peers}  # fingerprint of each peer's key on disk
        self.serving_at = {}  # master -> time from which it serves its key on disk
        self.minion_ids, self.silent, self.answer_at = list(minions), set(), {}
        self.trusted = {}  # minion -> fingerprint told (shared)
        self.statuses = []  # status() returns, one per call; then every peer fine
        self.log, self.sleeps = [], []
        self.peer_keys, self.opened = {}, None  # each peer's minion key; the keypair it opened
        self.sent = {}  # peer -> the arguments of its last rotate_key

    def ops(self):
        return rotation_steps.SaltOps(
            self.opts, call_peer=self.call_peer, minions=self.minions, status=self.status,
            restart_primary=self.restart_primary, primary_serving=self.primary_serving,
            reconnect_events=lambda: self.log.append("reconnect_events"),
            restart_failed=lambda: self.restart_failure, sleep=self.sleep,
            monotonic=lambda: self.now)

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds

    def _restarted(self, name, how):
        self.log.append(f"restart {name}")
        if how == "restarting" and self.serve_after is not None:
            self.serving_at[name] = self.now + self.serve_after
        return how

    def _serves(self, name):
        return name in self.serving_at and self.now >= self.serving_at[name]

    def call_peer(self, peer, fun, kwarg, timeout):
        protocol.request(fun, **kwarg)  # as jobs.call_peer: a request the peer takes
        if peer in self.silent:
            return None
        if fun == "multimaster_peer.inventory":
            return {"master_keys": {"fingerprint": self.disk[peer]}, "master_running": True,
                    "restart_pending": not self._serves(peer), "master_address": "127.0.0.3"}
        if not kwarg.get("restart_only"):
            self.sent[peer] = kwarg
            self.log.append(f"new key {peer}")
            if "keypair" in kwarg:
                self.opened = seal.unseal(self.peer_keys[peer], kwarg["keypair"]["sealed"],
                                          peer, "rotate_key/master.pem")
                new = finger.master_finger(kwarg["keypair"]["pub"])
            else:
                new = f"new-{peer}"
            old, self.disk[peer] = self.disk[peer], new
            self.serving_at.pop(peer, None)
            return {"result": True, "old": old, "new": new, "backup": f"/b/{peer}",
                    "restart": self._restarted(peer, self.peer_restart)}
        return {"result": True, "restart": self._restarted(peer, self.peer_restart)}

    def minions(self, tgt, tgt_type, fun, kwarg, timeout):
        expected = list(tgt) if tgt_type == "list" else list(self.minion_ids)
        up = [m for m in expected if m not in self.silent
              and self.now >= self.answer_at.get(m, 0)]
        self.log.append(f"{fun} {','.join(up)}")
        if fun == "multimaster.master_key_apply":
            self.trusted.update({m: kwarg["master_finger"] for m in up})
            return expected, {m: {"expected": True} for m in up}
        ok = {"findings": [{"check": "master_pubkey", "severity": "info", "message": "ok"}]}
        return expected, {m: ok for m in up}

    def status(self, peers, topology):
        if self.statuses:
            return self.statuses.pop(0)
        return {p: {"reachable": True, "master_running": True, "drift": {}} for p in peers}

    def restart_primary(self, restart_cmd):
        return self._restarted("primary", self.primary_restart)

    def primary_serving(self):
        if self._serves("primary"):
            return True, None
        return False, "its salt-master still runs with the old key (not restarted since)"


@pytest.fixture
def primary(tmp_path, keypair):
    """The primary's opts, its old keypair on disk (master.pem/.pub), a 2048-bit keysize."""
    opts = _mopts(tmp_path, id="m1", keysize=2048)
    (tmp_path / "pki" / "master.pem").write_bytes(keypair[0])
    (tmp_path / "pki" / "master.pub").write_bytes(keypair[1])
    return opts


def _fake(opts, peers=("p1", "p2"), minions=("web1", "web2"), **kwargs):
    fake = FakeSalt(opts, peers, minions, **kwargs)
    (pathlib.Path(opts["pki_dir"]) / "minions").mkdir(exist_ok=True)
    for peer in peers:
        priv, pub = rotation.gen_keypair(2048)
        fake.peer_keys[peer] = priv
        (pathlib.Path(opts["pki_dir"]) / "minions" / peer).write_bytes(pub)
    return fake


def _rotate(fake, topology, test=False, fresh=False, **waits):
    """``(return, Rotation)`` of one run, as the runner drives it (without the lock)."""
    rot = rotation_steps.Rotation(fake.ops(), topology, list(fake.disk), **waits)
    ret = rot.check(fresh, test)
    if ret["result"] and not test:
        ret = rot.run(ret)
    return ret, rot


def _done_plan(*steps):
    return [{"step": s, "state": "serving", "todo": "done"} for s in steps] + [
        {"step": "verify", "state": "pending",
         "todo": "every minion trusts the new key (multimaster.audit)"}]


def test_shared_rotation_one_master_at_a_time(primary, keypair):
    fake = _fake(primary)
    ret, rot = _rotate(fake, "shared")
    new = rotation.current_finger(primary)
    old = finger.master_finger(keypair[1].decode())
    assert new != old and fake.disk == {"p1": new, "p2": new}
    # the staged private key reached each peer sealed to its minion key, then was dropped
    assert rotation.public_of(fake.opened).strip() == \
        (pathlib.Path(primary["pki_dir"]) / "master.pub").read_bytes().strip()
    assert not os.path.exists(rotation.stage_dir(rot.state_dir))
    # each master once the previous one serves; the minions told before the primary switches
    assert fake.log == [
        "new key p1", "restart p1", "new key p2", "restart p2",
        "multimaster.master_key_apply web1,web2", "restart primary", "reconnect_events",
        "multimaster.audit web1,web2"]
    assert fake.trusted == {"web1": new, "web2": new}
    primary_step = ret["steps"]["m1"]
    assert primary_step["backup"].startswith(primary["cachedir"])
    assert ret == {
        "result": True, "topology": "shared", "test": False, "resumed": False,
        "started": rot.record["started"], "plan": _done_plan("p1", "p2", "minions", "m1"),
        "steps": {"p1": {"state": "serving", "old": "old-p1", "new": new, "backup": "/b/p1"},
                  "p2": {"state": "serving", "old": "old-p2", "new": new, "backup": "/b/p2"},
                  "minions": {"state": "serving", "told": 2, "not_told": []},
                  "m1": {"state": "serving", "old": old, "new": new,
                         "backup": primary_step["backup"]}},
        "minions": {"confirmed": ["web1", "web2"], "unconfirmed": {}},
        "fingerprints": {"p1": new, "p2": new, "m1": new},
        "next": f"set pillar multimaster:master_finger to {new} (and multimaster:master_pub, if "
                "used, to the new master.pub) before the next state.apply of salt.multimaster, "
                "which would otherwise put the old key back",
    }
    assert rotation.load_record(rot.state_dir) is None  # done: nothing to resume


def test_backup_keep_reaches_every_master(primary):
    """``multimaster:backup_keep`` prunes the rotation's backups, on the peers and here."""
    base = pathlib.Path(primary["cachedir"]) / "multimaster" / "backup"
    old = [f"2020010{day}T000000.000000Z" for day in range(1, 5)]
    for name in old:
        (base / name).mkdir(parents=True)
    fake = _fake(primary)
    ret, _ = _rotate(fake, "signed", backup_keep=3)
    assert ret["result"] is True, ret
    assert {p: kw["backup_keep"] for p, kw in fake.sent.items()} == {"p1": 3, "p2": 3}
    assert sorted(p.name for p in base.iterdir()) == [
        *old[2:], os.path.basename(ret["steps"]["m1"]["backup"])]


def test_resume_after_the_primary_restart_never_happened(primary):
    """The primary holds its new key but nothing restarted it: the re-run only restarts it."""
    fake = _fake(primary)
    fake.primary_restart = "restart_required"
    ret, rot = _rotate(fake, "shared")
    error = rotation.restart_remedy("m1", "restart_required")
    assert (ret["result"], ret["error"]) == (False, error)
    assert ret["steps"]["m1"]["state"] == rotation.WRITTEN
    assert ret["steps"]["m1"]["restart"] == "restart_required"
    assert "minions" not in ret  # no verdict before every master serves
    saved = rotation.load_record(rot.state_dir)
    assert [saved["state"][s]["state"] for s in saved["steps"]] == [
        "serving", "serving", "serving", "written"]
    new = rotation.current_finger(primary)

    fake.primary_restart, fake.log = "restarting", []
    ret, rot = _rotate(fake, "shared")
    assert ret["result"] is True and ret["resumed"] is True
    assert ret["started"] == saved["started"]
    assert fake.log == ["restart primary", "reconnect_events", "multimaster.audit web1,web2"]
    assert rotation.current_finger(primary) == new  # the key written in the first run
    assert ret["fingerprints"] == {"p1": new, "p2": new, "m1": new}


def test_command_failure():
    class Proc:
        args = "systemctl restart salt-master"

        def __init__(self, code):
            self.code = code

        def poll(self):
            return self.code

    assert rotation.command_failure(None) is None
    assert rotation.command_failure(Proc(None)) is None  # still running
    assert rotation.command_failure(Proc(0)) is None
    assert rotation.command_failure(Proc(-15)) is None  # killed, as a restart may
    assert rotation.command_failure(Proc(5)) == \
        "its restart command 'systemctl restart salt-master' exited 5"


def test_a_failed_primary_restart_command_ends_the_wait_at_once(primary):
    """The service manager said no: the rotation stops at the next check, not after restart_wait."""
    fake = _fake(primary)
    # the primary's command exits 1 at once: the primary never restarts
    fake.restart_primary = lambda cmd: fake.log.append("restart primary") or "restarting"
    fake.restart_failure = "its restart command 'false' exited 1"
    ret, _ = _rotate(fake, "shared", restart_wait=100)
    assert (ret["result"], ret["error"]) == (False, rotation.restart_remedy(
        "m1", "its restart command 'false' exited 1: its salt-master still runs with the "
              "old key (not restarted since)"))
    assert [ret["steps"][s]["state"] for s in ("p1", "p2", "m1")] == [
        "serving", "serving", "written"]
    assert fake.log[-1] == "restart primary"
    # one poll after the restart, not restart_wait (the peers' waits: 4 s each)
    assert fake.now < 20, fake.sleeps


def test_a_peer_that_never_serves_stops_the_rotation(primary, keypair):
    """signed: p1 writes its key but never serves it; the primary is left alone; a re-run resumes."""
    (pathlib.Path(primary["pki_dir"]) / "master_sign.pub").write_bytes(keypair[1])
    fake = _fake(primary, peers=("p1",), serve_after=None)
    ret, rot = _rotate(fake, "signed", restart_wait=10)
    assert ret == {
        "result": False, "topology": "signed", "test": False, "resumed": False,
        "started": rot.record["started"],
        "plan": [{"step": "p1", "state": "pending",
                  "todo": "new key, restart, confirm it serves the key"},
                 {"step": "m1", "state": "pending",
                  "todo": "new key, restart, confirm it serves the key"},
                 {"step": "verify", "state": "pending",
                  "todo": "every minion trusts the new key (multimaster.audit)"}],
        "steps": {"p1": {"state": "written", "old": "old-p1", "new": "new-p1",
                         "backup": "/b/p1", "restart": "restarting"},
                  "m1": {"state": "pending"}},
        "error": rotation.restart_remedy(
            "p1", "after 10 s: its salt-master still runs with the old key (not restarted "
                  "since)"),
    }
    assert fake.log == ["new key p1", "restart p1"]
    assert fake.now >= 10 and set(fake.sleeps) == {rotation_steps.POLL}
    assert rotation.current_finger(primary) == finger.master_finger(keypair[1].decode())

    # fixed: the re-run asks p1 for a restart only (its new key stays), then the primary
    fake.serve_after, fake.log = 4, []
    ret, rot = _rotate(fake, "signed")
    assert ret["result"] is True and ret["resumed"] is True, ret
    assert fake.log == ["restart p1", "restart primary", "reconnect_events",
                        "multimaster.audit web1,web2"]
    assert ret["steps"]["p1"] == {"state": "serving", "old": "old-p1", "new": "new-p1",
                                  "backup": "/b/p1"}
    assert "next" not in ret


def test_a_peer_whose_minion_does_not_answer(primary, keypair):
    (pathlib.Path(primary["pki_dir"]) / "master_sign.pub").write_bytes(keypair[1])
    fake = _fake(primary, peers=("p1",))
    fake.silent.add("p1")  # gone between the pre-checks and its step
    ret, _ = _rotate(fake, "signed")
    assert ret["result"] is False
    assert ret["error"] == ("p1: no new key: its salt-minion did not answer (start it, check "
                            "salt-run manage.status), then run salt-run multimaster.rotate_key "
                            "again")
    assert ret["steps"]["p1"] == {"state": "pending"}


def test_minions_that_do_not_confirm(primary):
    """web2 never answers, web3 answers after a while: asked again until verify_wait."""
    fake = _fake(primary, peers=("p1",), minions=("web1", "web2", "web3"))
    fake.silent.add("web2")
    fake.answer_at["web3"] = 20
    ret, rot = _rotate(fake, "shared", verify_wait=30)
    new = rotation.current_finger(primary)
    assert ret["steps"]["minions"] == {"state": "serving", "told": 1,
                                       "not_told": ["web2", "web3"]}
    assert ret["minions"] == {"confirmed": ["web1", "web3"], "unconfirmed": {
        "web2": {"reason": "no audit return (None)",
                 "remedy": rotation.remedy("web2", "shared", new)}}}
    assert (ret["result"], ret["error"]) == (
        False, "1 minion(s) did not confirm the new key: web2 (see minions:unconfirmed)")
    assert fake.log[-2:] == ["multimaster.audit ", "multimaster.audit "]
    assert "multimaster.audit web3" in fake.log
    saved = rotation.load_record(rot.state_dir)
    assert saved["unconfirmed"] == ["web2"] and saved["done"] is False

    # the remedy done: the re-run changes no master, only asks again
    fake.silent.clear()
    fake.log = []
    ret, rot = _rotate(fake, "shared")
    assert ret["result"] is True and ret["resumed"] is True
    assert fake.log == ["multimaster.audit web1,web2,web3"]
    assert ret["minions"] == {"confirmed": ["web1", "web2", "web3"], "unconfirmed": {}}
    assert rotation.load_record(rot.state_dir) is None


def test_pre_checks_ask_again_then_stop_before_any_change(primary):
    down = {"p1": {"reachable": False, "error": "p1: its salt-minion did not answer"}}
    fake = _fake(primary, peers=("p1",))
    fake.statuses = [down, down]  # a minion reconnecting: fine at the third look
    ret, rot = _rotate(fake, "shared", test=True)
    assert ret == {"result": True, "topology": "shared", "test": True, "resumed": False,
                   "started": rot.record["started"], "plan": rotation.plan(rot.record)}
    assert fake.sleeps == [rotation_steps.CHECK_PAUSE] * 2
    assert fake.log == [] and os.listdir(rot.state_dir) == []  # a dry run writes nothing

    drift = {"p1": {"reachable": True, "master_running": True,
                    "drift": {"master_keys": {"changed": ["master.pem"]}}}}
    fake.statuses, fake.sleeps = [down, down, drift], []
    ret, rot = _rotate(fake, "shared")
    assert ret["result"] is False and ret["error"] == (
        "p1: its master keypair differs from the primary's: run salt-run multimaster.sync "
        "only=master_keys topology=shared first")
    assert fake.sleeps == [rotation_steps.CHECK_PAUSE] * 2  # no pause after the last look
    assert fake.log == [] and os.listdir(rot.state_dir) == []

    fake.statuses = [{"result": False, "error": "no peers answered"}] * 3
    ret, _ = _rotate(fake, "shared")
    assert (ret["result"], ret["error"]) == (False, "no peers answered")
    assert fake.log == [] and os.listdir(rot.state_dir) == []


def test_an_unfinished_rotation_is_resumed_as_it_was_started(primary):
    fake = _fake(primary, peers=("p1",))
    fake.primary_restart = "restart_required"
    _rotate(fake, "shared")
    first = rotation.current_finger(primary)
    ret, _ = _rotate(fake, "signed")
    assert ret == {"result": False, "retcode": 1,
                   "error": "multimaster.rotate_key: " + rotation.resumable(
                       rotation.load_record(layout.state_dir(primary)), "signed", ["p1"], "m1")}
    assert "fresh=True" in ret["error"]
    # fresh=True: forgotten, a new rotation with a new key from the first step on
    fake.primary_restart, fake.log = "restarting", []
    ret, _ = _rotate(fake, "shared", fresh=True)
    assert ret["result"] is True and ret["resumed"] is False
    assert fake.log[:2] == ["new key p1", "restart p1"]
    assert rotation.current_finger(primary) not in (first, None)


# ----- the runner's rotate_key refuses bad input before anything is sent --------
def _runner(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("mm_runner_rotate",
                                                  REPO / "_runners" / "multimaster.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (tmp_path / "pki").mkdir()
    mod.__opts__ = {"id": "m1", "pki_dir": str(tmp_path / "pki"), "cachedir": str(tmp_path / "c"),
                    "multimaster": {"peers": ["m2"], "topology": "shared"}}
    mod.__context__ = {}

    def nothing_sent(*args, **kwargs):
        raise AssertionError(f"sent with bad input: {args} {kwargs}")

    # a rotation, its status and its jobs start with the Salt side built
    monkeypatch.setattr(rotation_steps, "SaltOps", nothing_sent)
    return mod


@pytest.mark.parametrize("kwargs,error", [
    ({"topology": "ring"}, "unknown topology 'ring' (known: shared, signed)"),
    ({"topology": "signed"}, "needs master_sign_pubkey: True"),
    ({"test": "sure"}, "test must be a boolean"),
    ({"peers": "m9"}, "'m9' not in multimaster:peers"),
    ({"restart_wait": 0}, "restart_wait must be more than 0 seconds"),
    ({"restart_cmd": ["systemctl"]}, "restart_cmd must be a command"),
    ({"multimaster": {"backup_keep": 0}},
     "multimaster:backup_keep must be a whole number of at least 1, not 0"),
    # it restarts this primary too: a program not installed here is refused first
    ({"restart_cmd": "no-such-init salt-master restart"},
     "m1: the restart command 'no-such-init salt-master restart' cannot run: 'no-such-init' "
     "not found (PATH of the salt-master)"),
])
def test_rotate_key_refuses_bad_input(tmp_path, monkeypatch, kwargs, error):
    runner = _runner(tmp_path, monkeypatch)
    runner.__opts__["multimaster"].update(kwargs.pop("multimaster", {}))
    ret = runner.rotate_key(**kwargs)
    assert ret["result"] is False and ret["retcode"] == 1, ret
    assert error in ret["error"]
    assert not (tmp_path / "c" / "multimaster" / rotation.RECORD_NAME).exists()
