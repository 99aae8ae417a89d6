"""
``salt_multimaster.membership``: the peers drop-in and how Salt merges it,
the checks of a new peer, where each minion stands with a master, the steps
of add_peer/remove_peer against a fake Salt (:class:`membership_steps.SaltOps`),
and the runner refusing bad input before anything is sent.
"""

import importlib.util
import os
import re
import stat

import pytest
import salt.config

from salt_multimaster import daemon, membership, membership_steps, protocol
from tests.conftest import REPO

RESTART = "salt-call --local service.restart salt-master"


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


@pytest.mark.parametrize("include", ["conf.d/*.conf", ["conf.d/*.conf", "other.d/*.conf"]])
def test_dropins_follow_default_include(tmp_path, include):
    """The peers' and the sync's drop-ins: one path rule, a list default_include included."""
    opts = {"conf_file": str(tmp_path / "master"), "default_include": include}
    assert membership.dropin_path(opts) == str(tmp_path / "conf.d" / "multimaster-peers.conf")
    assert protocol.dropin_path(opts) == str(tmp_path / "conf.d" / "multimaster-sync.conf")


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
    with pytest.raises(membership.MembershipError, match=r"is damaged \(not YAML\): fix it, or "):
        membership.read_dropin(path)
    with open(path, "wb") as fh:
        fh.write(b"\xff\xfe peers")
    with pytest.raises(membership.MembershipError, match=r"is damaged \(not UTF-8\)"):
        membership.read_dropin(path)
    os.unlink(path)
    os.mkdir(path)  # a directory in its place: refused, named; a write moves it aside
    with pytest.raises(membership.MembershipError, match=r"is damaged \(a directory\)"):
        membership.read_dropin(path)
    membership.write_dropin(path, ["master03"])
    assert membership.read_dropin(path) == ["master03"]


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


# ----- the steps, Salt faked ----------------------------------------------------
class FakeSalt:
    """
    The Salt side of the steps: the peer host, the minions and the sync
    answer as told; the calls are recorded; the clock is fake.
    """

    def __init__(self, opts):
        self.opts = opts
        self.calls = []
        self.host = _host(interface="10.0.0.3")  # host_check's answer (None: none)
        self.started_pids = []  # master_pid of the host checks after the start
        # the start: a service manager knows salt-master (True), none does
        # (False), or multimaster_peer.restart_master's reply (a dict)
        self.service = False
        self.accepted = ["master02", "master03", "web01", "web02"]
        self.audits = {"web01": ["10.0.0.1"], "web02": ["10.0.0.1"]}
        self.pillars = {"web01": {"multimaster": {"masters": ["10.0.0.1", "10.0.0.3"]}},
                        "web02": {"multimaster": {"masters": ["10.0.0.1"]}}}
        self.synced = {"master03": _sync_res(added=["master.pem"])}
        self.sync_seen = []
        self.now = 0.0
        self.slept = []

    def cmd(self, tgt, fun, arg=None, kwarg=None, tgt_type="glob", timeout=30):
        self.calls.append((fun, tgt))
        if fun == "multimaster_peer.host_check":
            host = self.host
            if self.started_pids and ("multimaster_peer.restart_master", tgt) in self.calls:
                host = dict(host, master_pid=self.started_pids.pop(0))
            return {} if host is None else {tgt: host}
        if fun == "multimaster_peer.restart_master":
            if isinstance(self.service, dict):
                return {tgt: self.service}
            how = "restarting" if self.service is True else "restart_required"
            return {tgt: {"result": how == "restarting", "restart": how, "cmd": RESTART}}
        if fun == "multimaster.audit":
            assert tgt_type == "list", tgt_type
            return {mid: {"masters": self.audits[mid], "findings": []}
                    for mid in tgt if mid in self.audits}
        raise AssertionError(fun)

    def minions(self, tgt, tgt_type):
        self.calls.append(("minions", tgt))
        return list(self.accepted)

    def cached_pillars(self, minions):
        return {mid: self.pillars[mid] for mid in minions if mid in self.pillars}

    def sync(self, peers=None, test=False):
        self.sync_seen.append({"peers": peers, "test": test,
                               "configured": self.opts["multimaster"]["peers"]})
        if isinstance(self.synced, Exception):
            raise self.synced
        return self.synced

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds

    def ops(self):
        return membership_steps.SaltOps(self.opts, cmd=self.cmd, minions=self.minions,
                                        cached_pillars=self.cached_pillars, sync=self.sync,
                                        sleep=self.sleep, monotonic=lambda: self.now)


