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
