"""
Faults on real daemons (issue 14): a peer's minion killed mid-apply, a
``salt-run`` killed mid-sync, two syncs at once, sources damaged on the
primary, files changed behind the stat cache.  One primary, one peer.

The tests of this module run in order on one cluster; each starts from a
peer in step with the primary.
"""

import json
import os
import pathlib
import signal
import sqlite3
import subprocess
import time

import psutil
import pytest

from tests.support.cluster import PULL_PRIMARY, gen_keypair, log_tail, wait_until

pytestmark = pytest.mark.daemons

ONLY = "only=minion_keys,file_roots,pillar_roots"


@pytest.fixture(scope="module")
def cluster(cluster_factory):
    cluster = cluster_factory(
        "flt",
        peers=1,
        minions=0,
        # Salt's default request workers: the pulls hold them (PULL_PRIMARY)
        primary_overrides=dict(PULL_PRIMARY, peer_run={"flt-peer.*": ["multimaster.pull"]}),
    )
    pm = cluster.peer_minions[0]
    dropin = pathlib.Path(cluster.primary.config_file).parent / "master.d" / "multimaster.conf"
    dropin.parent.mkdir(exist_ok=True)
    dropin.write_text(json.dumps({"multimaster": {"peers": [pm.id]}}))
    cluster.start()
    assert cluster.wait_ping(cluster.primary, pm.id)
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", ONLY)
    assert ret.returncode == 0, ret
    yield cluster
    cluster.stop()


# ----- helpers ---------------------------------------------------------------
PUB = gen_keypair(1024)[1]


