"""
Unit tests of the per-setting checks of a minion's configuration in
``salt_multimaster.checks`` (the whole audit and the checks of the running
system: test_audit.py).  No daemons.
"""

import pytest
import salt.config
import salt.utils.crypt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

import salt_multimaster.checks as checks
from salt_multimaster import finger as finger_mod
from salt_multimaster import masters, minion_config
from tests.unit.test_masters import fake_resolver


def _pub_pem():
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


# ----- master_list ------------------------------------------------------------------
def test_master_list_right():
    resolved = {"m1": {"10.0.0.1"}, "10.0.0.1": {"10.0.0.1"}, "m2": {"10.0.0.2"}}
    # the same masters under other spellings (address, explicit default port)
    assert checks.check_master_list(["10.0.0.1", "m2:4506"], ["m1", "m2"], 4506, resolved) == []


def test_master_list_missing_and_unexpected():
    ret = checks.check_master_list(["m1", "m3"], ["m1", "m2"], 4506, {})
    assert [(f["check"], f["severity"]) for f in ret] == [
        ("master_list", "error"),
        ("master_list", "error"),
    ]
    assert ret[0]["message"] == "Expected master(s) missing from the minion configuration: m2"
    assert ret[1]["message"] == "Configured master(s) not in the expected list: m3"


def test_master_list_empty_and_unknown():
    assert checks.check_master_list([], ["m1"])[0]["severity"] == "error"
    assert checks.check_master_list(["m1"], None)[0]["severity"] == "info"


def test_master_list_port_matters():
    ret = checks.check_master_list(["m1:5506"], ["m1"], 4506, {})
    assert len(ret) == 2


@pytest.mark.parametrize("entry,reason", [
    ("m2:abc", "master entry 'm2:abc' has a non-numeric port"),
    ("m2:0", "master entry 'm2:0' has an invalid port 0"),
    ("m2:99999", "master entry 'm2:99999' has an invalid port 99999"),
])
def test_master_list_entry_the_state_refuses(entry, reason):
    """The audit flags what multimaster.minion_config refuses: one parser."""
    remedy = ("Fix or remove the entry in 'master' in the minion configuration (a host, "
              "host:port with a port from 1 to 65535, or [ipv6]:port) and restart "
              "salt-minion; the salt.multimaster.minion state refuses to write it too.")
    bad = {"check": "master_list", "severity": "error",
           "message": f"Master entry {entry!r} in 'master' cannot be used: {reason}.",
           "remedy": remedy}
    assert checks.check_master_list(["m1", entry], None)[0] == bad
    ret = checks.check_master_list(["m1", entry], ["m1", "m2"], 4506, {})
    assert ret[0] == bad
    assert [f["message"] for f in ret[1:]] == [
        "Expected master(s) missing from the minion configuration: m2",
        f"Configured master(s) not in the expected list: {entry}"]
    with pytest.raises(ValueError, match=reason):
        minion_config.apply("/nonexistent/minion", ["m1", entry], {})
    # never connected to, never a duplicate of a valid entry
    assert checks.check_master_reachable([entry], connect=lambda h, p, t: "refused") == []
    assert checks.check_duplicate_master(["m2", entry], 4506, {}) == []
    assert checks.check_master_list(["m1"], [entry], 4506, {})[0]["message"] == (
        f"Master entry {entry!r} in the expected list cannot be used: {reason}.")


# ----- duplicate_master ---------------------------------------------------------------
def test_duplicate_master_spellings():
    resolved = masters.resolve_hosts(
        ["master01", "10.0.0.1", "10.0.0.2"],
        resolver=fake_resolver({"master01": ["10.0.0.1"]}),
    )
    configured = ["master01", "10.0.0.2", "10.0.0.1:4506", "10.0.0.2:4506"]
    ret = checks.check_duplicate_master(configured, 4506, resolved)
    assert ret == [
        {
            "check": "duplicate_master",
            "severity": "error",
            "message": "The same master is configured 2 times: 'master01', "
            "'10.0.0.1:4506' (all reach 10.0.0.1:4506); every job from it returns 2 times.",
            "remedy": "Keep one entry for this master in 'master' (remove "
            "'10.0.0.1:4506') and restart salt-minion.",
        },
        {
            "check": "duplicate_master",
            "severity": "error",
            "message": "The same master is configured 2 times: '10.0.0.2', "
            "'10.0.0.2:4506' (all reach 10.0.0.2:4506); every job from it returns 2 times.",
            "remedy": "Keep one entry for this master in 'master' (remove "
            "'10.0.0.2:4506') and restart salt-minion.",
        },
    ]


