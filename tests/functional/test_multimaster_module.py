"""
The ``multimaster`` execution module through Salt's loader: the audit, the
drop-in and trusted-key functions the states call, and the restart helper.
"""

import pytest
import salt.utils.crypt
import salt.version
from salt.exceptions import CommandExecutionError, SaltInvocationError

from tests.functional.conftest import new_pub as _pub
from tests.support.cluster import wait_until

from salt_multimaster import finger

VERSION = salt.version.__version__


@pytest.fixture
def cached_key(minion):
    """A cached minion_master.pub and its fingerprint (salt-key -F master form)."""
    path = minion["pki"] / "minion_master.pub"
    path.write_text(_pub())
    return finger.file_finger(str(path))


# ----- audit ----------------------------------------------------------------------------
def test_audit_right_minion(mm, masters, cached_key):
    ret = mm.audit(masters=",".join(masters["masters"]), master_finger=cached_key,
                   master_version=VERSION)
    assert ret == {
        "result": True,
        "findings": [],
        # the configured list from the config file
        "masters": masters["masters"],
        "master_finger": cached_key,
        "saltversion": VERSION,
    }


def test_audit_expectations_from_pillar(mm, masters, cached_key, pillar):
    pillar({"multimaster": {"masters": [masters["masters"][0], "127.0.0.3"],
                            "master_finger": cached_key, "master_version": "3006.0",
                            "topology": "shared"}})
    ret = mm.audit()
    # every supported Salt is newer than 3006.0
    assert [(f["check"], f["severity"]) for f in ret["findings"]] == [
        ("master_list", "error"), ("master_list", "error"), ("version_skew", "error")]
    assert ret["result"] is False
    # keyword arguments win over the pillar
    assert mm.audit(masters=masters["masters"], master_version=VERSION)["findings"] == []


def test_audit_flags_what_the_state_refuses(mm, minion, masters, cached_key):
    """One parser: an entry multimaster.minion_config refuses is an audit error."""
    (minion["conf_dir"] / "minion.d" / "bad.conf").write_text(
        f"master: [{masters['masters'][0]}, 'm2:99999', 10.0.0.1:{masters['request_port']},"
        f" 127.0.0.1:{masters['request_port']}]\nmaster_alive_interval: 0\n")
    ret = mm.audit(master_finger="00:11")
    errors = {f["check"] for f in ret["findings"] if f["severity"] == "error"}
    # restart_pending: the loaded modules run with the options before bad.conf
    assert errors == {"master_list", "duplicate_master", "master_reachable", "master_pubkey",
                      "restart_pending"}
    assert ret["result"] is False
    assert ret["findings"][0]["message"] == (
        "Master entry 'm2:99999' in 'master' cannot be used: master entry 'm2:99999' has "
        "an invalid port 99999.")
    with pytest.raises(SaltInvocationError, match="'m2:99999' has an invalid port 99999"):
        mm.minion_config_apply(masters=["m1", "m2:99999"])
    assert not minion["dropin"].exists()


@pytest.mark.parametrize("kwargs,message", [
    ({"topology": "mesh"}, "multimaster.audit: topology must be 'shared' or 'signed', "
                           "not 'mesh'"),
    ({"timeout": 0}, "multimaster.audit: timeout must be more than 0 seconds, not 0"),
    ({"timeout": "nan"}, "multimaster.audit: timeout must be a finite number of seconds, "
                         "not 'nan'"),
    ({"timeout": 1e9}, "multimaster.audit: timeout must be at most 60 seconds, "
                       "not 1000000000.0"),
])
def test_audit_bad_input(mm, minion, kwargs, message):
    with pytest.raises(SaltInvocationError) as exc:
        mm.audit(**kwargs)
    assert str(exc.value) == message


def test_audit_changes_nothing(mm, minion, cached_key):
    def snapshot():
        return {str(p): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"")
                for p in sorted((minion["root"] / "conf").rglob("*"))
                + sorted(minion["pki"].rglob("*"))}

    before = snapshot()
    mm.audit(master_finger=cached_key)
    assert snapshot() == before


# ----- the drop-in ----------------------------------------------------------------------
def test_minion_config_path(mm, minion):
    assert mm.minion_config_path() == str(minion["dropin"])
    assert mm.minion_config_path("x.conf") == str(minion["conf_dir"] / "minion.d" / "x.conf")
    assert mm.minion_config_path("/abs/x.conf") == "/abs/x.conf"


