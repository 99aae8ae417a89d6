"""
Pure logic of the minion configuration states: salt_multimaster.minion_config.
"""

import os

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

import salt_multimaster.minion_config as mc
from salt_multimaster import finger as finger_mod
from salt_multimaster.validate import InvalidInput


def _pub():
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


def test_validate_ok():
    assert mc.validate(
        ["m1", "m2"],
        {
            "master_alive_interval": 30,
            "master_type": "failover",
            "master_failback": True,
            "master_failback_interval": 0,
            "random_master": False,
            "retry_dns": 0,
            "auth_tries": 7,
            "acceptance_wait_time": 1,
            "acceptance_wait_time_max": 0,
            "verify_master_pubkey_sign": True,
            "ipc_mode": "tcp",
            "tcp_pub_port": [4510, 4512],
            "tcp_pull_port": [4511, 4513],
        },
    ) == []


@pytest.mark.parametrize(
    "masters,settings,fragment",
    [
        ("m1", {}, "masters must be a list"),
        (None, {}, "no masters given"),
        ({"m1": 1}, {}, "masters must be a list"),
        ([], {}, "masters is empty"),
        (["m1", "bad:port"], {}, "non-numeric port"),
        (["m1", "m2"], {"master_alive_interval": -1}, "master_alive_interval: -1"),
        (["m1", "m2"], {"master_alive_interval": "30"}, "master_alive_interval: '30'"),
        (["m1", "m2"], {"master_alive_interval": True}, "master_alive_interval: True"),
        (["m1", "m2"], {"master_failback_interval": -5}, "master_failback_interval"),
        (["m1", "m2"], {"retry_dns": -1}, "retry_dns"),
        (["m1", "m2"], {"auth_tries": 0}, "auth_tries"),
        (["m1", "m2"], {"acceptance_wait_time": -1}, "acceptance_wait_time: -1"),
        (["m1", "m2"], {"random_master": "yes"}, "random_master: 'yes' is not a boolean"),
        (["m1", "m2"], {"master_type": "hot"}, "master_type: 'hot'"),
        (["m1", "m2"], {"ipc_mode": "udp"}, "ipc_mode"),
        (["m1", "m2"], {"tcp_pub_port": [4510]}, "1 ports listed for 2 masters"),
        (["m1", "m1:4506", "m2"], {"tcp_pub_port": [4510, 4512, 4514]}, "3 ports listed for 2"),
        (["m1", "m2"], {"tcp_pub_port": [4510, 4510]}, "not unique"),
        (["m1", "m2"], {"tcp_pub_port": [4510, 99999]}, "not a TCP port"),
        (["m1", "m2"], {"tcp_pub_port": [4510, 4512], "tcp_pull_port": [4512, 4513]},
         "share ports [4512]"),
        (["m1", "m2"], {"tcp_pub_port": 4510, "tcp_pull_port": 4510}, "both 4510"),
        (["m1"], {"master_type": "failover"}, "at least two masters"),
        (["m1", "m2"], {"master_type": "str", "master_failback": True}, "master_failback"),
        (["m1", "m2"], {"master_port": 4506}, "master_port: not a setting"),
    ],
)
def test_validate_errors(masters, settings, fragment):
    errors = mc.validate(masters, settings)
    assert any(fragment in e for e in errors), errors


def test_desired_and_render_roundtrip():
    config, notes = mc.desired(
        ["m1", "m1:4506", "m2"],
        {"master_alive_interval": 30, "random_master": True, "master_type": "str",
         "tcp_pub_port": [4510, 4512]},
    )
    assert list(config) == ["master", "master_type", "master_alive_interval",
                            "random_master", "tcp_pub_port"]
    assert config["master"] == ["m1", "m2"]
    assert config["tcp_pub_port"] == 4510
    assert any("m1:4506" in n for n in notes)
    text = mc.render(config)
    assert text.startswith("# Managed by Salt")
    assert text == mc.render(dict(config))
    assert mc.parse(text) == config


def test_parse_invalid_and_empty():
    assert mc.parse(None) == {}
    assert mc.parse("") == {}
    assert mc.parse("- a\n- b\n") is None
    assert mc.parse("a: [\n") is None


