"""
Restarts that cannot happen are failures (issue 15, item 5): the core
(salt_multimaster.restart), the one restart helper
(multimaster.restart_minion) and the states that schedule it.
"""

import time
from unittest.mock import MagicMock, patch

import pytest

from salt_multimaster import restart as core
from tests.unit.test_states import minion, module, states  # noqa: F401  pylint: disable=unused-import

DEFAULT = "salt-call --local service.restart salt-minion"


def _which(*present):
    return lambda prog: f"/usr/bin/{prog}" if prog in present else None


@pytest.mark.parametrize("cmd, programs", [
    (DEFAULT, ["salt-call"]),
    ("sleep 2; systemctl restart salt-minion", ["systemctl"]),
    ("FOO=1 /opt/salt/bin/salt-call --local service.restart salt-minion && true",
     ["/opt/salt/bin/salt-call"]),
    ("rc-service salt-minion restart || service salt-minion restart", ["rc-service", "service"]),
    ("touch '/tmp/a b'|logger", ["touch", "logger"]),
])
def test_command_programs(cmd, programs):
    assert core.command_programs(cmd) == programs


def test_impossible_reasons():
    which = _which("salt-call", "systemctl")
    assert core.impossible(DEFAULT, "salt-minion", which=which, service_available=True) is None
    assert core.impossible(DEFAULT, "salt-minion", which=which, service_available=None) is None
    assert core.impossible(DEFAULT, "salt-minion", which=which, service_available=False) == (
        "no service manager on this host knows the salt-minion service, so the default "
        f"restart command {DEFAULT!r} cannot restart it")
    # a custom command does not go through the service manager
    assert core.impossible("systemctl restart salt-minion", "salt-minion", which=which,
                           service_available=False) is None
    assert core.impossible("sleep 1; nosuch-init salt-minion restart", "salt-minion",
                           which=which) == (
        "the restart command 'sleep 1; nosuch-init salt-minion restart' cannot run: "
        "'nosuch-init' not found (PATH of the salt-minion)")
    assert core.impossible(DEFAULT, "salt-minion", which=_which(), service_available=True) == (
        f"the restart command {DEFAULT!r} cannot run: 'salt-call' not found "
        "(PATH of the salt-minion)")
    assert "cannot be parsed" in core.impossible("echo 'x", "salt-minion", which=which)


def test_restart_minion_without_service_manager_schedules_nothing(minion):  # noqa: F811
    with patch.dict(module.__salt__, {"service.available": MagicMock(return_value=False)}):
        assert module.restart_minion(test=True) == {
            "scheduled": False, "possible": False, "cmd": DEFAULT,
            "reason": "no service manager on this host knows the salt-minion service, so "
                      f"the default restart command {DEFAULT!r} cannot restart it"}
        with pytest.raises(module._MMCommandExecutionError, match="no service manager"):
            module.restart_minion()
    minion["run_bg"].assert_not_called()
    assert not (minion["tmp"] / "cache" / "multimaster" / "restart.pending").exists()


def test_restart_minion_missing_program(minion):  # noqa: F811
    with pytest.raises(module._MMCommandExecutionError,
                       match="'no-such-restarter' not found"):
        module.restart_minion(cmd="no-such-restarter salt-minion", delay=0)
    minion["run_bg"].assert_not_called()
    with pytest.raises(module._MMSaltInvocationError, match="salt-minion or salt-master"):
        module.restart_minion(service="salt-api")


def test_restart_minion_master_service(minion):  # noqa: F811
    ret = module.restart_minion(cmd="true", delay=0, service="salt-master")
    assert ret["scheduled"] is True and ret["cmd"] == "true"
    # its own pending marker: a pending master restart does not hide a minion restart
    assert (minion["tmp"] / "cache" / "multimaster" / "restart-salt-master.pending").exists()
    assert not (minion["tmp"] / "cache" / "multimaster" / "restart.pending").exists()


NO_SM = ("no service manager on this host knows the salt-minion service, so the default "
         f"restart command {DEFAULT!r} cannot restart it")


def test_minion_config_impossible_restart_fails(minion):  # noqa: F811
    """Written, but the state fails and says to restart the minion by hand; test=True too."""
    dropin = minion["conf_dir"] / "minion.d" / "multimaster.conf"
    with patch.dict(module.__salt__, {"service.available": MagicMock(return_value=False)}):
        with patch.dict(states.__opts__, {"test": True}):
            predicted = states.minion_config("multimaster.conf", masters=["m1", "m2"],
                                             master_alive_interval=30)
        assert not dropin.exists()
        with patch.dict(states.__opts__, {"test": False}):
            ret = states.minion_config("multimaster.conf", masters=["m1", "m2"],
                                       master_alive_interval=30)
    tail = (f" The salt-minion was NOT restarted: {NO_SM}. Restart the salt-minion yourself "
            "(the new configuration takes effect then), or set pillar "
            "multimaster:minion_restart_cmd to a command that restarts it here.")
    assert predicted["result"] is False
    assert predicted["comment"] == (f"Multi-master minion config {dropin} would be updated."
                                    + tail.replace("was NOT", "would NOT be"))
    assert ret["result"] is False
    assert ret["comment"] == f"Updated the multi-master minion config {dropin}." + tail
    assert "restart" not in ret["changes"] and ret["changes"]["master"]["new"] == ["m1", "m2"]
    assert dropin.exists()
    minion["run_bg"].assert_not_called()


