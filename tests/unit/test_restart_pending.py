"""
restart_pending: the running salt-minion's options against its config files
(salt_multimaster.audit.check_restart_pending; multimaster.audit passes its
own ``__opts__``, see tests/functional).
"""

import pytest

import salt_multimaster.audit as audit

FILES = {"master": ["10.0.0.1", "10.0.0.2:4506"], "master_port": 4506,
         "master_alive_interval": 30, "master_type": "str", "retry_dns": 30,
         "tcp_pub_port": 4510, "random_master": False}


def _running(**over):
    running = dict(FILES, __cli="salt-minion", master="10.0.0.2", multimaster=True,
                   publish_port=4999)
    running.update(over)
    return running


def test_same_options_no_finding():
    # a multi-master job knows only its own master (in the list: fine); publish_port
    # comes from the master's reply and is not compared
    assert audit.check_restart_pending(_running(), FILES) == []
    assert audit.check_restart_pending(_running(master="10.0.0.1:4506"), FILES) == []


def test_changed_settings_are_named():
    ret = audit.check_restart_pending(_running(master_alive_interval=0, retry_dns=0), FILES)
    assert ret == [{
        "check": "restart_pending",
        "severity": "error",
        "message": "The running salt-minion does not use its config files: it started before "
                   "these options changed: master_alive_interval (running 0, files 30); "
                   "retry_dns (running 0, files 30).",
        "remedy": "Restart the salt-minion; the options in its config files take effect then.",
    }]


def test_master_removed_from_files():
    ret = audit.check_restart_pending(_running(master="10.0.0.9"), FILES)
    assert ret[0]["message"].endswith(
        "master (running 10.0.0.9:4506, files 10.0.0.1:4506, 10.0.0.2:4506).")


def test_failover_list_compared_whole():
    files = dict(FILES, master_type="failover")
    running = _running(master_type="failover", master="10.0.0.1", multimaster=False,
                       master_list=["10.0.0.1", "10.0.0.2"])
    assert audit.check_restart_pending(running, files) == []
    running["master_list"] = ["10.0.0.2", "10.0.0.1"]  # priority changed on disk
    assert "master (running" in audit.check_restart_pending(running, files)[0]["message"]
    # random_master shuffles the list at start: order does not count then
    running["random_master"] = files["random_master"] = True
    assert audit.check_restart_pending(running, files) == []
    running["master_list"] = ["10.0.0.1"]
    assert audit.check_restart_pending(running, files)[0]["check"] == "restart_pending"


def test_single_master_exact():
    files = dict(FILES, master="10.0.0.1")
    assert audit.check_restart_pending(_running(master="10.0.0.1", multimaster=False), files) == []
    assert audit.check_restart_pending(_running(master="10.0.0.2", multimaster=False), files)


@pytest.mark.parametrize("over", [{"__cli": None}, {"__cli": "salt-call"},
                                  {"__cli": "salt-call.exe"}, {"caller": True}])
def test_not_compared_outside_the_daemon(over):
    """salt-call reads fresh options from the files: nothing to compare."""
    running = _running(master_alive_interval=0, **over)
    assert audit.check_restart_pending(running, FILES) == []


def test_daemon_started_by_another_script_name():
    # __cli is the basename of argv[0]: salt-factories runs cli_salt_minion.py
    running = _running(master_alive_interval=0, __cli="cli_salt_minion.py")
    assert audit.check_restart_pending(running, FILES)[0]["check"] == "restart_pending"


def test_failed_restart_command_named():
    running = _running(master_alive_interval=0)
    assert audit.check_restart_pending(running, FILES, restart_status=0) == \
        audit.check_restart_pending(running, FILES)
    (found,) = audit.check_restart_pending(running, FILES, restart_status=127)
    assert found["message"].endswith(
        "master_alive_interval (running 0, files 30). The last restart command scheduled by "
        "the multimaster states exited with status 127.")
    assert audit.check_restart_pending(_running(), FILES, restart_status=127) == []
