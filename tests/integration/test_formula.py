"""
The ``salt.multimaster`` formula against real daemons, with the repository as
a ``file_roots`` root.

Cluster ``frm`` (file_roots install path, nothing pip installed): a minion
whose config lists the peer twice (``peer`` and ``peer:4506``), has no
master_alive_interval and trusts a stale minion_master.pub.  One
``state.apply salt.multimaster`` fixes all three; after the restart it answers
from both masters, the audit is clean, and a second run changes nothing.

Cluster ``frr`` (pip install path): ``salt.multimaster.master`` installs the
salt/key reactor on the primary; ``salt-key -a`` on the primary alone makes a
new minion answer through the peer.

No test leans on another: each asks for the state it starts from
(``unconfigured``, ``configured``, ``stale_key`` for ``frm``; ``reactor``
for ``frr``).
"""

import datetime
import json
import pathlib
import time

import pytest
import salt.utils.yaml
import salt.version
from salt_multimaster import finger as fingers

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from _runners import multimaster_reactor  # its QUIET (the repository is on sys.path: tests/conftest.py)
from tests.support.cluster import log_tail, master_key_paths, wait_until

pytestmark = pytest.mark.daemons

# salt/key event act for an accepted key: Salt 3006/3007 "accept", 3008 "accepted"
ACCEPT_ACT = "accepted" if salt.version.__version_info__[0] >= 3008 else "accept"
# Salt 3008's pillar.get masks values unless unmask=True, an argument 3006/3007
# refuse ("keyword arguments are not valid")
PILLAR_UNMASK = ["unmask=True"] if salt.version.__version_info__[0] >= 3008 else []

# The repository is the file_roots root: keep the virtualenv, git data and
# caches out of the file server (listing them makes every sync slow).
IGNORE = [r"(^|/)\.venv(/|$)", r"(^|/)\.git(/|$)", r"(^|/)__pycache__(/|$)",
          r"(^|/)\.pytest_cache(/|$)", r"(^|/)build(/|$)"]


def _new_pub():
    key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _state_returns(ret):
    """The state return dicts of a ``salt ... state.apply`` CLI return."""
    assert isinstance(ret.data, dict), ret
    return ret.data


def _changes(ret):
    return {k: v["changes"] for k, v in _state_returns(ret).items() if v["changes"]}


def _all_ok(ret):
    data = _state_returns(ret)
    return all(v["result"] is True for v in data.values()), data


def _rewrite_minion_masters(minion, masters):
    path = pathlib.Path(minion.config_file)
    conf = salt.utils.yaml.safe_load(path.read_text())
    conf["master"] = masters
    conf.pop("master_alive_interval", None)
    path.write_text(salt.utils.yaml.safe_dump(conf))


# ---------------------------------------------------------------------------
# cluster frm: the minion formula
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def frm(cluster_factory, clean_environ, mm_root, repo_tree):
    top_root = mm_root / "frm-top"
    pillar_root = mm_root / "frm-pillar"
    top_root.mkdir(exist_ok=True)
    pillar_root.mkdir(exist_ok=True)
    cluster = cluster_factory(
        "frm",
        peers=1,
        minions=1,
        environ=clean_environ,
        primary_overrides={
            "file_roots": {"base": [str(repo_tree), str(top_root)]},
            "pillar_roots": {"base": [str(pillar_root)]},
            "file_ignore_regex": IGNORE,
        },
    )
    minion = cluster.minions[0]
    primary_ip = cluster.primary.config["interface"]
    peer_ip = cluster.peers[0].config["interface"]
    (top_root / "top.sls").write_text(f"base:\n  '{minion.id}':\n    - salt.multimaster\n")
    # a duplicate master entry (the peer twice), no master_alive_interval
    _rewrite_minion_masters(minion, [primary_ip, peer_ip, f"{peer_ip}:4506"])
    cluster.start()
    assert cluster.wait_ping(cluster.primary, minion.id)
    assert cluster.wait_ping(cluster.peers[0], minion.id)
    _, master_pub = cluster_master_pub(cluster)
    marker = mm_root / "frm-restart-marker"
    pillar = {
        "multimaster": {
            "masters": [primary_ip, peer_ip],
            "master_finger": cluster.master_fingerprint(cluster.primary),
            "master_pub": master_pub,
            "minion": {"master_alive_interval": 10},
            # no service manager here: a harmless command proves the
            # background restart; the test restarts the daemon itself
            "minion_restart_cmd": f"date +%s.%N > {marker}",
            "minion_restart_delay": 10,
        }
    }
    (pillar_root / "top.sls").write_text(f"base:\n  '{minion.id}':\n    - multimaster\n")
    (pillar_root / "multimaster.sls").write_text(json.dumps(pillar))
    cluster.marker = marker
    yield cluster
    cluster.stop()


