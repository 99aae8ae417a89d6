"""
A long sync shows its progress on the terminal the way Salt runners do
(progress events of the job, one line each), while ``--out=json`` stays one
JSON document holding the data alone.
"""

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from tests.support.cluster import pull_cluster

pytestmark = pytest.mark.daemons

FILES = 600


cluster = pull_cluster("prg")


def _salt_run(cluster, *args):
    """salt-run as an operator types it (salt-factories would add --out=json)."""
    cmd = [os.path.join(os.path.dirname(sys.executable), "salt-run"),
           "-c", str(pathlib.Path(cluster.primary.config_file).parent), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)


def _write_files(cluster, tag):
    base = cluster.file_root(cluster.primary) / "progress"
    for i in range(FILES):
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
                if line.startswith(f"multimaster: {peer}: applying {FILES} change(s) (")
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
    assert len(data[peer]["file_roots"]["updated"]) == FILES
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
    (apply,) = [e.data for e in events if e.data.get("phase") == "apply"
                and e.data["message"].startswith(f"multimaster: {peer}: applying {FILES} ")]
    assert (apply["peer"], apply["done"], apply["total"]) == (peer, 0, FILES), apply
