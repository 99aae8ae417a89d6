"""
A large sync, on one pull cluster: it shows its progress on the terminal
the way Salt runners do (progress events of the job, one line each), while
``--out=json`` stays one JSON document holding the data alone; a peer whose
salt-minion dies in the middle of its apply is found within seconds (Salt's
find_job), whatever the timeout and the size of the sync, and the report
claims nothing the peer did not confirm.  Each test writes its own
directory of the primary's file_roots and leaves the peer in step.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import salt.payload

from tests.support.cluster import pull_cluster

pytestmark = pytest.mark.daemons

PROGRESS_FILES = 600
BIG_FILES = 3000


cluster = pull_cluster("lrg")


# ----- progress: the terminal, --out=json, the events -------------------------------
def _salt_run(cluster, *args):
    """salt-run as an operator types it (salt-factories would add --out=json)."""
    cmd = [os.path.join(os.path.dirname(sys.executable), "salt-run"),
           "-c", str(pathlib.Path(cluster.primary.config_file).parent), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)


def _write_files(cluster, tag):
    base = cluster.file_root(cluster.primary) / "progress"
    for i in range(PROGRESS_FILES):
        (base / f"d{i % 10}").mkdir(parents=True, exist_ok=True)
        (base / f"d{i % 10}" / f"f{i}.txt").write_text(f"{tag} {i}\n")


def test_default_output_shows_progress_then_the_summary(cluster):
    peer = cluster.peer_minions[0].id
    _write_files(cluster, "one")
    # rescan=True: the primary asks the peer for its inventory, whatever an
    # earlier sync left it knowing of the peer
    ret = _salt_run(cluster, "multimaster.sync", "only=file_roots", "rescan=True")
    assert ret.returncode == 0, ret.stdout + ret.stderr
    lines = ret.stdout.splitlines()
    assert "multimaster: reading the primary's state for file_roots" in lines, ret.stdout
    assert f"multimaster: asking {peer} for an inventory" in lines, ret.stdout
    applying = [n for n, line in enumerate(lines)
                if line.startswith(f"multimaster: {peer}: applying {PROGRESS_FILES} change(s) (")
                and line.endswith("pull chunk(s))")]
    assert applying, ret.stdout
    done = lines.index(f"multimaster: {peer}: ok")
    summary = [n for n, line in enumerate(lines) if line.startswith("summary: 1 peer(s)")]
    assert applying[0] < done < summary[0], ret.stdout
    # progress is a line each, never Salt's nested event blobs
    assert not any(line.strip() in ("suffix:", "event:", "progress") for line in lines), \
        ret.stdout


def test_json_output_is_the_data_alone(cluster):
    peer = cluster.peer_minions[0].id
    # the files on the peer first, so that the sync below updates every one
    _write_files(cluster, "json-base")
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=file_roots")
    assert ret.returncode == 0, ret
    _write_files(cluster, "two")
    ret = _salt_run(cluster, "multimaster.sync", "only=file_roots", "--out=json")
    assert ret.returncode == 0, ret.stdout + ret.stderr
    data = json.loads(ret.stdout)  # one document: no progress events in it
    assert data[peer]["result"] is True
    assert len(data[peer]["file_roots"]["updated"]) == PROGRESS_FILES
    assert "multimaster:" not in ret.stdout


def test_each_step_is_an_event_on_the_primary_bus(cluster, event_listener):
    """
    Whatever the output, each step of a sync is an event on the primary's
    bus (``salt/multimaster/sync/progress``, for a reactor or a dashboard):
    the lines the terminal shows, with the phase, the peer and the count.
    """
    peer = cluster.peer_minions[0].id
    _write_files(cluster, "events-base")
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=file_roots")
    assert ret.returncode == 0, ret
    _write_files(cluster, "events")
    start = time.time()
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=file_roots")
    assert ret.returncode == 0, ret
    # the master's engine forwards its events to the test's listener a
    # moment later: wait until the sync's last one is there
    deadline = time.monotonic() + 30
    while True:
        events = sorted(event_listener.get_events(
            [(cluster.primary.id, "salt/multimaster/sync/progress")], after_time=start),
            key=lambda e: e.stamp)
        messages = [e.data["message"] for e in events]
        if f"multimaster: {peer}: ok" in messages or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert messages[0] == "multimaster: reading the primary's state for file_roots", messages
    assert messages[-1] == f"multimaster: {peer}: ok", messages
    applying = f"multimaster: {peer}: applying {PROGRESS_FILES} "
    (apply,) = [e.data for e in events if e.data.get("phase") == "apply"
                and e.data["message"].startswith(applying)]
    assert (apply["peer"], apply["done"], apply["total"]) == (peer, 0, PROGRESS_FILES), apply


# ----- a peer dying mid-apply, a peer master down --------------------------------------
def _running(minion, fun):
    """Whether ``minion`` runs a job of ``fun`` now (its proc dir)."""
    proc = pathlib.Path(minion.config["cachedir"]) / "proc"
    for path in proc.glob("*"):
        try:
            with open(path, "rb") as fh:
                if salt.payload.load(fh).get("fun") == fun:
                    return True
        except Exception:  # pylint: disable=broad-except
            continue
    return False


def _kill_tree(pid):
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    for proc in procs:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_peer_dying_mid_apply_is_reported_in_seconds(cluster):
    pm, peer = cluster.peer_minions[0], cluster.peers[0]
    base = cluster.file_root(cluster.primary)
    for i in range(BIG_FILES):
        (base / "big" / f"d{i % 30}").mkdir(parents=True, exist_ok=True)
        (base / "big" / f"d{i % 30}" / f"f{i}").write_bytes(os.urandom(8192))
    result = []
    runner = threading.Thread(target=lambda: result.append(cluster.salt_run(
        cluster.primary, "multimaster.sync", "only=file_roots", "timeout=600", timeout=900)))
    runner.start()
    end = time.time() + 120
    while time.time() < end and not _running(pm, "multimaster_peer.apply"):
        time.sleep(0.05)
    assert _running(pm, "multimaster_peer.apply"), "the apply never started"
    _kill_tree(pm.pid)
    killed = time.monotonic()
    runner.join(900)
    # the old wait was timeout + ops/10: over 600 s here
    assert time.monotonic() - killed < 90
    ret = result[0]
    assert ret.returncode != 0, ret.stdout
    res = ret.data[pm.id]
    assert res["result"] is False
    assert res["error"].startswith(f"{pm.id}'s salt-minion did not answer the apply"), res
    assert res["file_roots"]["added"] == []
    assert len(res["file_roots"]["unconfirmed"]) == BIG_FILES
    # back up, a plain re-run converges
    pm.terminate()
    pm.start()
    assert cluster.wait_ping(cluster.primary, pm.id)
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=file_roots")
    assert ret.returncode == 0, ret.stdout
    peer_base = cluster.file_root(peer)
    assert sorted(p.relative_to(peer_base) for p in (peer_base / "big").rglob("f*")) == sorted(
        p.relative_to(base) for p in (base / "big").rglob("f*"))


def test_peer_master_down_is_said_so(cluster):
    pm, peer = cluster.peer_minions[0], cluster.peers[0]
    (cluster.file_root(cluster.primary) / "late.sls").write_text("late: {}\n")
    peer.terminate()
    try:
        ret = cluster.salt_run(cluster.primary, "multimaster.status")
        assert ret.returncode != 0, ret.stdout
        assert ret.data[pm.id]["master_running"] is False
        assert "salt-master is not running" in ret.data[pm.id]["error"]
        ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=file_roots")
        assert ret.returncode != 0, ret.stdout
        res = ret.data[pm.id]
        assert res["result"] is False
        assert res["error"].startswith(f"{pm.id}'s salt-master is not running"), res
        # the data went all the same: ready when the master starts
        assert (cluster.file_root(peer) / "late.sls").exists()
    finally:
        peer.start()
    ret = cluster.salt_run(cluster.primary, "multimaster.status")
    assert ret.returncode == 0, ret.stdout
    assert ret.data[pm.id]["master_running"] is True
