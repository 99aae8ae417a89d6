"""
Continuous replication (the ``multimaster_watch`` engine on the primary, its
journal as a trigger), on real daemons: a file saved in a root, a pillar
file, a key accepted and deleted with ``salt-key`` on the primary reach the
peer without anyone running ``multimaster.sync``; the peer serves the file
(``cp.get_file_str`` through the peer).  The peer master runs the engine
too (its journal), and, naming no peers, never syncs.  The primary runs the
formula's salt/key reactor as well, which leaves key events to the engine:
one sync per change, not two.
"""

import pathlib

import pytest

from tests.conftest import REPO
from tests.support.cluster import gen_keypair, pull_cluster, wait_until

pytestmark = pytest.mark.daemons

ENGINES = {"engines": [{"multimaster_watch": {"poll": 0.5}}]}

# the primary runs the formula's salt/key reactor too (the formula's default)
REACTOR = {"reactor": [{"salt/key": [str(REPO / "salt" / "multimaster" / "reactor" / "key.sls")]}]}

cluster = pull_cluster("cnt", master_overrides=ENGINES, primary_overrides=REACTOR)


def _syncs(cluster, master):
    """The syncs the engine of ``master`` started, from its log."""
    return cluster.log_since(master, 0).count("multimaster_watch: changes on this master: syncing")


def _engine_lines(cluster, master):
    """The lines of the engine of ``master`` in its log, for failures."""
    return "\n".join(line for line in cluster.log_since(master, 0).splitlines()
                     if "multimaster_watch" in line)[-6000:]


def _served(cluster, path):
    """What the peer serves at ``salt://<path>`` to its own host's minion (None: nothing)."""
    pm = cluster.peer_minions[0]
    ret = cluster.salt(cluster.peers[0], "cp.get_file_str", f"salt://{path}", minion_tgt=pm.id)
    return ret.data if ret.returncode == 0 and isinstance(ret.data, str) else None


def test_a_saved_file_is_served_by_the_peer_without_a_sync(cluster):
    primary, peer = cluster.primary, cluster.peers[0]
    socket = pathlib.Path(primary.config["cachedir"]) / "multimaster" / "watch.sock"
    assert wait_until(socket.is_socket, deadline=60)
    before = _syncs(cluster, primary)
    web = cluster.file_root(primary) / "web"
    web.mkdir(exist_ok=True)
    (web / "init.sls").write_text("web:\n  test.succeed_without_changes\n")
    (cluster.file_root(primary, kind="pillar_roots") / "web.sls").write_text("port: 8080\n")
    peer_web = cluster.file_root(peer) / "web" / "init.sls"
    assert wait_until(peer_web.is_file, deadline=60), _engine_lines(cluster, primary)
    assert wait_until(lambda: _served(cluster, "web/init.sls") ==
                      "web:\n  test.succeed_without_changes\n", deadline=30)
    peer_pillar = cluster.file_root(peer, kind="pillar_roots") / "web.sls"
    assert wait_until(lambda: peer_pillar.is_file() and peer_pillar.read_text() == "port: 8080\n",
                      deadline=60)
    # an edit in place, then a removal
    (web / "init.sls").write_text("web:\n  test.nop\n")
    assert wait_until(lambda: _served(cluster, "web/init.sls") == "web:\n  test.nop\n",
                      deadline=60)
    (web / "init.sls").unlink()
    assert wait_until(lambda: not peer_web.exists(), deadline=60)
    assert _syncs(cluster, primary) > before
    # the peer master's own engine keeps its journal and never syncs
    assert _syncs(cluster, peer) == 0


def test_keys_accepted_and_deleted_on_the_primary_reach_the_peer(cluster):
    primary, peer = cluster.primary, cluster.peers[0]
    pub = gen_keypair(2048)[1]
    (cluster.pki_dir(primary) / "minions_pre" / "cnt-new").write_bytes(pub)
    before = _syncs(cluster, primary)
    ret = cluster.salt_key(primary, "-a", "cnt-new", "-y")
    assert ret.returncode == 0, ret
    assert wait_until(lambda: cluster.keys(peer)["minions"].get("cnt-new") == pub.decode()
                      and "cnt-new" not in cluster.keys(peer)["minions_pre"], deadline=60)
    ret = cluster.salt_key(primary, "-d", "cnt-new", "-y")
    assert ret.returncode == 0, ret
    assert wait_until(lambda: all("cnt-new" not in ids for ids in cluster.keys(peer).values()),
                      deadline=60)
    # the reactor ran on both events and left them to the engine: one sync
    # per change, not one from each
    assert wait_until(lambda: len(cluster.job_records(
        primary, "runner.multimaster_reactor.key_event")) >= 2, deadline=30)
    assert _syncs(cluster, primary) - before >= 2
    assert "syncing the keys of" not in cluster.log_since(primary, 0)
    # the operator's sync, the full reconcile, finds the peer a replica
    ret = cluster.salt_run(primary, "multimaster.status")
    assert ret.returncode == 0, ret.stdout


def test_a_key_accepted_while_the_primary_was_down_reaches_the_peer_at_its_start(cluster):
    # salt-key works with the master stopped; nothing watched that change,
    # so the engine syncs every category when it starts
    primary, peer = cluster.primary, cluster.peers[0]
    pub = gen_keypair(2048)[1]
    (cluster.pki_dir(primary) / "minions_pre" / "cnt-offline").write_bytes(pub)
    primary.terminate()
    try:
        ret = cluster.salt_key(primary, "-a", "cnt-offline", "-y")
        assert ret.returncode == 0, ret
        assert (cluster.pki_dir(primary) / "minions" / "cnt-offline").is_file()
    finally:
        primary.start()
    assert wait_until(lambda: cluster.keys(peer)["minions"].get("cnt-offline") == pub.decode(),
                      deadline=120), _engine_lines(cluster, primary)
