"""
What a sync may write on a peer, against real daemons: only inside the roots
the peer is configured with, and never a setuid, setgid, sticky or
world-writable file.

The peer's ``file_roots:base`` has two roots; each test removes the
faults it planted.
"""

import os
import pathlib
import shutil
import stat

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


def _mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_dropped_mode_bits_are_never_written_and_are_reported(cluster):
    base = cluster.file_root(cluster.primary)
    (base / "suid.sh").write_text("#!/bin/sh\nid\n")
    os.chown(base / "suid.sh", 65534, 65534)
    os.chmod(base / "suid.sh", 0o4755)
    (base / "shared.sls").write_text("shared: {}\n")
    os.chmod(base / "shared.sls", 0o666)
    (base / "plain.sls").write_text("plain: {}\n")
    os.chmod(base / "plain.sls", 0o640)
    peer_id = cluster.peer_minions[0].id
    root1, _ = cluster.roots

    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=file_roots", "test=True")
    assert ret.returncode == 0, ret.stdout
    planned = ret.data[peer_id]["file_roots"]
    assert sorted(planned["added"]) == ["base:plain.sls", "base:shared.sls", "base:suid.sh"]
    assert planned["warnings"] == [
        "base:shared.sls: mode 0666 on the primary, written as 0664 "
        "(a peer never gets a world-writable file)",
        "base:suid.sh: mode 4755 on the primary, written as 0755 "
        "(a peer never gets a setuid file)",
    ]
    assert not (root1 / "suid.sh").exists()

    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=file_roots")
    assert ret.returncode == 0, ret.stdout
    res = ret.data[peer_id]
    assert res["result"] is True, res
    assert res["file_roots"]["warnings"] == planned["warnings"]
    assert "mode 4755 on the primary, written as 0755" in ret.stdout
    assert _mode(root1 / "suid.sh") == 0o755
    assert (root1 / "suid.sh").read_text() == "#!/bin/sh\nid\n"
    assert _mode(root1 / "shared.sls") == 0o664
    assert _mode(root1 / "plain.sls") == 0o640

    # the dropped bits are the only difference left: nothing to write again
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=file_roots")
    assert ret.returncode == 0, ret.stdout
    again = ret.data[peer_id]["file_roots"]
    assert again["added"] == again["updated"] == again["removed"] == [], again
    assert "warnings" not in again
    ret = cluster.salt_run(cluster.primary, "multimaster.status")
    assert ret.data[peer_id]["drift"]["file_roots"] == {
        "added": 0, "updated": 0, "removed": 0, "conflicts": 0}


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
    try:
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
    finally:
        # the faults go: the next test's syncs must not meet them
        (root2 / "alt").unlink()
        shutil.rmtree(base / "alt")
        shutil.rmtree(elsewhere)