@pytest.fixture
def fake(tmp_path):
    """A primary master01 with peer master02 (its own master.d) and accepted master03."""
    conf = _conf_dir(tmp_path, operator="multimaster:\n  peers: [master02]\n")
    pki = tmp_path / "pki"
    os.makedirs(pki / "minions")
    for mid in ("master02", "master03"):
        (pki / "minions" / mid).write_text("key")
    (pki / "master.pem").write_text("PEM")
    (pki / "master.pub").write_text("PUB")
    fake = FakeSalt(_opts(conf, multimaster={"peers": ["master02"]}))
    fake.conf = conf
    fake.dropin = str(conf / "master.d" / "multimaster-peers.conf")
    return fake


PULL_NEXT = ("master03 may not pull a sync's bulk: a first sync larger than inline_limit is "
             "refused; apply salt.multimaster.master on this primary (it grants every peer), "
             "or add:\n" + protocol.peer_run_snippet(["master03"]))
CHECK_STOPPED = {"result": True, "comment": "salt-master on master03 is not running and its "
                 "ports are free (/etc/salt/master): the keys are placed before its first start"}
MINIONS_ADD = {"result": True, "minions": {"will_get": ["web01"], "pillar_lacks": ["web02"]},
               "comment": "1 minion(s) will list 10.0.0.3 after state.apply salt.multimaster: "
                          "web01"}
NEXT_ADD = membership.next_steps(MINIONS_ADD["minions"], "10.0.0.3", True)


def test_add_peer_test_mode_plans_with_the_peer_and_writes_nothing(fake):
    fake.synced = {"master03": _sync_res(daemon.not_running_error("master03", "10.0.0.3:4506"),
                                         added=["master.pem"])}
    ret = membership_steps.add_peer(fake.ops(), "master03", test=True)
    assert ret == {
        "peer": "master03", "test": True, "master_entry": "10.0.0.3", "result": True,
        "next_steps": [PULL_NEXT] + NEXT_ADD,
        "steps": {"check": CHECK_STOPPED,
                  "config": {"result": None, "comment": f"{fake.dropin} would list master03"},
                  "sync": {"result": None, "comment": "would replicate",
                           "changes": fake.synced["master03"]},
                  "start": {"result": None, "comment": "salt-master would start once the "
                            "primary's master keys are placed (its first start)"},
                  "minions": MINIONS_ADD}}
    # the sync's dry run saw the new peer configured; afterwards nothing is
    assert fake.sync_seen == [{"peers": "master03", "test": True,
                               "configured": ["master02", "master03"]}]
    assert fake.opts["multimaster"] == {"peers": ["master02"]}
    assert not os.path.exists(fake.dropin)
    # the minions looked at leave the peers' own minions out
    assert ("multimaster.audit", ["web01", "web02"]) in fake.calls


def test_add_peer_stops_at_a_failed_check_and_changes_nothing(fake):
    fake.host = _host(ports={4505: False, 4506: True})
    ret = membership_steps.add_peer(fake.ops(), "master03")
    assert ret == {"peer": "master03", "test": False, "next_steps": [], "result": False,
                   "retcode": 1, "steps": {"check": {"result": False, "comment": (
                       "ports 4506 on master03 are taken by something that is no running "
                       "salt-master of /etc/salt/master: free them (or fix interface/ports "
                       "there) first")}}}
    assert fake.calls == [("multimaster_peer.host_check", "master03")]
    assert not fake.sync_seen and not os.path.exists(fake.dropin)


