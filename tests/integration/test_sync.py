"""
``salt-run multimaster.sync`` against real daemons: a primary, two fresh peers
with their own generated master keys, a minion accepted on the primary only.

Fixture ``first_run`` is an operator's first session on the fresh cluster
(plant, status, ``test=True``, sync, status, restart the peers), done once
whichever test asks first; the first tests check what it recorded.  Every
later test starts from ``synced``: the planted content restored on the
primary and the peers mirroring it, confirmed by a sync.
"""

import os
import pathlib
import stat
import time

import pytest

from tests.support.cluster import gen_keypair, master_key_paths

pytestmark = pytest.mark.daemons

CATS = ("master_keys", "minion_keys", "file_roots", "pillar_roots", "master_config")


@pytest.fixture(scope="module")
def cluster(cluster_factory):
    cluster = cluster_factory(
        "syn",
        peers=2,
        minions=1,
        share_master_keys=False,
        accept_on_peers=False,
        primary_overrides={
            "file_ignore_regex": [r"/\.git($|/)"],
            "file_ignore_glob": ["*.swp"],
            "nodegroups": {"webs": "L@syn-minion1"},
            "publisher_acl": {"ops": ["test.*"]},
            "peer_run": {"syn-peer.*": ["multimaster.pull"]},
        },
    )
    peers = [m.id for m in cluster.peer_minions]
    # a small inline limit: the initial sync pulls keys and pillar files, and
    # file_roots files in bulk (pull_min_files 2); later syncs of one or two
    # files fetch them from the fileserver
    _set_master_conf(cluster.primary, {"multimaster": {
        "peers": peers, "inline_limit": 1024, "pull_min_files": 2}})
    cluster.start()
    assert cluster.wait_pings(cluster.primary, cluster.peer_minions)
    yield cluster
    cluster.stop()


def _set_master_conf(master, values):
    import salt.utils.yaml  # pylint: disable=import-outside-toplevel

    dropin = pathlib.Path(master.config_file).parent / "master.d" / "multimaster.conf"
    dropin.parent.mkdir(exist_ok=True)
    dropin.write_text(salt.utils.yaml.safe_dump(values))


def _snapshot(master):
    """Every file under a master's pki_dir and roots, with content and mode."""
    ret = {}
    dirs = [master.config["pki_dir"]]
    for kind in ("file_roots", "pillar_roots"):
        for roots in master.config[kind].values():
            dirs.extend(roots)
    dirs.append(str(pathlib.Path(master.config_file).parent))
    for top in dirs:
        for dirpath, _, files in os.walk(top):
            for name in files:
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                ret[path] = (st.st_mode, os.readlink(path) if os.path.islink(path) else open(path, "rb").read())
    return ret


