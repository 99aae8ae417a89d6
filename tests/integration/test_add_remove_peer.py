"""
``salt-run multimaster.add_peer`` and ``multimaster.remove_peer`` against real
daemons: one master grows to two and shrinks back.

The new peer's salt-master is installed but never started: add_peer places
the primary's master keys before its first start.  Every minion answers
from the new master after ``state.apply salt.multimaster``; remove_peer
refuses while a minion lists it, and leaves the audit clean once none does.

No test leans on another: each starts from the state it asks for
(``not_added``, ``added``, ``listed``), which the fixture brings the shared
cluster to.
"""

import os
import pathlib
import stat

import pytest

from tests.support.cluster import gen_keypair, master_key_paths
from tests.support.grow import dropin, start_primary_only, write_pillar

pytestmark = pytest.mark.daemons

IGNORE = [r"(^|/)\.venv(/|$)", r"(^|/)\.git(/|$)", r"(^|/)__pycache__(/|$)",
          r"(^|/)\.pytest_cache(/|$)", r"(^|/)build(/|$)"]


@pytest.fixture(scope="module")
def grow(cluster_factory, repo_tree, mm_root):
    pillar_root = mm_root / "adp-pillar"
    cluster = cluster_factory(
        "adp",
        peers=1,
        minions=1,
        primary_overrides={
            "file_roots": {"base": [str(repo_tree)]},
            "pillar_roots": {"base": [str(pillar_root)]},
            "file_ignore_regex": IGNORE,
            "peer_run": {r"adp\-peer1$": ["multimaster.pull"]},
        },
    )
    cluster.peer_id = cluster.peer_minions[0].id
    cluster.peer_ip = cluster.peers[0].config["interface"]
    cluster.primary_ip = cluster.primary.config["interface"]
    cluster.marker = mm_root / "adp-restart-marker"
    cluster.pillar_root = pillar_root
    minion = cluster.minions[0]
    # the operator's first step: the new master in the pillar the formula reads
    write_pillar(pillar_root, [minion.id], [cluster.primary_ip, cluster.peer_ip], cluster.marker)
    start_primary_only(cluster)
    assert cluster.wait_pings(cluster.primary, cluster.all_minions)
    ret = cluster.salt(cluster.primary, "saltutil.refresh_pillar", "wait=True",
                       minion_tgt=minion.id, timeout=120)
    assert ret.returncode == 0, ret
    yield cluster
    cluster.stop()


def _tree(master):
    """Every file under a master's config dir and pki_dir (path -> bytes)."""
    ret = {}
    for top in (os.path.dirname(master.config_file), master.config["pki_dir"]):
        for dirpath, _, files in os.walk(top):
            for name in files:
                path = os.path.join(dirpath, name)
                with open(path, "rb") as fh:
                    ret[path] = fh.read()
    return ret


def _audit(grow, minion):
    """The minion's configured masters, and its master_list/master_reachable findings."""
    ret = grow.salt(grow.primary, "multimaster.audit", minion_tgt=minion.id)
    assert isinstance(ret.data, dict), ret
    return ret.data["masters"], [
        f for f in ret.data["findings"]
        if f["check"] in ("master_list", "master_reachable") and f["severity"] != "info"]


def _error(ret):
    assert ret.returncode != 0, ret
    return str(ret.data.get("error") if isinstance(ret.data, dict) else ret.stdout)


def _minion_dropin(minion):
    """The formula's drop-in in the minion's config dir."""
    return pathlib.Path(minion.config_file).parent / "minion.d" / "multimaster.conf"


def _pillar_lists_peer(grow):
    """The minion's pillar lists the primary and the new master (refreshed if it changed)."""
    files = [grow.pillar_root / "top.sls", grow.pillar_root / "multimaster.sls"]
    before = [p.read_text() if p.exists() else None for p in files]
    minion = grow.minions[0]
    write_pillar(grow.pillar_root, [minion.id], [grow.primary_ip, grow.peer_ip], grow.marker)
    if [p.read_text() for p in files] != before:
        ret = grow.salt(grow.primary, "saltutil.refresh_pillar", "wait=True",
                        minion_tgt=minion.id, timeout=120)
        assert ret.returncode == 0, ret