def cluster_master_pub(cluster):
    _, pub = master_key_paths(cluster.primary.config["pki_dir"])
    return pub, pub.read_text()


def _minion_paths(minion):
    conf_dir = pathlib.Path(minion.config_file).parent
    pki = pathlib.Path(minion.config["pki_dir"])
    return conf_dir / "minion.d" / "multimaster.conf", pki / "minion_master.pub"


@pytest.fixture(scope="module")
def frm_synced(frm):
    """
    Modules synced and pillar compiled while the cached master key is still
    right (once), every refresh finished before a test makes the key stale;
    the sync's return.
    """
    minion = frm.minions[0]
    # refresh=False: the sync's own pillar refresh would run unwatched
    ret = frm.salt(frm.primary, "saltutil.sync_all", "refresh=False", minion_tgt=minion.id,
                   timeout=240)
    refreshed = frm.refresh_pillar(frm.primary, minion)
    assert refreshed.returncode == 0, refreshed
    return ret


def _right_key(frm):
    """Cache the primary's master.pub on the minion (what master_key_apply writes)."""
    _minion_paths(frm.minions[0])[1].write_text(cluster_master_pub(frm)[1])


def _reset(frm, key=None):
    """
    The minion as before the formula: no drop-in on disk, no restart marker,
    ``key`` (default: the right one) as its cached master key.
    """
    dropin, cached = _minion_paths(frm.minions[0])
    dropin.unlink(missing_ok=True)
    frm.marker.unlink(missing_ok=True)
    if key is None:
        _right_key(frm)
    else:
        cached.write_bytes(key)


@pytest.fixture
def stale_key(frm, frm_synced):  # pylint: disable=unused-argument
    """
    A stale minion_master.pub (as after a restore from an old image) on the
    unconfigured minion; the right key back afterwards.
    """
    stale = _new_pub()
    _reset(frm, key=stale)
    yield stale.decode()
    _right_key(frm)
    # a sign-in that failed on the stale key (any pillar refresh) leaves
    # returns undelivered until the next one succeeds: the minion answers
    # again before the next test starts, or this one errors
    assert frm.wait_ping(frm.primary, frm.minions[0].id), "no answer with the right key back"


@pytest.fixture
def unconfigured(frm, frm_synced):  # pylint: disable=unused-argument
    """The minion as before the formula, its master key right."""
    _reset(frm)
    return frm


@pytest.fixture
def configured(frm, frm_synced):  # pylint: disable=unused-argument
    """
    The minion's configuration as the formula writes it, on disk (the
    running minion is restarted by the test that needs it): applied now if
    missing, the background restart command waited for and its marker
    removed.
    """
    dropin, _ = _minion_paths(frm.minions[0])
    _right_key(frm)
    if not dropin.exists():
        frm.marker.unlink(missing_ok=True)
        ret = frm.salt(frm.primary, "state.apply", "salt.multimaster",
                       minion_tgt=frm.minions[0].id, timeout=180)
        ok, data = _all_ok(ret)
        assert ok, data
        assert wait_until(lambda: frm.marker.exists() and frm.marker.read_text().strip())
    frm.marker.unlink(missing_ok=True)
    return frm