def _plant(cluster):
    """
    Keys in every state, files in every saltenv, ignored files, symlinks: on
    the fresh primary, and again before each test (what a test removed or
    moved is put back, what is there stays).
    """
    pki = cluster.pki_dir(cluster.primary)
    for state, mid in (("minions_pre", "pend1"), ("minions_rejected", "rej1"),
                       ("minions_denied", "den1"), ("minions", "acc1"), ("minions_pre", "mover")):
        (pki / state).mkdir(exist_ok=True)
        if (pki / state / mid).exists():
            continue
        for other in pki.glob(f"minions*/{mid}"):
            other.unlink()
        (pki / state / mid).write_bytes(gen_keypair(1024)[1])
    base = cluster.file_root(cluster.primary)
    (base / "web").mkdir(exist_ok=True)
    (base / "web" / "init.sls").write_text("web:\n  test.succeed_without_changes\n")
    (base / "run.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(base / "run.sh", 0o750)
    (base / ".git").mkdir(exist_ok=True)
    (base / ".git" / "config").write_text("[core]\n")
    (base / "web" / ".init.sls.swp").write_text("swap")
    if not (base / "link.sls").is_symlink():
        os.symlink("web/init.sls", base / "link.sls")
    outside = cluster.pki_dir(cluster.primary).parent / "outside.txt"
    outside.write_text("secret outside the root")
    if not (base / "escape.txt").is_symlink():
        os.symlink(str(outside), base / "escape.txt")
    prod = cluster.file_root(cluster.primary, "prod")
    (prod / "prod.sls").write_text("prod: {}\n")
    pillar = cluster.file_root(cluster.primary, kind="pillar_roots")
    (pillar / "top.sls").write_text("base:\n  '*':\n    - data\n")
    (pillar / "data.sls").write_text("secret_value: s3cr3t-pillar\n")


def _after_sync(cluster, peer, pm):
    """What the checks of the first sync read on ``peer``, read right after it."""
    base = cluster.file_root(peer)
    dropin = pathlib.Path(peer.config_file).parent / "master.d" / "multimaster-sync.conf"
    return {
        "keys": cluster.keys(peer),
        "master_keys": [(p.read_bytes(), stat.S_IMODE(p.stat().st_mode))
                        for p in master_key_paths(peer.config["pki_dir"])],
        "pki_mode": stat.S_IMODE(os.stat(peer.config["pki_dir"]).st_mode),
        "paths": sorted(str(p.relative_to(base)) for p in base.rglob("*")),
        "files": {str(p.relative_to(base)): (stat.S_IMODE(p.stat().st_mode), p.read_text())
                  for p in base.rglob("*") if p.is_file()},
        "prod": sorted(p.name for p in cluster.file_root(peer, "prod").iterdir()),
        "pillar_data": (cluster.file_root(peer, kind="pillar_roots") / "data.sls").read_text(),
        "dropin": dropin.read_text(),
    }


@pytest.fixture(scope="module")
def first_run(cluster):
    """
    The operator's first session on the fresh cluster, once: plant, status,
    ``test=True``, the sync (what it wrote on each peer read right after),
    status, restart the peers.  Returns what each step returned.
    """
    run = {}
    _plant(cluster)
    run["before"] = [_snapshot(p) for p in cluster.peers]
    run["status"] = cluster.salt_run(cluster.primary, "multimaster.status")
    run["fingers"] = {m.id: cluster.master_fingerprint(m) for m in cluster.masters}
    run["after_status"] = [_snapshot(p) for p in cluster.peers]
    run["test"] = cluster.salt_run(cluster.primary, "multimaster.sync", "test=True")
    run["after_test"] = [_snapshot(p) for p in cluster.peers]
    run["sync"] = cluster.salt_run(cluster.primary, "multimaster.sync")
    run["primary_keys"] = cluster.keys(cluster.primary)
    run["primary_master_keys"] = [
        p.read_bytes() for p in master_key_paths(cluster.primary.config["pki_dir"])]
    run["peers"] = {pm.id: _after_sync(cluster, peer, pm)
                    for peer, pm in zip(cluster.peers, cluster.peer_minions)}
    run["published"] = {fun: _published(cluster, cluster.primary, fun)
                        for fun in ("multimaster_peer.apply", "multimaster_peer.inventory")}
    run["sealed_in_job_cache"] = [p for p in cluster.job_cache(cluster.primary).rglob("*")
                                  if p.is_file() and b"mmseal1b" in p.read_bytes()]
    run["pull_dir"] = list(
        (pathlib.Path(cluster.primary.config["cachedir"]) / "multimaster" / "pull").iterdir())
    # the peers' masters run their old keys until restarted: status says so
    run["status_synced"] = cluster.salt_run(cluster.primary, "multimaster.status")
    for peer in cluster.peers:
        cluster.restart(peer)
    return run


@pytest.fixture
def synced(cluster, first_run):  # pylint: disable=unused-argument
    """
    The known state a test starts from: the planted content back on the
    primary (a test removes or moves some of it), and every peer mirroring
    the primary, confirmed by a sync (``force=True``: a failed test may
    have left a conflict behind).
    """
    _plant(cluster)
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "force=True")
    assert ret.returncode == 0, ret
    for peer in cluster.peers:
        assert cluster.keys(peer) == cluster.keys(cluster.primary)
    return cluster


def test_status_reports_drift_and_changes_nothing(cluster, first_run):
    ret = first_run["status"]
    assert ret.returncode == 0, ret
    for pm in cluster.peer_minions:
        res = ret.data[pm.id]
        assert res["reachable"] is True
        assert res["in_sync"] is False
        finger = res["master_finger"]
        # the one master fingerprint: what salt-key -F master printed on each
        assert finger["primary"] == first_run["fingers"][cluster.primary.id]
        assert finger["peer"] == first_run["fingers"][pm.id]  # the peer master's id
        assert finger["peer"] != finger["primary"]
        assert res["minion_keys"]["primary"]["minions_pre"] == 2
        assert res["minion_keys"]["peer"]["minions"] == 0
        assert res["drift"]["file_roots"]["added"] == 4
        assert res["drift"]["master_keys"]["updated"] == 2
    assert first_run["after_status"] == first_run["before"]


def test_test_mode_changes_nothing_and_reports_the_plan(cluster, first_run):
    ret = first_run["test"]
    assert ret.returncode == 0, ret
    assert first_run["after_test"] == first_run["after_status"]
    for pm in cluster.peer_minions:
        res = ret.data[pm.id]
        assert res["result"] is True, res
        assert set(CATS) <= set(res)
        assert "master.pem" in res["master_keys"]["updated"]
        assert "minions_pre/pend1" in res["minion_keys"]["added"]
        assert "minions/syn-minion1" in res["minion_keys"]["added"], res["minion_keys"]
        assert "base:web/init.sls" in res["file_roots"]["added"]
        assert "prod:prod.sls" in res["file_roots"]["added"]
        assert "base:data.sls" in res["pillar_roots"]["added"]
        assert "nodegroups" in res["master_config"]["added"] + res["master_config"]["updated"]


