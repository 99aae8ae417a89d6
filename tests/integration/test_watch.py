"""
The change journal engine (``multimaster_watch``) on the primary and on the
peer master: a sync lists only the directories that changed and is as right
as a full read, a key rewritten in place included (which the key dirs'
stamps alone do not show); with the engine gone, a sync reads everything.
"""

import os
import pathlib
import re
import signal
import stat
import time

import pytest

from tests.support.cluster import gen_keypair, pull_cluster

pytestmark = pytest.mark.daemons

# the journal only: the syncs are the tests' own (continuous replication:
# test_continuous.py)
ENGINES = {"engines": [{"multimaster_watch": {"poll": 0.2, "replicate": False}}]}
# what the journal serves (the master keys are shared, the config would
# make the peer restart)
ONLY = "only=minion_keys,file_roots,pillar_roots"


# _unlisted reads a debug message of the scans
cluster = pull_cluster("wat", master_overrides=ENGINES, log_level="debug")


def _socket(master):
    return pathlib.Path(master.config["cachedir"]) / "multimaster" / "watch.sock"


def _wait_for(check, timeout=60):
    end = time.time() + timeout
    while time.time() < end:
        if check():
            return True
        time.sleep(0.2)
    return False


def _sync(cluster, *args):
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", ONLY, *args)
    assert ret.returncode == 0, ret
    return ret.data[cluster.peer_minions[0].id]


def _unlisted(cluster, daemon, since):
    """The 'N director(ies) unlisted' of the file_roots scans logged after ``since`` (an offset)."""
    text = cluster.log_since(daemon, since)
    return [int(n) for n in re.findall(r"file_roots read at journal token \d+, (\d+) director",
                                       text)]


def _tree(master):
    base = pathlib.Path(master.config["file_roots"]["base"][0])
    return {str(p.relative_to(base)): (p.read_bytes(), p.stat().st_mode & 0o7777)
            for p in base.rglob("*") if p.is_file()}


def test_a_sync_lists_only_what_changed_and_holds_the_peer_as_a_replica(cluster):
    primary, peer = cluster.primary, cluster.peers[0]
    assert _wait_for(lambda: _socket(primary).is_socket() and _socket(peer).is_socket())
    for master in (primary, peer):  # reached by the master's user only
        assert stat.S_IMODE(_socket(master).stat().st_mode) == 0o600
        assert stat.S_IMODE(_socket(master).parent.stat().st_mode) == 0o700
    base = cluster.file_root(primary)
    for d in range(6):
        (base / f"d{d}" / "sub").mkdir(parents=True, exist_ok=True)
        for f in range(5):
            (base / f"d{d}" / "sub" / f"f{f}.sls").write_text(f"{d} {f}\n")
    pki = pathlib.Path(primary.config["pki_dir"])
    (pki / "minions" / "wat-a").write_bytes(gen_keypair(2048)[1])
    _sync(cluster)  # the first read with the engine: everything, recorded
    _sync(cluster)
    assert cluster.keys(peer)["minions"]["wat-a"] == cluster.keys(primary)["minions"]["wat-a"]

    # in place, nested; a new directory; a file removed; a mode changed; a
    # key added, and a key rewritten in place (same name, same dir mtime)
    primary_log, peer_log = cluster.log_size(primary), cluster.log_size(peer_minion(cluster))
    with open(base / "d1" / "sub" / "f1.sls", "r+b") as fh:
        fh.write(b"X")
    (base / "new" / "deeper").mkdir(parents=True)
    (base / "new" / "deeper" / "n.sls").write_text("n\n")
    (base / "d2" / "sub" / "f2.sls").unlink()
    (base / "d3" / "sub" / "f3.sls").chmod(0o600)
    (pki / "minions" / "wat-b").write_bytes(gen_keypair(2048)[1])
    res = _sync(cluster)
    assert res["result"] is True, res
    assert sorted(res["file_roots"]["updated"]) == ["base:d1/sub/f1.sls", "base:d3/sub/f3.sls"]
    assert res["file_roots"]["added"] == ["base:new/deeper/n.sls"]
    assert res["file_roots"]["removed"] == ["base:d2/sub/f2.sls"]
    assert _tree(peer) == _tree(primary)
    assert cluster.keys(peer)["minions"] == cluster.keys(primary)["minions"]
    # most directories were taken from the last read, on both sides
    assert _unlisted(cluster, primary, primary_log) and min(
        _unlisted(cluster, primary, primary_log)) >= 6
    assert _unlisted(cluster, peer_minion(cluster), peer_log)


