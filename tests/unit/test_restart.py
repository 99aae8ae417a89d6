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


def test_service_available_asks_the_service_module():
    asked = []
    known = {"service.available": lambda name: asked.append(name) or name == "salt-master"}
    assert core.service_available(known, "salt-master") is True
    assert core.service_available(known, "salt-minion") is False
    assert asked == ["salt-master", "salt-minion"]
    assert core.service_available({}, "salt-minion") is False  # no service module: none here

    def broken(name):
        raise RuntimeError(f"cannot ask for {name}")

    assert core.service_available({"service.available": broken}, "salt-master") is None


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


def test_schedule_waits_for_the_job_at_most_wait_max(opts, tmp_path):
    """A job process that lingers after its return (Salt 3007.15) holds the restart ``wait_max`` s."""
    marker = tmp_path / "marker"
    job = subprocess.Popen(["sleep", "30"])  # pylint: disable=consider-using-with
    try:
        start = time.monotonic()
        core.schedule(opts, _run_bg, f"touch {marker}", 0, service="salt-master",
                      wait_pid=job.pid, wait_max=1)
        time.sleep(0.5)
        assert not marker.exists()  # the "job" still runs
        assert wait_until(marker.exists, deadline=10, step=0.1)
        assert job.poll() is None and time.monotonic() - start < 10
    finally:
        job.kill()
        job.wait()


def test_master_restart_waits_for_the_job_at_most_master_job_wait(opts):
    scripts = []
    restart = core.MasterRestart(opts, lambda: None, lambda s: scripts.append(s) or 1234,
                                 lambda: None, cmd="true")
    assert restart() == "restarting"
    steps = core.MASTER_JOB_WAIT * 4
    assert f"[ $i -lt {steps} ]" in scripts[0] and f"p={os.getpid()};" in scripts[0]


def test_schedule_records_the_exit_status(opts, tmp_path):
    status = tmp_path / "cache" / "multimaster" / "restart-salt-minion.status"
    core.schedule(opts, _run_bg, "sleep 0; exit 3", 0, wait_pid=0)
    assert wait_until(status.exists, deadline=10, step=0.1) and core.last_status(opts) == 3
    # the script has written the status; it is pending until it exited
    assert wait_until(lambda: core.pending(opts) == 0, deadline=10, step=0.1)
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


# ----- a master's restart: the one setting every path reads ---------------------
MASTER_DEFAULT = "salt-call --local service.restart salt-master"


def _master(opts, cmd=None, present=("salt-call", "rc-service"), manager=False, option=None):
    """A MasterRestart over fakes: ``(restart, scripts run, marks made)``."""
    scripts, marks = [], []
    if option is not None:
        opts = dict(opts, **{core.MASTER_CMD_OPTION: option})
    restart = core.MasterRestart(opts, lambda: marks.append(True),
                                 lambda script: scripts.append(script) or 42,
                                 lambda: manager, cmd=cmd, which=_which(*present))
    return restart, scripts, marks


def test_master_restart_reads_the_minion_option(opts):
    restart, scripts, marks = _master(opts, option="rc-service salt-master restart")
    assert (restart.cmd, restart.configured, restart.refused) == (
        "rc-service salt-master restart", True, None)
    assert restart.predict() == "would restart"
    assert restart() == "restarting" and marks == [True]
    (script,) = scripts
    assert "; sleep 1; rm -f " in script and "; (rc-service salt-master restart); " in script
    assert script.endswith("restart-salt-master.status")
    assert restart.describe("m2") == {"cmd": "rc-service salt-master restart", "configured": True,
                                  "refused": None, "possible": True, "last_status": None}
    # a rotation's restart_cmd wins over the option
    restart, _, _ = _master(opts, cmd="/bin/true", option="rc-service salt-master restart",
                            present=("/bin/true",))
    assert restart.cmd == "/bin/true" and restart.source == "restart_cmd"


def test_master_restart_refuses_a_command_that_cannot_run(opts):
    restart, scripts, marks = _master(opts, option="sv restart salt-master")
    reason = ("the restart command 'sv restart salt-master' cannot run: 'sv' not found (PATH "
              "of the salt-minion)")
    assert restart.refused == reason
    assert restart.why_refused("m2") == (
        f"the salt-master could not restart to load it: {reason}; nothing written: fix the "
        "option multimaster.master_restart_cmd of the salt-minion on m2 (or remove it to "
        "restart through the service manager)")
    assert restart.predict() == restart.why_refused()
    assert restart.describe("m2")["refused"] == restart.why_refused("m2")
    # asked anyway (a caller that wrote nonetheless): marked, nothing run
    assert restart() == "restart_required" and marks == [True] and scripts == []
    for bad in ([], 3, "   "):
        restart, _, _ = _master(opts, option=bad) if bad != "   " else _master(opts, cmd=bad)
        if bad == []:  # an empty value: not configured
            assert restart.refused is None and not restart.configured
        else:
            assert restart.refused.endswith(f"must be a command string, not {bad!r}")


def test_master_restart_without_a_setting_uses_the_service_manager(opts):
    restart, scripts, marks = _master(opts, manager=True)
    assert (restart.cmd, restart.configured) == (MASTER_DEFAULT, False)
    assert restart() == "restarting" and len(scripts) == 1 and marks == [True]
    # no service manager knows salt-master: written, then restart_required
    restart, scripts, marks = _master(opts, manager=False)
    assert restart.refused is None and restart.predict() == "restart_required"
    assert restart() == "restart_required" and scripts == [] and marks == [True]


def test_the_formulas_master_restart_reads_the_master_restart_option(tmp_path):
    """multimaster.restart_minion service=salt-master: the host's multimaster.master_restart_cmd."""
    import importlib.util  # pylint: disable=import-outside-toplevel

    from tests.conftest import REPO  # pylint: disable=import-outside-toplevel

    spec = importlib.util.spec_from_file_location("mm_module_restart",
                                                  REPO / "_modules" / "multimaster.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.__salt__, mod.__pillar__ = {}, {}
    marker = tmp_path / "master-restarted"
    for option, possible in ((f"touch {marker}", True),
                             ("no-such-init salt-master restart", False)):
        mod.__opts__ = {"cachedir": str(tmp_path), core.MASTER_CMD_OPTION: option}
        ret = mod.restart_minion(service="salt-master", test=True)
        assert ret["cmd"] == option and ret["possible"] is possible, ret
    assert "'no-such-init' not found" in ret["reason"], ret
    # the salt-minion's own restart does not read it
    assert mod.restart_minion(test=True)["cmd"] == DEFAULT
