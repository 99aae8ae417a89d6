"""
The multimaster states in Salt's unit-test pattern: the state module's
``__opts__``/``__salt__``/``__pillar__`` are patched, whole return dicts are
compared.  The second half wires the states to the real execution-module
helpers working on a temporary minion config and pki_dir.
"""

import importlib.util
import os
import sys
import time
from unittest.mock import MagicMock, patch

import pytest
import salt.utils.crypt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.conftest import REPO

from salt_multimaster import finger as finger_mod  # noqa: E402


def _load(kind, name):
    spec = importlib.util.spec_from_file_location(
        f"mm_test_{kind}_{name}", str(REPO / f"_{kind}" / f"{name}.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for dunder in ("__opts__", "__salt__", "__pillar__", "__context__", "__grains__"):
        setattr(mod, dunder, {})
    return mod


states = _load("states", "multimaster")
module = _load("modules", "multimaster")


def _pub():
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


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
    assert module.__virtual__() == "multimaster"


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
    restart.assert_called_once_with(cmd=None, delay=1)


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
    from salt.exceptions import CommandExecutionError

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
# States wired to the real execution-module helpers (temporary minion)
# ---------------------------------------------------------------------------
@pytest.fixture
def minion(tmp_path, monkeypatch):
    # the default restart command needs salt-call and a service manager that
    # knows salt-minion (service.available below)
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    conf_dir = tmp_path / "etc"
    conf_dir.mkdir()
    conf_file = conf_dir / "minion"
    conf_file.write_text("master:\n- 127.0.0.2\n- 127.0.0.2:4506\n- 127.0.0.3\n")
    pki = tmp_path / "pki"
    pki.mkdir()
    opts = {
        "conf_file": str(conf_file),
        "pki_dir": str(pki),
        "cachedir": str(tmp_path / "cache"),
        "master_port": 4506,
        "hash_type": "sha256",
        "multiprocessing": True,
        "master_alive_interval": 0,
    }
    run_bg = MagicMock(return_value={"pid": 0})
    funcs = {
        name: getattr(module, name.split(".", 1)[1])
        for name in (
            "multimaster.minion_config_check",
            "multimaster.minion_config_apply",
            "multimaster.master_key_check",
            "multimaster.master_key_apply",
            "multimaster.restart_minion",
        )
    }
    funcs["cmd.run_bg"] = run_bg
    funcs["service.available"] = MagicMock(return_value=True)
    funcs["cp.get_file_str"] = MagicMock(return_value=None)
    with patch.dict(module.__opts__, opts), patch.dict(module.__salt__, funcs), patch.dict(
        module.__pillar__, {}
    ), patch.dict(states.__salt__, funcs):
        yield {"conf_dir": conf_dir, "pki": pki, "run_bg": run_bg, "opts": opts,
               "tmp": tmp_path}


def test_minion_config_converges(minion):
    dropin = minion["conf_dir"] / "minion.d" / "multimaster.conf"
    masters = ["127.0.0.2", "127.0.0.2:4506", "127.0.0.3"]
    with patch.dict(states.__opts__, {"test": True}):
        ret = states.minion_config("multimaster.conf", masters=masters,
                                   master_alive_interval=30)
    assert ret["result"] is None
    assert ret["changes"] == {
        "master": {"old": None, "new": ["127.0.0.2", "127.0.0.3"]},
        "master_alive_interval": {"old": None, "new": 30},
    }
    assert not dropin.exists()
    minion["run_bg"].assert_not_called()

    with patch.dict(states.__opts__, {"test": False}):
        ret = states.minion_config("multimaster.conf", masters=masters,
                                   master_alive_interval=30, restart_delay=0)
    assert ret["result"] is True, ret
    assert ret["changes"]["master"]["new"] == ["127.0.0.2", "127.0.0.3"]
    assert "restart" in ret["changes"]
    assert dropin.read_text().startswith("# Managed by Salt")
    minion["run_bg"].assert_called_once()
    script = minion["run_bg"].call_args.args[0]
    assert f"p={os.getpid()};" in script
    assert "; (salt-call --local service.restart salt-minion); echo $? > " in script

    with patch.dict(states.__opts__, {"test": False}):
        ret = states.minion_config("multimaster.conf", masters=masters,
                                   master_alive_interval=30)
    assert ret["result"] is True and ret["changes"] == {}, ret
    assert "master_alive_interval=0" in ret["comment"]  # the running minion lags behind
    assert minion["run_bg"].call_count == 1

    # Salt reads the drop-in with the main file: effective config is deduplicated
    import salt.config  # pylint: disable=import-outside-toplevel

    opts = salt.config.minion_config(str(minion["conf_dir"] / "minion"), minion_id="x")
    assert opts["master"] == ["127.0.0.2", "127.0.0.3"]
    assert opts["master_alive_interval"] == 30


def test_minion_config_invalid_and_overridden(minion):
    with patch.dict(states.__opts__, {"test": False}):
        ret = states.minion_config("multimaster.conf", masters=["a", "b"],
                                   tcp_pub_port=[4510], master_alive_interval=-1)
        assert ret["result"] is False
        assert "master_alive_interval: -1" in ret["comment"]
        assert "tcp_pub_port: 1 ports listed for 2 masters" in ret["comment"]
        (minion["conf_dir"] / "minion.d").mkdir()
        (minion["conf_dir"] / "minion.d" / "zz.conf").write_text("master: [x]\n")
        ret = states.minion_config("multimaster.conf", masters=["a", "b"])
        assert ret["result"] is False
        assert "zz.conf" in ret["comment"]
    assert not (minion["conf_dir"] / "minion.d" / "multimaster.conf").exists()


def test_minion_config_pillar_masters_and_restart_cmd(minion, tmp_path):
    marker = tmp_path / "restarted"
    pillar = {"multimaster": {"masters": ["m1", "M1", "m2"],
                              "minion_restart_cmd": f"touch {marker}"}}
    with patch.dict(module.__pillar__, pillar), patch.dict(states.__opts__, {"test": False}):
        ret = states.minion_config("/abs/ignored/../" + str(tmp_path / "mm.conf"))
    assert ret["result"] is False  # not in the minion's includes: never read
    with patch.dict(module.__pillar__, pillar), patch.dict(states.__opts__, {"test": False}):
        ret = states.minion_config("multimaster.conf")
    assert ret["result"] is True, ret
    assert ret["changes"]["master"]["new"] == ["m1", "m2"]
    assert f"; (touch {marker}); echo $? > " in minion["run_bg"].call_args.args[0]


def test_restart_minion_really_runs_after_the_job(minion, tmp_path):
    """The background command waits for the job process (here: a child) to exit."""
    import subprocess  # pylint: disable=import-outside-toplevel

    marker = tmp_path / "marker"
    job = subprocess.Popen(["sleep", "2"])  # pylint: disable=consider-using-with

    def run_bg(cmd, **kwargs):
        proc = subprocess.Popen(cmd, shell=True)  # pylint: disable=consider-using-with
        return {"pid": proc.pid}

    with patch.dict(module.__salt__, {"cmd.run_bg": run_bg}), patch.object(
        module._mm_os, "getpid", return_value=job.pid
    ):
        first = module.restart_minion(cmd=f"touch {marker}", delay=0)
        second = module.restart_minion(cmd=f"touch {marker}", delay=0)
    assert first["scheduled"] is True
    assert second == {"scheduled": False, "pid": first["pid"], "cmd": f"touch {marker}"}
    time.sleep(0.5)
    assert not marker.exists()  # the "job" still runs
    job.wait()
    for _ in range(100):
        if marker.exists():
            break
        time.sleep(0.1)
    assert marker.exists()


def test_master_key_replaces_stale_key(minion):
    good, stale = _pub(), _pub()
    cached = minion["pki"] / "minion_master.pub"
    cached.write_text(stale)
    (minion["tmp"] / "good.pub").write_text(good)
    # the installed Salt's salt-key -F master form
    finger = finger_mod.file_finger(str(minion["tmp"] / "good.pub"))
    with patch.dict(states.__opts__, {"test": True}):
        ret = states.master_key("minion_master.pub", contents=good, master_finger=finger)
    assert ret["result"] is None
    assert ret["changes"]["master_key"]["new"] == finger
    assert cached.read_text() == stale
    with patch.dict(states.__opts__, {"test": False}):
        ret = states.master_key("minion_master.pub", contents=good, master_finger=finger,
                                restart=False)
    assert ret["result"] is True, ret
    assert cached.read_text() == good
    backup = ret["changes"]["backup"]
    assert backup.startswith(str(minion["tmp"] / "cache" / "multimaster" / "backup"))
    assert open(backup, encoding="utf-8").read() == stale
    with patch.dict(states.__opts__, {"test": False}):
        ret = states.master_key("minion_master.pub", contents=good, master_finger=finger)
    assert ret["result"] is True and ret["changes"] == {}, ret
    # the key content must match master_finger
    with patch.dict(states.__opts__, {"test": False}):
        ret = states.master_key("minion_master.pub", contents=stale, master_finger=finger)
    assert ret["result"] is False and "does not have fingerprint" in ret["comment"]
    assert cached.read_text() == good


def test_master_key_signed_topology_and_source(minion):
    sign = _pub()
    minion["run_bg"].return_value = {"pid": 0}
    with patch.dict(module.__salt__, {"cp.get_file_str": MagicMock(return_value=sign)}), \
            patch.dict(module.__pillar__, {"multimaster": {"topology": "signed"}}), \
            patch.dict(states.__opts__, {"test": False}):
        ret = states.master_key("master_sign.pub", source="salt://keys/master_sign.pub")
    assert ret["result"] is True, ret
    assert (minion["pki"] / "master_sign.pub").read_text() == sign
    assert module.master_key_path(topology="signed") == str(minion["pki"] / "master_sign.pub")


def test_master_key_finger_only(minion):
    key = _pub()
    (minion["pki"] / "minion_master.pub").write_text(key)
    finger = salt.utils.crypt.pem_finger(str(minion["pki"] / "minion_master.pub"))
    with patch.dict(states.__opts__, {"test": False}):
        assert states.master_key("minion_master.pub", master_finger=finger)["result"] is True
        # Salt 3008's salt-key -F master form names the same key
        text_form = salt.utils.crypt.pem_finger(key=key.encode())
        assert states.master_key("minion_master.pub", master_finger=text_form)["result"] is True
        ret = states.master_key("minion_master.pub", master_finger="ab:" * 31 + "ab")
        assert ret["result"] is False and "no key content" in ret["comment"]
        ret = states.master_key("minion_master.pub")
        assert ret["result"] is False and "give the expected key" in ret["comment"]


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


def test_invalid_restart_delay_leaves_files_alone(minion):
    dropin = minion["conf_dir"] / "minion.d" / "multimaster.conf"
    cached = minion["pki"] / "minion_master.pub"
    stale, good = _pub(), _pub()
    cached.write_text(stale)
    with patch.dict(states.__opts__, {"test": False}):
        ret = states.minion_config("multimaster.conf", masters=["127.0.0.2", "127.0.0.3"],
                                   restart_delay="soon")
        assert ret["result"] is False, ret
        ret = states.master_key("minion_master.pub", contents=good, restart_delay=-5)
        assert ret["result"] is False, ret
    assert not dropin.exists()
    assert cached.read_text() == stale
    minion["run_bg"].assert_not_called()


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


@pytest.mark.parametrize("delay", [-1, "soon", float("nan"), 10 ** 6])
def test_restart_minion_refuses_bad_delay(minion, delay):
    from salt.exceptions import SaltInvocationError  # pylint: disable=import-outside-toplevel

    with pytest.raises(SaltInvocationError, match="^delay must be"):
        module.restart_minion(cmd="true", delay=delay)
    minion["run_bg"].assert_not_called()