@pytest.mark.usefixtures("stale_key")
def test_stale_setup(frm, frm_synced):
    """
    The starting point: modules synced and pillar compiled while the cached
    master key is still right, then a stale minion_master.pub (as after a
    restore from an old image).  A stale key blocks every new sign-in (pillar
    refresh, restart): the state must fix it while the minion's session lives.
    """
    minion = frm.minions[0]
    dropin, _ = _minion_paths(minion)
    ret = frm_synced
    assert ret.returncode == 0, ret
    assert "states.multimaster" in ret.data["states"], ret.data
    ret = frm.salt(frm.primary, "pillar.get", "multimaster:minion", *PILLAR_UNMASK,
                   minion_tgt=minion.id)
    assert ret.data == {"master_alive_interval": 10}, ret
    assert not dropin.exists()
    ret = frm.salt(frm.primary, "multimaster.audit", minion_tgt=minion.id)
    checks = {f["check"] for f in ret.data["findings"] if f["severity"] != "info"}
    assert {"duplicate_master", "master_alive_interval", "master_pubkey"} <= checks, ret.data
    assert ret.data["result"] is False


def test_stale_key_repaired_by_a_plain_job(frm, stale_key):
    """
    ``state.apply`` cannot run on this minion now: Salt verifies every
    freshly compiled pillar with the cached master key (3006.28, 3007.15,
    3008).  A plain job runs on
    the live session: ``multimaster.master_key_apply`` takes the key from
    pillar ``multimaster:master_pub``.
    """
    minion = frm.minions[0]
    _, cached = _minion_paths(minion)
    ret = frm.salt(frm.primary, "multimaster.master_key_check", minion_tgt=minion.id)
    assert ret.data["match"] is False, ret
    assert ret.data["expected_finger"] == frm.master_fingerprint(frm.primary)
    ret = frm.salt(frm.primary, "multimaster.master_key_apply", minion_tgt=minion.id)
    assert ret.returncode == 0, ret
    assert ret.data["written"] is True, ret.data
    assert open(ret.data["backup"], encoding="utf-8").read() == stale_key
    _, master_pub = cluster_master_pub(frm)
    assert cached.read_text().strip() == master_pub.strip()


def test_stale_key_repaired_after_a_failed_pillar_refresh(frm, stale_key):
    """
    A pillar refresh on the stale key fails its signature check (on Salt
    3007.15 that master then got none of the minion's returns until the key
    was right).  ``multimaster.master_key_apply`` as a plain job still runs,
    writes the key and answers; the minion answers the next job too.
    """
    minion = frm.minions[0]
    _, cached = _minion_paths(minion)
    since = frm.log_size(minion)
    frm.refresh_pillar(frm.primary, minion)  # completes, with an error logged
    assert "Pillar data could not be refreshed" in frm.log_since(minion, since)
    ret = frm.salt(frm.primary, "multimaster.master_key_apply", minion_tgt=minion.id,
                   timeout=120)
    assert ret.returncode == 0, ret
    assert ret.data["written"] is True, ret.data
    assert open(ret.data["backup"], encoding="utf-8").read() == stale_key
    assert cached.read_text().strip() == cluster_master_pub(frm)[1].strip()
    assert frm.ping(frm.primary, minion.id), "no answer after the repair"


@pytest.mark.usefixtures("frm_synced")
def test_master_key_state_replaces_stale_signing_key(frm, mm_root):
    """The master_key state on a real minion: a stale master_sign.pub from salt://."""
    minion = frm.minions[0]
    pki = pathlib.Path(minion.config["pki_dir"])
    stale, good = _new_pub(), _new_pub()
    (pki / "master_sign.pub").write_bytes(stale)
    keys = mm_root / "frm-top" / "frm-keys"
    keys.mkdir(exist_ok=True)
    (keys / "master_sign.pub").write_bytes(good)
    finger = fingers.master_finger(good.decode())
    args = ("multimaster.master_key", "master_sign.pub",
            "source=salt://frm-keys/master_sign.pub", "topology=signed",
            f"master_finger={finger}", "restart=False")
    ret = frm.salt(frm.primary, "state.single", *args, "test=True", minion_tgt=minion.id)
    (state,) = _state_returns(ret).values()
    assert state["result"] is None and "master_key" in state["changes"], state
    assert (pki / "master_sign.pub").read_bytes() == stale
    ret = frm.salt(frm.primary, "state.single", *args, minion_tgt=minion.id)
    (state,) = _state_returns(ret).values()
    assert state["result"] is True and "backup" in state["changes"], state
    assert (pki / "master_sign.pub").read_bytes() == good
    ret = frm.salt(frm.primary, "state.single", *args, minion_tgt=minion.id)
    (state,) = _state_returns(ret).values()
    assert state["result"] is True and state["changes"] == {}, state
    (pki / "master_sign.pub").unlink()


