"""
What a sync may write on a peer, against real daemons: only inside the roots
the peer is configured with.

The peer's ``file_roots:base`` has two roots; the tests run in order.
"""

import os
import pathlib

import pytest
import salt.utils.yaml

pytestmark = pytest.mark.daemons


def _dropin(master, name, values):
    path = pathlib.Path(master.config_file).parent / "master.d" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(salt.utils.yaml.safe_dump(values))


@pytest.fixture(scope="module")
def cluster(cluster_factory):
    cluster = cluster_factory("cnf", peers=1, minions=0)
    peer = cluster.peers[0]
    root1 = pathlib.Path(peer.config["file_roots"]["base"][0])
    root2 = root1.parent / "second-root"
    root2.mkdir(parents=True, exist_ok=True)
    _dropin(peer, "roots.conf", {"file_roots": {"base": [str(root1), str(root2)]}})
    _dropin(cluster.primary, "multimaster.conf",
            {"multimaster": {"peers": [cluster.peer_minions[0].id]}})
    cluster.start()
    assert cluster.wait_ping(cluster.primary, cluster.peer_minions[0].id)
    cluster.roots = (root1, root2)
    yield cluster
    cluster.stop()


def test_a_symlinked_dir_in_a_second_root_is_never_written_through(cluster):
    base = cluster.file_root(cluster.primary)
    (base / "alt").mkdir()
    (base / "alt" / "y.sls").write_text("from the primary\n")
    (base / "fine.sls").write_text("fine: {}\n")
    root1, root2 = cluster.roots
    elsewhere = root1.parent / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "y.sls").write_text("not the sync's to touch\n")
    os.symlink(str(elsewhere), root2 / "alt")
    peer_id = cluster.peer_minions[0].id

    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=file_roots")
    assert ret.returncode != 0, ret.stdout
    res = ret.data[peer_id]
    assert res["result"] is False
    rep = res["file_roots"]
    assert [e for e in rep["errors"] if e.startswith("base:alt/y.sls: ")
            and "outside" in e and str(root2) in e], rep["errors"]
    assert "base:alt/y.sls" not in rep["added"] + rep["updated"]
    assert rep["added"] == ["base:fine.sls"]
    # nothing written outside the roots, nor in the first root instead
    assert (elsewhere / "y.sls").read_text() == "not the sync's to touch\n"
    assert sorted(os.listdir(elsewhere)) == ["y.sls"]
    assert not (root1 / "alt").exists()
    assert (root1 / "fine.sls").read_text() == "fine: {}\n"
