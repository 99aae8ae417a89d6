"""
``salt_multimaster.membership``: the peers drop-in and how Salt merges it,
the checks of a new peer, where each minion stands with a master, and the
runner's add_peer/remove_peer refusing bad input before anything is sent.
"""

import importlib.util
import os
import stat

import pytest
import salt.config

from salt_multimaster import daemon, membership
from tests.conftest import REPO


def _conf_dir(tmp_path, main="", operator=None):
    conf = tmp_path / "etc"
    (conf / "master.d").mkdir(parents=True)
    (conf / "master").write_text(main)
    if operator is not None:
        (conf / "master.d" / "multimaster.conf").write_text(operator)
    return conf


def _opts(conf, **extra):
    opts = {"conf_file": str(conf / "master"), "id": "master01_master",
            "pki_dir": str(conf.parent / "pki")}
    opts.update(extra)
    return opts


# ----- the drop-in and Salt's merge -------------------------------------------
def test_dropin_is_joined_with_the_operators_master_d_block(tmp_path):
    conf = _conf_dir(tmp_path, operator="multimaster:\n  peers: [master02]\n  topology: signed\n")
    path = membership.dropin_path(_opts(conf))
    assert path == str(conf / "master.d" / "multimaster-peers.conf")
    membership.write_dropin(path, ["master03", "master02"])
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    loaded = salt.config.master_config(str(conf / "master"))
    # Salt joins the lists of master.d files; every other setting stays
    assert sorted(membership.effective_peers(loaded)) == ["master02", "master03"]
    assert loaded["multimaster"]["topology"] == "signed"
    assert membership.read_dropin(path) == ["master03", "master02"]
    assert membership.shadowed(str(conf / "master"), path) is None


def test_a_main_file_block_would_be_hidden_so_it_is_refused(tmp_path):
    conf = _conf_dir(tmp_path, main="multimaster:\n  peers: [master02]\n  topology: signed\n")
    path = membership.dropin_path(_opts(conf))
    membership.write_dropin(path, ["master03"])
    loaded = salt.config.master_config(str(conf / "master"))
    # what Salt does: the master.d block replaces the main file's
    assert loaded["multimaster"] == {"peers": ["master03"]}
    error = membership.shadowed(str(conf / "master"), path)
    assert "hide your whole multimaster block" in error
    assert str(conf / "master.d" / "multimaster.conf") in error


def test_empty_dropin_is_removed_and_foreign_content_refused(tmp_path):
    conf = _conf_dir(tmp_path)
    path = membership.dropin_path(_opts(conf))
    assert membership.read_dropin(path) == []
    membership.write_dropin(path, ["master03"])
    membership.write_dropin(path, [])
    assert not os.path.exists(path)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("multimaster:\n  peers: [a]\n  topology: signed\n")
    with pytest.raises(membership.MembershipError, match="more than multimaster:peers"):
        membership.read_dropin(path)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("multimaster: [unclosed\n")
    with pytest.raises(membership.MembershipError, match="unreadable"):
        membership.read_dropin(path)


def test_peers_value_must_be_a_list():
    assert membership.as_list("a, b") == ["a", "b"]
    assert membership.effective_peers({}) == []
    with pytest.raises(membership.MembershipError, match="must be a list"):
        membership.as_list({"a": 1})
    with pytest.raises(membership.MembershipError, match="must be a mapping"):
        membership.effective_peers({"multimaster": "x"})


# ----- a new peer -----------------------------------------------------------
@pytest.fixture
def pki_opts(tmp_path):
    conf = _conf_dir(tmp_path)
    opts = _opts(conf)
    for state, mid in (("minions", "master03"), ("minions_pre", "master04")):
        os.makedirs(os.path.join(opts["pki_dir"], state), exist_ok=True)
        with open(os.path.join(opts["pki_dir"], state, mid), "w", encoding="utf-8") as fh:
            fh.write("key")
    return opts


@pytest.mark.parametrize("peer, configured, dropin, message", [
    ("bad/id", [], [], "invalid peer id 'bad/id'"),
    ("a,b", [], [], "invalid peer id"),
    ("master01_master", [], [], "is this primary master itself"),
    ("master01", [], [], "is this primary master itself"),
    ("master03", ["master03"], ["master03"], "written by add_peer"),
    ("master03", ["master03"], [], "in your multimaster:peers"),
    ("master04", [], [], "its key is in minions_pre): accept it with salt-key -a master04"),
    ("nosuch", [], [], "'nosuch' is not an accepted minion of this master: run a salt-minion"),
])
def test_check_new_peer_refuses_by_name(pki_opts, peer, configured, dropin, message):
    with pytest.raises(membership.MembershipError) as exc:
        membership.check_new_peer(peer, pki_opts, configured, dropin)
    assert message in str(exc.value)