def test_duplicate_master_same_name_twice():
    # seed 002: centos02 listed twice
    ret = checks.check_duplicate_master(["centos02", "centos02", "xxx"], 4506, {})
    assert len(ret) == 1 and "2 times" in ret[0]["message"]


def test_no_duplicate_for_other_port_or_host():
    resolved = {"a": {"10.0.0.1"}, "b": {"10.0.0.2"}}
    assert checks.check_duplicate_master(["a", "b", "a:5506"], 4506, resolved) == []


# ----- master_reachable ---------------------------------------------------------------
def test_master_reachable_per_master():
    calls = []

    def connect(host, port, timeout):
        calls.append((host, port, timeout))
        return None if host == "10.0.0.1" else "Connection refused"

    ret = checks.check_master_reachable(
        ["10.0.0.1", "10.0.0.2:5506", "10.0.0.1:4506"], 4505, 4506, 0.5, connect
    )
    assert sorted(calls) == [
        ("10.0.0.1", 4505, 0.5),
        ("10.0.0.1", 4506, 0.5),
        ("10.0.0.2", 4505, 0.5),
        ("10.0.0.2", 5506, 0.5),
    ]
    assert ret == [
        {
            "check": "master_reachable",
            "severity": "error",
            "message": "Master 10.0.0.2:5506 is not reachable: publish port 4505 "
            "(Connection refused); request port 5506 (Connection refused).",
            "remedy": "Start salt-master on 10.0.0.2:5506 or open TCP ports 4505/5506 "
            "from this minion (firewall, interface, publish_port/ret_port); remove the "
            "entry if the master is retired.",
        }
    ]


def test_master_reachable_real_refused_port():
    ret = checks.check_master_reachable(["127.0.0.1:1"], 1, 4506, 0.5)
    assert len(ret) == 1 and "not reachable" in ret[0]["message"]


# ----- master_pubkey ------------------------------------------------------------------
def test_master_pubkey(tmp_path):
    path = tmp_path / "minion_master.pub"
    path.write_bytes(_pub_pem())
    finger = salt.utils.crypt.pem_finger(str(path), sum_type="sha256")
    # reported in the installed Salt's salt-key -F form; either form matches
    text_form = salt.utils.crypt.pem_finger(key=path.read_bytes(), sum_type="sha256")
    assert checks.check_master_pubkey(str(path), finger_mod.file_finger(str(path)),
                                      text_form) == []
    assert checks.check_master_pubkey(str(path), finger, finger) == []
    assert checks.check_master_pubkey(str(path), finger, finger.upper()) == []
    stale = checks.check_master_pubkey(str(path), finger, "aa:bb")
    assert [f["severity"] for f in stale] == ["error"]
    assert "expected aa:bb" in stale[0]["message"]
    assert f"remove {path}" in stale[0]["remedy"]
    missing = checks.check_master_pubkey(str(tmp_path / "nope.pub"), "", finger)
    assert [f["severity"] for f in missing] == ["error"]
    assert "missing" in missing[0]["message"]
    assert checks.check_master_pubkey(str(path), finger, None)[0]["severity"] == "info"


def test_master_pubkey_signed_missing_remedy():
    ret = checks.check_master_pubkey("/p/master_sign.pub", "", "aa", "signed")
    assert "master_sign.pub" in ret[0]["remedy"]


# ----- master_alive_interval ----------------------------------------------------------
@pytest.mark.parametrize(
    "opts,masters,count",
    [
        ({}, ["a", "b"], 1),
        ({"master_alive_interval": 0}, ["a", "b"], 1),
        ({"master_alive_interval": 30}, ["a", "b"], 0),
        ({}, ["a"], 0),
        ({"master_type": "failover"}, ["a"], 1),
    ],
)
def test_master_alive_interval(opts, masters, count):
    ret = checks.check_master_alive_interval(opts, masters)
    assert len(ret) == count
    assert all(f["severity"] == "warning" for f in ret)