@pytest.mark.parametrize("synced, error", [
    ({"master03": {"result": False, "error": "master03's salt-minion did not answer"},
      "retcode": 1}, "master03's salt-minion did not answer"),
    (RuntimeError("boom"), "RuntimeError: boom"),
])
def test_add_peer_puts_the_dropin_back_when_the_sync_fails(fake, synced, error):
    fake.opts["peer_run"] = {"master03": ["multimaster.pull"]}
    fake.synced = synced
    ret = membership_steps.add_peer(fake.ops(), "master03")
    res = synced.get("master03") if isinstance(synced, dict) else None
    assert ret == {
        "peer": "master03", "test": False, "master_entry": "10.0.0.3", "result": False,
        "retcode": 1, "next_steps": [],
        "steps": {"check": CHECK_STOPPED,
                  "config": {"result": False,
                             "comment": f"{fake.dropin} put back as it was: the sync failed"},
                  "sync": {"result": False, "comment": f"not replicated: {error}",
                           "changes": res}}}
    # the sync ran with the drop-in in place, then it went
    assert sorted(fake.sync_seen[0]["configured"]) == ["master02", "master03"]
    assert not os.path.exists(fake.dropin)
    assert fake.opts["multimaster"] == {"peers": ["master02"]}


def test_add_peer_puts_the_dropin_back_when_salt_does_not_load_it(fake):
    # an include applied after master.d sets multimaster: the drop-in is hidden
    (fake.conf / "master").write_text("include: late.conf\n")
    (fake.conf / "late.conf").write_text("multimaster:\n  peers: [master02]\n")
    ret = membership_steps.add_peer(fake.ops(), "master03")
    assert ret["steps"]["config"] == {"result": False, "comment": (
        f"{fake.dropin} written but Salt does not load master03 from it (an include of your "
        "config sets multimaster after master.d?): put back as it was")}
    assert list(ret["steps"]) == ["check", "config"] and ret["retcode"] == 1
    assert not fake.sync_seen and not os.path.exists(fake.dropin)


def test_add_peer_configures_and_says_to_start_the_master(fake):
    ret = membership_steps.add_peer(fake.ops(), "master03")
    assert membership.read_dropin(fake.dropin) == ["master03"]
    assert sorted(fake.opts["multimaster"]["peers"]) == ["master02", "master03"]
    assert ret["steps"]["config"] == {"result": True, "comment": f"{fake.dropin} lists master03"}
    assert ret["steps"]["sync"] == {"result": True, "comment": "replicated",
                                    "changes": fake.synced["master03"]}
    assert ret["steps"]["start"] == {"result": False, "comment": (
        "start salt-master on master03 now (no service manager there knows salt-master, and "
        "no minion option multimaster.master_restart_cmd says how to start it): the primary's "
        "master keys are in place; then salt-run multimaster.status peers=master03")}
    assert ret["steps"]["minions"] == MINIONS_ADD
    assert ret["result"] is False and ret["retcode"] == 1


def test_add_peer_start_refused_by_the_peer_names_why(fake):
    fake.service = {"result": False, "error": "multimaster_peer.restart_master: the "
                    "salt-master could not restart to load it: ..."}
    ret = membership_steps.add_peer(fake.ops(), "master03")
    assert ret["steps"]["start"]["result"] is False
    assert ret["steps"]["start"]["comment"].startswith(
        "start salt-master on master03 now (multimaster_peer.restart_master: the salt-master "
        "could not restart"), ret["steps"]["start"]


def test_add_peer_check_refuses_a_restart_command_that_cannot_run(fake):
    fake.host = dict(fake.host, master_restart={"refused": "the salt-master could not "
                                                "restart to load it: ..."})
    ret = membership_steps.add_peer(fake.ops(), "master03")
    assert ret["steps"] == {"check": {"result": False, "comment": (
        "master03: nothing written, its salt-master cannot be (re)started by the command "
        "configured there: the salt-master could not restart to load it: ...")}}
    assert ret["retcode"] == 1 and not fake.sync_seen and not os.path.exists(fake.dropin)