def test_apply_test_mode_changes_nothing(unconfigured):
    frm = unconfigured
    minion = frm.minions[0]
    dropin, _ = _minion_paths(minion)
    ret = frm.salt(frm.primary, "state.apply", "salt.multimaster", "test=True",
                   minion_tgt=minion.id, timeout=180)
    data = _state_returns(ret)
    key = data["multimaster_|-multimaster-minion-multimaster-master_key_|-minion_master.pub_|-master_key"]
    conf = data[
        "multimaster_|-multimaster-minion-multimaster-minion_config_|-multimaster.conf_|-minion_config"
    ]
    assert key["result"] is True and key["changes"] == {}, data
    assert conf["result"] is None, data
    assert conf["changes"]["master"] == {
        "old": None,
        "new": [frm.primary.config["interface"], frm.peers[0].config["interface"]],
    }
    assert conf["changes"]["master_alive_interval"] == {"old": None, "new": 10}
    assert not dropin.exists()
    assert not frm.marker.exists()


def test_apply_converges_and_restarts_in_background(unconfigured):
    frm = unconfigured
    minion = frm.minions[0]
    dropin, _ = _minion_paths(minion)
    ret = frm.salt(frm.primary, "state.apply", "salt.multimaster",
                   minion_tgt=minion.id, timeout=180)
    returned = time.time()
    ok, data = _all_ok(ret)
    assert ok, data
    changes = _changes(ret)
    assert list(changes) == [
        "multimaster_|-multimaster-minion-multimaster-minion_config_|-multimaster.conf_|-minion_config"
    ], changes
    assert "restart" in list(changes.values())[0], changes
    # the restart command waits for the job process to exit, then 10 s
    assert not frm.marker.exists()
    conf = salt.utils.yaml.safe_load(dropin.read_text())
    assert conf == {
        "master": [frm.primary.config["interface"], frm.peers[0].config["interface"]],
        "master_alive_interval": 10,
    }
    for _ in range(120):
        if frm.marker.exists() and frm.marker.read_text().strip():
            break
        time.sleep(1)
    assert float(frm.marker.read_text()) >= returned - 1


def test_after_restart_answers_from_both_masters_and_audit_clean(configured):
    frm = configured
    minion = frm.minions[0]
    frm.restart(minion)
    assert frm.wait_ping(frm.primary, minion.id)
    assert frm.wait_ping(frm.peers[0], minion.id)
    # one return per job from the formerly duplicated peer
    ret = frm.salt(frm.peers[0], "test.ping", minion_tgt=minion.id)
    assert ret.stdout.count(minion.id) == 1, ret.stdout
    ret = frm.salt(frm.primary, "multimaster.audit", minion_tgt=minion.id)
    assert ret.returncode == 0, ret
    assert ret.data["result"] is True, ret.data
    assert [f for f in ret.data["findings"] if f["severity"] != "info"] == [], ret.data


def test_second_apply_and_highstate_change_nothing(configured):
    frm = configured
    minion = frm.minions[0]
    ret = frm.salt(frm.primary, "state.apply", "salt.multimaster",
                   minion_tgt=minion.id, timeout=180)
    ok, data = _all_ok(ret)
    assert ok and _changes(ret) == {}, data
    # a highstate with a top.sls including the formula (modules auto-synced)
    ret = frm.salt(frm.primary, "state.highstate", minion_tgt=minion.id, timeout=180)
    ok, data = _all_ok(ret)
    assert ok and _changes(ret) == {}, data
    assert any("salt.multimaster" in v["__sls__"] for v in data.values()), data
    time.sleep(2)
    assert not frm.marker.exists()


