"""The compact sync/status reports salt-run prints without --out."""

from salt_multimaster import report


def _res(**cats):
    base = {c: {"added": [], "updated": [], "removed": [], "conflicts": [], "errors": []}
            for c in report.CATEGORIES}
    for cat, values in cats.items():
        base[cat].update(values)
    return base


def test_sync_rows_name_the_first_few_then_count():
    ret = {
        "m2": dict(_res(minion_keys={"added": [f"minions/k{i}" for i in range(300)]},
                        file_roots={"conflicts": ["x: differs"]}),
                   result=False, error="1 conflict(s) left on m2", restart="restart_required"),
        "m3": dict(_res(), result=True),
        "retcode": 1,
    }
    rows = report.sync_rows(ret)
    assert rows == {
        "m2": "FAILED: 1 conflict(s) left on m2\n"
              "  master_keys   in sync\n"
              "  minion_keys   300 added: minions/k0, minions/k1, minions/k2 ... and 297 more\n"
              "  file_roots    in sync\n"
              "    conflict: x: differs\n"
              "  pillar_roots  in sync\n"
              "  master_config in sync\n"
              "  restart: restart_required",
        "m3": "in sync\n  master_keys   in sync\n  minion_keys   in sync\n  file_roots    in sync\n"
              "  pillar_roots  in sync\n  master_config in sync",
        "summary": "2 peer(s): 1 in sync, 0 changed, 1 failed",
        "retcode": 1,
    }
    verbose = report.sync_rows(ret, verbose=True)["m2"]
    assert "minions/k299" in verbose and "more" not in verbose


def test_sync_rows_in_test_mode_say_would():
    ret = {"m2": dict(_res(file_roots={"updated": ["base:a.sls"]}), result=True)}
    rows = report.sync_rows(ret, test=True)
    assert "  file_roots    1 would update: base:a.sls" in rows["m2"].splitlines()
    assert rows["m2"].startswith("would change")
    assert rows["summary"] == ("1 peer(s): 0 in sync, 1 would change, 0 failed "
                               "(test run, nothing changed)")
    assert rows["retcode"] == 0


def test_input_error_is_one_row():
    rows = report.sync_rows({"result": False, "error": "unknown category 'x'", "retcode": 1})
    assert rows == {"error": "unknown category 'x'", "retcode": 1}


def test_status_rows():
    ret = {"m2": {"reachable": True, "in_sync": False, "pull_allowed": False,
                  "pull_config": "peer_run:\n  'm2$':\n    - multimaster.pull",
                  "master_running": True, "restart_pending": False,
                  "master_finger": {"primary": "aa", "peer": "aa"},
                  "minion_keys": {"primary": {"minions": 3}, "peer": {"minions": 2}},
                  "drift": {"minion_keys": {"added": 1, "updated": 0, "removed": 0,
                                            "conflicts": 0}}},
           "m3": {"reachable": False, "in_sync": False, "error": "m3's salt-minion did not answer"},
           "retcode": 1}
    rows = report.status_rows(ret)
    assert rows["m2"].splitlines() == [
        "DRIFT",
        "  minion_keys   1 added",
        "  master key     same as the primary (aa)",
        "  minion keys    primary minions 3; peer minions 2",
        "  pull channel NOT allowed (bulk syncs are refused); add:",
        "    peer_run:",
        "      'm2$':",
        "        - multimaster.pull",
    ]
    assert rows["m3"] == "UNREACHABLE: m3's salt-minion did not answer"
    assert rows["retcode"] == 1


def test_restore_rows():
    ret = {"m2": {"result": True, "backup_restored": "20261123T223735Z",
                  "restored": ["file_roots/base/motd.sls"], "errors": [],
                  "backup": "/c/backup/20261123T223800Z", "restart": None}}
    assert report.restore_rows(ret) == {
        "m2": "restored 1 file(s) from backup 20261123T223735Z\n"
              "  file_roots/base/motd.sls\n"
              "  what was there is in backup: /c/backup/20261123T223800Z",
        "retcode": 0}
    assert report.restore_rows(ret, test=True)["m2"].startswith("would restore 1 file(s)")


def test_sync_rows_name_the_damaged_state_files_rebuilt():
    ret = {"m2": dict(_res(), result=True,
                      rebuilt=["/c/multimaster/state.sqlite: not a file"],
                      primary_rebuilt=["/m/multimaster/state.sqlite: a directory"]),
           "retcode": 0}
    assert report.sync_rows(ret)["m2"].splitlines()[-2:] == [
        "  damaged on the peer, rebuilt: /c/multimaster/state.sqlite: not a file",
        "  damaged on the primary, rebuilt: /m/multimaster/state.sqlite: a directory"]