def _plant_bulk(cluster, tag, files=2000, keys=2000, size=20000):
    """A large delta: ``keys`` rejected keys and ``files`` file_roots files."""
    pki = cluster.pki_dir(cluster.primary) / "minions_rejected"
    pki.mkdir(exist_ok=True)
    for i in range(keys):
        (pki / f"{tag}-{i:05d}").write_bytes(PUB)
    base = cluster.file_root(cluster.primary) / tag
    base.mkdir()
    for i in range(files):
        (base / f"{i:05d}").write_bytes(os.urandom(size // 2).hex().encode())


def _start_sync(cluster, *args):
    """``salt-run multimaster.sync`` in the background, in its own process group."""
    cli = cluster.primary.salt_run_cli(timeout=600)
    cmd = cli.cmdline("multimaster.sync", *args)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, env=dict(os.environ))


def _finish(proc, timeout=600):
    out, err = proc.communicate(timeout=timeout)
    try:
        data = json.loads(out)
    except ValueError:
        data = None
    return proc.returncode, data, out, err


def _kill_tree(pid):
    """SIGKILL ``pid`` and every process under it, children first."""
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = root.children(recursive=True) + [root]
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def _state_dir(daemon):
    return pathlib.Path(daemon.config["cachedir"]) / "multimaster"


def _stage_leftovers(cluster):
    """Every ``.mm-stage-*`` path under the peer's pki_dir and roots."""
    peer = cluster.peers[0]
    tops = [cluster.pki_dir(peer)]
    for kind in ("file_roots", "pillar_roots"):
        for roots in peer.config[kind].values():
            tops.extend(pathlib.Path(r) for r in roots)
    found = []
    for top in tops:
        for dirpath, dirs, files in os.walk(top):
            found.extend(os.path.join(dirpath, n) for n in dirs + files if n.startswith(".mm-"))
    return found


def _staged_anywhere(cluster):
    """True once the peer's apply has staged a file (in its stage dir, or beside a destination)."""
    stage = _state_dir(cluster.peers[0]) / "stage"
    if stage.is_dir():
        for dirpath, _, files in os.walk(stage):
            if dirpath != str(stage) and files:
                return True
    return any(os.path.isdir(p) and os.listdir(p) for p in _stage_leftovers(cluster))


def _failed(cluster, out, err):
    """A failed sync's output with the primary's and the peer minion's log tails (a string)."""
    if isinstance(out, bytes):
        out, err = out.decode(errors="replace"), err.decode(errors="replace")
    try:
        data = json.loads(out)
    except ValueError:
        data = None
    if isinstance(data, dict):
        # the lists of a bulk sync run to thousands of names: their lengths
        out = json.dumps({pid: {k: ({kind: len(v) if isinstance(v, list) else v
                                    for kind, v in val.items()} if isinstance(val, dict) else val)
                                for k, val in rep.items()} if isinstance(rep, dict) else rep
                          for pid, rep in data.items()}, indent=1)
    return "\n".join([out[-6000:], err[-3000:], "primary log:", *log_tail(cluster.primary),
                      "peer minion log:", *log_tail(cluster.peer_minions[0])])


def _in_step(cluster):
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", ONLY)
    assert ret.returncode == 0, _failed(cluster, ret.stdout, ret.stderr)
    assert cluster.keys(cluster.peers[0]) == cluster.keys(cluster.primary)
    return ret


# ----- item 1: staging of a peer minion killed mid-apply ----------------------
def test_peer_minion_killed_mid_apply_leaves_nothing_served_or_behind(cluster):
    pm, peer = cluster.peer_minions[0], cluster.peers[0]
    _plant_bulk(cluster, "stg")
    proc = _start_sync(cluster, ONLY)
    try:
        assert wait_until(lambda: _staged_anywhere(cluster), deadline=240, step=0.05), \
            "the peer never staged anything"
        _kill_tree(pm.pid)
    finally:
        _kill_tree(proc.pid)
        proc.communicate()
    # nothing half-synced where the peer master serves files or reads keys
    assert _stage_leftovers(cluster) == []
    listed = cluster.salt_run(peer, "fileserver.file_list")
    assert listed.returncode == 0, listed
    assert not [f for f in listed.data if ".mm-" in f], listed.data
    assert not (cluster.file_root(peer) / "stg" / "00000").exists()  # never committed
    stage = _state_dir(peer) / "stage"
    assert [n for n in os.listdir(stage) if not n.endswith(".lock")], "no stale batch to clean"
    pm.terminate()
    pm.start()
    assert cluster.wait_ping(cluster.primary, pm.id)
    ret = _in_step(cluster)
    assert len(ret.data[pm.id]["file_roots"]["added"]) == 2000, ret.data[pm.id]
    # the next apply removed what the killed one staged
    assert os.listdir(stage) == []
    assert _stage_leftovers(cluster) == []
    assert (cluster.file_root(peer) / "stg" / "01999").read_bytes() == \
        (cluster.file_root(cluster.primary) / "stg" / "01999").read_bytes()


# ----- item 6: grants of a killed salt-run ------------------------------------
def test_killed_sync_grants_and_their_job_cache_entries_go_once_expired(cluster):
    pull_dir = _state_dir(cluster.primary) / "pull"
    pull_dir.mkdir(exist_ok=True)
    before = set(os.listdir(pull_dir))  # the killed sync of the test before left its grant
    _plant_bulk(cluster, "grt")
    proc = _start_sync(cluster, ONLY)
    try:
        assert wait_until(lambda: any(n.endswith(".jids") and n not in before
                                      for n in os.listdir(pull_dir)), deadline=240, step=0.05), \
            "the peer never pulled"
    finally:
        _kill_tree(proc.pid)
        proc.communicate()
    # the peer goes on pulling and applying: wait for it to finish, and for
    # the job cache entries of the pulls the grant recorded
    assert wait_until(lambda: (cluster.file_root(cluster.peers[0]) / "grt" / "01999").exists(),
                      deadline=300, step=0.5)
    jobs = cluster.job_cache(cluster.primary)

    def recorded():
        tokens = sorted(n for n in os.listdir(pull_dir) if not n.endswith(".jids"))
        jids = [j for t in tokens if (pull_dir / f"{t}.jids").exists()
                for j in (pull_dir / f"{t}.jids").read_text().split()]
        stored = [p.parent for p in jobs.glob("*/*/jid") if p.read_text().strip() in jids]
        return tokens, jids, stored

    def settled():
        _, jids, stored = recorded()
        return len(stored) == len(jids) >= 2

    assert wait_until(settled, deadline=60, step=0.2), recorded()
    tokens, jids, stored = recorded()
    assert len(set(tokens) - before) == 1, tokens
    assert len(stored) == len(jids) >= 2, (jids, stored)
    # grants still valid stay: a sync within their ten minutes keeps them
    _in_step(cluster)
    assert sorted(n for n in os.listdir(pull_dir) if not n.endswith(".jids")) == tokens
    # ten minutes later
    for token in tokens:
        grant = json.loads((pull_dir / token).read_text())
        grant["expires"] = time.time() - 1
        (pull_dir / token).write_text(json.dumps(grant))
    ret = _in_step(cluster)
    assert ret.data[cluster.peer_minions[0].id]["result"] is True
    assert sorted(os.listdir(pull_dir)) == []
    assert [p for p in stored if p.exists()] == []


# ----- item 7: two syncs at once ------------------------------------------------
def test_concurrent_syncs_do_the_work_once(cluster):
    pm = cluster.peer_minions[0]
    lock = _state_dir(cluster.primary) / "sync.lock"
    pull_dir = _state_dir(cluster.primary) / "pull"
    pull_dir.mkdir(exist_ok=True)
    before = set(os.listdir(pull_dir))
    _plant_bulk(cluster, "lck")
    first = _start_sync(cluster, ONLY)
    try:
        # the first sync is applying once it granted the peer its pull
        assert wait_until(lambda: set(os.listdir(pull_dir)) - before, deadline=120, step=0.05)
        refused = cluster.salt_run(cluster.primary, "multimaster.sync", ONLY, "lock_wait=0")
        assert refused.returncode != 0, refused
        holder = lock.read_text().split()[0]
        assert refused.data["error"] == f"a sync is already running, jid {holder}", refused.data
        assert refused.data[pm.id] == {"result": False, "error": refused.data["error"]}
        assert first.poll() is None, "the first sync ended too soon for this test"
        second = _start_sync(cluster, ONLY, "lock_wait=300")  # waits for the first
        code, data, out, err = _finish(first)
        assert code == 0, _failed(cluster, out, err)
        assert len(data[pm.id]["file_roots"]["added"]) == 2000
        assert len(data[pm.id]["minion_keys"]["added"]) == 2000
        code, data, out, err = _finish(second)
    finally:
        for proc in (first, locals().get("second")):
            if proc is not None and proc.poll() is None:
                _kill_tree(proc.pid)
    assert code == 0, _failed(cluster, out, err)
    # the second found the work done
    for cat in ("minion_keys", "file_roots", "pillar_roots"):
        for kind in ("added", "updated", "removed"):
            assert data[pm.id][cat][kind] == [], data[pm.id]
    assert lock.read_text() == ""


# ----- item 3: damage on the primary --------------------------------------------
def test_damaged_sources_on_the_primary_keep_the_peers_copy(cluster):
    pm, peer = cluster.peer_minions[0], cluster.peers[0]
    pki, base = cluster.pki_dir(cluster.primary), cluster.file_root(cluster.primary)
    key = pki / "minions" / "fragile"
    key.write_bytes(PUB)
    (base / "fragile.sls").write_text("fragile: true\n")
    _in_step(cluster)
    good = (cluster.pki_dir(peer) / "minions" / "fragile").read_bytes()
    # damaged the way a disk or an editor damages it: a new file in its place
    tmp = pki / "minions" / ".tmp-fragile"
    tmp.write_bytes(b"\x00" * 300)
    os.rename(tmp, key)
    (base / "fragile.sls").unlink()
    os.symlink("fragile.sls", base / "fragile.sls")  # unreadable: ELOOP
    for args in ((ONLY,), ("only=minion_keys", "minion_ids=fragile")):
        ret = cluster.salt_run(cluster.primary, "multimaster.sync", *args)
        assert ret.returncode != 0, ret
        res = ret.data[pm.id]
        assert res["result"] is False, res
        assert "fragile" in res["error"], res
        assert res["minion_keys"]["removed"] == [], res
        assert any("minions/fragile: not a PEM public key" in e for e in res["primary_errors"]), res
        assert (cluster.pki_dir(peer) / "minions" / "fragile").read_bytes() == good
        if "file_roots" in res:
            assert res["file_roots"]["removed"] == [], res
            assert any("fragile.sls" in e for e in res["primary_errors"]), res
    assert (cluster.file_root(peer) / "fragile.sls").read_text() == "fragile: true\n"
    # repaired on the primary: in step again
    key.write_bytes(PUB)
    (base / "fragile.sls").unlink()
    (base / "fragile.sls").write_text("fragile: true\n")
    _in_step(cluster)


# ----- item 9: files changed behind the stat cache ----------------------------
def _rewrite_in_place(path, data, daemon):
    """
    Rewrite ``path`` in place (same inode, size and mtime) behind the stat
    cache of the state store of ``daemon`` (the primary master, or the
    peer's minion, whose state dir holds the peer's): its row of the file
    made to vouch for the new ctime too, as a cache that missed the change
    would.  (A scan compares the ctime: a plain rewrite is seen at once.)
    """
    st = path.stat()
    assert len(data) == st.st_size
    with open(path, "r+b") as fh:
        fh.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    now = path.stat()
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    db = sqlite3.connect(pathlib.Path(daemon.config["cachedir"]) / "multimaster" / "state.sqlite")
    try:
        with db:
            rows = db.execute("UPDATE files SET ctime_ns = ? WHERE ino = ? AND size = ? AND "
                              "mtime_ns = ?", (now.st_ctime_ns, st.st_ino, st.st_size,
                                               st.st_mtime_ns)).rowcount
    finally:
        db.close()
    assert rows, path


def test_rescan_finds_files_changed_behind_the_stat_cache(cluster):
    pm, peer = cluster.peer_minions[0], cluster.peers[0]
    mine = cluster.file_root(cluster.primary) / "same.sls"
    theirs = cluster.file_root(peer) / "same.sls"
    mine.write_text("value: 1111\n")
    _in_step(cluster)
    assert theirs.read_text() == "value: 1111\n"
    _in_step(cluster)  # recorded by both sides' scans
    _rewrite_in_place(theirs, b"value: 2222\n", pm)  # edited on the peer
    ret = _in_step(cluster)
    assert ret.data[pm.id]["file_roots"]["updated"] == []  # not seen: the documented trade-off
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", ONLY, "rescan=True")
    # seen: an edit of the peer since its last sync, named and left there
    assert ret.returncode != 0, ret
    assert ret.data[pm.id]["file_roots"]["peer_changed"] == [
        "base:same.sls: edited on the peer since its last sync (kept)"], ret.data[pm.id]
    assert theirs.read_text() == "value: 2222\n"
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", ONLY, "rescan=True", "force=True")
    assert ret.returncode == 0, ret
    assert ret.data[pm.id]["file_roots"]["updated"] == ["base:same.sls"], ret.data[pm.id]
    assert theirs.read_text() == "value: 1111\n"
    _rewrite_in_place(mine, b"value: 3333\n", cluster.primary)  # edited on the primary
    ret = _in_step(cluster)
    assert ret.data[pm.id]["file_roots"]["updated"] == []
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", ONLY, "rescan=True")
    assert ret.returncode == 0, ret
    assert ret.data[pm.id]["file_roots"]["updated"] == ["base:same.sls"], ret.data[pm.id]
    assert theirs.read_text() == "value: 3333\n"


def test_a_full_sync_reads_everything_again_once_per_verify_interval(cluster):
    """
    multimaster:verify_interval: a full sync (every category of
    multimaster:replicate) after that many seconds since the last full
    read finds what stat cannot see, without rescan=True.
    """
    pm = cluster.peer_minions[0]
    dropin = pathlib.Path(cluster.primary.config_file).parent / "master.d" / "multimaster.conf"
    saved = dropin.read_text()
    mine = cluster.file_root(cluster.primary) / "verified.sls"
    theirs = cluster.file_root(cluster.peers[0]) / "verified.sls"
    mine.write_text("value: 1111\n")
    _in_step(cluster)
    _in_step(cluster)  # the file recorded by both sides' stat caches
    try:
        dropin.write_text(json.dumps({"multimaster": {
            "peers": [pm.id], "replicate": ["minion_keys", "file_roots", "pillar_roots"],
            "verify_interval": 3600}}))
        marker = pathlib.Path(cluster.primary.config["cachedir"]) / "multimaster" / "last-verify"
        marker.unlink(missing_ok=True)
        _in_step(cluster)  # due (never verified): read again, recorded
        assert marker.is_file()
        _rewrite_in_place(mine, b"value: 2222\n", cluster.primary)
        ret = _in_step(cluster)
        assert ret.data[pm.id]["file_roots"]["updated"] == []  # within the interval: not seen
        done = marker.stat().st_mtime
        os.utime(marker, (done - 3600, done - 3600))  # the interval has passed
        ret = _in_step(cluster)
        assert ret.data[pm.id]["file_roots"]["updated"] == ["base:verified.sls"], ret.data[pm.id]
        assert theirs.read_text() == "value: 2222\n"
    finally:
        dropin.write_text(saved)
