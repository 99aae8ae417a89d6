"""salt_multimaster.rotation: the steps on one master, the record, the plan, the verdicts."""

import os
import stat

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from salt_multimaster import daemon, finger, rotation


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
    assert rotation.restart_primary(str(tmp_path), None, False) == "restart_required"
    assert (tmp_path / daemon.RESTART_MARKER).is_file() and launched == []
    assert rotation.restart_primary(str(tmp_path), None, True) == "restarting"
    assert rotation.restart_primary(str(tmp_path), "service salt-master restart", False) == \
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


def test_as_list():
    assert rotation.as_list("a, b,,c") == ["a", "b", "c"]
    assert rotation.as_list(["a"]) == ["a"]
    assert rotation.as_list(None) == []


# ----- the runner's rotate_key refuses bad input before anything is sent --------
def _runner(tmp_path):
    import importlib.util  # pylint: disable=import-outside-toplevel

    from tests.conftest import REPO  # pylint: disable=import-outside-toplevel

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

    mod.status = mod._rot_job = nothing_sent
    return mod


@pytest.mark.parametrize("kwargs,error", [
    ({"topology": "ring"}, "unknown topology 'ring' (known: shared, signed)"),
    ({"topology": "signed"}, "needs master_sign_pubkey: True"),
    ({"test": "sure"}, "test must be a boolean"),
    ({"peers": "m9"}, "'m9' not in multimaster:peers"),
    ({"restart_wait": 0}, "restart_wait must be more than 0 seconds"),
    ({"restart_cmd": ["systemctl"]}, "restart_cmd must be a command"),
])
def test_rotate_key_refuses_bad_input(tmp_path, kwargs, error):
    runner = _runner(tmp_path)
    ret = runner.rotate_key(**kwargs)
    assert ret["result"] is False and ret["retcode"] == 1, ret
    assert error in ret["error"]
    assert not (tmp_path / "c" / "multimaster" / rotation.RECORD_NAME).exists()
