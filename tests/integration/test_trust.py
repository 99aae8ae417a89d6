"""
Trust, on real daemons: what rides the publish channel.

Every minion of the primary receives and decrypts every publish (one AES
session key), so a sync publishes nothing but routing: the arguments are
sealed to each peer, and bulk is pulled point-to-point or refused.
"""

import hashlib
import pathlib
import secrets

import pytest
import salt.payload
import salt.utils.yaml

from salt_multimaster import protocol
from tests.support.cluster import gen_keypair

pytestmark = pytest.mark.daemons

RAND = secrets.token_hex(4)


@pytest.fixture(scope="module")
def cluster(cluster_factory):
    cluster = cluster_factory(
        "tru",
        peers=1,
        minions=1,
        primary_overrides={"publisher_acl": {"ops": ["test.*"]}},
        # the leak search reads the minions' logs: every line Salt can write
        log_level="debug",
    )
    _dropin(cluster.primary, "multimaster.conf", {"multimaster": {
        "peers": [m.id for m in cluster.peer_minions],
        "master_config_keys": ["nodegroups", "publisher_acl", "external_auth"]}})
    cluster.start()
    assert cluster.wait_pings(cluster.primary, cluster.all_minions)
    yield cluster
    cluster.stop()


def _dropin(master, name, values):
    path = pathlib.Path(master.config_file).parent / "master.d" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(salt.utils.yaml.safe_dump(values))


def _publish_loads(master):
    """Every load this master published or recorded (the job cache's .load.p)."""
    ret = []
    for load in sorted(pathlib.Path(master.config["cachedir"]).glob("jobs/*/*/.load.p")):
        with open(load, "rb") as fh:
            ret.append((load, salt.payload.load(fh), load.stat().st_size))
    return ret


def _leaks(cluster, needles):
    """Where any of ``needles`` shows up outside the primary and the peer."""
    needles = [n.encode() for n in needles]
    hits = []
    # what the primary published: every minion decrypts it
    for path, load, _ in _publish_loads(cluster.primary):
        if str(load.get("fun", "")).startswith("runner."):
            continue  # a runner's own record, never published
        text = repr(load).encode()
        hits.extend(f"publish {load.get('fun')} ({path})" for n in needles if n in text)
    # a plain minion: its log (debug), cachedir, config
    for minion in cluster.minions:
        root = pathlib.Path(minion.config["root_dir"])
        for path in root.rglob("*"):
            if path.is_file() and any(n in path.read_bytes() for n in needles):
                hits.append(str(path))
    # the publish as any targeted minion logs it ("Command details")
    for minion in cluster.all_minions:
        for line in pathlib.Path(minion.config["log_file"]).read_bytes().splitlines():
            if b"Command details" in line and any(n in line for n in needles):
                hits.append(f"{minion.id} log: {line[:120]!r}")
    return hits


def _secrets(cluster, n):
    """A pillar file and config values only the masters may know; their needles."""
    pillar = cluster.file_root(cluster.primary, kind="pillar_roots")
    rel = f"vault_{RAND}_{n}.sls"
    data = f"db_password: hunter{n}-{RAND}\n".encode()
    (pillar / rel).write_bytes(data)
    user = f"eauser{RAND}x{n}"
    _dropin(cluster.primary, "policy.conf", {
        "external_auth": {"pam": {user: ["test.*"]}},
        "nodegroups": {f"ng{RAND}{n}": f"L@{RAND}host{n}"}})
    return rel, user, [rel, hashlib.sha256(data).hexdigest(), f"hunter{n}-{RAND}", user,
                       f"{RAND}host{n}"]


def test_nothing_secret_rides_the_publish(cluster):
    """Pillar paths, sizes, hashes and master_config values are sealed to the peer."""
    peer, pm = cluster.peers[0], cluster.peer_minions[0]
    published = {p for p, _, _ in _publish_loads(cluster.primary)}
    needles = []
    for n in (1, 2):  # a first sync, then a change of each
        rel, user, new = _secrets(cluster, n)
        needles += new
        ret = cluster.salt_run(cluster.primary, "multimaster.sync")
        res = ret.data[pm.id]
        # master_config changed: the peer's master must restart (no systemd here)
        assert ret.returncode != 0 and res["result"] is False, res
        assert res["restart"] == "restart_required" and "must restart" in res["error"], res
        assert f"base:{rel}" in res["pillar_roots"]["added"]
        # it did travel, sealed
        assert (cluster.file_root(peer, kind="pillar_roots") / rel).read_text().startswith(
            "db_password")
        dropin = pathlib.Path(peer.config_file).parent / "master.d" / "multimaster-sync.conf"
        assert user in dropin.read_text()
    applies = [load for path, load, _ in _publish_loads(cluster.primary)
               if load.get("fun") == "multimaster_peer.apply" and path not in published]
    assert len(applies) == 2
    assert _leaks(cluster, needles) == []
    cluster.restart(peer)
    ret = cluster.salt_run(cluster.primary, "multimaster.sync")
    assert ret.returncode == 0, ret.stdout


