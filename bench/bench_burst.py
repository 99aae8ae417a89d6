"""
Benchmark: ``salt-key -A -y`` of many pending keys on the primary with the
salt/key reactor of ``salt.multimaster.master`` installed: the time until the
peer holds every key, and the number of syncs the reactor ran.

Run standalone (it drives pytest and the repository's real-daemon fixtures)::

    .venv/3008/bin/python bench/bench_burst.py              # 300 keys
    MM_BENCH_BURST=100 .venv/3008/bin/python bench/bench_burst.py

Two cases in the same run, on the same cluster: the baseline
(``key_event_quiet: 0``: every round syncs what is queued at once, the
behaviour before coalescing) and the default (the second sync waits until
the events stopped for a second).  Prints both and their ratio, writes JSON
to bench/results/; asserts nothing about timing.
"""

import os
import pathlib
import sys
import time

import pytest

import daemons  # bench/daemons.py
from daemons import salt_factories_config  # noqa: F401  pylint: disable=unused-import

REPO = pathlib.Path(__file__).resolve().parent.parent
KEYS = int(os.environ.get("MM_BENCH_BURST", "300"))



def _case(cluster, name, quiet):
    import salt.utils.yaml  # pylint: disable=import-outside-toplevel

    from tests.support.cluster import gen_keypair, wait_until  # pylint: disable=import-outside-toplevel

    master_d = pathlib.Path(cluster.primary.config_file).parent / "master.d"
    conf = {"multimaster": {"peers": [m.id for m in cluster.peer_minions]}}
    if quiet is not None:
        conf["multimaster"]["key_event_quiet"] = quiet
    (master_d / "multimaster.conf").write_text(salt.utils.yaml.safe_dump(conf))
    cluster.restart(cluster.primary)
    for pm in cluster.peer_minions:
        assert cluster.wait_ping(cluster.primary, pm.id)
    ids = [f"{name}{i:04d}" for i in range(KEYS)]
    pre = cluster.pki_dir(cluster.primary) / "minions_pre"
    pre.mkdir(exist_ok=True)
    for mid in ids:
        (pre / mid).write_bytes(gen_keypair(1024)[1])
    log = cluster.log_files(cluster.primary)[0]
    before = log.read_text(errors="replace").count("syncing the keys of")
    start = time.monotonic()
    ret = cluster.salt_key(cluster.primary, "-A", "-y")
    assert ret.returncode == 0, ret
    peer = cluster.peers[0]
    held = wait_until(lambda: set(ids) <= set(cluster.keys(peer)["minions"]),
                      deadline=600, step=0.2)
    elapsed = time.monotonic() - start
    time.sleep(5)  # a queued round finishing after the last key arrived
    syncs = log.read_text(errors="replace").count("syncing the keys of") - before
    return {"keys": KEYS, "all_on_peer": held, "seconds": round(elapsed, 2), "syncs": syncs}


@pytest.mark.daemons
def test_bench_burst(cluster_factory, repo_tree, capsys):
    import salt.utils.yaml  # pylint: disable=import-outside-toplevel

    cluster = cluster_factory("bbu", peers=1, minions=0, accept_on_peers=False,
                              # the repository without .venv/.git (tests/conftest.py's repo_tree), as
                              # test_formula's frr: the primary's fileserver walks its roots
                              primary_overrides={"file_roots": {"base": [str(repo_tree)]}})
    master_d = pathlib.Path(cluster.primary.config_file).parent / "master.d"
    master_d.mkdir(exist_ok=True)
    (master_d / "multimaster.conf").write_text(salt.utils.yaml.safe_dump(
        {"multimaster": {"peers": [m.id for m in cluster.peer_minions]}}))
    # what salt.multimaster.master writes: the reactor, and the pull channel
    # (a coalesced sync of hundreds of keys exceeds inline_limit)
    from salt_multimaster import protocol  # pylint: disable=import-outside-toplevel

    (master_d / "multimaster-reactor.conf").write_text(salt.utils.yaml.safe_dump(
        {"reactor": [{"salt/key": ["salt://salt/multimaster/reactor/key.sls"]}],
         "peer_run": protocol.peer_run_config([m.id for m in cluster.peer_minions])}))
    cluster.start()
    for pm in cluster.peer_minions:
        assert cluster.wait_ping(cluster.primary, pm.id)
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=minion_keys")
    # salt-run exits 0 on a runner it cannot load ("... is not available.")
    assert ret.returncode == 0 and "is not available" not in str(ret.stdout), ret.stdout
    baseline = _case(cluster, "base", 0)
    coalesced = _case(cluster, "coal", None)
    report = {"baseline_quiet_0": baseline, "default": coalesced,
              "time_ratio": round(coalesced["seconds"] / baseline["seconds"], 2),
              "sync_ratio": round(coalesced["syncs"] / max(baseline["syncs"], 1), 3)}
    daemons.save("bench_burst", report)
    with capsys.disabled():
        print(f"\nsalt-key -A -y of {KEYS} pending keys, reactor installed, until the peer "
              "holds them all:")
        for label, case in (("baseline (quiet 0)", baseline), ("default (quiet unset)", coalesced)):
            print(f"  {label:<22} {case['seconds']:7.2f} s  {case['syncs']:3d} syncs  "
                  f"all on peer: {case['all_on_peer']}")
        print(f"  ratio default/baseline: time {report['time_ratio']}x, "
              f"syncs {report['sync_ratio']}x (goal: one or two syncs)", flush=True)
    assert baseline["all_on_peer"] and coalesced["all_on_peer"]


if __name__ == "__main__":
    sys.exit(daemons.main(__file__))