def test_add_peer_starts_the_master_and_waits_for_it(fake):
    fake.service = True
    fake.started_pids = [None, None, 4242]
    ret = membership_steps.add_peer(fake.ops(), "master03")
    assert ret["steps"]["start"] == {"result": True, "comment": (
        f"salt-master started on master03 (pid 4242, {RESTART}) with the primary's keys")}
    assert ret["result"] is True and "retcode" not in ret
    assert fake.slept == [membership_steps.PEER_START_POLL] * 2


def test_add_peer_gives_up_on_a_master_that_does_not_start(fake):
    fake.service = True
    ret = membership_steps.add_peer(fake.ops(), "master03")
    assert ret["steps"]["start"] == {"result": False, "comment": (
        f"salt-master on master03 did not start within {membership_steps.PEER_START_WAIT} s "
        f"({RESTART}): see its log")}
    assert sum(fake.slept) == membership_steps.PEER_START_WAIT and ret["retcode"] == 1


@pytest.fixture
def added(fake):
    """master03 in the drop-in, its master listed by web01's config (10.0.0.3)."""
    membership.write_dropin(fake.dropin, ["master03"])
    fake.opts["multimaster"] = {"peers": ["master02", "master03"]}
    fake.audits["web01"] = ["10.0.0.1", "10.0.0.3"]
    fake.pillars["web01"] = {"multimaster": {"masters": ["10.0.0.1"]}}
    return fake


def test_remove_peer_refuses_while_a_minion_lists_it(added):
    ret = membership_steps.remove_peer(added.ops(), "master03")
    rows = {"still_lists": ["web01"], "clean": ["web02"]}
    assert ret == {
        "peer": "master03", "test": False, "master_entry": "10.0.0.3", "result": False,
        "retcode": 1, "next_steps": membership.next_steps(rows, "10.0.0.3", False),
        "steps": {"minions": {"result": False, "minions": rows,
                              "comment": "1 minion(s) still list 10.0.0.3: web01"},
                  "config": {"result": False, "comment": f"master03 kept in {added.dropin}: "
                             "minions still list it (force=True removes it anyway)"}}}
    assert membership.read_dropin(added.dropin) == ["master03"]


def test_remove_peer_test_mode_changes_nothing(added):
    added.audits["web01"] = ["10.0.0.1"]
    ret = membership_steps.remove_peer(added.ops(), "master03", address="10.0.0.3", test=True)
    assert ret == {
        "peer": "master03", "test": True, "master_entry": "10.0.0.3", "result": True,
        "next_steps": [],
        "steps": {"minions": {"result": True, "minions": {"clean": ["web01", "web02"]},
                              "comment": "no minion that answered lists 10.0.0.3"},
                  "config": {"result": None,
                             "comment": f"master03 would be removed from {added.dropin}"}}}
    assert membership.read_dropin(added.dropin) == ["master03"]
    # address given: the peer host is not asked
    assert ("multimaster_peer.host_check", "master03") not in added.calls


def test_remove_peer_force_takes_it_out_and_still_fails(added):
    ret = membership_steps.remove_peer(added.ops(), "master03", force=True)
    assert ret["steps"]["config"] == {"result": True,
                                      "comment": f"master03 removed from {added.dropin}"}
    assert ret["next_steps"][-1] == ("stop salt-master on master03: no minion lists it and no "
                                     "sync reaches it any more")
    assert ret["result"] is False and ret["retcode"] == 1
    assert not os.path.exists(added.dropin)
    assert added.opts["multimaster"] == {"peers": ["master02"]}


def test_remove_peer_says_when_the_dropin_is_not_written(added, monkeypatch):
    def fail(path, peers):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(membership, "write_dropin", fail)
    added.audits["web01"] = ["10.0.0.1"]
    ret = membership_steps.remove_peer(added.ops(), "master03")
    assert ret["steps"]["config"] == {"result": False, "comment": (
        f"{added.dropin} not written: [Errno 13] Permission denied: '{added.dropin}'")}
    assert ret["result"] is False and ret["retcode"] == 1
    assert added.opts["multimaster"] == {"peers": ["master02", "master03"]}