def test_sync_replicates_everything(cluster, first_run):
    ret = first_run["sync"]
    # no service manager here: the peers' masters still run their old keys,
    # so no peer is a replica in service yet, and a cron job must notice
    assert ret.returncode != 0, ret.stdout
    plan = first_run["test"].data
    primary_keys = first_run["primary_keys"]
    for pm in cluster.peer_minions:
        res = ret.data[pm.id]
        peer = first_run["peers"][pm.id]
        assert res["result"] is False, res
        assert res["restart"] == "restart_required" and "restart_required" not in res
        assert res["error"] == (
            f"{pm.id}'s salt-master must restart to load the new master keys or config (no "
            "service manager restarted it): restart it"), res
        # test=True reported exactly what the real run did
        for cat in CATS:
            for kind in ("added", "updated", "removed"):
                assert sorted(res[cat][kind]) == sorted(plan[pm.id][cat][kind]), (cat, kind)
        assert "warnings" not in res  # bulk was pulled through peer_run, not published
        assert peer["keys"] == primary_keys
        assert [key for key, _ in peer["master_keys"]] == first_run["primary_master_keys"]
        assert peer["master_keys"][0][1] == 0o400
        assert peer["pki_mode"] == 0o700
        files = peer["files"]
        assert files["web/init.sls"][1].startswith("web:")
        assert files["run.sh"][0] == 0o750
        assert files["link.sls"][1] == files["web/init.sls"][1]
        assert not any(p == ".git" or p.startswith(".git/") for p in peer["paths"])
        assert "web/.init.sls.swp" not in peer["paths"]
        assert "escape.txt" not in peer["paths"]
        assert any("escape.txt" in e for e in res["primary_errors"])
        assert peer["prod"] == ["prod.sls"]
        assert "s3cr3t-pillar" in peer["pillar_data"]
        assert "webs" in peer["dropin"]
    # the publishes, which every minion receives, carry nothing but routing:
    # the arguments are sealed to each peer (the operations themselves came
    # with the first pulled chunk)
    applies = first_run["published"]["multimaster_peer.apply"]
    assert len(applies) == len(cluster.peers)
    for kwargs in first_run["published"].values():
        for kwarg in kwargs:
            assert set(kwarg) == {"sealed", "__kwarg__"}, kwarg
            assert all(blob.startswith("mmseal1:") for blob in kwarg["sealed"].values())
    # and the sealed chunks the peers pulled left the job cache with the grant
    assert first_run["sealed_in_job_cache"] == []
    assert first_run["pull_dir"] == []


def _published(cluster, master, fun):
    """The keyword arguments of every ``fun`` job the master published."""
    import salt.payload  # pylint: disable=import-outside-toplevel

    ret = []
    for load in sorted(cluster.job_cache(master).glob("*/*/.load.p")):
        with open(load, "rb") as fh:
            data = salt.payload.load(fh)
        if data.get("fun") == fun:
            ret.append(next(a for a in data["arg"] if isinstance(a, dict) and a.get("__kwarg__")))
    return ret


def test_peer_serves_minion_after_restart(cluster, first_run):
    minion = cluster.minions[0].id
    # the peers' masters ran their old keys until restarted: status said so
    ret = first_run["status_synced"]
    assert ret.returncode == 0, ret.stdout
    for pm in cluster.peer_minions:
        assert ret.data[pm.id]["restart_pending"] is True, ret.data[pm.id]
        assert ret.data[pm.id]["in_sync"] is False
    # first_run restarted them
    for peer in cluster.peers:
        assert cluster.master_fingerprint(peer) == cluster.master_fingerprint(cluster.primary)
        assert cluster.wait_ping(peer, minion, deadline=120), peer.id
    # nodegroups came with master_config
    ret = cluster.salt(cluster.peers[0], "test.ping", "-N", minion_tgt="webs")
    assert ret.returncode == 0 and ret.data == {minion: True}, ret


@pytest.mark.usefixtures("synced")
def test_sync_run_on_a_peer_says_where_to_run_it(cluster):
    ret = cluster.salt_run(cluster.peers[0], "multimaster.sync")
    assert ret.returncode != 0
    assert ret.data["error"].startswith("this master is a peer: it holds "), ret.data
    assert ret.data["error"].endswith("run salt-run multimaster.sync on the primary")


