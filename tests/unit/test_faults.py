"""
Unit tests of the core behind issue 14's fault fixes: staging outside the
served trees and its cleanup, the per-primary sync lock, expired pull
grants, damaged sources that block removals, and ``rescan`` of files.
"""

import json
import multiprocessing
import os
import signal
import time

import pytest

from salt_multimaster import (fsutil, grants, keyscan, lock, manifest, primary, replicate,
                              rootscan, sync, transport)
from tests.support.cluster import gen_keypair
from tests.support.keys import digest_of_keys

A, B = "a" * 64, "b" * 64


# ----- staging (item 1) ------------------------------------------------------
def _all_files(top):
    return sorted(os.path.relpath(os.path.join(d, f), top)
                  for d, _, files in os.walk(top) for f in files)


def test_batch_with_stage_root_stages_nothing_beside_destinations(tmp_path):
    root, stage_root = tmp_path / "srv" / "salt", tmp_path / "cache" / "stage"
    (root / "big").mkdir(parents=True)
    batch = fsutil.Batch(stage_root=str(stage_root))
    batch.write(str(root / "big" / "a"), b"A")
    batch.write(str(root / "top"), b"T", mode=0o640)
    # staged, not yet committed: nothing new where Salt serves
    assert os.listdir(root / "big") == []
    assert os.listdir(root) == ["big"]
    assert len(_all_files(stage_root)) == 3  # two staged files and the batch's lock
    batch.commit()
    assert (root / "big" / "a").read_bytes() == b"A"
    assert (root / "top").stat().st_mode & 0o777 == 0o640
    assert os.listdir(stage_root) == []  # the batch's dir and lock are gone
    assert _all_files(root) == ["big/a", "top"]


def _stage_and_die(root, stage_root):
    batch = fsutil.Batch(stage_root=stage_root)
    batch.write(os.path.join(root, "x"), b"x" * 100)
    os.kill(os.getpid(), signal.SIGKILL)


def test_clean_stages_removes_what_a_killed_batch_left_and_spares_live_ones(tmp_path):
    root, stage_root = tmp_path / "root", tmp_path / "stage"
    root.mkdir()
    proc = multiprocessing.get_context("fork").Process(
        target=_stage_and_die, args=(str(root), str(stage_root)))
    proc.start()
    proc.join()
    assert proc.exitcode == -signal.SIGKILL
    left = sorted(os.listdir(stage_root))
    assert len(left) == 2 and left[1] == left[0] + ".lock"
    live = fsutil.Batch(stage_root=str(stage_root))
    live.write(str(root / "y"), b"y")
    removed = fsutil.clean_stages(str(stage_root))
    assert removed == [str(stage_root / left[0])]
    assert sorted(os.listdir(stage_root)) == sorted(
        [os.path.basename(live.home), os.path.basename(live.home) + ".lock"])
    live.commit()
    assert (root / "y").read_bytes() == b"y" and not (root / "x").exists()
    assert os.listdir(stage_root) == []
    assert os.listdir(root) == ["y"]


def test_clean_stages_of_a_missing_root_is_nothing(tmp_path):
    assert fsutil.clean_stages(str(tmp_path / "nope")) == []


def test_batch_abort_with_stage_root_leaves_nothing(tmp_path):
    root, stage_root = tmp_path / "root", tmp_path / "stage"
    root.mkdir()
    batch = fsutil.Batch(stage_root=str(stage_root))
    batch.write(str(root / "a"), b"a")
    batch.abort()
    assert os.listdir(root) == [] and os.listdir(stage_root) == []


# ----- lock (item 7) ---------------------------------------------------------
def test_sync_lock_excludes_a_second_holder_and_names_the_first(tmp_path):
    path = str(tmp_path / "sync.lock")
    with lock.SyncLock(path, "20261123220000000001"):
        with pytest.raises(lock.Busy) as exc:
            lock.SyncLock(path, "20261123220000000002", wait=0).acquire()
        assert str(exc.value) == "a sync is already running, jid 20261123220000000001"
        assert exc.value.holder == "20261123220000000001"
    # released: the next one takes it
    with lock.SyncLock(path, "20261123220000000002"):
        assert lock.read_holder(path) == "20261123220000000002"
    assert lock.read_holder(path) is None


