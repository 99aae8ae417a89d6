"""
A damaged state file never bricks replication (issue 36), against real
daemons: one primary, one peer (both running the change journal engine),
the peer host's minion restarting its master through
``multimaster.master_restart_cmd`` (the sandbox's service stand-in).

For each state file of each side in turn (the primary's
``cachedir/multimaster``, the peer host minion's, the peer master's, and
the drop-in the sync owns on the peer), each of: random bytes, truncated,
emptied, a directory in its place; then a change on the primary and
``salt-run multimaster.sync``: the sync converges, or fails with a named
error and the next one converges; no traceback in any return or CLI
output; the peer equals the primary after at most two syncs.  One cluster,
one test: several files of each side damaged at a time, each another way
(one sync for all of them).
"""

import itertools
import json
import os
import pathlib

import pytest

from salt_multimaster import restart
from tests.support.cluster import (KEY_DIRS, PULL_PRIMARY, gen_keypair, master_key_paths,
                                   wait_until)
from tests.support.service import MasterService
from tests.unit.test_contract import _tree
from tests.unit.test_damage import DAMAGES, damage, state_files

pytestmark = pytest.mark.daemons

PUB = gen_keypair(1024)[1]


@pytest.fixture(scope="module")
def cluster(cluster_factory, mm_root):
    cluster = cluster_factory(
        "dmg", peers=1, minions=0,
        # the journal only: the syncs are the test's own
        master_overrides={"engines": [{"multimaster_watch": {"replicate": False}}]},
        # Salt's default request workers and a 30 s find_job wait, as every
        # primary granting the pull channel here (PULL_PRIMARY): Salt 3007,
        # the machine loaded, a sync after the peer master's restart
        # reported the peer host's minion gone (one CI run, one of five
        # loaded runs of this module alone)
        primary_overrides=dict(PULL_PRIMARY, peer_run={r"dmg\-peer1$": ["multimaster.pull"]}))
    pm, peer = cluster.peer_minions[0], cluster.peers[0]
    service = MasterService([peer], mm_root / "dmg-service")
    service.configure(pm, peer)
    dropin = pathlib.Path(cluster.primary.config_file).parent / "master.d" / "multimaster.conf"
    dropin.parent.mkdir(exist_ok=True)
    dropin.write_text(json.dumps({"multimaster": {"peers": [pm.id]}}))
    cluster.start()
    assert cluster.wait_ping(cluster.primary, pm.id)
    with service:
        cluster.service = service
        cluster.count = 0
        cluster.twice = []
        yield cluster
    cluster.stop()


def _replica(cluster):
    """Whether the peer holds the primary's keys, roots and master keys."""
    primary, peer = cluster.primary, cluster.peers[0]
    for kind in ("file_roots", "pillar_roots"):
        if _tree(cluster.file_root(primary, kind=kind)) != _tree(
                cluster.file_root(peer, kind=kind)):
            return False
    mine, theirs = cluster.keys(primary), cluster.keys(peer)
    if any(mine[state] != theirs[state] for state in KEY_DIRS):
        return False
    return [p.read_bytes() for p in master_key_paths(primary.config["pki_dir"])] == [
        p.read_bytes() for p in master_key_paths(peer.config["pki_dir"])]


def _sync(cluster, *args):
    """``salt-run multimaster.sync`` as an operator runs it: (exit code, output)."""
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", *args, timeout=300)
    out = f"{ret.stdout}\n{ret.stderr}"
    assert "Traceback" not in out and "caused an exception" not in out, out
    return ret.returncode, out


def _change(cluster):
    """A new pending key and a new file on the primary, the previous ones removed."""
    cluster.count += 1
    n = cluster.count
    pre = cluster.pki_dir(cluster.primary) / "minions_pre"
    pre.mkdir(exist_ok=True)
    (pre / f"dmg-{n}").write_bytes(PUB)
    (pre / f"dmg-{n - 1}").unlink(missing_ok=True)
    root = cluster.file_root(cluster.primary)
    (root / f"dmg-{n}.sls").write_text(f"{n}\n")
    (root / f"dmg-{n - 1}.sls").unlink(missing_ok=True)