def test_a_key_rewritten_in_place_is_found_at_once(cluster):
    """
    A key file rewritten in place leaves its dir's mtime as it was: the key
    dirs' stamps alone miss it until the dir next changes or ``rescan``
    (tests/integration/test_sync.py); the journal names it, so the very
    next sync finds another key for an id the peer holds: a conflict, as
    always, replaced with ``force=True``.
    """
    primary, peer = cluster.primary, cluster.peers[0]
    pki = pathlib.Path(primary.config["pki_dir"])
    key = pki / "minions" / "wat-a"
    if not key.exists():
        key.write_bytes(gen_keypair(2048)[1])
    _sync(cluster)
    time.sleep(0.1)  # the dir's stamp settled before the rewrite
    before = (pki / "minions").stat()
    with open(key, "r+b") as fh:
        fh.write(gen_keypair(2048)[1])
        fh.truncate()
    os.utime(pki / "minions", ns=(before.st_atime_ns, before.st_mtime_ns))
    ret = cluster.salt_run(primary, "multimaster.sync", ONLY)
    res = ret.data[cluster.peer_minions[0].id]
    assert ret.returncode == 1, ret
    assert [c.split(":")[0] for c in res["minion_keys"]["conflicts"]] == ["minions/wat-a"], res
    res = _sync(cluster, "force=True")
    assert res["minion_keys"]["updated"] == ["minions/wat-a"], res
    assert cluster.keys(peer)["minions"]["wat-a"] == key.read_text()


def peer_minion(cluster):
    return cluster.peer_minions[0]


def test_without_the_engine_a_sync_reads_everything(cluster):
    """
    The primary's engine killed: Salt restarts it in a new session, whose
    journal does not vouch for anything before it; a change made while it
    was down is replicated all the same.
    """
    primary, peer = cluster.primary, cluster.peers[0]
    base = cluster.file_root(primary)
    sock = _socket(primary)
    assert _wait_for(sock.is_socket)
    engine = _serving(sock)
    assert len(engine) == 1, engine
    for pid in engine:
        os.kill(pid, signal.SIGKILL)
    with open(base / "d4" / "sub" / "f4.sls", "r+b") as fh:
        fh.write(b"Y")
    log = cluster.log_size(primary)
    res = _sync(cluster)
    assert res["file_roots"]["updated"] == ["base:d4/sub/f4.sls"], res
    assert _tree(peer) == _tree(primary)
    # nothing taken from the last read (no journal, or a new session's)
    assert not any(_unlisted(cluster, primary, log))
    # Salt restarts the engine; the next syncs use it again
    assert _wait_for(lambda: sock.is_socket() and _serving(sock) not in ([], engine), 120)
    _sync(cluster)
    log = cluster.log_size(primary)
    (base / "d5" / "sub" / "f0.sls").write_text("after the restart\n")
    res = _sync(cluster)
    assert res["file_roots"]["updated"] == ["base:d5/sub/f0.sls"], res
    assert _tree(peer) == _tree(primary)
    assert min(_unlisted(cluster, primary, log)) >= 6


def _serving(sock):
    """The pids of the processes listening on the unix socket ``sock`` (its engine)."""
    inodes = set()
    with open("/proc/net/unix", encoding="utf-8") as fh:
        for line in fh.readlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[7] == str(sock):
                inodes.add(f"socket:[{fields[6]}]")
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:
            continue
        if links & inodes:
            pids.append(int(pid))
    return pids
