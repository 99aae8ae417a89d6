"""
The ``multimaster`` states through Salt's loader (``state.single``): test
mode predicts without writing (result None), applying converges, a second run
changes nothing, bad input fails and writes nothing.
"""

import pytest
import salt.config

from tests.functional.conftest import new_pub as _pub
from tests.support.cluster import wait_until

from salt_multimaster import finger


MASTERS = ["127.0.0.2", "127.0.0.2:4506", "127.0.0.3"]


def test_minion_config_predicts_then_converges(mm_state, minion, tmp_path):
    marker = tmp_path / "restarted"
    kwargs = {"name": "multimaster.conf", "masters": MASTERS, "master_alive_interval": 45,
              "restart_cmd": f"touch {marker}", "restart_delay": 0}
    predicted = mm_state.minion_config(test=True, **kwargs)
    assert predicted.result is None
    assert predicted.changes == {
        "master": {"old": None, "new": ["127.0.0.2", "127.0.0.3"]},
        "master_alive_interval": {"old": None, "new": 45},
    }
    assert predicted.comment == (
        f"Multi-master minion config {minion['dropin']} would be updated and the minion "
        "restarted. Note: removed duplicate masters: 127.0.0.2:4506.")
    assert not minion["dropin"].exists() and not marker.exists()

    applied = mm_state.minion_config(**kwargs)
    assert applied.result is True
    assert applied.changes == dict(
        predicted.changes, restart=f"scheduled after this job returns: touch {marker}")
    assert minion["dropin"].read_text().startswith("# Managed by Salt")
    assert wait_until(marker.exists, deadline=10, step=0.1)
    # Salt reads the drop-in with the main file
    opts = salt.config.minion_config(str(minion["conf_file"]), minion_id="x")
    assert opts["master"] == ["127.0.0.2", "127.0.0.3"] and opts["master_alive_interval"] == 45

    again = mm_state.minion_config(**kwargs)
    assert again.result is True and again.changes == {}
    # the loaded modules still run with the old value
    assert again.comment == (
        f"Multi-master minion config {minion['dropin']} is already set. Note: removed "
        "duplicate masters: 127.0.0.2:4506. Note: the running minion still uses "
        "master_alive_interval=30: it loads the drop-in when it restarts.")


def test_minion_config_from_pillar(mm_state, minion, pillar):
    pillar({"multimaster": {"masters": ["m1", "M1", "m2"]}})
    ret = mm_state.minion_config(name="multimaster.conf", restart=False)
    assert ret.result is True
    assert ret.changes == {"master": {"old": None, "new": ["m1", "m2"]}}
    assert ret.comment.endswith("The minion must restart to use it (restart: False).")


@pytest.mark.parametrize("test", [True, False])
def test_minion_config_refuses_and_writes_nothing(mm_state, minion, test):
    ret = mm_state.minion_config(name="multimaster.conf", masters=["a", "b:99999"],
                                 master_alive_interval=-1, test=test)
    assert ret.result is False
    assert ret.comment == (
        f"Invalid multi-master minion settings, {minion['dropin']} not written: master entry "
        "'b:99999' has an invalid port 99999; master_alive_interval: -1 is not a "
        "non-negative integer (seconds)")
    ret = mm_state.minion_config(name="multimaster.conf", masters=["a", "b"],
                                 restart_delay="soon", test=test)
    assert ret.result is False
    assert ret.comment == ("Invalid argument, nothing written: restart_delay must be a number "
                           "of seconds, not 'soon'")
    assert not minion["dropin"].exists()