@pytest.mark.usefixtures("synced")
def test_noop_sync_changes_nothing(cluster):
    ret = cluster.salt_run(cluster.primary, "multimaster.status")
    for pm in cluster.peer_minions:
        assert ret.data[pm.id]["in_sync"] is True, ret.data[pm.id]
        assert ret.data[pm.id]["restart_pending"] is False
        finger = ret.data[pm.id]["master_finger"]
        assert finger["peer"] == finger["primary"]
    before = [_snapshot(p) for p in cluster.peers]
    ret = cluster.salt_run(cluster.primary, "multimaster.sync")
    assert ret.returncode == 0, ret
    for pm in cluster.peer_minions:
        res = ret.data[pm.id]
        for cat in CATS:
            assert res[cat]["added"] == res[cat]["updated"] == res[cat]["removed"] == [], (cat, res)
        assert "restart" not in res
    assert [_snapshot(p) for p in cluster.peers] == before


def _peer_jobs(cluster):
    """``{fun: set of job dirs}`` of the multimaster_peer jobs the primary published."""
    import salt.payload  # pylint: disable=import-outside-toplevel

    ret = {"multimaster_peer.inventory": set(), "multimaster_peer.apply": set()}
    for load in cluster.job_cache(cluster.primary).glob("*/*/.load.p"):
        with open(load, "rb") as fh:
            fun = salt.payload.load(fh).get("fun")
        if fun in ret:
            ret[fun].add(load.parent)
    return ret


def _new_jobs(cluster, before):
    """How many jobs of each multimaster_peer function were published since ``before``."""
    return {fun: len(jobs - before[fun]) for fun, jobs in _peer_jobs(cluster).items()}


@pytest.mark.usefixtures("synced")
def test_a_change_sync_is_one_publish_per_peer(cluster):
    """
    #17 item 7: the primary remembers what each peer was last confirmed to
    hold, and publishes the apply with those digests; a peer changed behind
    its back answers with its inventory and converges in a second round.
    """
    pki, root = cluster.pki_dir(cluster.primary), cluster.file_root(cluster.primary)
    (pki / "minions" / "onepub").write_bytes(gen_keypair(1024)[1])
    (root / "one.sls").write_text("one: 1\n")
    before = _peer_jobs(cluster)
    ret = cluster.salt_run(cluster.primary, "multimaster.sync")
    assert ret.returncode == 0, ret
    for pm in cluster.peer_minions:
        assert ret.data[pm.id]["minion_keys"]["added"] == ["minions/onepub"], ret.data
        assert ret.data[pm.id]["file_roots"]["added"] == ["base:one.sls"], ret.data
    # one apply per peer, and no inventory at all
    new = _new_jobs(cluster, before)
    assert new == {"multimaster_peer.inventory": 0, "multimaster_peer.apply": 2}, new
    for peer in cluster.peers:
        assert (cluster.pki_dir(peer) / "minions" / "onepub").exists()
        assert (cluster.file_root(peer) / "one.sls").read_text() == "one: 1\n"

    # the first peer changed behind the primary's back: the fallback (its
    # own change, made since its last sync, is left there and named)
    peer0, pm0 = cluster.peers[0], cluster.peer_minions[0]
    (cluster.file_root(peer0) / "local.sls").write_text("mine\n")
    (root / "one.sls").write_text("one: 2\n")
    before = _peer_jobs(cluster)
    ret = cluster.salt_run(cluster.primary, "multimaster.sync")
    assert ret.returncode != 0, ret
    assert ret.data[pm0.id]["file_roots"]["removed"] == [], ret.data
    assert ret.data[pm0.id]["file_roots"]["peer_changed"] == [
        "base:local.sls: added on the peer since its last sync (kept)"], ret.data
    for pm in cluster.peer_minions:
        assert ret.data[pm.id]["file_roots"]["updated"] == ["base:one.sls"], ret.data
    # peer0: the conditional apply (refused), then the apply; peer1: one apply
    new = _new_jobs(cluster, before)
    assert new == {"multimaster_peer.inventory": 0, "multimaster_peer.apply": 3}, new
    for peer in cluster.peers:
        assert (cluster.file_root(peer) / "one.sls").read_text() == "one: 2\n"
        assert cluster.keys(peer) == cluster.keys(cluster.primary)
    assert (cluster.file_root(peer0) / "local.sls").exists()
    (pki / "minions" / "onepub").unlink()
    (root / "one.sls").unlink()
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "force=True")
    assert ret.returncode == 0, ret
    assert not (cluster.file_root(peer0) / "local.sls").exists()
    # nothing changed since: one inventory per peer checks it, and no apply
    # (the peers' key dirs changed a moment ago, their history record holds)
    before = _peer_jobs(cluster)
    ret = cluster.salt_run(cluster.primary, "multimaster.sync")
    assert ret.returncode == 0, ret
    new = _new_jobs(cluster, before)
    assert new == {"multimaster_peer.inventory": 2, "multimaster_peer.apply": 0}, new