def test_invalid_pillar_fails_and_writes_nothing(configured):
    frm = configured
    minion = frm.minions[0]
    dropin, _ = _minion_paths(minion)
    before = dropin.read_text()
    bad = json.dumps({"multimaster": {"masters": "just-one-string",
                                      "minion": {"master_alive_interval": -3}}})
    ret = frm.salt(frm.primary, "state.apply", "salt.multimaster", f"pillar={bad}",
                   minion_tgt=minion.id, timeout=180)
    data = _state_returns(ret)
    conf = data[
        "multimaster_|-multimaster-minion-multimaster-minion_config_|-multimaster.conf_|-minion_config"
    ]
    assert conf["result"] is False
    assert "masters must be a list" in conf["comment"]
    assert "master_alive_interval: -3" in conf["comment"]
    assert dropin.read_text() == before
    assert ret.returncode != 0


# ---------------------------------------------------------------------------
# cluster frr: salt.multimaster.master, the salt/key reactor (pip install path)
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def frr(cluster_factory, repo_tree):
    cluster = cluster_factory(
        "frr",
        peers=1,
        minions=1,
        accept_on_peers=False,
        primary_overrides={"file_roots": {"base": [str(repo_tree)]}, "file_ignore_regex": IGNORE},
    )
    # the contract's primary configuration: who the peers are
    dropin = pathlib.Path(cluster.primary.config_file).parent / "master.d" / "multimaster.conf"
    dropin.parent.mkdir(exist_ok=True)
    dropin.write_text(salt.utils.yaml.safe_dump(
        {"multimaster": {"peers": [m.id for m in cluster.peer_minions]}}))
    cluster.start()
    assert cluster.wait_pings(cluster.primary, cluster.all_minions)
    # the primary's own keys reach the peer once (the minion used below)
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=minion_keys")
    assert ret.returncode == 0, ret
    yield cluster
    cluster.stop()


def _new_minion(cluster, minion_id):
    """A minion of both masters whose key no master has accepted yet."""
    minion = cluster._minion(minion_id, cluster.masters, {})  # pylint: disable=protected-access
    # the factory waits for a start event, which needs an accepted key
    minion.get_check_events = lambda: []
    minion.start()
    return minion


def _diag(cluster):
    """
    Key dirs of the peer, the primary's and the peer minion's multimaster
    log lines, for failures (a string: pytest shows it whole).
    """
    def lines(daemon):
        return log_tail(daemon, 40, lambda line: "multimaster" in line
                        or "reactor" in line.lower())

    keys = {k: sorted(v) for k, v in cluster.keys(cluster.peers[0]).items()}
    return "\n".join([f"peer keys: {keys}", "primary log:", *lines(cluster.primary),
                      "peer minion log:", *lines(cluster.peer_minions[0])])


def _master_sls_pillar(cluster):
    return json.dumps({"multimaster": {"master": {
        "config": str(cluster.primary.config_file),
        # no service manager here: the test restarts the primary itself
        "restart_cmd": "true",
        "restart_delay": 0,
    }}})


@pytest.fixture(scope="module")
def reactor(frr):
    """
    ``salt.multimaster.master`` applied on the primary once (``test=True``,
    the run, a second run, a ``test=True`` with a periodic sync), the primary
    restarted to load the reactor; what each step returned or left.
    """
    minion = frr.minions[0]
    pillar = _master_sls_pillar(frr)
    dropin = pathlib.Path(frr.primary.config_file).parent / "master.d" / "multimaster-reactor.conf"
    run = {"dropin": dropin}
    run["test"] = frr.salt(frr.primary, "state.apply", "salt.multimaster.master", "test=True",
                           f"pillar={pillar}", minion_tgt=minion.id, timeout=180)
    run["dropin_after_test"] = dropin.exists()
    run["apply"] = frr.salt(frr.primary, "state.apply", "salt.multimaster.master",
                            f"pillar={pillar}", minion_tgt=minion.id, timeout=180)
    run["dropin_after_apply"] = dropin.read_text() if dropin.exists() else None
    run["again"] = frr.salt(frr.primary, "state.apply", "salt.multimaster.master",
                            f"pillar={pillar}", minion_tgt=minion.id, timeout=180)
    # the optional periodic full sync, predicted only
    scheduled = json.loads(pillar)
    scheduled["multimaster"]["master"]["sync_interval"] = 15
    run["scheduled"] = frr.salt(frr.primary, "state.apply", "salt.multimaster.master",
                                "test=True", f"pillar={json.dumps(scheduled)}",
                                minion_tgt=minion.id, timeout=180)
    # the change journal engine, predicted only
    watched = json.loads(pillar)
    watched["multimaster"]["master"]["watch"] = True
    run["watched"] = frr.salt(frr.primary, "state.apply", "salt.multimaster.master",
                              "test=True", f"pillar={json.dumps(watched)}",
                              minion_tgt=minion.id, timeout=180)
    # load the reactor (the formula's restart command is a no-op here)
    frr.restart(frr.primary)
    run["answering"] = {m.id: frr.wait_ping(frr.primary, m.id) for m in frr.all_minions}
    return run