def test_minion_config_check_and_apply(mm, minion, pillar):
    pillar({"multimaster": {"masters": ["127.0.0.2", "127.0.0.2:4506", "127.0.0.3"]}})
    check = mm.minion_config_check(master_alive_interval=30)
    assert check["errors"] == [] and check["rewrite"] is True
    assert check["changes"] == {"master": {"old": None, "new": ["127.0.0.2", "127.0.0.3"]},
                                "master_alive_interval": {"old": None, "new": 30}}
    assert check["notes"] == ["removed duplicate masters: 127.0.0.2:4506"]
    assert not minion["dropin"].exists()
    applied = mm.minion_config_apply(master_alive_interval=30)
    assert applied["written"] is True
    assert minion["dropin"].read_text() == check["content"]
    again = mm.minion_config_apply(master_alive_interval=30)
    assert again["written"] is False and again["changes"] == {}


def test_minion_config_apply_refuses_and_writes_nothing(mm, minion):
    with pytest.raises(SaltInvocationError, match="master_alive_interval: -1"):
        mm.minion_config_apply(masters=["a", "b"], master_alive_interval=-1)
    with pytest.raises(SaltInvocationError, match="masters must be a list"):
        mm.minion_config_apply(masters="a")
    (minion["conf_dir"] / "minion.d" / "zz.conf").write_text("master: [x]\n")
    with pytest.raises(SaltInvocationError, match="zz.conf"):
        mm.minion_config_apply(masters=["a", "b"])
    assert not minion["dropin"].exists()


# ----- the trusted master key -----------------------------------------------------------
def test_master_key_path(mm, minion, pillar):
    assert mm.master_key_path() == str(minion["pki"] / "minion_master.pub")
    assert mm.master_key_path(topology="signed") == str(minion["pki"] / "master_sign.pub")
    pillar({"multimaster": {"topology": "signed"}})
    assert mm.master_key_path() == str(minion["pki"] / "master_sign.pub")
    assert mm.master_key_path("/abs/k.pub") == "/abs/k.pub"


def test_master_key_check_and_apply_from_pillar(mm, minion, cached_key, pillar):
    good = _pub()
    stale = (minion["pki"] / "minion_master.pub").read_text()
    pillar({"multimaster": {"master_pub": good}})
    check = mm.master_key_check()
    assert check["match"] is False and check["current_finger"] == cached_key
    assert check["expected_finger"] == finger.master_finger(good)
    applied = mm.master_key_apply()
    assert applied["written"] is True
    assert (minion["pki"] / "minion_master.pub").read_text() == good
    assert applied["backup"].startswith(str(minion["state_dir"] / "backup"))
    with open(applied["backup"], encoding="utf-8") as fh:
        assert fh.read() == stale
    assert mm.master_key_apply()["written"] is False


def test_master_key_apply_errors(mm, minion, cached_key):
    with pytest.raises(SaltInvocationError, match="not a PEM public key"):
        mm.master_key_apply(contents="nonsense")
    with pytest.raises(SaltInvocationError, match="does not have fingerprint"):
        mm.master_key_apply(contents=_pub(), master_finger=cached_key)
    with pytest.raises(SaltInvocationError, match="give the expected key"):
        mm.master_key_apply()
    with pytest.raises(CommandExecutionError, match="no key content was given"):
        mm.master_key_apply(master_finger="ab:" * 31 + "ab")
    # the minion's own master_finger form names the same key
    body_form = salt.utils.crypt.pem_finger(str(minion["pki"] / "minion_master.pub"))
    assert mm.master_key_check(master_finger=body_form)["match"] is True
    # fetched from the file server: nothing there
    ret = mm.master_key_check(source="salt://nope/master.pub")
    assert ret["errors"] == ["cannot fetch salt://nope/master.pub: no such file on the master"]


def test_master_key_from_the_file_server(mm, minion):
    sign = _pub()
    (minion["root"] / "states" / "master_sign.pub").write_text(sign)
    ret = mm.master_key_apply(source="salt://master_sign.pub", topology="signed")
    assert ret["written"] is True and ret["backup"] is None
    assert (minion["pki"] / "master_sign.pub").read_text() == sign