@pytest.mark.usefixtures("synced")
def test_delete_and_move_on_primary_reach_peers_with_backup(cluster):
    pki = cluster.pki_dir(cluster.primary)
    (pki / "minions_rejected" / "rej1").unlink()
    (pki / "minions_pre" / "mover").rename(pki / "minions" / "mover")
    (cluster.file_root(cluster.primary) / "run.sh").unlink()
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=minion_keys,file_roots")
    assert ret.returncode == 0, ret
    for peer, pm in zip(cluster.peers, cluster.peer_minions):
        res = ret.data[pm.id]
        assert set(res["minion_keys"]["removed"]) == {"minions_rejected/rej1", "minions_pre/mover"}
        assert res["minion_keys"]["added"] == ["minions/mover"]
        assert res["file_roots"]["removed"] == ["base:run.sh"]
        assert cluster.keys(peer) == cluster.keys(cluster.primary)
        backup = pathlib.Path(res["backup"])
        assert (backup / "minion_keys" / "minions_rejected" / "rej1").exists()
        assert (backup / "file_roots" / "base" / "run.sh").exists()
        ret_key = cluster.salt_key(peer, "-L")
        assert ret_key.data == cluster.salt_key(cluster.primary, "-L").data


@pytest.mark.usefixtures("synced")
def test_damaged_saved_state_on_the_primary_still_converges(cluster):
    """
    The primary plans a bucket from its previous state only when that state
    checks out against the digests the peers compared with; else it asks them
    again.  Here the previous state is emptied: trusting it would leave the
    removed key and file on the peers.
    """
    pki, base = cluster.pki_dir(cluster.primary), cluster.file_root(cluster.primary)
    (pki / "minions" / "doomed").write_bytes(gen_keypair(1024)[1])
    (base / "doomed.sls").write_text("doomed: true\n")
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=minion_keys,file_roots")
    assert ret.returncode == 0, ret
    assert all((cluster.file_root(p) / "doomed.sls").exists() for p in cluster.peers)
    (pki / "minions" / "doomed").unlink()
    (base / "doomed.sls").unlink()
    state = pathlib.Path(cluster.primary.config["cachedir"]) / "multimaster"
    for name in ("state.sqlite", "state.sqlite-wal", "state.sqlite-shm"):  # the last scans
        (state / name).unlink(missing_ok=True)
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=minion_keys,file_roots")
    assert ret.returncode == 0, ret
    for peer, pm in zip(cluster.peers, cluster.peer_minions):
        res = ret.data[pm.id]
        assert res["minion_keys"]["removed"] == ["minions/doomed"], res
        assert res["file_roots"]["removed"] == ["base:doomed.sls"], res
        assert cluster.keys(peer) == cluster.keys(cluster.primary)
        assert not (cluster.file_root(peer) / "doomed.sls").exists()


@pytest.mark.usefixtures("synced")
def test_rescan_finds_a_key_rewritten_in_place(cluster):
    """
    A key rewritten in place (same inode, same directory entry, the dir's
    mtime unchanged) is found by the next sync: each key is statted, and
    its mtime and ctime moved; ``rescan=True`` reads every key again.
    """
    pki = cluster.pki_dir(cluster.primary)
    key = pki / "minions" / "inplace"
    key.write_bytes(gen_keypair(2048)[1])
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=minion_keys")
    assert ret.returncode == 0, ret
    assert all(ret.data[pm.id]["minion_keys"]["added"] == ["minions/inplace"]
               for pm in cluster.peer_minions), ret.data
    dir_stat = (pki / "minions").stat()
    with open(key, "r+b") as fh:  # same inode, same directory entry
        fh.truncate(0)
        fh.write(gen_keypair(2048)[1])
    os.utime(pki / "minions", ns=(dir_stat.st_atime_ns, dir_stat.st_mtime_ns))
    # found: another key for an id the peer holds is a conflict, as always
    for extra in ((), ("rescan=True",)):
        ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=minion_keys", *extra)
        assert ret.returncode != 0, ret
        for pm in cluster.peer_minions:
            conflicts = ret.data[pm.id]["minion_keys"]["conflicts"]
            assert [c.split(":")[0] for c in conflicts] == ["minions/inplace"], ret.data[pm.id]
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=minion_keys",
                           "rescan=True", "force=True")
    assert ret.returncode == 0, ret
    for peer, pm in zip(cluster.peers, cluster.peer_minions):
        assert ret.data[pm.id]["minion_keys"]["updated"] == ["minions/inplace"], ret.data[pm.id]
        assert (cluster.pki_dir(peer) / "minions" / "inplace").read_bytes() == key.read_bytes()