def test_master_sls_installs_reactor(frr, reactor):
    dropin = reactor["dropin"]
    data = _state_returns(reactor["test"])
    assert all(v["result"] is None for v in data.values()), data
    assert reactor["dropin_after_test"] is False
    ret = reactor["apply"]
    ok, data = _all_ok(ret)
    assert ok, data
    assert set(_changes(ret)) == {
        "file_|-multimaster-master-file-serialize_|-{}_|-serialize".format(dropin),
        "multimaster_|-multimaster-master-multimaster-restart_scheduled_|-salt-master_|-"
        "restart_scheduled",
    }, data
    # the reactor, and the pull channel for the configured peers (that id only)
    assert salt.utils.yaml.safe_load(reactor["dropin_after_apply"]) == {
        "reactor": [{"salt/key": ["salt://salt/multimaster/reactor/key.sls"]}],
        "peer_run": {r"frr\-peer1$": ["multimaster.pull"]},
    }
    ret = reactor["again"]
    ok, data = _all_ok(ret)
    assert ok and _changes(ret) == {}, data
    # the optional periodic full sync, predicted only
    data = _state_returns(reactor["scheduled"])
    diff = str(data["file_|-multimaster-master-file-serialize_|-{}_|-serialize".format(dropin)])
    assert "multimaster-sync" in diff and "function: multimaster.sync" in diff, data
    # the journal engine, next to the engines of the master file (which a
    # master.d engines list would otherwise replace)
    data = _state_returns(reactor["watched"])
    diff = str(data["file_|-multimaster-master-file-serialize_|-{}_|-serialize".format(dropin)])
    assert "multimaster_watch" in diff, data
    own = [next(iter(e)) if isinstance(e, dict) else e
           for e in frr.primary.config.get("engines") or []]
    assert own and all(name in diff for name in own), (own, data)
    assert all(reactor["answering"].values()), reactor["answering"]
    ret = frr.salt_run(frr.primary, "multimaster.status")
    assert ret.data[frr.peer_minions[0].id]["pull_allowed"] is True, ret.data


def _accepted_only(keys, minion_id):
    return [state for state, ids in keys.items() if minion_id in ids] == ["minions"]


def _job_args(load):
    """A runner job record's arguments as key=value (its own record, or Salt's)."""
    args = list(load.get("arg") or []) + list(load.get("fun_args") or [])
    args += list((load.get("return") or {}).get("fun_args") or [])
    ret = set()
    for arg in args:
        if isinstance(arg, dict):
            ret |= {f"{k}={v}" for k, v in arg.items() if not str(k).startswith("__")}
        else:
            ret.add(str(arg))
    return ret