def test_remove_peer_needs_the_address_of_a_silent_peer(added):
    added.host = None
    with pytest.raises(membership.MembershipError, match="pass address=<the entry"):
        membership_steps.remove_peer(added.ops(), "master03")
    assert membership.read_dropin(added.dropin) == ["master03"]


@pytest.mark.parametrize("steps, peer, message", [
    (membership_steps.add_peer, None, "name the peer"),
    (membership_steps.add_peer, "master02", "is already a peer"),
    (membership_steps.add_peer, "master09", "is not an accepted minion"),
    (membership_steps.remove_peer, "master07", "'master07' is no peer of this primary"),
    (membership_steps.remove_peer, "master02", "listed in your own multimaster:peers"),
])
def test_steps_refuse_before_anything_is_sent(fake, steps, peer, message):
    with pytest.raises(membership.MembershipError, match=re.escape(message)):
        steps(fake.ops(), peer)
    assert fake.calls == [] and not fake.sync_seen


# ----- the runner: its input checked before anything is sent -------------------
@pytest.fixture
def runner(fake, monkeypatch):
    spec = importlib.util.spec_from_file_location("mm_runner_membership",
                                                  REPO / "_runners" / "multimaster.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.__opts__ = fake.opts
    mod.__context__ = {}
    built = []

    def nothing_sent(*args, **kwargs):
        raise AssertionError(f"sent with bad input: {args} {kwargs}")

    class Refusing(membership_steps.SaltOps):
        """The runner's Salt: every call fails the test."""

        def __init__(self, opts, **salt_calls):
            built.append(sorted(salt_calls))
            super().__init__(opts, **{name: nothing_sent for name in salt_calls})

    monkeypatch.setattr(membership_steps, "SaltOps", Refusing)
    mod.built = built
    mod.dropin = fake.dropin
    return mod


@pytest.mark.parametrize("fun, args, kwargs, message", [
    ("add_peer", [], {}, "name the peer"),
    ("add_peer", ["master02"], {}, "is already a peer"),
    ("add_peer", ["master01"], {}, "is this primary master itself"),
    ("add_peer", ["master09"], {}, "is not an accepted minion"),
    ("add_peer", ["master03"], {"test": "maybe"}, "test"),
    ("add_peer", ["master03"], {"timeout": "soon"}, "timeout"),
    ("add_peer", ["master03"], {"tset": True}, "unknown argument tset: did you mean test?"),
    ("remove_peer", ["master07"], {}, "'master07' is no peer of this primary"),
    ("remove_peer", ["master02"], {}, "listed in your own multimaster:peers"),
    ("remove_peer", ["master02"], {"force": "maybe"}, "force"),
])
def test_runner_refuses(runner, fun, args, kwargs, message):
    ret = getattr(runner, fun)(*args, **kwargs)
    assert ret == {"result": False, "error": ret["error"], "retcode": 1}
    assert message in ret["error"]
    assert runner.__context__ == {"retcode": 1}
    assert not os.path.exists(runner.dropin)


def test_runner_refuses_a_main_file_block(runner, fake):
    (fake.conf / "master").write_text("multimaster:\n  peers: [master02]\n")
    ret = runner.add_peer("master03")
    assert "hide your whole multimaster block" in ret["error"], ret
    # the runner's Salt calls were all handed over, none made
    assert runner.built == [["cached_pillars", "cmd", "minions", "sync"]]


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


def test_pillar_masters():
    pillars = {"a": {"multimaster": {"masters": ["m1", "m2"]}}, "b": {"multimaster": "x"},
               "c": {}, "d": None, "e": {"multimaster": {"masters": "m1"}},
               "other": {"multimaster": {"masters": ["m1"]}}}
    assert membership.pillar_masters(pillars, ["a", "b", "c", "d", "e"]) == {
        "a": ["m1", "m2"], "e": ["m1"]}
