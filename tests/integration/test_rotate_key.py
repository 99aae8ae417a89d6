"""
``salt-run multimaster.rotate_key`` on real daemons, in both topologies: a
dry run writes nothing; a rotation with one minion stopped lists it by id
with its remedy, and a re-run after the remedy confirms it; a rotation
interrupted after the first master (its restart never happens) converges
when run again.  Masters restart through a stand-in for the service
manager (tests/support/rotate.py).
"""

import contextlib
import pathlib
import shutil
import stat

import pytest

from tests.support.cluster import gen_keypair, master_key_paths
from tests.support.rotate import (RestartWatcher, files_holding, key_body_lines, marker_of,
                                  pki_snapshot)

pytestmark = pytest.mark.daemons

# A stopped minion is given up when it does not answer saltutil.find_job
# within the master's gather_job_timeout (Salt's default, 10 s), at each of
# the rotation's calls to the minions (telling them the new key, verifying,
# then again until verify_wait has passed): where one is stopped, the tests
# pass verify_wait=5 (one more call), not the 15 s that took two or three.


def _config(cluster, topology):
    dropin = pathlib.Path(cluster.primary.config_file).parent / "master.d" / "multimaster.conf"
    dropin.parent.mkdir(exist_ok=True)
    dropin.write_text(
        f"multimaster:\n  peers: [{cluster.peer_minions[0].id}]\n  topology: {topology}\n"
        "  master_restart_cmd: 'true'\n  backup_keep: 2\n")


def _share_sign_pair(cluster):
    """
    Every master and minion holds one master_sign pair (pub only on
    minions), placed before the first start as an operator seeds it.
    """
    priv, pub = gen_keypair(2048)
    for master in cluster.masters:
        pki = cluster.pki_dir(master)
        pki.mkdir(parents=True, exist_ok=True)
        (pki / "master_sign.pem").write_bytes(priv)
        (pki / "master_sign.pem").chmod(0o400)
        (pki / "master_sign.pub").write_bytes(pub)
    for minion in cluster.all_minions:
        pki = pathlib.Path(minion.config["pki_dir"])
        pki.mkdir(parents=True, exist_ok=True)
        (pki / "master_sign.pub").write_bytes(pub)


def _watcher(cluster):
    return RestartWatcher([(cluster.primary, cluster.primary),
                           *zip(cluster.peers, cluster.peer_minions)])


def _pub(master):
    return master_key_paths(master.config["pki_dir"])[1].read_bytes()


def _rotate(cluster, *args, timeout=600):
    ret = cluster.salt_run(cluster.primary, "multimaster.rotate_key", "--out=json", *args,
                           timeout=timeout)
    assert isinstance(ret.data, dict), (ret.returncode, ret.stdout, ret.stderr)
    return ret


def _all_daemons(cluster):
    return [*cluster.masters, *cluster.all_minions]


def _dry_run(cluster, steps):
    """
    test=True shows ``steps`` and writes nothing: pki dirs, record, staged
    key, marker (none of them before the first rotation; a rotation's
    record, as it was, after one).
    """
    state = pathlib.Path(cluster.primary.config["cachedir"]) / "multimaster"
    written = [state / "rotation.json", state / "rotation-staged", marker_of(cluster.primary)]

    def records():
        return {str(path): path.read_bytes() if path.is_file() else path.exists()
                for path in written}

    before = pki_snapshot(*_all_daemons(cluster)), records()
    ret = _rotate(cluster, "test=True")
    assert ret.returncode == 0, ret.stdout
    assert [s["step"] for s in ret.data["plan"]] == steps, ret.data
    assert (pki_snapshot(*_all_daemons(cluster)), records()) == before