@pytest.mark.usefixtures("reactor")
def test_accept_on_primary_alone_reaches_the_peer(frr):
    new = _new_minion(frr, "frr-new1")
    try:
        assert wait_until(lambda: "frr-new1" in frr.keys(frr.primary)["minions_pre"])
        assert wait_until(lambda: "frr-new1" in frr.keys(frr.peers[0])["minions_pre"])
        ret = frr.salt_key(frr.primary, "-a", "frr-new1", "-y")
        assert ret.returncode == 0, ret
        # no manual step: the reactor replicates the key, the minion authenticates
        # (a move between two key dirs is a rename and an unlink: wait for both)
        assert wait_until(lambda: _accepted_only(frr.keys(frr.peers[0]), "frr-new1")), _diag(frr)
        assert frr.wait_ping(frr.peers[0], "frr-new1", deadline=120), _diag(frr)
        # the reactor ran on this Salt's own salt/key act value (3006/3007
        # accept, 3008 accepted)
        acts = {arg for _, load, _ in frr.job_records(
            frr.primary, "runner.multimaster_reactor.key_event") for arg in _job_args(load)}
        assert f"act={ACCEPT_ACT}" in acts and "minion_id=frr-new1" in acts, acts
        # the minion's retried auth on the peer did not put it back in pending
        assert _accepted_only(frr.keys(frr.peers[0]), "frr-new1"), _diag(frr)
        # deleting it on the primary reaches the peer too
        ret = frr.salt_key(frr.primary, "-d", "frr-new1", "-y")
        assert ret.returncode == 0, ret
        assert wait_until(lambda: "frr-new1" not in frr.keys(frr.peers[0])["minions"]), _diag(frr)
    finally:
        new.terminate()


@pytest.mark.usefixtures("reactor")
def test_key_burst_is_coalesced(frr):
    ids = [f"frr-burst{i}" for i in range(3)]
    minions = [_new_minion(frr, mid) for mid in ids]
    log = frr.log_files(frr.primary)[0]
    try:
        for mid in ids:
            assert wait_until(lambda mid=mid: mid in frr.keys(frr.primary)["minions_pre"])
        before = log.read_text(errors="replace").count("syncing the keys of")
        ret = frr.salt_key(frr.primary, "-A", "-y")
        assert ret.returncode == 0, ret
        for mid in ids:
            assert wait_until(lambda mid=mid: mid in frr.keys(frr.peers[0])["minions"]), _diag(frr)
        assert frr.wait_pings(frr.peers[0], ids, deadline=120), ids
        # a few seconds for any queued round to finish, then count the syncs
        time.sleep(5)
        syncs = log.read_text(errors="replace").count("syncing the keys of") - before
        assert 1 <= syncs < len(ids), syncs
    finally:
        for m in minions:
            m.terminate()


@pytest.mark.usefixtures("reactor")
def test_large_key_burst_costs_two_syncs(frr):
    """salt-key -A of many pending keys: the first event syncs, one more covers the rest."""
    from tests.support.cluster import gen_keypair  # pylint: disable=import-outside-toplevel

    pre = frr.pki_dir(frr.primary) / "minions_pre"
    ids = [f"frr-many{i:02d}" for i in range(60)]
    for mid in ids:
        (pre / mid).write_bytes(gen_keypair(1024)[1])
    log = frr.log_files(frr.primary)[0]
    before = log.read_text(errors="replace").count("syncing the keys of")
    ret = frr.salt_key(frr.primary, "-A", "-y")
    assert ret.returncode == 0, ret
    assert wait_until(lambda: set(ids) <= set(frr.keys(frr.peers[0])["minions"]),
                      deadline=180), _diag(frr)
    time.sleep(5)  # any queued round finishes
    syncs = log.read_text(errors="replace").count("syncing the keys of") - before
    # The contract (multimaster_reactor.key_event): one sync at once, one
    # more once the events have stopped for key_event_quiet seconds.  Salt's
    # reactor delivers the 60 events over seconds (about 10 a second here);
    # a pause in that delivery as long as the quiet time (a starved master
    # on a loaded host) ends a burst, and what follows is another burst with
    # its own second sync.  The pauses are read from the key_event jobs'
    # jids (their start times).
    started = sorted(datetime.datetime.strptime(jid, "%Y%m%d%H%M%S%f") for jid, load, _ in
                     frr.job_records(frr.primary, "runner.multimaster_reactor.key_event")
                     if any(arg.startswith("minion_id=frr-many") for arg in _job_args(load)))
    gaps = [round((b - a).total_seconds(), 1) for a, b in zip(started, started[1:])]
    pauses = sum(gap >= multimaster_reactor.QUIET - 0.5 for gap in gaps)
    assert len(started) == len(ids), (len(started), _diag(frr))
    assert 1 <= syncs <= 2 + pauses, (syncs, f"event gaps (s): {gaps}", _diag(frr))