@pytest.mark.usefixtures("synced")
def test_conflicts_are_reported_and_forced(cluster):
    peer, pm = cluster.peers[0], cluster.peer_minions[0]
    ppki = cluster.pki_dir(peer)
    other = gen_keypair(1024)[1]
    (ppki / "minions" / "acc1").write_bytes(other)
    (ppki / "minions" / "peeronly").write_bytes(gen_keypair(1024)[1])
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", f"peers={pm.id}", "only=minion_keys")
    assert ret.returncode != 0, ret
    res = ret.data[pm.id]
    # changed on the peer since its last sync: named, left in place
    assert sorted(res["minion_keys"]["peer_changed"]) == [
        "minions/acc1: another key on the peer since its last sync (kept)",
        "minions/peeronly: accepted on the peer since its last sync (kept)"], res
    assert (ppki / "minions" / "acc1").read_bytes() == other
    assert (ppki / "minions" / "peeronly").exists()
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", f"peers={pm.id}",
                           "only=minion_keys", "force=True")
    res = ret.data[pm.id]
    assert res["result"] is True and res["minion_keys"]["conflicts"] == [], res
    assert cluster.keys(peer) == cluster.keys(cluster.primary)


@pytest.mark.usefixtures("synced")
def test_targeted_key_sync_mirrors_only_the_ids_given(cluster):
    """
    minion_ids (what the salt/key reactor passes): same plan, and after a
    full sync one publish per peer (an apply, no inventory); when keys of
    other ids differ too, the primary forgets what the peers hold and asks
    them once at the next sync.
    """
    pki = cluster.pki_dir(cluster.primary)
    (pki / "minions" / "tgt1").write_bytes(gen_keypair(1024)[1])
    (pki / "minions" / "untargeted").write_bytes(gen_keypair(1024)[1])
    before = [_snapshot(p) for p in cluster.peers]
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "minion_ids=tgt1", "test=True")
    assert ret.returncode == 0, ret
    for pm in cluster.peer_minions:
        assert ret.data[pm.id] == {"result": True, "minion_keys": {
            "added": ["minions/tgt1"], "updated": [], "removed": [], "conflicts": [], "errors": []}}
    assert [_snapshot(p) for p in cluster.peers] == before

    before = _peer_jobs(cluster)
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "minion_ids=tgt1")
    assert ret.returncode == 0, ret
    for peer, pm in zip(cluster.peers, cluster.peer_minions):
        assert ret.data[pm.id]["minion_keys"]["added"] == ["minions/tgt1"], ret.data
        ppki = cluster.pki_dir(peer)
        assert (ppki / "minions" / "tgt1").read_bytes() == (pki / "minions" / "tgt1").read_bytes()
        assert not (ppki / "minions" / "untargeted").exists()
    new = _new_jobs(cluster, before)
    assert new == {"multimaster_peer.inventory": 0, "multimaster_peer.apply": 2}, new
    # the peers lack "untargeted": what they hold is no longer known (asked,
    # nothing to apply)
    (pki / "minions" / "untargeted").unlink()
    before = _peer_jobs(cluster)
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "minion_ids=tgt1")
    assert ret.returncode == 0, ret
    assert _new_jobs(cluster, before) == {
        "multimaster_peer.inventory": 1, "multimaster_peer.apply": 0}, ret

    # rejected on the primary: moved on the peers, the old file backed up;
    # one publish each (the primary remembered what the last one set)
    (pki / "minions" / "tgt1").rename(pki / "minions_rejected" / "tgt1")
    before = _peer_jobs(cluster)
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "minion_ids=tgt1")
    assert ret.returncode == 0, ret
    for peer, pm in zip(cluster.peers, cluster.peer_minions):
        res = ret.data[pm.id]
        assert res["minion_keys"]["added"] == ["minions_rejected/tgt1"], res
        assert res["minion_keys"]["removed"] == ["minions/tgt1"], res
        assert (pathlib.Path(res["backup"]) / "minion_keys" / "minions" / "tgt1").exists()
        assert not (cluster.pki_dir(peer) / "minions" / "tgt1").exists()
        # the peer's master rotates its AES key, as salt-key does
        assert res["aes_rotation"] == "requested", res
    new = _new_jobs(cluster, before)
    assert new == {"multimaster_peer.inventory": 0, "multimaster_peer.apply": 2}, new

    # the key deleted on the first peer behind the primary's back, accepted
    # again on the primary: that peer answers the conditional apply with its
    # keys of the id: changed on both sides since its last sync, a conflict
    # left in place; the other keeps the key rejected (a sync never accepts
    # again a key rejected on a peer); force=True settles both
    peer0, pm0 = cluster.peers[0], cluster.peer_minions[0]
    (cluster.pki_dir(peer0) / "minions_rejected" / "tgt1").unlink()
    (pki / "minions_rejected" / "tgt1").rename(pki / "minions" / "tgt1")
    before = _peer_jobs(cluster)
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "minion_ids=tgt1")
    assert ret.returncode != 0, ret
    assert ret.data[pm0.id]["minion_keys"]["added"] == [], ret.data
    assert [c.split(":")[0] for c in ret.data[pm0.id]["minion_keys"]["conflicts"]] == [
        "minions_rejected/tgt1"], ret.data
    res = ret.data[cluster.peer_minions[1].id]
    assert res["result"] is False and res["minion_keys"]["added"] == [], res
    assert res["minion_keys"]["conflicts"][0].startswith(
        "minions_rejected/tgt1: revoked on this peer master"), res
    assert (cluster.pki_dir(cluster.peers[1]) / "minions_rejected" / "tgt1").exists()
    new = _new_jobs(cluster, before)
    assert new == {"multimaster_peer.inventory": 0, "multimaster_peer.apply": 2}, new
    assert not (cluster.pki_dir(peer0) / "minions" / "tgt1").exists()
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "minion_ids=tgt1", "force=True")
    assert ret.returncode == 0, ret
    assert ret.data[pm0.id]["minion_keys"]["added"] == ["minions/tgt1"], ret.data
    res = ret.data[cluster.peer_minions[1].id]
    assert res["minion_keys"]["added"] == ["minions/tgt1"], res
    assert res["minion_keys"]["removed"] == ["minions_rejected/tgt1"], res
    for peer in cluster.peers:
        assert (cluster.pki_dir(peer) / "minions" / "tgt1").read_bytes() == (
            pki / "minions" / "tgt1").read_bytes()
        assert not (cluster.pki_dir(peer) / "minions_rejected" / "tgt1").exists()

    # a different key for the id on a peer is a conflict there, untouched
    other = gen_keypair(1024)[1]
    (cluster.pki_dir(peer0) / "minions" / "tgt2").write_bytes(other)
    (pki / "minions" / "tgt2").write_bytes(gen_keypair(1024)[1])
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "minion_ids=tgt2")
    assert ret.data[pm0.id]["minion_keys"]["conflicts"][0].startswith("minions/tgt2:")
    assert (cluster.pki_dir(peer0) / "minions" / "tgt2").read_bytes() == other
    assert ret.data[cluster.peer_minions[1].id]["minion_keys"]["added"] == ["minions/tgt2"]
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "minion_ids=tgt2", "force=True")
    assert ret.returncode == 0, ret
    assert ret.data[pm0.id]["minion_keys"]["updated"] == ["minions/tgt2"]

    # bad input names it and writes nothing
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "minion_ids=ok1,../evil")
    assert ret.returncode != 0 and "'../evil'" in ret.data["error"], ret
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "minion_ids=tgt1",
                           "only=file_roots")
    assert ret.returncode != 0 and "file_roots" in ret.data["error"], ret
    for name in ("minions/tgt1", "minions/tgt2"):
        (pki / name).unlink()
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=minion_keys")
    assert ret.returncode == 0, ret
    for peer in cluster.peers:
        assert cluster.keys(peer) == cluster.keys(cluster.primary)