def test_sync_lock_waits_for_the_holder_up_to_wait(tmp_path):
    path = str(tmp_path / "sync.lock")
    first = lock.SyncLock(path, "1").acquire()
    now = [0.0]

    def sleep(seconds):
        now[0] += seconds
        if now[0] >= 1.0:
            first.release()

    second = lock.SyncLock(path, "2", wait=5, poll=0.5, clock=lambda: now[0], sleep=sleep)
    second.acquire()
    assert now[0] == 1.0 and lock.read_holder(path) == "2"
    second.release()


def _hold_and_die(path):
    lock.SyncLock(path, "99").acquire()
    os.kill(os.getpid(), signal.SIGKILL)


def test_sync_lock_of_a_killed_holder_is_free(tmp_path):
    path = str(tmp_path / "sync.lock")
    proc = multiprocessing.get_context("fork").Process(target=_hold_and_die, args=(path,))
    proc.start()
    proc.join()
    assert lock.read_holder(path) == "99"  # its jid is still written
    with lock.SyncLock(path, "100", wait=0):
        assert lock.read_holder(path) == "100"


# ----- pull grants (item 6) --------------------------------------------------
def test_expired_grants_are_found_live_ones_kept(tmp_path):
    now = time.time()
    (tmp_path / "aa11").write_text(json.dumps({"expires": now - 1}))
    (tmp_path / "aa11.jids").write_text("20261123220000000001\n20261123220000000002\n")
    (tmp_path / "bb22").write_text(json.dumps({"expires": now + 600}))
    (tmp_path / "bb22.jids").write_text("20261123220000000003\n")
    (tmp_path / "cc33.jids").write_text("20261123220000000004\n")  # its grant gone
    old = now - 3600
    os.utime(tmp_path / "cc33.jids", (old, old))
    (tmp_path / "dd44").write_text("{not json")  # being written, or damaged, but new
    assert grants.expired(str(tmp_path), now=now, ttl=600) == ["aa11", "cc33"]
    assert grants.jids(str(tmp_path), "aa11") == ["20261123220000000001", "20261123220000000002"]
    assert grants.jids(str(tmp_path), "zz") == []
    assert grants.expired(str(tmp_path / "missing")) == []


# ----- damaged sources (item 3) ----------------------------------------------
def test_plan_keys_never_removes_a_key_damaged_on_the_primary():
    primary = {"minions": {"ok": A}}
    peer = {"minions": {"ok": A, "web1": B}}
    damaged = {"minions": ["web1"]}
    for force in (False, True):
        ops, report = replicate.plan_keys(primary, peer, history=["ok", "web1"], force=force,
                                          damaged=damaged)
        assert ops == []
        assert report == {
            "added": [], "updated": [], "removed": [], "conflicts": [],
            "errors": ["minions/web1: damaged or unreadable on the primary: the peer's copy "
                       "is kept (repair the key on the primary)"],
        }
    # without it, the key reads as deleted on the primary
    ops, _ = replicate.plan_keys(primary, peer, history=["ok", "web1"])
    assert ops == [{"op": "remove", "state": "minions", "id": "web1"}]


def test_plan_tree_never_removes_files_unreadable_on_the_primary():
    primary = {"base": {"keep": [1, 0o644, A]}}
    peer = {"base": {"keep": [1, 0o644, A], "bad.sls": [1, 0o644, B],
                     "sub/x": [1, 0o644, B], "subx": [1, 0o644, B], "gone": [1, 0o644, B]}}
    ops, report = replicate.plan_tree(primary, peer, damaged={"base": ["bad.sls", "sub/"]})
    assert ops == [{"op": "remove", "env": "base", "rel": "gone"},
                   {"op": "remove", "env": "base", "rel": "subx"}]
    assert report["errors"] == ["base:bad.sls: unreadable on the primary: the peer's copy is kept",
                                "base:sub/x: unreadable on the primary: the peer's copy is kept"]
    ops, report = replicate.plan_tree(primary, peer, damaged={"base": ["/"]})
    assert ops == [] and len(report["errors"]) == 4


