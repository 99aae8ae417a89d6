"""
The harness and the manual baseline of the seeds: two masters set up by hand
(the primary's keypair copied before the peer first starts, every minion key,
the peer host's own minion's included, accepted on both), and the pip
install path of the extension.
"""

import pytest

pytestmark = pytest.mark.daemons


@pytest.fixture(scope="module")
def cluster(cluster_factory):
    cluster = cluster_factory("fnd", peers=1, minions=1, share_master_keys=True)
    cluster.start()
    yield cluster
    cluster.stop()


def test_master_keys_shared_by_hand(cluster):
    primary, peer = cluster.primary, cluster.peers[0]
    assert cluster.master_fingerprint(primary) == cluster.master_fingerprint(peer)


def test_minion_answers_from_either_master(cluster):
    minion = cluster.minions[0].id
    assert cluster.wait_ping(cluster.primary, minion)
    assert cluster.wait_ping(cluster.peers[0], minion)


def test_peer_minion_answers_every_master(cluster):
    """The supported layout: a peer host's minion lists every master (docs/layout.rst)."""
    peer_minion = cluster.peer_minions[0].id
    assert cluster.wait_ping(cluster.primary, peer_minion)
    assert cluster.wait_ping(cluster.peers[0], peer_minion)


def test_pip_path_loads_runner_and_module(cluster, pip_site):
    ret = cluster.salt_run(cluster.primary, "multimaster.version")
    assert ret.returncode == 0, ret
    assert ret.data["runner"].startswith(str(pip_site))
    minion = cluster.minions[0].id
    ret = cluster.salt(cluster.primary, "multimaster.version", minion_tgt=minion)
    assert ret.returncode == 0, ret
    assert ret.data["module"].startswith(str(pip_site))
    ret = cluster.salt(cluster.primary, "sys.list_state_modules", "multimaster",
                       minion_tgt=minion)
    assert ret.returncode == 0, ret
    assert ret.data == ["multimaster"], ret


def test_sys_doc_shows_docstrings(cluster):
    # Salt has no runner named sys.doc: runner docs come from doc.runner / salt-run -d
    ret = cluster.salt_run(cluster.primary, "doc.runner")
    assert "CLI Example" in ret.data["multimaster.version"], ret
    ret = cluster.salt_run(cluster.primary, "-d", "multimaster")
    assert "CLI Example" in ret.stdout, ret
    ret = cluster.salt(cluster.primary, "sys.doc", "multimaster",
                       minion_tgt=cluster.minions[0].id)
    assert "CLI Example" in ret.data["multimaster.version"]


def test_minion_still_answers_through_peer_when_primary_stops(cluster):
    minion = cluster.minions[0].id
    cluster.primary.terminate()
    try:
        assert cluster.wait_ping(cluster.peers[0], minion, deadline=60)
    finally:
        cluster.primary.start()
    # as the next test finds it: every minion answering the primary again
    assert cluster.wait_pings(cluster.primary, cluster.all_minions)
