"""
Peer-host minions are first-class (docs/layout.rst): every minion, the peer
hosts' own minions included, lists every master.  Two fresh peers sharing
the primary's master key but holding no minion key: after one
``multimaster.sync`` from the primary, every peer answers for every minion
(a peer manages the other masters' hosts too) and the fleet audit run on a
peer finds every minion and nothing wrong.
"""

import pathlib

import pytest
import salt.utils.yaml

pytestmark = pytest.mark.daemons


@pytest.fixture(scope="module")
def cluster(cluster_factory):
    cluster = cluster_factory(
        "phs", peers=2, minions=1, share_master_keys=True, accept_on_peers=False,
        minion_overrides={"master_alive_interval": 10},
    )
    dropin = pathlib.Path(cluster.primary.config_file).parent / "master.d" / "multimaster.conf"
    dropin.parent.mkdir(exist_ok=True)
    dropin.write_text(salt.utils.yaml.safe_dump(
        {"multimaster": {"peers": [m.id for m in cluster.peer_minions]}}))

    def pillar(started):
        # on the primary only: the sync carries it to the peers
        started.write_contract_pillar(
            started.primary, "*", [m.config["interface"] for m in started.masters],
            started.master_fingerprint(started.primary))

    yield from cluster.running(before_minions=pillar)


@pytest.fixture(scope="module")
def synced(cluster):
    """One sync from the primary: the peers get every minion key and the pillar."""
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "--out=json")
    assert ret.returncode == 0, ret.stdout
    for pm in cluster.peer_minions:
        assert ret.data[pm.id]["result"] is True, ret.data[pm.id]
        added = ret.data[pm.id]["minion_keys"]["added"]
        assert {f"minions/{m.id}" for m in cluster.all_minions} <= set(added), added
    for peer in cluster.peers:
        assert sorted(cluster.keys(peer)["minions"]) == sorted(
            m.id for m in cluster.all_minions)
        for minion in cluster.all_minions:
            # the minion signs in to the peer on its next retry
            assert cluster.wait_ping(peer, minion.id), (peer.id, minion.id)
    return cluster


def test_peer_host_minions_list_every_master(cluster):
    """What the layout asks of a peer host's minion: every master, primary first."""
    masters = [m.config["interface"] for m in cluster.masters]
    for pm, peer in zip(cluster.peer_minions, cluster.peers):
        # in a job, the option is the one master the job came from: read the files
        ret = cluster.salt_call(pm, "--local", "config.get", "master")
        assert ret.returncode == 0, ret
        assert ret.data == masters
        ret = cluster.salt(cluster.primary, "config.get", "multimaster.master_config",
                           minion_tgt=pm.id)
        assert ret.data == str(peer.config_file)


def test_every_minion_answers_every_peer(synced):
    cluster = synced
    everyone = {m.id: True for m in cluster.all_minions}
    for peer in cluster.peers:
        ret = cluster.salt(peer, "test.ping", minion_tgt="*")
        assert ret.returncode == 0, ret
        assert ret.data == everyone, (peer.id, ret.data)


def test_fleet_audit_through_a_peer_is_clean(synced):
    cluster = synced
    everyone = sorted(m.id for m in cluster.all_minions)
    for peer in cluster.peers:
        ret = cluster.salt_run(peer, "multimaster.audit", "--out=json")
        assert ret.returncode == 0, ret.stdout
        data = ret.data
        assert data["master"] == peer.id
        assert data["missing"] == [] and data["failed"] == [], data
        assert "no_return" not in data["totals"], data["totals"]
        assert sorted(data["minions"]) == everyone
        assert data["counts"]["returned"] == len(everyone), data["counts"]
        for minion_id, entry in data["minions"].items():
            assert entry["ok"] is True, (minion_id, entry)
            assert entry["masters"] == [m.config["interface"] for m in cluster.masters]
            # compared with the pillar the sync carried (without it: an info
            # finding "no expected master list")
            assert [f for f in entry["findings"] if f["check"] == "master_list"] == [], entry
            assert [f for f in entry["findings"] if f["severity"] != "info"] == [], entry
        assert data["result"] is True and data["retcode"] == 0
