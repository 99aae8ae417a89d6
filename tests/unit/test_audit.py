"""
Unit tests of the audit: the whole audit and the checks of the running
system in ``salt_multimaster.audit`` (the per-setting checks:
test_checks.py), the fleet report in ``salt_multimaster.fleet``, and the
runner ``multimaster.audit`` with its dunders patched.  No daemons; the
execution module ``multimaster.audit`` is tested through Salt's loader in
tests/functional.
"""

import importlib.util
import os
import pathlib
from unittest import mock

import pytest
import salt.config
import salt.version

import salt_multimaster.audit as audit
import salt_multimaster.fleet as fleet
from salt_multimaster import finger as finger_mod
from tests.unit.test_checks import _pub_pem

REPO = pathlib.Path(__file__).resolve().parent.parent.parent
VERSION = salt.version.__version__


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for dunder in ("__opts__", "__pillar__", "__context__", "__salt__"):
        setattr(module, dunder, {})
    return module


@pytest.fixture(scope="module")
def runner():
    return _load("_runners/multimaster.py", "mm_runner_under_test")


def test_master_version_map():
    assert audit.master_version_map(None) == {}
    assert audit.master_version_map("3008.3") == {"(all)": "3008.3"}
    assert audit.master_version_map(3008.3) == {"(all)": "3008.3"}
    assert audit.master_version_map("3008.3,3007.1") == {"#1": "3008.3", "#2": "3007.1"}
    assert audit.master_version_map({"m1": "3008.3"}) == {"m1": "3008.3"}


# ----- duplicate_minion_process -------------------------------------------------------
def _ps(conf_dir="/etc/salt/x"):
    """A minion daemon (pid 100), its process manager and a job process."""
    return [
        (1, 0, ["/sbin/init"], "/"),
        (100, 1, ["/usr/bin/python3", "/usr/bin/salt-minion", f"--config-dir={conf_dir}"], "/"),
        (101, 100, [f"/usr/bin/python3 /usr/bin/salt-minion --config-dir={conf_dir} "
                    "MultiMinionProcessManager"], "/"),
        (102, 100, [f"/usr/bin/python3 /usr/bin/salt-minion --config-dir={conf_dir} "
                    "ProcessPayload(jid=1)"], "/"),
        (200, 1, ["/usr/bin/python3", "/usr/bin/salt-minion", "-c", "/other"], "/"),
        (300, 1, ["/usr/bin/python3", "/usr/bin/salt-call", "-c", conf_dir], "/"),
    ]


def test_minion_config_dir():
    cdir = audit.minion_config_dir
    assert cdir(["/usr/bin/salt-minion"]) == "/etc/salt"
    assert cdir(["/usr/bin/salt-minion", "-d", "-c", "/srv/c"]) == "/srv/c"
    assert cdir(["salt-minion", "-c/srv/c"]) == "/srv/c"
    assert cdir(["salt-minion", "--config-dir", "c"], cwd="/srv") == "/srv/c"
    assert cdir(["/usr/bin/python3", "/tmp/scripts/cli_salt_minion.py",
                 "--config-dir=/srv/c"]) == "/srv/c"
    # seed 002: a vendor package's pg-salt-minion
    assert cdir(["/home/q/bin/pg-salt-minion -c /home/q/etc -d"]) == "/home/q/etc"
    assert cdir(["/usr/bin/salt-call", "-c", "/srv/c"]) is None
    assert cdir(["vim", "salt-minion.conf"]) is None


def test_one_daemon_with_children_is_no_duplicate():
    processes = _ps()
    assert audit.minion_daemons("/etc/salt/x/minion", processes) == [100]
    assert audit.check_duplicate_minion_process("/etc/salt/x/minion", processes) == []


def test_two_daemons_for_one_config():
    processes = _ps() + [
        (400, 1, ["/usr/bin/python3", "/usr/bin/salt-minion", "-c", "/etc/salt/x", "-d"], "/"),
        (401, 400, ["/usr/bin/python3 /usr/bin/salt-minion -c /etc/salt/x -d Manager"], "/"),
    ]
    ret = audit.check_duplicate_minion_process("/etc/salt/x/minion", processes)
    assert [(f["check"], f["severity"]) for f in ret] == [("duplicate_minion_process", "error")]
    assert "PIDs 100, 400" in ret[0]["message"]
    assert "400" in ret[0]["remedy"]


def test_list_processes_sees_this_process():
    import os  # pylint: disable=import-outside-toplevel

    pids = {pid: ppid for pid, ppid, _, _ in audit.list_processes()}
    assert pids[os.getpid()] == os.getppid()