def test_damaged_sources_named_by_manifests(tmp_path, monkeypatch):
    pki = tmp_path / "pki"
    (pki / "minions").mkdir(parents=True)
    (pki / "minions" / "good").write_bytes(gen_keypair(1024)[1])
    (pki / "minions" / "bad").write_bytes(b"garbage, not a key")
    snap = keyscan.KeysSnapshot(str(pki), str(tmp_path / "state"))
    assert snap.damaged == {"minions": ["bad"]}
    assert snap.errors == ["minions/bad: not a PEM public key, skipped"]
    # a scan that finds the dir as it was still names it
    again = keyscan.KeysSnapshot(str(pki), str(tmp_path / "state"))
    assert again.damaged == {"minions": ["bad"]}

    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "ok").write_text("ok")
    (root / "secret").write_text("x")
    (root / "sub" / "f").write_text("f")
    real_hash = manifest.sha256_file

    def hasher(path):
        if path.endswith("/secret"):
            raise PermissionError(13, "Permission denied")
        return real_hash(path)

    monkeypatch.setattr(manifest, "sha256_file", hasher)
    scan = rootscan.RootsScan({"file_roots": {"base": [str(root)]}}, "file_roots",
                              str(tmp_path / "state"))
    assert sorted(manifest.merge(scan.parts, scan.parts)["base"]) == ["ok", "sub/f"]
    assert scan.errors == [f"{root}: secret: unreadable: Permission denied"]
    assert scan.damaged == manifest.damaged_sources(scan.errors) == {"base": ["secret"]}
    assert manifest.damaged_sources(["a plain error"]) == {}


# ----- rescan of files (item 9) ----------------------------------------------
def test_a_file_rewritten_in_place_is_seen_and_rescan_reads_every_file(tmp_path, monkeypatch):
    """
    A file rewritten with its inode, size and mtime put back is seen by the
    next scan (its ctime moved); ``rescan=True`` reads every file again,
    whatever the store holds.
    """
    root = tmp_path / "root"
    root.mkdir()
    path = root / "f.sls"
    path.write_text("one")
    (root / "g.sls").write_text("g")
    opts = {"file_roots": {"base": [str(root)]}}
    state = str(tmp_path / "state")

    def read(rescan=False):
        return rootscan.RootsScan(opts, "file_roots", state, rescan=rescan).parts

    first = read()
    st = path.stat()
    with open(path, "r+", encoding="utf-8") as fh:  # same inode, size
        fh.write("two")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # and mtime
    plain = read()
    bucket = manifest.bucket_of("base/f.sls")
    assert plain[bucket]["base"]["f.sls"][2] != first[bucket]["base"]["f.sls"][2]
    reads = []
    real = manifest.sha256_file
    monkeypatch.setattr(manifest, "sha256_file", lambda p: reads.append(p) or real(p))
    assert read() == plain and reads == []
    assert read(rescan=True) == plain and sorted(reads) == [str(path), str(root / "g.sls")]


def test_forget_fileserver_hashes(tmp_path):
    entry = tmp_path / "roots" / "hash" / "base" / "f.sls.hash.sha256"
    entry.parent.mkdir(parents=True)
    entry.write_text("abc:1.0")
    assert manifest.forget_fileserver_hashes(str(tmp_path)) is True
    assert os.listdir(tmp_path / "roots") == []
    assert manifest.forget_fileserver_hashes(str(tmp_path)) is False


# ----- the runner and the sync core's use of them ----------------------------------------------
def _runner(tmp_path):
    import importlib.util  # pylint: disable=import-outside-toplevel

    from tests.conftest import REPO  # pylint: disable=import-outside-toplevel

    spec = importlib.util.spec_from_file_location("mm_runner_faults",
                                                  REPO / "_runners" / "multimaster.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.__opts__ = {"cachedir": str(tmp_path / "cache"), "pki_dir": str(tmp_path / "pki"),
                    "id": "primary_master", "hash_type": "sha256",
                    "multimaster": {"peers": ["m02", "m03"]}}
    mod.__context__ = {}
    return mod


def test_sync_refuses_while_another_sync_holds_the_lock(tmp_path):
    runner = _runner(tmp_path)
    state = tmp_path / "cache" / "multimaster"
    state.mkdir(parents=True)
    msg = "a sync is already running, jid 20261123220000000001"
    with lock.SyncLock(str(state / "sync.lock"), "20261123220000000001"):
        assert runner.sync(lock_wait=0) == {
            "result": False, "error": msg, "retcode": 1,
            "m02": {"result": False, "error": msg}, "m03": {"result": False, "error": msg},
        }
        assert runner.__context__["retcode"] == 1
        bad = runner.sync(lock_wait="soon")
        assert bad["error"] == "lock_wait must be a number of seconds (0 to 86400), not 'soon'"