@contextlib.contextmanager
def _interrupted_then_resumed(cluster):
    """
    A rotation whose primary restart never happens (its service manager
    fails: the restart command exits 3): the rotation stops at once, naming
    the command's exit; the block checks the cluster then, given the steps.
    Then the service manager is fixed and the re-run converges: each master
    restarted once, the peer before the primary, every minion confirms.
    """
    primary = cluster.primary
    with _watcher(cluster) as watcher:
        watcher.enabled.discard(id(primary))
        # the peer's restart happens (the watcher, on its restart marker;
        # its command's own exit is left in its status file)
        ret = _rotate(cluster, "restart_cmd=exit 3")
        assert ret.returncode != 0, ret.stdout
        assert "run salt-run multimaster.rotate_key again" in ret.data["error"]
        assert "its restart command 'exit 3' exited 3" in ret.data["error"], ret.data["error"]
        steps = ret.data["steps"]
        assert steps[cluster.peer_minions[0].id]["state"] == "serving"
        assert steps[primary.config["id"]]["state"] == "written"
        yield steps
        # the re-run asks for the restart again
        watcher.enable(primary)
        ret = _rotate(cluster)
    assert ret.returncode == 0, ret.stdout
    assert ret.data["resumed"] is True
    assert watcher.restarts == [cluster.peers[0].id, primary.id]
    assert sorted(ret.data["minions"]["confirmed"]) == sorted(m.id for m in cluster.all_minions)


