"""
A peer master restarted without systemd (issue 35), against real daemons:
one primary, one fresh peer with its own master key, a minion of both.

The peer host's salt-minion names its master's restart command in the
option ``multimaster.master_restart_cmd`` (here the sandbox's stand-in for
a service manager, ``tests.support.service``):

- a sync of new master keys restarts the peer's salt-master through it
  (``result: True``, exit 0) and the peer then serves the primary's key:
  the minion answers through it;
- a command whose program is not installed is refused before anything is
  written (test=True predicts it).
"""

import json
import pathlib

import pytest

from tests.support.cluster import gen_keypair, master_key_paths, wait_until
from tests.support.service import MasterService

pytestmark = pytest.mark.daemons


@pytest.fixture(scope="module")
def cluster(cluster_factory, mm_root):
    cluster = cluster_factory(
        "mrs", peers=1, minions=1, share_master_keys=False, accept_on_peers=False,
        primary_overrides={"peer_run": {"mrs-peer.*": ["multimaster.pull"]}})
    pm, peer = cluster.peer_minions[0], cluster.peers[0]
    service = MasterService([peer], mm_root / "mrs-service")
    service.configure(pm, peer)  # the operator's setting, on the peer host's minion
    dropin = pathlib.Path(cluster.primary.config_file).parent / "master.d" / "multimaster.conf"
    dropin.parent.mkdir(exist_ok=True)
    dropin.write_text(json.dumps({"multimaster": {"peers": [pm.id]}}))
    cluster.start()
    for minion in cluster.all_minions:
        assert cluster.wait_ping(cluster.primary, minion.id)
    with service:
        cluster.service = service
        yield cluster
    cluster.stop()


def _state(daemon):
    return pathlib.Path(daemon.config["cachedir"]) / "multimaster"


def _peer_keys(cluster):
    return [p.read_bytes() for p in master_key_paths(cluster.peers[0].config["pki_dir"])]


def _own_key_on_disk(cluster):
    """The peer holds a master key of its own on disk (a fresh peer's, or a new one)."""
    primary = [p.read_bytes() for p in master_key_paths(cluster.primary.config["pki_dir"])]
    if _peer_keys(cluster) == primary:
        priv, pub = gen_keypair(2048)
        pem, pubfile = master_key_paths(cluster.peers[0].config["pki_dir"])
        pem.chmod(0o600)
        pem.write_bytes(priv)
        pem.chmod(0o400)
        pubfile.write_bytes(pub)
    assert _peer_keys(cluster) != primary


def _sync(cluster, *args):
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", *args, "--out=json")
    assert isinstance(ret.data, dict), ret
    return ret, ret.data[cluster.peer_minions[0].id]


def test_missing_restart_program_is_refused_before_anything_is_written(cluster):
    peer, pm = cluster.peers[0], cluster.peer_minions[0]
    _own_key_on_disk(cluster)
    cluster.service.uninstall(peer)
    try:
        keys = _peer_keys(cluster)
        marker = _state(pm) / "restart-needed"
        before = marker.read_bytes() if marker.exists() else None
        missing = cluster.service.command(peer)
        for test in ("test=True", "test=False"):
            ret, res = _sync(cluster, "only=master_keys", test)
            assert ret.returncode != 0, ret
            assert res["result"] is False, res
            errors = res["master_keys"]["errors"]
            assert sorted(e.split(":", 1)[0] for e in errors) == ["master.pem", "master.pub"], res
            for error in errors:
                assert f"the restart command {missing!r} cannot run: {missing!r} not found" \
                    in error, error
                assert "nothing written: fix the option multimaster.master_restart_cmd" \
                    in error, error
            assert res["master_keys"]["added"] == res["master_keys"]["updated"] == [], res
            assert "restart" not in res, res
            assert "Traceback" not in ret.stdout + ret.stderr
        # nothing written, no restart asked for
        assert _peer_keys(cluster) == keys
        assert (marker.read_bytes() if marker.exists() else None) == before
    finally:
        cluster.service.install(peer)


def test_sync_restarts_the_peer_master_through_the_configured_command(cluster):
    peer, pm, minion = cluster.peers[0], cluster.peer_minions[0], cluster.minions[0]
    _own_key_on_disk(cluster)
    restarts = len(cluster.service.restarts)
    ret, res = _sync(cluster, "test=True")
    assert res["restart"] == "would restart", res
    ret, res = _sync(cluster)
    assert ret.returncode == 0, ret
    assert res["result"] is True and res["restart"] == "restarting", res
    assert sorted(res["master_keys"]["updated"] + res["master_keys"]["added"]) == [
        "master.pem", "master.pub"], res
    # the command ran after the job returned: the stand-in restarted the master
    assert wait_until(lambda: len(cluster.service.restarts) > restarts, deadline=120)
    status = _state(pm) / "restart-salt-master.status"
    assert wait_until(status.exists, deadline=60) and status.read_text().strip() == "0"

    def replica():
        got = cluster.salt_run(cluster.primary, "multimaster.status", "--out=json")
        row = (got.data or {}).get(pm.id) if isinstance(got.data, dict) else None
        return got.returncode == 0 and isinstance(row, dict) and row["in_sync"] \
            and row["restart_pending"] is False

    assert wait_until(replica, deadline=120)
    # it serves the primary's key: the minion, which trusts it, answers through the peer
    assert cluster.wait_ping(peer, minion.id, deadline=120)
    ret, res = _sync(cluster)
    assert ret.returncode == 0 and res["result"] is True and "restart" not in res, res