def _apply_and_restart(grow, masters):
    """``state.apply salt.multimaster`` on the minion, restarted; it answers ``masters``."""
    minion = grow.minions[0]
    ret = grow.salt(grow.primary, "state.apply", "salt.multimaster", minion_tgt=minion.id,
                    timeout=240)
    assert ret.returncode == 0, ret
    grow.restart(minion)
    for master in masters:
        assert grow.wait_ping(master, minion.id)


@pytest.fixture
def not_added(grow):
    """
    The new master as before add_peer: no peer of the primary, stopped,
    without the primary's keys; the minion's pillar lists it, its config
    does not.
    """
    if dropin(grow.primary).exists():
        grow.salt_run(grow.primary, "multimaster.remove_peer", grow.peer_id, "force=True")
        assert not dropin(grow.primary).exists()
    peer = grow.peers[0]
    if peer.is_running():
        peer.terminate()
    pki = grow.pki_dir(peer)
    for name in ("master.pem", "master.pub", f"{peer.id}.pem", f"{peer.id}.pub"):
        (pki / name).unlink(missing_ok=True)
    _minion_dropin(grow.minions[0]).unlink(missing_ok=True)
    _pillar_lists_peer(grow)
    return grow


@pytest.fixture
def added(grow):
    """The new master added by add_peer and running; the minion's pillar lists it."""
    _pillar_lists_peer(grow)
    peer = grow.peers[0]
    if not dropin(grow.primary).exists():
        if peer.is_running():
            peer.terminate()
        ret = grow.salt_run(grow.primary, "multimaster.add_peer", grow.peer_id)
        assert ret.data["steps"]["sync"]["result"] is True, ret
    if not peer.is_running():
        peer.start()
    return grow


@pytest.fixture
def listed(added):
    """Added, and the minion's config lists it (formula applied, minion restarted)."""
    grow = added
    minion = grow.minions[0]
    path = _minion_dropin(minion)
    if not (path.exists() and grow.peer_ip in path.read_text()):
        _apply_and_restart(grow, grow.masters)
    return grow


def test_bad_input_is_refused_by_name(not_added):
    grow = not_added
    pending = grow.pki_dir(grow.primary) / "minions_pre" / "adp-pending"
    pending.parent.mkdir(exist_ok=True)
    pending.write_bytes(gen_keypair(1024)[1])
    before = _tree(grow.primary)
    ret = grow.salt_run(grow.primary, "multimaster.add_peer", "adp-pending")
    assert "accept it with salt-key -a adp-pending" in _error(ret), ret
    ret = grow.salt_run(grow.primary, "multimaster.add_peer", "nosuch-host")
    assert "'nosuch-host' is not an accepted minion" in _error(ret), ret
    ret = grow.salt_run(grow.primary, "multimaster.add_peer", grow.primary.id)
    assert "is this primary master itself" in _error(ret), ret
    ret = grow.salt_run(grow.primary, "multimaster.add_peer")
    assert "name the peer" in _error(ret), ret
    ret = grow.salt_run(grow.primary, "multimaster.remove_peer", grow.peer_id)
    assert f"'{grow.peer_id}' is no peer of this primary" in _error(ret), ret
    assert _tree(grow.primary) == before
    pending.unlink()


def test_add_peer_test_mode_shows_the_plan_and_writes_nothing(not_added):
    grow = not_added
    primary, peer = _tree(grow.primary), _tree(grow.peers[0])
    ret = grow.salt_run(grow.primary, "multimaster.add_peer", grow.peer_id, "test=True")
    assert ret.returncode == 0, ret
    steps = ret.data["steps"]
    assert steps["check"]["result"] is True, steps
    assert "not running and its ports are free" in steps["check"]["comment"]
    assert steps["config"]["result"] is None and steps["sync"]["result"] is None, steps
    assert "master.pem" in steps["sync"]["changes"]["master_keys"]["added"], steps
    assert steps["start"]["result"] is None, steps
    assert ret.data["master_entry"] == grow.peer_ip
    # the minions whose pillar lists the new master, config does not
    assert steps["minions"]["minions"] == {"will_get": [grow.minions[0].id]}, steps
    assert _tree(grow.primary) == primary and _tree(grow.peers[0]) == peer
    assert not dropin(grow.primary).exists()


