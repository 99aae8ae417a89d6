"""
The one restart helper (salt_multimaster.restart): what it refuses, the
background script it runs after the job, the pending marker and the exit
status it leaves for the audit; and the states' answer when a restart cannot
happen (mocked execution functions).  ``multimaster.restart_minion`` and the
states over it run through Salt's loader in tests/functional.
"""

import os
import subprocess
import time
from unittest.mock import MagicMock, patch

import pytest
from salt.exceptions import CommandExecutionError

from salt_multimaster import restart as core
from tests.support.cluster import wait_until
from tests.unit.test_states import configure_loader_modules, states  # noqa: F401  pylint: disable=unused-import

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


def _run_bg(script):
    return subprocess.Popen(script, shell=True).pid  # pylint: disable=consider-using-with


@pytest.fixture
def opts(tmp_path):
    return {"cachedir": str(tmp_path / "cache"), "multiprocessing": True}


def test_paths(opts, tmp_path):
    state = tmp_path / "cache" / "multimaster"
    assert core.pending_path(opts) == str(state / "restart.pending")
    assert core.pending_path(opts, "salt-master") == str(state / "restart-salt-master.pending")
    assert core.status_path(opts) == str(state / "restart-salt-minion.status")
    assert core.last_status(opts) is None and core.pending(opts) == 0
    assert core.check_service("salt-master") == "salt-master"
    with pytest.raises(ValueError, match="^service must be salt-minion or salt-master, not 'x'"):
        core.check_service("x")


def test_schedule_runs_after_the_job_once(opts, tmp_path):
    """The background command waits for the job process (here: a child) to exit."""
    marker = tmp_path / "marker"
    job = subprocess.Popen(["sleep", "2"])  # pylint: disable=consider-using-with
    first = core.schedule(opts, _run_bg, f"touch {marker}", 0, wait_pid=job.pid)
    second = core.schedule(opts, _run_bg, f"touch {marker}", 0, wait_pid=job.pid)
    assert first["scheduled"] is True and core.pending(opts) == first["pid"]
    assert second == {"scheduled": False, "pid": first["pid"], "cmd": f"touch {marker}"}
    time.sleep(0.5)
    assert not marker.exists()  # the "job" still runs
    job.wait()
    assert wait_until(marker.exists, deadline=10, step=0.1)


def test_schedule_records_the_exit_status(opts, tmp_path):
    status = tmp_path / "cache" / "multimaster" / "restart-salt-minion.status"
    core.schedule(opts, _run_bg, "sleep 0; exit 3", 0, wait_pid=0)
    assert wait_until(status.exists, deadline=10, step=0.1) and core.last_status(opts) == 3
    # a new restart forgets the old outcome until its own command ran
    core.schedule(opts, _run_bg, "sleep 1", 0, wait_pid=0)
    assert core.last_status(opts) is None
    assert wait_until(status.exists, deadline=10, step=0.1) and core.last_status(opts) == 0
    assert wait_until(lambda: core.pending(opts) == 0, deadline=10, step=0.1)


def test_salt_run_bg():
    calls = []

    def run_bg(script, **kwargs):
        calls.append((script, kwargs))
        return {"pid": 7}

    assert core.salt_run_bg({"cmd.run_bg": run_bg})("sleep 1") == 7
    assert calls == [("sleep 1", {"python_shell": True, "cwd": "/"})]


def test_schedule_waits_for_this_process_in_a_job_process(opts):
    scripts = []
    core.schedule(opts, lambda script: scripts.append(script) or 0, "true", 2)
    core.schedule(dict(opts, multiprocessing=False), lambda s: scripts.append(s) or 0, "true",
                  2, service="salt-master")
    assert scripts[0].startswith(f"p={os.getpid()}; ")
    assert scripts[1].startswith("p=0; ") and "; sleep 2; rm -f " in scripts[1]
    assert "; (true); echo $? > " in scripts[1]


@pytest.mark.parametrize("test", [True, False])
def test_master_key_impossible_restart_fails(test):
    from tests.unit.test_states import _key_check  # pylint: disable=import-outside-toplevel

    reason = "the restart command 'x' cannot run: 'x' not found (PATH of the salt-minion)"

    def restart_minion(test=False, **kwargs):
        if test:
            return {"scheduled": False, "possible": False, "reason": reason, "cmd": "x"}
        raise CommandExecutionError(reason)

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