# ----- the whole audit ------------------------------------------------------------------
@pytest.fixture
def minion_opts(tmp_path):
    """A minion's options read from its config files, with a cached master key."""
    conf_dir = tmp_path / "conf"
    pki = tmp_path / "pki"
    (conf_dir / "minion.d").mkdir(parents=True)
    pki.mkdir()
    (pki / "minion_master.pub").write_bytes(_pub_pem())
    (conf_dir / "minion").write_text(
        "id: m1\n"
        "master: [10.0.0.1, 10.0.0.2]\n"
        f"pki_dir: {pki}\n"
        f"cachedir: {tmp_path / 'cache'}\n"
        "master_alive_interval: 30\n"
    )
    opts = salt.config.minion_config(str(conf_dir / "minion"), minion_id="m1")
    opts["conf_file"] = str(conf_dir / "minion")
    return opts


def _audit(opts, **kwargs):
    kwargs.setdefault("connect", lambda h, p, t: None)
    kwargs.setdefault("processes", [])
    return audit.run_audit(opts, **kwargs)


def test_run_audit_right(minion_opts):
    finger = finger_mod.file_finger(os.path.join(minion_opts["pki_dir"], "minion_master.pub"))
    ret = _audit(minion_opts, expected_masters=["10.0.0.1", "10.0.0.2"], expected_finger=finger,
                 master_versions={"(all)": VERSION})
    assert ret == {"result": True, "findings": [], "masters": ["10.0.0.1", "10.0.0.2"],
                   "master_finger": finger, "saltversion": VERSION}


def test_run_audit_faults(minion_opts):
    minion_opts["master"] = ["10.0.0.1", "10.0.0.1:4506", "10.0.0.2", "10.0.0.3:abc"]
    minion_opts["master_alive_interval"] = 0
    conf_dir = os.path.dirname(minion_opts["conf_file"])
    processes = [(10, 1, ["salt-minion", "-c", conf_dir], "/"),
                 (11, 1, ["salt-minion", "-c", conf_dir], "/")]
    ret = _audit(minion_opts, expected_finger="00:11", processes=processes,
                 connect=lambda h, p, t: "Connection refused" if h == "10.0.0.2" else None)
    assert [(f["check"], f["severity"]) for f in ret["findings"]] == [
        ("master_list", "error"),  # 10.0.0.3:abc
        ("master_list", "info"),
        ("duplicate_master", "error"),
        ("master_reachable", "error"),
        ("master_pubkey", "error"),
        ("master_alive_interval", "warning"),
        ("version_skew", "info"),
        ("duplicate_minion_process", "error"),
    ]
    assert ret["result"] is False


def test_run_audit_changes_nothing(minion_opts, tmp_path):
    def snapshot():
        return {str(p): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"")
                for p in sorted(tmp_path.rglob("*"))}

    before = snapshot()
    _audit(minion_opts)
    assert snapshot() == before


# ----- fleet report ---------------------------------------------------------------------
def _minion_ret(result=True, findings=()):
    return {"ret": {"result": result, "findings": list(findings), "masters": ["a", "b"],
                    "master_finger": "ff", "saltversion": VERSION}, "retcode": 0, "jid": "1"}


DUP = {"check": "duplicate_master", "severity": "error", "message": "m", "remedy": "r"}
ALIVE = {"check": "master_alive_interval", "severity": "warning", "message": "m", "remedy": "r"}
INFO = {"check": "master_list", "severity": "info", "message": "m", "remedy": "r"}


def test_build_report():
    returns = {
        "ok1": _minion_ret(findings=[INFO]),
        "warn1": _minion_ret(findings=[ALIVE]),
        "bad1": _minion_ret(False, [DUP, ALIVE]),
        "gone1": {"out": "no_return", "ret": "Minion did not return. [No response]",
                  "retcode": 1},
        "gone2": False,
        "nomod": {"ret": "'multimaster.audit' is not available.", "retcode": 254},
    }
    expected = ["ok1", "warn1", "bad1", "gone1", "gone2", "gone3", "nomod"]
    report = fleet.build_report("m1", "3008.3", "*", "glob", expected, returns)
    assert report["result"] is False and report["retcode"] == 1
    assert report["missing"] == ["gone1", "gone2", "gone3"]
    assert report["failed"] == ["bad1", "nomod"]
    assert report["counts"] == {"targeted": 7, "returned": 4, "ok": 2, "failed": 2,
                                "missing": 3}
    assert report["totals"] == {
        "duplicate_master": {"error": 1},
        "master_alive_interval": {"warning": 2},
        "audit": {"error": 1},
        "no_return": {"error": 3},
    }
    assert report["minions"]["bad1"] == {"ok": False, "findings": [DUP, ALIVE],
                                         "masters": ["a", "b"], "master_finger": "ff",
                                         "saltversion": VERSION}
    assert report["minions"]["nomod"]["findings"][0]["check"] == "audit"