def test_add_peer_places_keys_before_the_first_start(not_added):
    grow = not_added
    ret = grow.salt_run(grow.primary, "multimaster.add_peer", grow.peer_id)
    steps = ret.data["steps"]
    assert steps["check"]["result"] is True and steps["config"]["result"] is True, steps
    assert steps["sync"]["result"] is True, steps
    # no service manager here: add_peer says to start it, and exits non-zero
    assert steps["start"]["result"] is False and "start salt-master" in steps["start"]["comment"]
    assert ret.returncode != 0
    path = dropin(grow.primary)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert grow.peer_id in path.read_text()
    # the primary's keypair is on the never-started peer
    pem, pub = master_key_paths(grow.primary.config["pki_dir"])
    peer_pki = grow.pki_dir(grow.peers[0])
    assert (peer_pki / "master.pem").read_bytes() == pem.read_bytes()
    assert (peer_pki / "master.pub").read_bytes() == pub.read_bytes()
    assert not grow.peers[0].is_running()
    grow.peers[0].start()
    ret = grow.salt_run(grow.primary, "multimaster.status", f"peers={grow.peer_id}", "--out=json")
    assert ret.returncode == 0, ret
    assert ret.data[grow.peer_id]["in_sync"] is True, ret.data
    # a second add is refused by name
    ret = grow.salt_run(grow.primary, "multimaster.add_peer", grow.peer_id)
    assert "is already a peer" in _error(ret), ret


def test_formula_gives_every_minion_the_new_master(added):
    grow = added
    minion = grow.minions[0]
    _apply_and_restart(grow, grow.masters)
    ret = grow.salt(grow.peers[0], "test.ping", minion_tgt=minion.id)
    assert ret.stdout.count(minion.id) == 1, ret.stdout
    masters, bad = _audit(grow, minion)
    assert masters == [grow.primary_ip, grow.peer_ip] and bad == [], bad


def test_remove_peer_refused_while_a_minion_lists_it(listed):
    grow = listed
    before = dropin(grow.primary).read_text()
    ret = grow.salt_run(grow.primary, "multimaster.remove_peer", grow.peer_id)
    assert ret.returncode != 0, ret
    rows = ret.data["steps"]["minions"]["minions"]
    assert rows.get("still_lists") == [grow.minions[0].id], ret.data
    assert ret.data["steps"]["config"]["result"] is False
    assert dropin(grow.primary).read_text() == before


def test_remove_peer_once_no_minion_lists_it(added):
    grow = added
    minion = grow.minions[0]
    write_pillar(grow.pillar_root, [minion.id], [grow.primary_ip], grow.marker)
    ret = grow.salt(grow.primary, "saltutil.refresh_pillar", "wait=True", minion_tgt=minion.id,
                    timeout=120)
    assert ret.returncode == 0, ret
    _apply_and_restart(grow, [grow.primary])
    before = dropin(grow.primary).read_text()
    ret = grow.salt_run(grow.primary, "multimaster.remove_peer", grow.peer_id, "test=True")
    assert ret.returncode == 0, ret
    assert ret.data["steps"]["config"]["result"] is None, ret.data
    assert dropin(grow.primary).read_text() == before
    ret = grow.salt_run(grow.primary, "multimaster.remove_peer", grow.peer_id)
    assert ret.returncode == 0, ret
    assert ret.data["steps"]["minions"]["minions"] == {"clean": [minion.id]}, ret.data
    assert not dropin(grow.primary).exists()
    grow.peers[0].terminate()
    masters, bad = _audit(grow, minion)
    assert masters == [grow.primary_ip] and bad == [], bad
    ret = grow.salt_run(grow.primary, "multimaster.sync", "test=True")
    assert "no peers" in _error(ret), ret