def test_diff():
    assert mc.diff({"master": ["a", "a"], "x": 1}, {"master": ["a"]}) == {
        "master": {"old": ["a", "a"], "new": ["a"]},
        "x": {"old": 1, "new": None},
    }
    assert mc.diff({"a": 1}, {"a": 1}) == {}


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def test_config_files_order_and_overrides(tmp_path):
    conf = str(tmp_path / "minion")
    _write(conf, "master: [a, a]\n")
    _write(str(tmp_path / "minion.d" / "10-x.conf"), "master_alive_interval: 5\n"
           "master_port: 4600\n")
    _write(str(tmp_path / "minion.d" / "zz.conf"), "master: [c]\n")
    dropin = mc.dropin_path(conf)
    assert dropin == str(tmp_path / "minion.d" / "multimaster.conf")
    assert mc.config_files(conf) == [
        conf, str(tmp_path / "minion.d" / "10-x.conf"), str(tmp_path / "minion.d" / "zz.conf")
    ]
    # not written yet: zz.conf sorts after it and sets master again
    assert mc.overriding_files(conf, dropin, ["master", "master_alive_interval"]) == {
        "master": str(tmp_path / "minion.d" / "zz.conf")
    }
    os.unlink(str(tmp_path / "minion.d" / "zz.conf"))
    assert mc.overriding_files(conf, dropin, ["master"]) == {}
    # the master_port of a later file: "a" and "a:4600" are one master
    assert mc.check(conf, ["a", "a:4600"], {})["notes"] == ["removed duplicate masters: a:4600"]
    assert "*" in mc.overriding_files(conf, str(tmp_path / "elsewhere.conf"), ["master"])


def test_dropin_path():
    assert mc.dropin_path("/etc/salt/minion") == "/etc/salt/minion.d/multimaster.conf"
    assert mc.dropin_path("/etc/salt/minion", "x.conf") == "/etc/salt/minion.d/x.conf"
    assert mc.dropin_path("/etc/salt/minion", "/abs/x.conf") == "/abs/x.conf"


@pytest.fixture
def conf(tmp_path):
    path = tmp_path / "minion"
    path.write_text("master: [m1, m1]\nmaster_port: 4510\n")
    return str(path)


def test_check_and_apply(conf, tmp_path):
    running = {"master_alive_interval": 0}
    check = mc.check(conf, ["m1", "m1:4510", "m2"], {"master_alive_interval": 30},
                     running=running)
    assert check["errors"] == [] and check["rewrite"] is True and check["restart_needed"]
    assert check["desired"] == {"master": ["m1", "m2"], "master_alive_interval": 30}
    assert check["notes"] == ["removed duplicate masters: m1:4510"]
    dropin = tmp_path / "minion.d" / "multimaster.conf"
    assert not dropin.exists()
    applied = mc.apply(conf, ["m1", "m2"], {"master_alive_interval": 30}, running=running)
    assert applied["written"] is True and dropin.read_text() == check["content"]
    assert os.stat(dropin).st_mode & 0o777 == 0o644
    again = mc.apply(conf, ["m1", "m2"], {"master_alive_interval": 30}, running=running)
    assert again["written"] is False and again["changes"] == {}
    # written, the running minion has not loaded it yet
    assert again["notes"] == ["the running minion still uses master_alive_interval=0: it "
                              "loads the drop-in when it restarts"]


def test_options_the_state_does_not_manage_are_kept(conf, tmp_path):
    """
    A peer host's ``multimaster.master_config`` (or any option the operator put
    in the drop-in) survives the state's rewrite; a managed setting no longer
    wanted is dropped.
    """
    dropin = tmp_path / "minion.d" / "multimaster.conf"
    dropin.parent.mkdir()
    dropin.write_text("master: [m1]\nmaster_alive_interval: 10\n"
                      "multimaster.master_config: /etc/salt/master\nlog_level: info\n")
    applied = mc.apply(conf, ["m1", "m2"], {"retry_dns": 0})
    assert applied["written"] is True
    assert mc.parse(dropin.read_text()) == {
        "master": ["m1", "m2"], "retry_dns": 0,
        "multimaster.master_config": "/etc/salt/master", "log_level": "info"}
    assert applied["changes"] == {"master": {"old": ["m1"], "new": ["m1", "m2"]},
                                  "retry_dns": {"old": None, "new": 0},
                                  "master_alive_interval": {"old": 10, "new": None}}
    assert applied["notes"] == ["kept options this file holds but the state does not manage: "
                                "log_level, multimaster.master_config"]
    again = mc.apply(conf, ["m1", "m2"], {"retry_dns": 0})
    assert again["written"] is False and again["changes"] == {}