def _settled(cluster):
    """Once a restart of the peer's master a sync asked for is done (or none was asked)."""
    pm, peer = cluster.peer_minions[0], cluster.peers[0]
    opts = {"cachedir": pm.config["cachedir"]}
    assert wait_until(lambda: restart.pending(opts, "salt-master") == 0
                      and cluster.service.idle() and peer.is_running(), deadline=180)


def _converges(cluster, where, edited=False):
    """
    A change, a sync; a second one when the first failed: then a replica,
    exit 0.  ``edited``: the sync's drop-in on the peer cut short or emptied
    still loads, options removed there as an operator's edit would remove
    them: the first sync names it and keeps it (a change of the peer, issue
    33), the second is the ``force=True`` its report names.
    """
    _change(cluster)
    code, out = _sync(cluster)
    _settled(cluster)
    if code != 0 or not _replica(cluster):
        cluster.twice.append((where, out.strip().splitlines()[:3]))
        force = edited and "since its last sync" in out
        code, out = _sync(cluster, *(["force=True"] if force else []))
        _settled(cluster)
    if code != 0 or not _replica(cluster):
        print(f"{where}: exit {code}\n{out}")  # whole (pytest shortens an assertion's message)
    assert code == 0 and _replica(cluster), (where, out)


def _damage_in_turn(cluster, *sides):
    """
    Each state file of each side, each way (every file meets every damage
    of :data:`DAMAGES`), a sync after each round: a round damages up to
    four files of each side, each of them another way, and four rounds
    give each of those files every damage (a Latin square).  The test's
    cost is in its syncs: 24 rounds instead of one per file and damage
    (92, 3 minutes); the unit test (tests/unit/test_damage.py) damages
    one file at a time.
    """
    ways = len(DAMAGES)
    chunks = [[side[i:i + ways] for i in range(0, len(side), ways)] for side in sides]
    for group in itertools.zip_longest(*chunks, fillvalue=[]):
        for turn in range(ways):
            damaged, edited = [], False
            for files in group:
                for k, path in enumerate(files):
                    how = DAMAGES[(turn + k) % ways]
                    if not os.path.lexists(path) or path.is_dir():
                        continue  # a cache not written again
                    try:
                        damage(path, how)
                    except FileNotFoundError:
                        continue  # gone meanwhile: the engine remakes its socket
                    damaged.append(f"{how} {path}")
                    edited = edited or (how in ("truncated", "empty")
                                        and path.name == "multimaster-sync.conf")
            if damaged:
                _converges(cluster, ", ".join(damaged), edited)


def test_damaged_state_files_converge(cluster):
    _converges(cluster, "start")  # every state file there
    _converges(cluster, "start")
    pm, peer = cluster.peer_minions[0], cluster.peers[0]
    primary = state_files(pathlib.Path(cluster.primary.config["cachedir"]) / "multimaster")
    peer_master = pathlib.Path(peer.config["cachedir"]) / "multimaster"
    peer_side = state_files(pathlib.Path(pm.config["cachedir"]) / "multimaster", peer_master)
    peer_side.append(pathlib.Path(peer.config_file).parent / "master.d" / "multimaster-sync.conf")
    assert len(primary) >= 4 and len(peer_side) >= 5, (primary, peer_side)
    assert all(any(p.name == "state.sqlite" for p in side) for side in (primary, peer_side))
    _damage_in_turn(cluster, primary, peer_side)
    # what a killed apply leaves in the stage dir, damaged: a file for a
    # staging dir, a staging dir with a garbage journal and lock
    stage = peer_master / "stage"
    stage.mkdir(exist_ok=True)
    (stage / ".mm-stage-dmg1").write_bytes(os.urandom(64))
    (stage / ".mm-stage-dmg2").mkdir()
    (stage / ".mm-stage-dmg2" / "beside").write_bytes(os.urandom(64))
    (stage / ".mm-stage-dmg2.lock").write_bytes(os.urandom(64))
    _converges(cluster, "stage leftovers")
    assert not list(stage.glob(".mm-stage-dmg*")), list(stage.iterdir())
    # what needed a second sync, for the record
    print(f"{cluster.count} syncs of damage ({len(primary)} + {len(peer_side)} files), "
          f"{len(cluster.twice)} needed a second: {cluster.twice}")