def test_restart_scheduled_state(minion):  # noqa: F811
    with patch.dict(states.__opts__, {"test": True}):
        assert states.restart_scheduled("salt-master", cmd="true", delay=0) == {
            "name": "salt-master", "result": None,
            "changes": {"restart": "would be scheduled after this job returns (salt-master)"},
            "comment": "The salt-master would restart in the background after this job returns."}
        minion["run_bg"].assert_not_called()
        bad = states.restart_scheduled("salt-master", cmd="no-such-ctl restart", delay=0)
    reason = ("the restart command 'no-such-ctl restart' cannot run: 'no-such-ctl' not found "
              "(PATH of the salt-minion)")
    failed = {
        "name": "salt-master", "result": False, "changes": {},
        "comment": f" The salt-master was NOT restarted: {reason}. Restart the salt-master "
                   "yourself (the new configuration takes effect then), or set pillar "
                   "multimaster:master:restart_cmd to a command that restarts it here."}
    assert bad == dict(failed, comment=failed["comment"].strip().replace(
        "was NOT", "would NOT be"))
    with patch.dict(states.__opts__, {"test": False}):
        ret = states.restart_scheduled("salt-master", cmd="no-such-ctl restart", delay=0)
        assert ret["result"] is False and ret["changes"] == {}
        assert ret["comment"] == "Restart of the salt-master requested." + failed["comment"]
        minion["run_bg"].assert_not_called()
        ret = states.restart_scheduled("salt-master", cmd="true", delay=0)
    assert ret == {"name": "salt-master", "result": True,
                   "changes": {"restart": "scheduled after this job returns: true"},
                   "comment": "Restart of the salt-master requested. The master restarts in "
                              "the background after this job returns."}


def test_background_restart_records_its_exit_status(minion, tmp_path):  # noqa: F811
    """The script leaves the command's exit status where the audit reads it."""
    import subprocess  # pylint: disable=import-outside-toplevel

    def run_bg(cmd, **kwargs):
        proc = subprocess.Popen(cmd, shell=True)  # pylint: disable=consider-using-with
        return {"pid": proc.pid}

    status = tmp_path / "cache" / "multimaster" / "restart-salt-minion.status"
    with patch.dict(module.__salt__, {"cmd.run_bg": run_bg}), patch.object(
        module._mm_os, "getpid", return_value=0
    ):
        module.restart_minion(cmd="sleep 0; exit 3", delay=0)
        for _ in range(100):
            if status.exists():
                break
            time.sleep(0.1)
        assert module._mm_restart_status() == 3
        # a new restart forgets the old outcome until its own command ran
        (tmp_path / "cache" / "multimaster" / "restart.pending").unlink(missing_ok=True)
        module.restart_minion(cmd="sleep 1", delay=0)
        assert module._mm_restart_status() is None
        for _ in range(100):
            if status.exists():
                break
            time.sleep(0.1)
        assert module._mm_restart_status() == 0


@pytest.mark.parametrize("test", [True, False])
def test_master_key_impossible_restart_fails(test):
    from tests.unit.test_states import _key_check  # pylint: disable=import-outside-toplevel

    reason = "the restart command 'x' cannot run: 'x' not found (PATH of the salt-minion)"

    def restart_minion(test=False, **kwargs):
        if test:
            return {"scheduled": False, "possible": False, "reason": reason, "cmd": "x"}
        raise module._MMCommandExecutionError(reason)

    apply_ = MagicMock(return_value={"written": True, "backup": "/b"})
    with patch.dict(states.__opts__, {"test": test}), patch.dict(
        states.__salt__,
        {"multimaster.master_key_check": MagicMock(return_value=_key_check()),
         "multimaster.master_key_apply": apply_,
         "multimaster.restart_minion": restart_minion},
    ):
        ret = states.master_key("minion_master.pub", contents="PEM", restart_cmd="x")
    path = "/etc/salt/pki/minion/minion_master.pub"
    tail = (f"restarted: {reason}. Restart the salt-minion yourself (the new configuration "
            "takes effect then), or set pillar multimaster:minion_restart_cmd to a command "
            "that restarts it here.")
    assert ret["result"] is False
    if test:
        assert ret["comment"] == (f"Trusted master key {path} would be replaced. "
                                  "The salt-minion would NOT be " + tail)
        apply_.assert_not_called()
    else:
        assert ret["comment"] == (f"Replaced the trusted master key {path}. "
                                  "The salt-minion was NOT " + tail)
        assert "restart" not in ret["changes"]