def test_build_report_all_ok_and_empty():
    report = fleet.build_report("m1", "3008.3", "*", "glob", ["a"], {"a": _minion_ret()})
    assert report["result"] is True and report["retcode"] == 0 and report["totals"] == {}
    report = fleet.build_report("m1", "3008.3", "nomatch*", "glob", [], {})
    assert report["result"] is False and report["totals"] == {"no_minions": {"error": 1}}


def test_render_rows():
    returns = {"web01": _minion_ret(), "db01": _minion_ret(False, [DUP, ALIVE])}
    report = fleet.build_report("master01", "3008.3", "*", "glob",
                                ["web01", "db01", "retcode"], returns)
    rows = fleet.render_rows(report)
    assert list(rows.values()) == [
        "master01 (Salt 3008.3), target '*' (glob): 3 targeted, 1 ok, 1 failed, "
        "1 did not return",
        "FAIL duplicate_master(E) master_alive_interval(W)",
        "ok",
        "NO RETURN (targeted, did not return through this master)",
        "duplicate_master 1E, master_alive_interval 1W, no_return 1E",
        1,
    ]
    assert list(rows)[:3] == ["master ", "db01   ", "web01  "]
    # a minion named like a row label never clobbers the exit code
    assert list(rows)[3] == "retcode (minion)" and list(rows)[-1] == "retcode"


# ----- runner ---------------------------------------------------------------------------
class FakeClient:
    calls = []

    def __init__(self, mopts=None, **kwargs):  # pylint: disable=unused-argument
        self.mopts = mopts

    def cmd(self, tgt, fun, **kwargs):
        FakeClient.calls.append((tgt, fun, kwargs))
        return {"a": _minion_ret(), "b": _minion_ret(False, [DUP])}

    def destroy(self):
        pass


class FakeCkMinions:
    def __init__(self, opts):
        self.opts = opts

    def check_minions(self, tgt, tgt_type):
        return {"minions": ["a", "b", "c"], "missing": []}


def _run_runner(runner, output=None, **kwargs):
    opts = {"id": "master01", "timeout": 5, "output": output}
    FakeClient.calls = []
    with mock.patch.dict(runner.__opts__, opts, clear=True), \
            mock.patch("salt.client.LocalClient", FakeClient), \
            mock.patch("salt.utils.minions.CkMinions", FakeCkMinions):
        return runner.audit(**kwargs)


def test_runner_data_with_out(runner):
    ret = _run_runner(runner, output="json", tgt="*")
    assert FakeClient.calls == [
        ("*", "multimaster.audit", {"kwarg": {"master_version": {"master01": VERSION}},
                                    "tgt_type": "glob", "timeout": 5, "full_return": True})
    ]
    assert ret["retcode"] == 1 and ret["missing"] == ["c"] and ret["failed"] == ["b"]
    assert ret["master"] == "master01"


def test_runner_table_by_default(runner):
    ret = _run_runner(runner, masters="m1,m2", topology="signed")
    assert set(ret) == {"outputter", "data"} and ret["outputter"] == "txt"
    assert ret["data"]["retcode"] == 1
    assert FakeClient.calls[0][2]["kwarg"] == {
        "master_version": {"master01": VERSION}, "masters": "m1,m2", "topology": "signed"
    }


@pytest.mark.parametrize("kwargs,error", [
    ({"tgt": ""}, "multimaster.audit: invalid target ''"),
    ({"timeout": "soon"}, "multimaster.audit: timeout must be a number of seconds, not 'soon'"),
    ({"timeout": -1}, "multimaster.audit: timeout must be more than 0 seconds, not -1"),
    ({"timeout": 0}, "multimaster.audit: timeout must be more than 0 seconds, not 0"),
    ({"timeout": "nan"},
     "multimaster.audit: timeout must be a finite number of seconds, not 'nan'"),
    ({"timeout": 10 ** 9},
     "multimaster.audit: timeout must be at most 86400 seconds, not 1000000000"),
])
def test_runner_bad_input(runner, kwargs, error):
    # a retcode in the return: salt-run exits non-zero (a raised
    # SaltInvocationError leaves it exiting 0 on 3008); nothing is published
    assert _run_runner(runner, **kwargs) == {"result": False, "error": error, "retcode": 1}
    assert FakeClient.calls == []