def test_check_new_peer_accepts_an_accepted_minion(pki_opts):
    assert membership.check_new_peer("master03", pki_opts, ["master02"], []) is None


def _host(**extra):
    host = {"master_id": "master03_master", "master_config": "/etc/salt/master",
            "interface": "0.0.0.0", "ret_port": 4506, "publish_port": 4505,
            "ports": {4505: False, 4506: False}, "master_pid": None, "pub_sha": "aa",
            "fqdn": "master03.example.com"}
    host.update(extra)
    return host


@pytest.mark.parametrize("host, result, state, words", [
    (_host(), True, "stopped", "ports are free"),
    (_host(master_pid=42, ports={4505: True, 4506: True}), True, "own_key", "its own master key"),
    (_host(master_pid=42, pub_sha="pp"), True, "primary_key", "the primary's master key"),
    (_host(ports={4505: False, 4506: True}), False, "busy", "ports 4506 on master03 are taken"),
    (_host(master_id="master01_master"), False, None, "this primary's own"),
    ("'multimaster_peer.host_check' is not available.", False, None, "gave no host check"),
    (None, False, None, "gave no host check"),
])
def test_check_host(host, result, state, words):
    ret = membership.check_host("master03", host, "master01_master", "pp")
    assert (ret["result"], ret["master"]) == (result, state), ret
    assert words in ret["comment"]


def test_master_entry():
    assert membership.master_entry(_host()) == "master03.example.com"
    assert membership.master_entry(_host(interface="10.0.0.3")) == "10.0.0.3"
    assert membership.master_entry(_host(interface="10.0.0.3", ret_port=5506)) == "10.0.0.3:5506"
    assert membership.master_entry(_host(interface="fd00::3", ret_port=5506)) == "[fd00::3]:5506"
    assert membership.master_entry(_host(), address="m3.lan") == "m3.lan"
    with pytest.raises(membership.MembershipError, match="pass address="):
        membership.master_entry(_host(fqdn=None))


def test_host_report_reads_the_peer_masters_state(tmp_path):
    pki = tmp_path / "pki"
    pki.mkdir()
    (pki / "master.pub").write_text("PUB")
    mopts = {"id": "m3_master", "conf_file": "/etc/salt/master", "interface": "127.0.0.9",
             "ret_port": 4506, "publish_port": 4505, "pki_dir": str(pki),
             "pidfile": str(tmp_path / "none.pid")}
    seen = []
    ret = membership.host_report(mopts, {"fqdn": "m3"}, "shared",
                                 connect=lambda h, p: seen.append((h, p)) or p == 4505)
    assert seen == [("127.0.0.9", 4505), ("127.0.0.9", 4506)]
    assert ret["ports"] == {4505: True, 4506: False}
    assert ret["master_pid"] is None and ret["fqdn"] == "m3"
    assert ret["pub_sha"] == __import__("hashlib").sha256(b"PUB").hexdigest()


# ----- the minions ------------------------------------------------------------
def test_minion_rows_when_adding():
    current = {"a": ["10.0.0.1"], "b": ["10.0.0.1", "10.0.0.3:4506"], "c": ["10.0.0.1"],
               "e": ["10.0.0.1"]}
    pillars = {"a": ["10.0.0.1", "10.0.0.3"], "b": ["10.0.0.1", "10.0.0.3"],
               "c": ["10.0.0.1"], "d": ["10.0.0.1", "10.0.0.3"]}
    rows = membership.minion_rows("10.0.0.3", ["a", "b", "c", "d", "e"], current, pillars, True)
    assert rows == {"will_get": ["a"], "lists_it": ["b"], "pillar_lacks": ["c"],
                    "no_answer": ["d"], "no_pillar": ["e"]}
    steps = membership.next_steps(rows, "10.0.0.3", True)
    assert "apply the formula: salt -L a state.apply salt.multimaster" in steps
    assert any(s.startswith("add 10.0.0.3 to pillar multimaster:masters for c") for s in steps)


def test_minion_rows_when_removing():
    current = {"a": ["10.0.0.1"], "b": ["10.0.0.1", "10.0.0.3"], "c": ["10.0.0.1"]}
    pillars = {"a": ["10.0.0.1"], "b": ["10.0.0.1"], "c": ["10.0.0.1", "10.0.0.3"]}
    rows = membership.minion_rows("10.0.0.3:4506", ["a", "b", "c", "d"], current, pillars, False)
    assert rows == {"clean": ["a"], "still_lists": ["b"], "pillar_lists": ["c"],
                    "no_answer": ["d"]}
    assert len(membership.next_steps(rows, "10.0.0.3", False)) == 3


