"""
Restarts that did not happen are not reported as done (issue 15, item 5),
against real daemons: one primary, one peer, the peer's minion and a minion
of both masters.  This machine has no service manager that knows
salt-minion, like the host in the issue.

- the state that changes the minion's drop-in with the default restart
  command fails (test=True predicts it) and says to restart by hand;
- ``salt <id> multimaster.audit`` (a real job of the salt-minion daemon)
  reports ``restart_pending`` for the changed option, through either master,
  and no longer after the minion restarted; a restart command that ran and
  failed is named there;
- the salt-master restart of salt.multimaster.master fails the same way.
"""

import pathlib

import pytest
import salt.utils.yaml
import salt.version

from tests.support.cluster import wait_until

pytestmark = pytest.mark.daemons

VERSION = salt.version.__version__
STATE = "multimaster_|-{0}_|-{0}_|-{1}"


@pytest.fixture(scope="module")
def rsp(cluster_factory):
    cluster = cluster_factory("rsp", peers=1, minions=1,
                              minion_overrides={"master_alive_interval": 10})
    cluster.start()
    for master in cluster.masters:
        assert cluster.wait_ping(master, "rsp-minion1")
    cluster.expected = [m.config["interface"] for m in cluster.masters]
    cluster.finger = cluster.master_fingerprint(cluster.primary)
    yield cluster
    cluster.stop()


def _audit(cluster, master):
    args = ["masters=[{}]".format(", ".join(cluster.expected)),
            f"master_finger={cluster.finger}", f"master_version='{VERSION}'"]
    ret = cluster.salt(master, "multimaster.audit", *args, minion_tgt="rsp-minion1",
                       timeout=120)
    assert isinstance(ret.data, dict), ret
    return ret


def _pending(ret):
    return [f for f in ret.data["findings"] if f["check"] == "restart_pending"]


def _single(cluster, *args):
    ret = cluster.salt(cluster.primary, "state.single", *args, minion_tgt="rsp-minion1",
                       timeout=120)
    assert isinstance(ret.data, dict), ret
    (state,) = ret.data.values()
    return ret, state


@pytest.fixture
def clean(rsp):
    """
    The minion as started: no formula drop-in, no restart status, and the
    daemon running its config files (restarted when a test left them
    changed).
    """
    minion = rsp.minions[0]
    leftovers = [
        pathlib.Path(minion.config["conf_file"]).parent / "minion.d" / "multimaster.conf",
        pathlib.Path(minion.config["cachedir"]) / "multimaster" / "restart-salt-minion.status",
    ]
    if any(path.exists() for path in leftovers):
        for path in leftovers:
            path.unlink(missing_ok=True)
        rsp.restart(minion)
        for master in rsp.masters:
            assert rsp.wait_ping(master, minion.id)
    return rsp


def test_clean_minion_has_no_restart_pending(clean):
    rsp = clean
    for master in rsp.masters:
        ret = _audit(rsp, master)
        assert ret.returncode == 0, ret
        assert ret.data["findings"] == [], ret.data


def test_impossible_restart_fails_and_audit_reports_restart_pending(clean):
    rsp = clean
    minion = rsp.minions[0]
    dropin = pathlib.Path(minion.config["conf_file"]).parent / "minion.d" / "multimaster.conf"
    masters = "masters=[{}]".format(", ".join(rsp.expected))
    args = ("multimaster.minion_config", "multimaster.conf", masters,
            "master_alive_interval=20")
    # test=True predicts the failure and writes nothing
    ret, state = _single(rsp, *args, "test=True")
    assert state["result"] is False, state
    assert "The salt-minion would NOT be restarted" in state["comment"], state
    assert not dropin.exists()
    ret, state = _single(rsp, *args)
    assert ret.returncode != 0, ret
    assert state["result"] is False, state
    assert "restart" not in state["changes"], state
    assert state["changes"]["master_alive_interval"] == {"old": None, "new": 20}, state
    assert "The salt-minion was NOT restarted" in state["comment"], state
    assert "Restart the salt-minion yourself (the new configuration takes effect then)" \
        in state["comment"], state
    assert salt.utils.yaml.safe_load(dropin.read_text())["master_alive_interval"] == 20
    # the daemon still runs with 10: a real job through either master says so
    for master in rsp.masters:
        ret = _audit(rsp, master)
        assert ret.returncode != 0, ret
        assert ret.data["result"] is False
        (found,) = _pending(ret)
        assert found["severity"] == "error"
        assert "master_alive_interval (running 10, files 20)" in found["message"], found
        assert "master (" not in found["message"], found
        assert found["remedy"].startswith("Restart the salt-minion"), found
    # salt-call reads fresh options: nothing to compare there
    ret = rsp.salt_call(minion, "multimaster.audit", "masters=[{}]".format(
        ", ".join(rsp.expected)), f"master_finger={rsp.finger}")
    assert not _pending(ret), ret.data
    # restarted by hand, as the comment says: no restart pending
    rsp.restart(minion)
    for master in rsp.masters:
        assert rsp.wait_ping(master, minion.id)
    for master in rsp.masters:
        ret = _audit(rsp, master)
        assert ret.returncode == 0, ret
        assert ret.data["findings"] == [], ret.data


def test_failed_background_restart_named_by_the_audit(clean):
    rsp = clean
    """A restart command that runs but fails after the job returned: the audit says so."""
    minion = rsp.minions[0]
    status = pathlib.Path(minion.config["cachedir"]) / "multimaster" / \
        "restart-salt-minion.status"
    masters = "masters=[{}]".format(", ".join(rsp.expected))
    ret, state = _single(rsp, "multimaster.minion_config", "multimaster.conf", masters,
                         "master_alive_interval=25", "restart_cmd=/bin/false",
                         "restart_delay=0")
    assert state["result"] is True, state
    assert state["changes"]["restart"] == "scheduled after this job returns: /bin/false"
    assert wait_until(status.exists, deadline=60)
    ret = _audit(rsp, rsp.primary)
    assert ret.returncode != 0, ret
    (found,) = _pending(ret)
    assert "master_alive_interval (running 10, files 25)" in found["message"], found
    assert found["message"].endswith(
        "The last restart command scheduled by the multimaster states exited with status 1."
    ), found
    rsp.restart(minion)
    for master in rsp.masters:
        assert rsp.wait_ping(master, minion.id)
    ret = _audit(rsp, rsp.primary)
    assert ret.returncode == 0 and not _pending(ret), ret


def test_master_restart_that_cannot_happen_fails(rsp):
    # the default command of salt.multimaster.master: no service manager here
    for test, said in (("test=True", "would NOT be"), ("test=False", "was NOT")):
        ret, state = _single(rsp, "multimaster.restart_scheduled", "salt-master", test)
        assert ret.returncode != 0, ret
        assert state["result"] is False, state
        assert state["changes"] == {}, state
        assert f"The salt-master {said} restarted" in state["comment"], state
        assert "multimaster:master:restart_cmd" in state["comment"], state
    # a command that exists is scheduled (a no-op here)
    ret, state = _single(rsp, "multimaster.restart_scheduled", "salt-master",
                         "cmd=/bin/true", "delay=0")
    assert ret.returncode == 0, ret
    assert state["result"] is True, state
    assert state["changes"] == {"restart": "scheduled after this job returns: /bin/true"}, state