def _check_backup(master, old_pub):
    """The old keypair is in the master's backup: 0400 key, 0700 dirs."""
    base = pathlib.Path(master.config["cachedir"]) / "multimaster" / "backup"
    found = [p for p in base.glob("*/master_keys/master.pub") if p.read_bytes() == old_pub]
    assert found, f"old key of {master.id} not in {base}"
    pem = found[0].with_name("master.pem")
    assert stat.S_IMODE(pem.stat().st_mode) == 0o400
    assert stat.S_IMODE(pem.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(pem.parent.parent.stat().st_mode) == 0o700


def _old_backups(master):
    """Three backups older than any a test makes, in ``master``'s backup dir: their names."""
    base = pathlib.Path(master.config["cachedir"]) / "multimaster" / "backup"
    names = [f"2020010{day}T000000.000000Z" for day in (1, 2, 3)]
    for name in names:
        (base / name).mkdir(mode=0o700, parents=True)
    return names


def _kept_backups(master):
    return sorted(p.name for p in (pathlib.Path(master.config["cachedir"]) / "multimaster"
                                   / "backup").iterdir())


def _running(cluster, topology, **start):
    """The fixture's body: ``cluster`` configured for ``topology``, started, then stopped."""
    _config(cluster, topology)
    yield from cluster.running(minions=cluster.minions, **start)


@pytest.fixture(scope="module")
def signed(cluster_factory):
    yield from _running(cluster_factory(
        "rks", peers=1, minions=2, share_master_keys=False,
        master_overrides={"master_sign_pubkey": True},
        minion_overrides={"verify_master_pubkey_sign": True},
    ), "signed", before_masters=_share_sign_pair)


def test_signed_dry_run_writes_nothing(signed):
    _dry_run(signed, [signed.peer_minions[0].id, signed.primary.config["id"], "verify"])


def test_signed_rotation_with_a_stopped_minion(signed):
    primary, peer = signed.primary, signed.peers[0]
    stopped, running = signed.minions[1], signed.minions[0]
    old = {m.id: _pub(m) for m in signed.masters}
    stopped.terminate()
    try:
        with _watcher(signed) as watcher:
            ret = _rotate(signed, "verify_wait=5")
        assert ret.returncode != 0, ret.stdout
        data = ret.data
        # every master serves a new key, one at a time: the peer before the primary
        assert watcher.restarts == [peer.id, primary.id]
        for master in signed.masters:
            assert _pub(master) != old[master.id]
            _check_backup(master, old[master.id])
        assert list(data["minions"]["unconfirmed"]) == [stopped.id], data
        assert "start the salt-minion" in data["minions"]["unconfirmed"][stopped.id]["remedy"]
        assert running.id in data["minions"]["confirmed"]
        assert signed.ping(primary, running.id)
        # the new private keys never left their hosts: no copy outside pki dirs
        needles = [n for m in signed.masters
                   for n in key_body_lines(master_key_paths(m.config["pki_dir"])[0])]
        roots = [d.config["root_dir"] for d in _all_daemons(signed)]
        assert files_holding(roots, needles,
                             skip=[d.config["pki_dir"] for d in _all_daemons(signed)]) == []
    finally:
        stopped.start()
    # the remedy: start it (done); it accepts the signed new keys by itself
    assert signed.wait_ping(primary, stopped.id, deadline=120)
    ret = _rotate(signed)
    assert ret.returncode == 0, ret.stdout
    assert ret.data["resumed"] is True
    assert stopped.id in ret.data["minions"]["confirmed"]
    assert ret.data["minions"]["unconfirmed"] == {}
    assert signed.wait_ping(peer, stopped.id, deadline=120)


def test_signed_rotation_interrupted_after_the_first_master_converges(signed):
    primary, peer = signed.primary, signed.peers[0]
    old = {m.id: _pub(m) for m in signed.masters}
    with _interrupted_then_resumed(signed):
        assert _pub(peer) != old[peer.id]
        # the minions still answer: the peer with its new key, the primary with its old
        assert signed.wait_pings(primary, signed.minions)
    assert _pub(primary) != old[primary.id]


@pytest.fixture(scope="module")
def shared(cluster_factory):
    yield from _running(cluster_factory("rkh", peers=1, minions=2), "shared")


def _trusted(minion):
    return (pathlib.Path(minion.config["pki_dir"]) / "minion_master.pub").read_bytes()


def test_shared_dry_run_writes_nothing(shared):
    _dry_run(shared, [shared.peer_minions[0].id, "minions", shared.primary.config["id"],
                      "verify"])


def test_shared_rotation_with_a_stopped_minion(shared):
    primary, peer = shared.primary, shared.peers[0]
    stopped, running = shared.minions[1], shared.minions[0]
    old = _pub(primary)
    assert _pub(peer) == old
    older = {m.id: _old_backups(m) for m in shared.masters}
    stopped.terminate()
    with _watcher(shared) as watcher:
        ret = _rotate(shared, "verify_wait=5")
    assert ret.returncode != 0, ret.stdout
    data = ret.data
    assert watcher.restarts == [peer.id, primary.id]
    new = _pub(primary)
    assert new != old and _pub(peer) == new
    for master in shared.masters:
        _check_backup(master, old)
        # multimaster:backup_keep (2) on every master: the oldest went
        kept = _kept_backups(master)
        assert len(kept) == 2 and not set(older[master.id][:2]) & set(kept), (master.id, kept)
    # every reachable minion trusts the new key; the stopped one is named
    for minion in [running, *shared.peer_minions]:
        assert _trusted(minion).strip() == new.strip()
        assert minion.id in data["minions"]["confirmed"]
    assert list(data["minions"]["unconfirmed"]) == [stopped.id], data
    remedy = data["minions"]["unconfirmed"][stopped.id]["remedy"]
    assert "minion_master.pub" in remedy
    assert _trusted(stopped).strip() == old.strip()
    assert shared.ping(primary, running.id) and shared.wait_ping(peer, running.id)
    # the new private key rode no publish, return or log in clear
    roots = [d.config["root_dir"] for d in _all_daemons(shared)]
    assert files_holding(roots, key_body_lines(master_key_paths(primary.config["pki_dir"])[0]),
                         skip=[d.config["pki_dir"] for d in _all_daemons(shared)]) == []
    # the documented remedy: the new master.pub as the minion's trusted key
    shutil.copyfile(master_key_paths(primary.config["pki_dir"])[1],
                    pathlib.Path(stopped.config["pki_dir"]) / "minion_master.pub")
    stopped.start()
    assert shared.wait_ping(primary, stopped.id, deadline=120)
    ret = _rotate(shared)
    assert ret.returncode == 0, ret.stdout
    assert ret.data["resumed"] is True and ret.data["minions"]["unconfirmed"] == {}
    state = pathlib.Path(primary.config["cachedir"]) / "multimaster"
    assert not (state / "rotation-staged").exists()


def test_shared_rotation_interrupted_after_the_first_master_converges(shared):
    primary, peer = shared.primary, shared.peers[0]
    old = _pub(primary)
    with _interrupted_then_resumed(shared) as steps:
        assert steps["minions"]["state"] == "serving"
        new = _pub(peer)
        assert new != old and _pub(primary) == new
        # each minion trusts the new key, served by the peer; the primary
        # still serves the old one over the minions' live sessions
        for minion in shared.minions:
            assert _trusted(minion).strip() == new.strip()
            assert shared.wait_ping(peer, minion.id)
    assert _pub(primary) == new