def test_bulk_is_refused_without_the_pull_channel(cluster):
    peer, pm = cluster.peers[0], cluster.peer_minions[0]
    pki = cluster.pki_dir(cluster.primary) / "minions_pre"
    pki.mkdir(exist_ok=True)
    ids = [f"bulk{i:03d}" for i in range(300)]
    for mid in ids:
        (pki / mid).write_bytes(gen_keypair(1024)[1])
    published = {p for p, _, _ in _publish_loads(cluster.primary)}
    pattern = protocol.peer_run_pattern(pm.id)
    for args in (("test=True",), ()):
        ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=minion_keys", *args)
        assert ret.returncode != 0, ret.stdout
        res = ret.data[pm.id]
        assert res["result"] is False
        assert "exceeds inline_limit (64 KiB)" in res["error"], res
        assert f"'{pattern}':\n    - multimaster.pull" in res["error"], res["error"]
    # nothing was published, nothing written, nothing claimed
    assert res["minion_keys"]["added"] == []
    assert len(res["minion_keys"]["unconfirmed"]) == 300
    assert not any(load.get("fun") == "multimaster_peer.apply"
                   for path, load, _ in _publish_loads(cluster.primary) if path not in published)
    assert not set(ids) & set(cluster.keys(peer)["minions_pre"])
    ret = cluster.salt_run(cluster.primary, "multimaster.status")
    assert ret.data[pm.id]["pull_allowed"] is False
    assert pattern in ret.data[pm.id]["pull_config"]
    # the snippet from the error, added as told: the same sync goes through,
    # pulled point-to-point; the publish stays small
    snippet = res["error"].split("\n", 1)[1]
    (pathlib.Path(cluster.primary.config_file).parent / "master.d" / "pull.conf").write_text(
        snippet + "\n")
    cluster.restart(cluster.primary)
    assert cluster.wait_ping(cluster.primary, pm.id)
    ret = cluster.salt_run(cluster.primary, "multimaster.status")
    assert ret.data[pm.id]["pull_allowed"] is True
    assert "pull_config" not in ret.data[pm.id]
    before = {p for p, _, _ in _publish_loads(cluster.primary)}
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=minion_keys")
    assert ret.returncode == 0, ret.stdout
    assert sorted(ret.data[pm.id]["minion_keys"]["added"]) == sorted(
        f"minions_pre/{mid}" for mid in ids)
    assert set(ids) <= set(cluster.keys(peer)["minions_pre"])
    sizes = [size for path, load, size in _publish_loads(cluster.primary)
             if path not in before and str(load.get("fun")).startswith("multimaster_peer.")]
    assert sizes and max(sizes) < 16 * 1024, sizes


def _salt_run_plain(cluster, *args):
    """salt-run as an operator types it: no --out (salt-factories adds --out=json)."""
    import os  # pylint: disable=import-outside-toplevel
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel

    cmd = [os.path.join(os.path.dirname(sys.executable), "salt-run"),
           "-c", str(pathlib.Path(cluster.primary.config_file).parent), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture
def in_step(cluster):
    """The peer mirroring the primary, its master restarted if the sync asks for it."""
    pm = cluster.peer_minions[0]
    ret = cluster.salt_run(cluster.primary, "multimaster.sync")
    if ret.returncode != 0 and ret.data[pm.id].get("restart") == "restart_required":
        cluster.restart(cluster.peers[0])
        ret = cluster.salt_run(cluster.primary, "multimaster.sync")
    assert ret.returncode == 0, ret.stdout
    return cluster


def test_default_output_is_a_compact_summary(in_step):
    cluster = in_step
    pm = cluster.peer_minions[0]
    ret = _salt_run_plain(cluster, "multimaster.status")
    assert ret.returncode == 0, ret.stderr
    lines = ret.stdout.splitlines()
    assert lines[0] == f"{pm.id}: in sync", ret.stdout
    assert f"{pm.id}:   master key     same as the primary" in ret.stdout
    assert lines[-1] == "retcode: 0"
    (cluster.file_root(cluster.primary) / "new.sls").write_text("new: {}\n")
    ret = _salt_run_plain(cluster, "multimaster.sync", "test=True")
    assert ret.returncode == 0, ret.stderr
    assert f"{pm.id}:   file_roots    1 would add: base:new.sls" in ret.stdout.splitlines()
    assert "summary: 1 peer(s): 0 in sync, 1 would change, 0 failed (test run, nothing " \
           "changed)" in ret.stdout
    assert len(ret.stdout.splitlines()) < 15, ret.stdout
    (cluster.file_root(cluster.primary) / "new.sls").unlink()
    # a bad input: one line, non-zero exit
    ret = _salt_run_plain(cluster, "multimaster.sync", "only=bogus")
    assert ret.returncode != 0
    assert "bogus" in ret.stdout