def test_apply_refuses_and_writes_nothing(conf, tmp_path, monkeypatch):
    with pytest.raises(InvalidInput, match="master entry 'm2:0' has an invalid port 0"):
        mc.apply(conf, ["m1", "m2:0"], {})
    (tmp_path / "minion.d").mkdir()
    (tmp_path / "minion.d" / "zz.conf").write_text("master_alive_interval: 1\n")
    check = mc.check(conf, ["m1"], {"master_alive_interval": 30})
    assert check["errors"] == [
        f"Salt reads these files after {tmp_path / 'minion.d' / 'multimaster.conf'} and they "
        f"set the same keys again: master_alive_interval ({tmp_path / 'minion.d' / 'zz.conf'})"
        "; remove the keys there"]
    with pytest.raises(InvalidInput):
        mc.apply(conf, ["m1"], {"master_alive_interval": 30})
    assert os.listdir(tmp_path / "minion.d") == ["zz.conf"]


def test_apply_write_failure(conf, monkeypatch):
    def disk_full(path, data, mode, durable=True):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mc.fsutil, "atomic_write", disk_full)
    with pytest.raises(mc.WriteError, match="^cannot write .*: .*No space left on device"):
        mc.apply(conf, ["m1"], {})


def test_trusted_key_path():
    opts = {"pki_dir": "/p"}
    assert mc.trusted_key_path(opts) == "/p/minion_master.pub"
    assert mc.trusted_key_path(opts, "signed") == "/p/master_sign.pub"
    assert mc.trusted_key_path(opts, "signed", "/abs.pub") == "/abs.pub"
    opts["master_sign_key_name"] = "sign"
    assert mc.trusted_key_path(opts, "signed") == "/p/sign.pub"
    assert mc.trusted_key_name("shared") == "minion_master.pub"
    assert mc.trusted_key_name("signed") == "master_sign.pub"
    assert mc.trusted_key_name("signed", "mysign") == "mysign.pub"


def test_key_check_and_apply(tmp_path):
    opts = {"pki_dir": str(tmp_path / "pki"), "cachedir": str(tmp_path / "cache")}
    path = mc.trusted_key_path(opts)
    good, stale = _pub(), _pub()
    os.makedirs(opts["pki_dir"])
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(stale)
    good_finger = finger_mod.master_finger(good)
    check = mc.key_check(path, contents=good, master_finger=good_finger)
    assert check == {"path": path, "errors": [], "match": False,
                     "current_finger": finger_mod.master_finger(stale),
                     "expected_finger": good_finger, "expected": good}
    applied = mc.key_apply(opts, path, fetch=lambda src: good, source="salt://k.pub")
    assert applied["written"] is True and open(path, encoding="utf-8").read() == good
    assert applied["backup"].startswith(str(tmp_path / "cache" / "multimaster" / "backup"))
    assert open(applied["backup"], encoding="utf-8").read() == stale
    assert mc.key_apply(opts, path, contents=good)["written"] is False
    # the fingerprint alone checks the key in either of Salt's forms
    body_form = finger_mod.body_finger(good)
    assert mc.key_check(path, master_finger=body_form)["match"] is True
    with pytest.raises(mc.WriteError, match="no key content was given"):
        mc.key_apply(opts, path, master_finger=finger_mod.body_finger(stale))


@pytest.mark.parametrize("kwargs,error", [
    ({"topology": "mesh"}, "topology 'mesh' is not one of shared, signed"),
    ({"master_finger": "zz"}, "master_finger 'zz' is not a key fingerprint"),
    ({"contents": "x"}, "the expected master key is not a PEM public key"),
    ({"source": "salt://k", "fetch": lambda s: ""},
     "cannot fetch salt://k: no such file on the master"),
    ({"source": "salt://k", "fetch": lambda s: 1 / 0}, "cannot fetch salt://k: division by zero"),
    ({}, "give the expected key (contents or source) or its master_finger"),
])
def test_key_check_errors(tmp_path, kwargs, error):
    path = str(tmp_path / "k.pub")
    assert mc.key_check(path, **kwargs)["errors"] == [error]
    with pytest.raises(InvalidInput):
        mc.key_apply({"cachedir": str(tmp_path)}, path, **kwargs)
    assert not os.path.exists(path)


def test_pem_helpers():
    pub = _pub()
    assert mc.looks_like_public_key(pub)
    private = "RSA " + "PRIVATE KEY"  # a header only, spelled so no key scanner flags it
    assert not mc.looks_like_public_key(f"-----BEGIN {private}-----\nx\n-----END {private}-----")
    assert finger_mod.normalize_pem("  " + pub.replace("\n", "\r\n") + "\n\n") == pub