# ----- the sync and the start -------------------------------------------------
def _sync_res(error=None, **cat):
    rep = {"added": [], "updated": [], "removed": [], "conflicts": [], "errors": []}
    rep.update(cat)
    ret = {"result": error is None, "master_keys": rep}
    if error:
        ret["error"] = error
    return ret


def test_sync_kept():
    down = daemon.not_running_error("m3", "10.0.0.3:4506")
    restart = ("m3's salt-master must restart to load the new master keys or config (no "
               "service manager restarted it): restart it")
    assert membership.sync_kept(_sync_res(), "m3")
    assert membership.sync_kept(_sync_res(f"{down}; {restart}"), "m3")
    assert not membership.sync_kept(_sync_res(f"{down}; 2 KiB exceeds inline_limit"), "m3")
    assert not membership.sync_kept(_sync_res(errors=["x: boom"]), "m3")
    assert not membership.sync_kept(_sync_res(unconfirmed=["master.pem"]), "m3")
    assert not membership.sync_kept({"result": False, "error": "no reply"}, "m3")
    assert not membership.sync_kept(None, "m3")


@pytest.mark.parametrize("state, res, test, expected", [
    ("stopped", {}, True, (None, False)),
    ("stopped", {}, False, (False, True)),
    ("own_key", {}, True, (None, False)),
    ("own_key", {"restart": "restarting"}, False, (True, False)),
    ("own_key", {"restart": "restart_required"}, False, (False, False)),
    ("primary_key", {}, False, (True, False)),
])
def test_master_step(state, res, test, expected):
    ret = membership.master_step(state, res, test)
    assert (ret["result"], ret["start"]) == expected, ret