@pytest.mark.parametrize("test", [True, False])
def test_impossible_restart_fails_the_state(mm_state, minion, test):
    """Written (without test), but the state fails and says to restart by hand."""
    ret = mm_state.minion_config(name="multimaster.conf", masters=["m1", "m2"],
                                 restart_cmd="no-such-restarter now", test=test)
    reason = ("the restart command 'no-such-restarter now' cannot run: 'no-such-restarter' "
              "not found (PATH of the salt-minion)")
    tail = (f"{reason}. Restart the salt-minion yourself (the new configuration takes "
            "effect then), or set pillar multimaster:minion_restart_cmd to a command that "
            "restarts it here.")
    assert ret.result is False
    if test:
        assert ret.comment == (f"Multi-master minion config {minion['dropin']} would be "
                               f"updated. The salt-minion would NOT be restarted: {tail}")
        assert not minion["dropin"].exists()
    else:
        assert ret.comment == (f"Updated the multi-master minion config {minion['dropin']}. "
                               f"The salt-minion was NOT restarted: {tail}")
        assert "restart" not in ret.changes and minion["dropin"].exists()


def test_master_key_predicts_then_replaces(mm_state, minion):
    good, stale = _pub(), _pub()
    cached = minion["pki"] / "minion_master.pub"
    cached.write_text(stale)
    expected = finger.master_finger(good)
    kwargs = {"name": "minion_master.pub", "contents": good, "master_finger": expected,
              "restart": False}
    predicted = mm_state.master_key(test=True, **kwargs)
    assert predicted.result is None
    assert predicted.changes == {"master_key": {"old": finger.master_finger(stale),
                                                "new": expected}}
    assert predicted.comment == f"Trusted master key {cached} would be replaced."
    assert cached.read_text() == stale

    applied = mm_state.master_key(**kwargs)
    assert applied.result is True and cached.read_text() == good
    backup = applied.changes["backup"]
    assert backup.startswith(str(minion["state_dir"] / "backup"))
    with open(backup, encoding="utf-8") as fh:
        assert fh.read() == stale
    assert applied.comment == (f"Replaced the trusted master key {cached}. The minion must "
                               "restart to use it (restart: False).")

    again = mm_state.master_key(**kwargs)
    assert again.result is True and again.changes == {}
    assert again.comment == f"Trusted master key {cached} is already {expected}."
    # the key given must have the fingerprint given
    wrong = mm_state.master_key(name="minion_master.pub", contents=stale,
                                master_finger=expected)
    assert wrong.result is False and "does not have fingerprint" in wrong.comment
    assert cached.read_text() == good


def test_master_key_signed_from_pillar(mm_state, minion, pillar):
    sign = _pub()
    pillar({"multimaster": {"topology": "signed", "master_pub": sign}})
    ret = mm_state.master_key(name="master_sign.pub", contents_pillar="multimaster:master_pub",
                              restart=False)
    assert ret.result is True
    assert (minion["pki"] / "master_sign.pub").read_text() == sign
    missing = mm_state.master_key(name="master_sign.pub", contents_pillar="multimaster:nope")
    assert missing.result is False
    assert missing.comment == "Pillar key multimaster:nope holds no master key"


def test_restart_scheduled(mm_state, minion, tmp_path):
    marker = tmp_path / "restarted"
    predicted = mm_state.restart_scheduled(name="salt-master", cmd=f"touch {marker}", delay=0,
                                           test=True)
    assert predicted.result is None
    assert predicted.changes == {
        "restart": "would be scheduled after this job returns (salt-master)"}
    assert not marker.exists()
    ret = mm_state.restart_scheduled(name="salt-master", cmd=f"touch {marker}", delay=0)
    assert ret.result is True
    assert ret.changes == {"restart": f"scheduled after this job returns: touch {marker}"}
    assert wait_until(marker.exists, deadline=10, step=0.1)
    bad = mm_state.restart_scheduled(name="salt-api")
    assert bad.result is False and bad.comment == (
        "name must be salt-minion or salt-master, not 'salt-api'")
    impossible = mm_state.restart_scheduled(name="salt-master", cmd="no-such-ctl restart",
                                            test=True)
    assert impossible.result is False
    assert impossible.comment.startswith("The salt-master would NOT be restarted: the restart "
                                         "command 'no-such-ctl restart' cannot run")
