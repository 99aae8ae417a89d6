"""
Topology ``signed`` (Salt's multi-master PKI): each master keeps its own
master.pem; the master_sign pair is shared and minions trust master_sign.pub.
"""

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
    own_priv, _ = master_key_paths(peer.config["pki_dir"])
    own_key = own_priv.read_bytes()
    ret = cluster.salt_run(primary, "multimaster.sync", "topology=signed", "inline_limit=10",
                           f"peers={cluster.peer_minions[0].id}",
                           "only=master_keys,minion_keys")
    assert ret.returncode == 0, ret.stdout
    res = ret.data[cluster.peer_minions[0].id]
    assert sorted(res["master_keys"]["updated"]) == ["master_sign.pem", "master_sign.pub"]
    # no peer_run on this primary: bulk went sealed in the publish, with a warning
    assert "peer_run" in res["warnings"][0]
    assert cluster.keys(peer)["minions"] == cluster.keys(primary)["minions"]
    ppki, pki = cluster.pki_dir(peer), cluster.pki_dir(primary)
    assert (ppki / "master_sign.pem").read_bytes() == (pki / "master_sign.pem").read_bytes()
    assert (ppki / "master_sign.pub").read_bytes() == (pki / "master_sign.pub").read_bytes()
    assert stat.S_IMODE((ppki / "master_sign.pem").stat().st_mode) == 0o400
    assert own_priv.read_bytes() == own_key
    assert cluster.master_fingerprint(peer) != cluster.master_fingerprint(primary)
    cluster.restart(peer)
    assert cluster.wait_ping(peer, cluster.minions[0].id, deadline=120)