# ----- the runner refuses bad input before anything is sent -------------------
@pytest.fixture
def runner(tmp_path):
    spec = importlib.util.spec_from_file_location("mm_runner_membership",
                                                  REPO / "_runners" / "multimaster.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    conf = _conf_dir(tmp_path, operator="multimaster:\n  peers: [master02]\n")
    os.makedirs(tmp_path / "pki" / "minions")
    for mid in ("master02", "master03"):
        (tmp_path / "pki" / "minions" / mid).write_text("key")
    mod.__opts__ = _opts(conf, pki_dir=str(tmp_path / "pki"), cachedir=str(tmp_path / "c"),
                         multimaster={"peers": ["master02"]})
    mod.__context__ = {}

    def nothing_sent(*args, **kwargs):
        raise AssertionError(f"sent with bad input: {args} {kwargs}")

    mod._member_client_cmd = nothing_sent
    mod.sync = nothing_sent
    mod.conf = conf
    return mod


@pytest.mark.parametrize("fun, args, kwargs, message", [
    ("add_peer", [], {}, "name the peer"),
    ("add_peer", ["master02"], {}, "is already a peer"),
    ("add_peer", ["master01"], {}, "is this primary master itself"),
    ("add_peer", ["master09"], {}, "is not an accepted minion"),
    ("add_peer", ["master03"], {"test": "maybe"}, "test"),
    ("add_peer", ["master03"], {"tset": True}, "unknown argument(s) tset"),
    ("remove_peer", ["master07"], {}, "'master07' is no peer of this primary"),
    ("remove_peer", ["master02"], {}, "listed in your own multimaster:peers"),
])
def test_runner_refuses(runner, fun, args, kwargs, message):
    ret = getattr(runner, fun)(*args, **kwargs)
    assert ret["result"] is False and ret["retcode"] == 1, ret
    assert message in ret["error"]
    assert not (runner.conf / "master.d" / "multimaster-peers.conf").exists()


def test_runner_refuses_a_main_file_block(runner):
    (runner.conf / "master").write_text("multimaster:\n  peers: [master02]\n")
    ret = runner.add_peer("master03")
    assert "hide your whole multimaster block" in ret["error"], ret


def test_report_rows():
    ret = {"peer": "m3", "test": True, "master_entry": "10.0.0.3", "result": True,
           "next_steps": ["apply the formula: salt -L a state.apply salt.multimaster"],
           "steps": {"check": {"result": True, "comment": "ports are free"},
                     "config": {"result": None, "comment": "would list m3"},
                     "sync": {"result": None, "comment": "would replicate",
                              "changes": _sync_res(added=["master.pem", "master.pub"])},
                     "minions": {"result": True, "comment": "1 minion(s)",
                                 "minions": {"will_get": ["a"], "pillar_lacks": ["b", "c"]}}}}
    rows = membership.report_rows(ret)
    assert list(rows) == ["peer", "check", "config", "sync", "minions", "next", "result",
                          "retcode"]
    assert rows["peer"] == "m3 (minions list it as 10.0.0.3): test run, nothing changed"
    assert rows["sync"].splitlines() == [
        "would do: would replicate", "  master_keys   2 would add: master.pem, master.pub"]
    assert rows["minions"].splitlines()[1:] == ["  pillar_lacks b, c", "  will_get     a"]
    assert rows["result"] == "planned (test run)" and rows["retcode"] == 0
    assert membership.report_rows({"result": False, "error": "bad", "retcode": 1}) == {
        "error": "bad", "retcode": 1}


# ----- the runner's steps, the peer and the minions stubbed ----------------------
@pytest.fixture
def flow(runner, tmp_path):
    """add_peer of master03 (accepted, stopped master) with the calls stubbed."""
    calls = []

    def client_cmd(tgt, fun, arg=None, kwarg=None, tgt_type="glob", timeout=30):
        calls.append(fun)
        if fun == "multimaster_peer.host_check":
            return {tgt: _host(interface="10.0.0.3")}
        if fun == "service.available":
            return {tgt: "'service.available' is not available."}
        raise AssertionError(fun)

    runner._member_client_cmd = client_cmd
    runner._member_minions = lambda *args: ({"will_get": ["web01"]}, ["apply the formula"])
    runner.calls = calls
    runner.dropin = runner.conf / "master.d" / "multimaster-peers.conf"
    pem, pub = tmp_path / "pki" / "master.pem", tmp_path / "pki" / "master.pub"
    pem.write_text("PEM")
    pub.write_text("PUB")
    return runner


def test_add_peer_test_mode_plans_with_the_peer_and_writes_nothing(flow):
    seen = {}

    def sync(peers=None, test=False):
        seen.update(peers=peers, test=test, configured=flow.__opts__["multimaster"]["peers"])
        return {"master03": _sync_res(daemon.not_running_error("master03", "10.0.0.3:4506"),
                                      added=["master.pem"])}

    flow.sync = sync
    ret = flow.add_peer("master03", test=True)
    assert seen == {"peers": "master03", "test": True, "configured": ["master02", "master03"]}
    assert flow.__opts__["multimaster"] == {"peers": ["master02"]}
    assert not flow.dropin.exists()
    assert ret["result"] is True and "retcode" not in ret, ret
    assert [s["result"] for s in ret["steps"].values()] == [True, None, None, None, True]
    assert ret["master_entry"] == "10.0.0.3"


def test_add_peer_puts_the_dropin_back_when_the_sync_fails(flow):
    flow.sync = lambda peers=None, test=False: {
        "master03": {"result": False, "error": "master03's salt-minion did not answer"},
        "retcode": 1}
    ret = flow.add_peer("master03")
    assert ret["retcode"] == 1 and ret["result"] is False
    assert ret["steps"]["sync"]["result"] is False
    assert "put back as it was" in ret["steps"]["config"]["comment"]
    assert not flow.dropin.exists()
    assert flow.__opts__["multimaster"]["peers"] == ["master02"]


def test_add_peer_configures_and_says_to_start_the_master(flow):
    flow.sync = lambda peers=None, test=False: {"master03": _sync_res(
        daemon.not_running_error("master03", "10.0.0.3:4506"), added=["master.pem"])}
    ret = flow.add_peer("master03")
    assert membership.read_dropin(str(flow.dropin)) == ["master03"]
    assert sorted(flow.__opts__["multimaster"]["peers"]) == ["master02", "master03"]
    assert ret["steps"]["sync"]["result"] is True
    assert ret["steps"]["start"]["result"] is False
    assert "start salt-master on master03 now" in ret["steps"]["start"]["comment"]
    assert ret["retcode"] == 1 and flow.calls[-1] == "service.available"


def test_pillar_masters():
    pillars = {"a": {"multimaster": {"masters": ["m1", "m2"]}}, "b": {"multimaster": "x"},
               "c": {}, "d": None, "e": {"multimaster": {"masters": "m1"}},
               "other": {"multimaster": {"masters": ["m1"]}}}
    assert membership.pillar_masters(pillars, ["a", "b", "c", "d", "e"]) == {
        "a": ["m1", "m2"], "e": ["m1"]}