@pytest.mark.parametrize("test", [True, "on", "yes", "1", 1])
def test_sync_in_test_mode_takes_no_lock(tmp_path, monkeypatch, test):
    """Every spelling of test mode is parsed once: none of them waits for the lock."""
    runner = _runner(tmp_path)
    state = tmp_path / "cache" / "multimaster"
    state.mkdir(parents=True)
    monkeypatch.setattr(primary, "sync", lambda opts, context, job, peers, only, test, *args,
                        **kwargs: {"result": True, "test": test})
    with lock.SyncLock(str(state / "sync.lock"), "20261123220000000001"):
        assert runner.sync(test=test, lock_wait=0) == {"result": True, "test": True}
        assert runner.sync(test="off", lock_wait=0)["error"] == (
            "a sync is already running, jid 20261123220000000001")


def test_sync_revokes_expired_grants_and_their_job_cache_entries(tmp_path):
    import salt.utils.jid  # pylint: disable=import-outside-toplevel

    opts = {"cachedir": str(tmp_path / "cache")}
    pull = tmp_path / "cache" / "multimaster" / "pull"
    pull.mkdir(parents=True)
    jid = "20261123220000000001"
    job = salt.utils.jid.jid_dir(jid, str(tmp_path / "cache" / "jobs"), "sha256")
    os.makedirs(job)
    (pull / "aa11").write_text(json.dumps({"expires": time.time() - 1}))
    (pull / "aa11.jids").write_text(jid + "\n")
    (pull / "bb22").write_text(json.dumps({"expires": time.time() + 600}))
    jobs_dir = str(tmp_path / "cache" / "jobs")
    transport.sweep_grants(opts, lambda j: salt.utils.jid.jid_dir(j, jobs_dir, "sha256"))
    assert sorted(os.listdir(pull)) == ["bb22"]
    assert not os.path.exists(job)


def test_plan_passes_damaged_sources_to_the_planners():
    keys = {"minions": {"ok": A}}
    primary = {"minion_keys": {"digest": digest_of_keys(keys), "previous": None,
                               "parts": manifest.split("minion_keys", keys),
                               "damaged": {"minions": ["bad"]}}}
    peer_keys = {"minions": {"ok": A, "bad": B}}
    parts = manifest.split("minion_keys", peer_keys)
    digest = manifest.bucket_digests(parts)
    inv = {"minion_keys": {"digest": digest, "buckets": sorted(digest),
                           "manifest": peer_keys, "history": ["ok", "bad"], "errors": []}}
    ops, report = sync.plan("shared", ["minion_keys"], primary, inv, True)
    assert ops == {"minion_keys": []}
    assert report["minion_keys"]["removed"] == []
    assert report["minion_keys"]["errors"][0].startswith("minions/bad: damaged or unreadable")
    assert sync.damaged_messages(primary, ["minion_keys"]) == [
        "minion_keys minions/bad: damaged or unreadable on the primary"]


def _stage_beside_and_die(root, stage_root):
    batch = fsutil.Batch(stage_root=stage_root)
    batch._same_fs = lambda directory: False  # as for a root on another filesystem
    batch.write(os.path.join(root, "x"), b"x")
    os.kill(os.getpid(), signal.SIGKILL)


def test_staging_beside_another_filesystem_is_journaled_and_cleaned(tmp_path):
    root, stage_root = tmp_path / "root", tmp_path / "stage"
    root.mkdir()
    proc = multiprocessing.get_context("fork").Process(
        target=_stage_beside_and_die, args=(str(root), str(stage_root)))
    proc.start()
    proc.join()
    assert [n for n in os.listdir(root) if n.startswith(".mm-stage-")]
    assert len(fsutil.clean_stages(str(stage_root))) == 1
    assert os.listdir(root) == [] and os.listdir(stage_root) == []
    # and a batch that lives cleans its own at commit
    batch = fsutil.Batch(stage_root=str(stage_root))
    batch._same_fs = lambda directory: False
    batch.write(str(root / "y"), b"y")
    batch.commit()
    assert os.listdir(root) == ["y"] and os.listdir(stage_root) == []
