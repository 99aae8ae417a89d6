"""
The multimaster states in Salt's unit-test pattern (configure_loader_modules):
the execution functions they call are mocks, whole return dicts are
compared.  The states over the real execution module, through Salt's loader,
are in tests/functional.
"""

import importlib.util
from unittest.mock import MagicMock, patch

import pytest
from salt.exceptions import CommandExecutionError

from tests.conftest import REPO


def _load(kind, name):
    spec = importlib.util.spec_from_file_location(
        f"mm_test_{kind}_{name}", str(REPO / f"_{kind}" / f"{name}.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


states = _load("states", "multimaster")


@pytest.fixture
def configure_loader_modules():
    return {states: {"__opts__": {"test": False}, "__salt__": {}, "__pillar__": {}}}


def _check(**over):
    ret = {
        "path": "/etc/salt/minion.d/multimaster.conf",
        "errors": [],
        "current": {},
        "desired": {"master": ["m1", "m2"], "master_alive_interval": 30},
        "changes": {},
        "rewrite": False,
        "restart_needed": False,
        "notes": [],
    }
    ret.update(over)
    return ret


CHANGES = {"master": {"old": ["m1", "m1", "m2"], "new": ["m1", "m2"]},
           "master_alive_interval": {"old": None, "new": 30}}


# ---------------------------------------------------------------------------
# multimaster.minion_config with mocked execution functions
# ---------------------------------------------------------------------------
def test_virtual():
    assert states.__virtual__() == "multimaster"


def test_minion_config_already_set():
    check = MagicMock(return_value=_check())
    apply_ = MagicMock()
    with patch.dict(states.__opts__, {"test": False}), patch.dict(
        states.__salt__,
        {"multimaster.minion_config_check": check, "multimaster.minion_config_apply": apply_},
    ):
        ret = states.minion_config("multimaster.conf", masters=["m1", "m2"],
                                   master_alive_interval=30)
    assert ret == {
        "name": "multimaster.conf",
        "result": True,
        "changes": {},
        "comment": "Multi-master minion config /etc/salt/minion.d/multimaster.conf is already set.",
    }
    check.assert_called_once_with(masters=["m1", "m2"], name="multimaster.conf",
                                  master_alive_interval=30)
    apply_.assert_not_called()


def test_minion_config_test_mode():
    check = MagicMock(return_value=_check(
        changes=CHANGES, rewrite=True, restart_needed=True,
        notes=["removed duplicate masters: m1"]))
    apply_ = MagicMock()
    restart = MagicMock(return_value={"scheduled": False, "possible": True, "reason": None,
                                      "cmd": "x"})
    with patch.dict(states.__opts__, {"test": True}), patch.dict(
        states.__salt__,
        {"multimaster.minion_config_check": check,
         "multimaster.minion_config_apply": apply_,
         "multimaster.restart_minion": restart},
    ):
        ret = states.minion_config("multimaster.conf", masters=["m1", "m1", "m2"],
                                   master_alive_interval=30, __id__="x", __sls__="y")
    assert ret == {
        "name": "multimaster.conf",
        "result": None,
        "changes": CHANGES,
        "comment": "Multi-master minion config /etc/salt/minion.d/multimaster.conf would be "
                   "updated and the minion restarted. Note: removed duplicate masters: m1.",
    }
    # state-internal keywords are not passed on as settings
    check.assert_called_once_with(masters=["m1", "m1", "m2"], name="multimaster.conf",
                                  master_alive_interval=30)
    apply_.assert_not_called()
    # only asked whether the restart could happen
    restart.assert_called_once_with(cmd=None, delay=None, service="salt-minion", test=True)


def test_minion_config_applied_and_restart_scheduled():
    check = MagicMock(return_value=_check(changes=CHANGES, rewrite=True, restart_needed=True))
    apply_ = MagicMock(return_value=_check(changes=CHANGES, rewrite=True,
                                           restart_needed=True, written=True))
    restart = MagicMock(return_value={"scheduled": True, "pid": 42, "cmd": "touch /x"})
    with patch.dict(states.__opts__, {"test": False}), patch.dict(
        states.__salt__,
        {"multimaster.minion_config_check": check,
         "multimaster.minion_config_apply": apply_,
         "multimaster.restart_minion": restart},
    ):
        ret = states.minion_config("multimaster.conf", masters=["m1", "m1", "m2"],
                                   master_alive_interval=30, restart_delay=1)
    assert ret == {
        "name": "multimaster.conf",
        "result": True,
        "changes": dict(CHANGES, restart="scheduled after this job returns: touch /x"),
        "comment": "Updated the multi-master minion config "
                   "/etc/salt/minion.d/multimaster.conf. The minion restarts in the "
                   "background after this job returns.",
    }
    restart.assert_called_once_with(cmd=None, delay=1, service="salt-minion")


def test_minion_config_restart_pending_and_disabled():
    check = MagicMock(return_value=_check(changes=CHANGES, rewrite=True, restart_needed=True))
    restart = MagicMock(return_value={"scheduled": False, "pid": 7, "cmd": "x"})
    funcs = {"multimaster.minion_config_check": check,
             "multimaster.minion_config_apply": check,
             "multimaster.restart_minion": restart}
    with patch.dict(states.__opts__, {"test": False}), patch.dict(states.__salt__, funcs):
        ret = states.minion_config("multimaster.conf", masters=["m1", "m2"])
        assert ret["changes"] == CHANGES
        assert ret["comment"].endswith("A minion restart is already pending (pid 7).")
        restart.reset_mock()
        ret = states.minion_config("multimaster.conf", masters=["m1", "m2"], restart=False)
    assert ret["result"] is True and ret["changes"] == CHANGES
    assert ret["comment"].endswith("The minion must restart to use it (restart: False).")
    restart.assert_not_called()


def test_minion_config_invalid_writes_nothing():
    check = MagicMock(return_value=_check(
        errors=["masters must be a list of master addresses, not str ('m1')"]))
    apply_ = MagicMock()
    with patch.dict(states.__opts__, {"test": False}), patch.dict(
        states.__salt__,
        {"multimaster.minion_config_check": check, "multimaster.minion_config_apply": apply_},
    ):
        ret = states.minion_config("multimaster.conf", masters="m1")
    assert ret == {
        "name": "multimaster.conf",
        "result": False,
        "changes": {},
        "comment": "Invalid multi-master minion settings, "
                   "/etc/salt/minion.d/multimaster.conf not written: masters must be a "
                   "list of master addresses, not str ('m1')",
    }
    apply_.assert_not_called()


def test_minion_config_apply_failure():
    check = MagicMock(return_value=_check(changes=CHANGES, rewrite=True, restart_needed=True))
    apply_ = MagicMock(side_effect=CommandExecutionError("disk full"))
    restart = MagicMock()
    with patch.dict(states.__opts__, {"test": False}), patch.dict(
        states.__salt__,
        {"multimaster.minion_config_check": check,
         "multimaster.minion_config_apply": apply_,
         "multimaster.restart_minion": restart},
    ):
        ret = states.minion_config("multimaster.conf", masters=["m1", "m2"])
    assert ret == {
        "name": "multimaster.conf",
        "result": False,
        "changes": {},
        "comment": "Failed to write the multi-master minion config "
                   "/etc/salt/minion.d/multimaster.conf: disk full",
    }
    restart.assert_not_called()


# ---------------------------------------------------------------------------
# multimaster.master_key with mocked execution functions
# ---------------------------------------------------------------------------
def _key_check(**over):
    ret = {"path": "/etc/salt/pki/minion/minion_master.pub", "errors": [], "match": False,
           "current_finger": "aa:aa", "expected_finger": "bb:bb", "expected": "PEM"}
    ret.update(over)
    return ret


def test_master_key_already_trusted():
    check = MagicMock(return_value=_key_check(match=True, current_finger="bb:bb"))
    with patch.dict(states.__opts__, {"test": False}), patch.dict(
        states.__salt__, {"multimaster.master_key_check": check}
    ):
        ret = states.master_key("minion_master.pub", master_finger="bb:bb")
    assert ret == {
        "name": "minion_master.pub",
        "result": True,
        "changes": {},
        "comment": "Trusted master key /etc/salt/pki/minion/minion_master.pub is already bb:bb.",
    }


def test_master_key_test_mode():
    check = MagicMock(return_value=_key_check())
    apply_ = MagicMock()
    restart = MagicMock(return_value={"scheduled": False, "possible": True, "reason": None,
                                      "cmd": "x"})
    with patch.dict(states.__opts__, {"test": True}), patch.dict(
        states.__salt__,
        {"multimaster.master_key_check": check, "multimaster.master_key_apply": apply_,
         "multimaster.restart_minion": restart},
    ):
        ret = states.master_key("minion_master.pub", contents="PEM")
    assert ret == {
        "name": "minion_master.pub",
        "result": None,
        "changes": {"master_key": {"old": "aa:aa", "new": "bb:bb"}},
        "comment": "Trusted master key /etc/salt/pki/minion/minion_master.pub would be "
                   "replaced and the minion restarted.",
    }
    apply_.assert_not_called()


def test_master_key_replaced():
    check = MagicMock(return_value=_key_check())
    apply_ = MagicMock(return_value=_key_check(written=True, backup="/c/bak/minion_master.pub"))
    restart = MagicMock(return_value={"scheduled": True, "pid": 3, "cmd": "r"})
    with patch.dict(states.__opts__, {"test": False}), patch.dict(
        states.__salt__,
        {"multimaster.master_key_check": check, "multimaster.master_key_apply": apply_,
         "multimaster.restart_minion": restart},
    ), patch.dict(states.__pillar__, {"multimaster": {"master_pub": "PEM"}}):
        ret = states.master_key("minion_master.pub", contents_pillar="multimaster:master_pub")
    assert ret == {
        "name": "minion_master.pub",
        "result": True,
        "changes": {"master_key": {"old": "aa:aa", "new": "bb:bb"},
                    "backup": "/c/bak/minion_master.pub",
                    "restart": "scheduled after this job returns: r"},
        "comment": "Replaced the trusted master key /etc/salt/pki/minion/minion_master.pub. "
                   "The minion restarts in the background after this job returns.",
    }
    assert check.call_args.kwargs["contents"] == "PEM"


def test_master_key_mismatch_without_content_fails():
    check = MagicMock(return_value=_key_check(expected=None, expected_finger="bb:bb"))
    with patch.dict(states.__opts__, {"test": False}), patch.dict(
        states.__salt__, {"multimaster.master_key_check": check}
    ):
        ret = states.master_key("minion_master.pub", master_finger="bb:bb")
    assert ret == {
        "name": "minion_master.pub",
        "result": False,
        "changes": {},
        "comment": "Trusted master key /etc/salt/pki/minion/minion_master.pub has "
                   "fingerprint aa:aa, not bb:bb, and no key content was given to "
                   "replace it (contents or source)",
    }


def test_master_key_missing_pillar():
    with patch.dict(states.__opts__, {"test": False}), patch.dict(states.__pillar__, {}):
        ret = states.master_key("minion_master.pub", contents_pillar="multimaster:master_pub")
    assert ret == {"name": "minion_master.pub", "result": False, "changes": {},
                   "comment": "Pillar key multimaster:master_pub holds no master key"}


# ---------------------------------------------------------------------------
# every argument is checked before anything is written
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,message", [
    ({"restart_delay": "soon"},
     "restart_delay must be a number of seconds, not 'soon'"),
    ({"restart_delay": -1},
     "restart_delay must be a whole number of seconds from 0 to 3600, not -1"),
    ({"restart": "maybe"},
     "restart must be a boolean (True/False, yes/no, 1/0), not 'maybe'"),
    ({"restart_cmd": ["systemctl"]},
     "restart_cmd must be a non-empty command string, not ['systemctl']"),
])
def test_invalid_restart_args_write_nothing(kwargs, message):
    called = MagicMock()
    funcs = {name: called for name in (
        "multimaster.minion_config_check", "multimaster.minion_config_apply",
        "multimaster.master_key_check", "multimaster.master_key_apply",
        "multimaster.restart_minion")}
    with patch.dict(states.__opts__, {"test": False}), patch.dict(states.__salt__, funcs):
        ret = states.minion_config("multimaster.conf", masters=["m1", "m2"], **kwargs)
        assert ret == {"name": "multimaster.conf", "result": False, "changes": {},
                       "comment": f"Invalid argument, nothing written: {message}"}
        ret = states.master_key("minion_master.pub", contents="PEM", **kwargs)
        assert ret == {"name": "minion_master.pub", "result": False, "changes": {},
                       "comment": f"Invalid argument, nothing written: {message}"}
    called.assert_not_called()


def test_invalid_pillar_restart_delay_writes_nothing():
    called = MagicMock()
    funcs = {name: called for name in (
        "multimaster.minion_config_check", "multimaster.minion_config_apply",
        "multimaster.restart_minion")}
    with patch.dict(states.__opts__, {"test": False}), patch.dict(states.__salt__, funcs), \
            patch.dict(states.__pillar__, {"multimaster": {"minion_restart_delay": "later"}}):
        ret = states.minion_config("multimaster.conf", masters=["m1", "m2"])
    assert ret == {"name": "multimaster.conf", "result": False, "changes": {},
                   "comment": "Invalid argument, nothing written: pillar "
                              "multimaster:minion_restart_delay must be a number of seconds, "
                              "not 'later'"}
    called.assert_not_called()
