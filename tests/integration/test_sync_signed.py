"""
Topology ``signed`` (Salt's multi-master PKI): each master keeps its own
master.pem; the master_sign pair is shared and minions trust master_sign.pub.
"""

import os
import pathlib
import shutil
import stat

import pytest

from tests.support.cluster import master_key_paths

pytestmark = pytest.mark.daemons


def _trust_primary_sign_key(cluster):
    sign_pub = cluster.pki_dir(cluster.primary) / "master_sign.pub"
    for minion in cluster.all_minions:
        pki = pathlib.Path(minion.config["pki_dir"])
        pki.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(sign_pub, pki / "master_sign.pub")


@pytest.fixture(scope="module")
def cluster(cluster_factory):
    cluster = cluster_factory(
        "sig",
        peers=1,
        minions=1,
        share_master_keys=False,
        accept_on_peers=False,
        master_overrides={"master_sign_pubkey": True},
        minion_overrides={"verify_master_pubkey_sign": True},
    )
    # only peers listed in multimaster:peers are synced
    dropin = pathlib.Path(cluster.primary.config_file).parent / "master.d" / "multimaster.conf"
    dropin.parent.mkdir(exist_ok=True)
    dropin.write_text(f"multimaster:\n  peers: [{cluster.peer_minions[0].id}]\n")
    cluster.start(before_minions=_trust_primary_sign_key)
    yield cluster
    cluster.stop()


def test_signed_sync_shares_the_sign_pair_and_keeps_own_master_key(cluster):
    primary, peer = cluster.primary, cluster.peers[0]
    pm = cluster.peer_minions[0]
    own_priv, _ = master_key_paths(peer.config["pki_dir"])
    own_key = own_priv.read_bytes()
    ppki, pki = cluster.pki_dir(peer), cluster.pki_dir(primary)
    args = ("multimaster.sync", "topology=signed", f"peers={pm.id}", "only=master_keys,minion_keys")
    # no peer_run on this primary: past inline_limit nothing is published,
    # the sync is refused with the grant to add, nothing is written
    ret = cluster.salt_run(primary, *args, "inline_limit=10")
    assert ret.returncode != 0, ret.stdout
    res = ret.data[pm.id]
    assert res["result"] is False and "peer_run:" in res["error"], res
    assert sorted(res["master_keys"]["unconfirmed"]) == ["master_sign.pem", "master_sign.pub"]
    # the peer keeps the sign pair it generated itself
    assert (ppki / "master_sign.pem").read_bytes() != (pki / "master_sign.pem").read_bytes()
    # a small delta rides the publish, sealed to the peer; the peer's master
    # must restart to load the new sign pair (no systemd here): said, and
    # the exit code alerts
    ret = cluster.salt_run(primary, *args)
    assert ret.returncode != 0, ret.stdout
    res = ret.data[pm.id]
    assert res["restart"] == "restart_required" and "must restart" in res["error"], res
    assert sorted(res["master_keys"]["updated"]) == ["master_sign.pem", "master_sign.pub"]
    assert cluster.keys(peer)["minions"] == cluster.keys(primary)["minions"]
    assert (ppki / "master_sign.pem").read_bytes() == (pki / "master_sign.pem").read_bytes()
    assert (ppki / "master_sign.pub").read_bytes() == (pki / "master_sign.pub").read_bytes()
    assert stat.S_IMODE((ppki / "master_sign.pem").stat().st_mode) == 0o400
    assert own_priv.read_bytes() == own_key
    assert cluster.master_fingerprint(peer) != cluster.master_fingerprint(primary)
    cluster.restart(peer)
    assert cluster.wait_ping(peer, cluster.minions[0].id, deadline=120)
    ret = cluster.salt_run(primary, *args)
    assert ret.returncode == 0, ret.stdout


def test_no_signing_key_material_outside_pki_dirs(cluster):
    """
    master_sign.pem (and each master's own master.pem) appears in no job
    cache, publish, event log or cachedir of any daemon: only in pki dirs.
    """
    pki_dirs = {os.path.realpath(d.config["pki_dir"]) for d in [*cluster.masters, *cluster.all_minions]}
    needles = []
    for path in (cluster.pki_dir(cluster.primary) / "master_sign.pem",
                 master_key_paths(cluster.primary.config["pki_dir"])[0]):
        lines = [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("-----")]
        needles += [ln.encode() for ln in lines[1:-1]]
    hits = []
    for daemon in [*cluster.masters, *cluster.all_minions]:
        for dirpath, _, files in os.walk(os.path.realpath(daemon.config["root_dir"])):
            if any(dirpath == p or dirpath.startswith(p + os.sep) for p in pki_dirs):
                continue
            for name in files:
                try:
                    data = open(os.path.join(dirpath, name), "rb").read()
                except OSError:
                    continue
                if any(n in data for n in needles):
                    hits.append(os.path.join(dirpath, name))
    assert hits == []