def test_bad_input_names_it(cluster):
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=minion_keys,bogus")
    assert ret.returncode != 0
    assert "bogus" in ret.data["error"]
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "timeout=soon")
    assert ret.returncode != 0
    assert "timeout must be a number of seconds, not 'soon'" in str(ret.data) + ret.stdout + ret.stderr
    good = cluster.peer_minions[0].id
    # peers= may only name configured peers: anything else refuses the run
    ret = cluster.salt_run(cluster.primary, "multimaster.sync",
                           f"peers={good},nosuchpeer,../evil", "only=minion_keys")
    assert ret.returncode != 0
    assert ret.data["error"].startswith(
        "peer(s) 'nosuchpeer', '../evil' not in multimaster:peers"), ret
    # a junk file in a key dir on the primary is reported, not replicated
    pki = cluster.pki_dir(cluster.primary)
    (pki / "minions" / "junk").write_text("not a key")
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", f"peers={good}", "only=minion_keys")
    assert any("junk" in e for e in ret.data[good]["primary_errors"])
    assert not (cluster.pki_dir(cluster.peers[0]) / "minions" / "junk").exists()
    (pki / "minions" / "junk").unlink()


@pytest.mark.usefixtures("synced")
def test_unreachable_peer_fails_alone(cluster):
    down = cluster.peer_minions[1]
    up = cluster.peer_minions[0]
    newkey = cluster.pki_dir(cluster.primary) / "minions" / "late1"
    newkey.write_bytes(gen_keypair(1024)[1])
    down.terminate()
    try:
        # the peer's job is tracked: a peer that is not there is given up
        # within seconds, not after the timeout
        started = time.monotonic()
        ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=minion_keys",
                               "timeout=600")
        assert time.monotonic() - started < 120
        assert ret.returncode != 0
        assert ret.data[down.id]["result"] is False
        # in step at the last sync: the change went out as one conditional apply
        assert ret.data[down.id]["error"] == (
            f"{down.id}'s salt-minion did not answer the apply (it is not connected to "
            "this master, or it stopped while working): start it, or check `salt-run "
            "manage.status`")
        assert ret.data[down.id]["minion_keys"]["unconfirmed"] == ["minions/late1"]
        assert ret.data[up.id]["result"] is True
        assert (cluster.pki_dir(cluster.peers[0]) / "minions" / "late1").exists()
        assert not (cluster.pki_dir(cluster.peers[1]) / "minions" / "late1").exists()
    finally:
        down.start()
    assert cluster.wait_ping(cluster.primary, down.id)
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=minion_keys")
    assert ret.returncode == 0, ret
    assert (cluster.pki_dir(cluster.peers[1]) / "minions" / "late1").exists()