# ----- failover_settings --------------------------------------------------------------
def test_failover_settings():
    two = ["a", "b"]
    check = checks.check_failover_settings
    assert check({}, two, False) == []
    assert check({"master_type": "failover", "verify_master_pubkey_sign": True}, two, True) == []
    ret = check({"master_type": "failover"}, two, False)
    assert [f["severity"] for f in ret] == ["warning"]
    assert "verify_master_pubkey_sign is off" in ret[0]["message"]
    ret = check({"master_type": "failover", "verify_master_pubkey_sign": True}, two, False)
    assert [f["severity"] for f in ret] == ["error"]
    assert "master_sign.pub is missing" in ret[0]["message"]
    ret = check({"verify_master_pubkey_sign": True}, two, True)
    assert [f["severity"] for f in ret] == ["warning"]
    assert "master_type is str" in ret[0]["message"]
    ret = check({"master_type": "failover", "verify_master_pubkey_sign": True}, ["a"], True)
    assert [f["severity"] for f in ret] == ["warning"]


# ----- ipc_tcp_ports ------------------------------------------------------------------
def test_ipc_tcp_ports():
    two = ["a", "b"]
    check = checks.check_ipc_tcp_ports
    assert check({"ipc_mode": "ipc", "tcp_pub_port": [1]}, two) == []
    assert check({"ipc_mode": "tcp", "tcp_pub_port": 4510, "tcp_pull_port": 4511}, two) == []
    ret = check({"ipc_mode": "tcp", "tcp_pub_port": [4510],
                 "tcp_pull_port": [4511, 4510]}, two)
    assert [f["message"] for f in ret if "is a list" not in f["message"]] == [
        "ipc_mode is tcp and tcp_pub_port lists 1 port(s) for 2 master(s).",
        "ipc_mode is tcp and port(s) 4510 are used more than once in "
        "tcp_pub_port/tcp_pull_port.",
    ]
    ret = check({"ipc_mode": "tcp", "tcp_pub_port": 4510, "tcp_pull_port": 4510}, two)
    assert len(ret) == 1 and "4510" in ret[0]["message"]


def test_ipc_tcp_port_lists_on_a_salt_that_takes_one_port():
    # every supported Salt types tcp_pub_port as int: a list stops salt-minion from starting
    assert salt.config.VALID_OPTS["tcp_pub_port"] is salt.config.VALID_OPTS["tcp_pull_port"] is int
    ret = checks.check_ipc_tcp_ports(
        {"ipc_mode": "tcp", "tcp_pub_port": [4510, 4512], "tcp_pull_port": 4511}, ["a", "b"]
    )
    assert [f["severity"] for f in ret] == ["error"]
    assert "tcp_pub_port is a list" in ret[0]["message"]
    ret = checks.check_ipc_tcp_ports(
        {"ipc_mode": "tcp", "tcp_pub_port": [4510, 4512], "tcp_pull_port": [4511, 4513]},
        ["a", "b"])
    assert [f["message"].split(" is a list")[0] for f in ret] == [
        "ipc_mode is tcp and tcp_pub_port", "ipc_mode is tcp and tcp_pull_port"]


# ----- version_skew -------------------------------------------------------------------
@pytest.mark.parametrize(
    "minion,master,severities",
    [
        ("3008.3", "3008.3", []),
        ("3008.1", "3008.3", []),
        ("3008.3", "3008.1", ["error"]),
        ("3008.3", "3007.1", ["error"]),
        ("3007.1", "3008.3", ["warning"]),
        ("2015.5.11", "2018.3.2", ["warning"]),  # seed 004
        ("2018.3.2", "2018.3.4", []),
        ("2019.2.0", "3000", ["warning"]),
    ],
)
def test_version_skew(minion, master, severities):
    ret = checks.check_version_skew(minion, {"m1": master})
    assert [f["severity"] for f in ret] == severities
    assert all(f["check"] == "version_skew" and f["remedy"] for f in ret)


def test_version_skew_unknown_and_unparsable():
    assert [f["severity"] for f in checks.check_version_skew("3008.3", {})] == ["info"]
    assert checks.check_version_skew("3008.3", {"m": "banana"})[0]["severity"] == "warning"
