"""The sync report keeps what the peer did not fail, whatever Salt trimmed."""

from salt_multimaster import sync


def _report():
    return {
        "minion_keys": {"added": ["minions/a", "minions/b"], "updated": [], "removed": ["minions_pre/a"],
                        "conflicts": [], "errors": []},
        "master_config": {"added": ["nodegroups"], "updated": [], "removed": [], "conflicts": [], "errors": []},
    }


def test_failed_items_leave_the_report():
    report = _report()
    sync.merge(report, {"minion_keys": {"errors": ["minions/b: disk full"], "failed": ["minions/b"]},
                           "master_config": {"errors": [], "failed": ["multimaster-sync.conf"]},
                           "backup": None})
    assert report["minion_keys"]["added"] == ["minions/a"]
    assert report["minion_keys"]["removed"] == ["minions_pre/a"]
    assert report["minion_keys"]["errors"] == ["minions/b: disk full"]
    assert report["master_config"]["added"] == []


def test_a_trimmed_return_is_an_error_not_an_empty_report():
    report = _report()
    sync.merge(report, {"minion_keys": {"errors": [], "failed": "VALUE_TRIMMED"}})
    assert report["minion_keys"]["added"] == ["minions/a", "minions/b"]
    assert report["minion_keys"]["errors"] == ["the peer's list of failed items was trimmed"]


# ----- the peer master's restart in the report ------------------------------------
CATS = ["minion_keys", "master_config"]
HOW = {"cmd": "rc-service salt-master restart", "configured": True, "refused": None,
       "possible": True, "last_status": None}


def test_test_mode_predicts_the_restart():
    ret = sync.finish("m2", dict(_report(), result=True), {"master_restart": HOW}, CATS,
                      test=True)
    assert ret["result"] is True and ret["restart"] == "would restart"
    ret = sync.finish("m2", dict(_report(), result=True),
                      {"master_restart": dict(HOW, configured=False, possible=False)}, CATS,
                      test=True)
    assert ret["result"] is True and ret["restart"].startswith("would be required (no service")
    # nothing the master loads on restart planned, or an older peer: nothing said
    report = _report()
    report["master_config"]["added"] = []
    assert "restart" not in sync.finish("m2", dict(report, result=True),
                                        {"master_restart": HOW}, CATS, test=True)
    assert "restart" not in sync.finish("m2", dict(_report(), result=True), {}, CATS, test=True)


def test_a_failed_restart_command_is_named_while_the_restart_is_pending():
    inv = {"restart_pending": True, "master_restart": dict(HOW, last_status=3)}
    ret = sync.finish("m2", dict(_report(), result=True), inv, CATS)
    assert ret["result"] is False and ret["restart"] == "restart_required"
    assert ret["error"] == (
        "m2's salt-master must restart to load the new master keys or config: its restart "
        "command 'rc-service salt-master restart' exited with status 3 (see the log of m2's "
        "salt-minion): fix the minion option multimaster.master_restart_cmd there, or restart "
        "it yourself")
    # no command ran (or it worked): the plain message
    ret = sync.finish("m2", dict(_report(), result=True), dict(inv, master_restart=HOW), CATS)
    assert ret["error"] == ("m2's salt-master must restart to load the new master keys or "
                            "config (no service manager restarted it): restart it")