# ----- restart --------------------------------------------------------------------------
def test_restart_minion_runs_the_command_once(mm, minion, tmp_path):
    marker = tmp_path / "restarted"
    assert mm.restart_minion(cmd=f"touch {marker}", test=True) == {
        "scheduled": False, "possible": True, "reason": None, "cmd": f"touch {marker}"}
    # pending for the delay: a job here is a thread of the minion (nothing to outlive)
    first = mm.restart_minion(cmd=f"touch {marker}", delay=3)
    assert first["scheduled"] is True and first["pid"] > 0
    # pending: a second call schedules nothing
    assert mm.restart_minion(cmd=f"touch {marker}", delay=0) == {
        "scheduled": False, "pid": first["pid"], "cmd": f"touch {marker}"}
    assert wait_until(marker.exists, deadline=10, step=0.1)
    status = minion["state_dir"] / "restart-salt-minion.status"
    assert wait_until(status.exists, deadline=10, step=0.1)


def test_restart_minion_from_pillar_and_for_the_master(mm, minion, pillar, tmp_path):
    marker = tmp_path / "restarted"
    pillar({"multimaster": {"minion_restart_cmd": f"touch {marker}",
                            "minion_restart_delay": 0}})
    assert mm.restart_minion()["cmd"] == f"touch {marker}"
    assert wait_until(marker.exists, deadline=10, step=0.1)
    master = mm.restart_minion(cmd="true", delay=3, service="salt-master")
    assert master["scheduled"] is True
    # its own pending marker: a pending master restart does not hide a minion restart
    assert (minion["state_dir"] / "restart-salt-master.pending").exists()


def test_restart_minion_refuses(mm, minion):
    with pytest.raises(CommandExecutionError, match="'no-such-restarter' not found"):
        mm.restart_minion(cmd="no-such-restarter salt-minion", delay=0)
    with pytest.raises(SaltInvocationError, match="salt-minion or salt-master"):
        mm.restart_minion(service="salt-api")
    for delay in (-1, "soon", float("nan"), 10 ** 6):
        with pytest.raises(SaltInvocationError, match="^delay must be"):
            mm.restart_minion(cmd="true", delay=delay)
    with pytest.raises(SaltInvocationError, match="cmd must be a non-empty command string"):
        mm.restart_minion(cmd=["true"])
    assert not (minion["state_dir"] / "restart.pending").exists()


# ----- engines_config (the multimaster_watch engine next to the master's own) ------------
@pytest.mark.parametrize("main,dropins,expected", [
    # the master file's engines are repeated: a master.d list replaces them
    ("engines: [{reactor_fwd: {x: 1}}]\n", {}, [{"reactor_fwd": {"x": 1}}, {"multimaster_watch": {}}]),
    # no engines anywhere
    ("interface: 0.0.0.0\n", {}, [{"multimaster_watch": {}}]),
    # another drop-in lists engines already: merged with ours, nothing repeated
    ("engines: [a]\n", {"other.conf": "engines: [b]\n"}, [{"multimaster_watch": {}}]),
    # running it already (here, or in another drop-in): no engines key
    ("engines: [multimaster_watch]\n", {}, None),
    ("", {"other.conf": "engines: [{multimaster_watch: {poll: 2}}]\n"}, None),
    # our own drop-in's engines never count
    ("engines: [a]\n", {"multimaster-reactor.conf": "engines: [a, multimaster_watch]\n"},
     ["a", {"multimaster_watch": {}}]),
])
def test_engines_config_keeps_the_engines_the_master_runs(mm, tmp_path, main, dropins,
                                                         expected):
    conf = tmp_path / "master"
    conf.write_text(main)
    (tmp_path / "master.d").mkdir()
    for name, text in dropins.items():
        (tmp_path / "master.d" / name).write_text(text)
    assert mm.engines_config(str(conf)) == expected


def test_engines_config_names_a_bad_option(mm, tmp_path):
    conf = tmp_path / "master"
    conf.write_text("engines: multimaster_watch\n")
    with pytest.raises(CommandExecutionError, match=r"engines in the master file is not a list"):
        mm.engines_config(str(conf))
    with pytest.raises(CommandExecutionError, match=r"no salt-master configuration"):
        mm.engines_config(str(tmp_path / "missing"))