@pytest.mark.usefixtures("synced")
def test_no_private_key_material_outside_pki_dirs(cluster):
    """Grep every cachedir, log and config of every daemon for the key bytes."""
    priv, _ = master_key_paths(cluster.primary.config["pki_dir"])
    lines = [ln for ln in priv.read_text().splitlines() if ln and not ln.startswith("-----")]
    needles = [ln.encode() for ln in lines[1:-1]]
    pki_dirs = {os.path.realpath(d.config["pki_dir"]) for d in [*cluster.masters, *cluster.all_minions]}
    hits = []
    for daemon in [*cluster.masters, *cluster.all_minions]:
        root = os.path.realpath(daemon.config["root_dir"])
        for dirpath, _, files in os.walk(root):
            if any(dirpath == p or dirpath.startswith(p + os.sep) for p in pki_dirs):
                continue
            for name in files:
                path = os.path.join(dirpath, name)
                try:
                    data = open(path, "rb").read()
                except OSError:
                    continue
                if any(n in data for n in needles):
                    hits.append(path)
    assert hits == []


@pytest.mark.usefixtures("synced")
def test_restore_rolls_a_peer_back_and_backups_are_pruned(cluster):
    peer, pm = cluster.peers[0], cluster.peer_minions[0]
    base, pbase = cluster.file_root(cluster.primary), cluster.file_root(peer)
    old = (pbase / "web" / "init.sls").read_text()
    (base / "web" / "init.sls").write_text("web:\n  test.fail_without_changes\n")
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", f"peers={pm.id}",
                           "only=file_roots", "backup_keep=2")
    assert ret.returncode == 0, ret.stdout
    assert (pbase / "web" / "init.sls").read_text() != old
    backups = pathlib.Path(peer.config["cachedir"]) / "multimaster" / "backup"
    assert len(list(backups.iterdir())) <= 2  # older backups pruned
    # test=True lists, changes nothing
    ret = cluster.salt_run(cluster.primary, "multimaster.restore", f"peer={pm.id}", "test=True")
    assert ret.returncode == 0, ret.stdout
    # link.sls is a symlink to web/init.sls on the primary, a copy on the peer
    assert ret.data[pm.id]["restored"] == [
        "file_roots/base/link.sls", "file_roots/base/web/init.sls"], ret.data
    assert (pbase / "web" / "init.sls").read_text() != old
    ret = cluster.salt_run(cluster.primary, "multimaster.restore", f"peer={pm.id}")
    assert ret.returncode == 0, ret.stdout
    assert (pbase / "web" / "init.sls").read_text() == old
    # a peer that is not configured, or an unknown backup: named errors
    ret = cluster.salt_run(cluster.primary, "multimaster.restore", "peer=syn-minion1")
    assert ret.returncode != 0 and "'syn-minion1' not in multimaster:peers" in ret.data["error"], \
        ret.data
    ret = cluster.salt_run(cluster.primary, "multimaster.restore", f"peer={pm.id}",
                           "backup=20000101T000000Z")
    assert ret.returncode != 0 and "no backup '20000101T000000Z'" in str(ret.data), ret.data
    # the next sync mirrors the primary again
    (base / "web" / "init.sls").write_text(old)
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", f"peers={pm.id}", "only=file_roots")
    assert ret.returncode == 0, ret.stdout
