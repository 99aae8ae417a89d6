"""
Benchmark: continuous replication (the ``multimaster_watch`` engine on the
primary, its change journal as a trigger), nobody running ``sync``.

* Delay: a file written in the primary's ``file_roots``, until the peer
  master's fileserver serves it (Salt's ``Fileserver.find_file`` on the
  peer's own options, in this process, polled every 10 ms): p50 and p99 of
  ``MM_BENCH_CONTINUOUS`` writes (default 30), one at a time.  The last
  one is also fetched through the peer with ``cp.get_file_str`` (the real
  path, not timed).  The baseline, from the same arithmetic: a cron job
  syncing every minute delays a change 30 s on average (p50) and 59.4 s at
  p99, before its own run time.
* Burst: 1,000 files written at once: the syncs the engine ran until the
  peer serves them all (goal: at most 3).

Run standalone (it drives pytest and the repository's real-daemon
fixtures)::

    .venv/3008/bin/python bench/bench_continuous.py

Prints the figures and their ratios to the goals, writes JSON to
bench/results/; asserts nothing about timing.
"""

import os
import pathlib
import statistics
import sys
import time

import pytest

import daemons  # bench/daemons.py
from daemons import salt_factories_config  # noqa: F401  pylint: disable=unused-import

SAMPLES = int(os.environ.get("MM_BENCH_CONTINUOUS", "30"))
BURST = 1000
CRON_INTERVAL = 60.0



def _served(fileserver, path, body):
    """Whether the peer's fileserver serves ``path`` with ``body``."""
    found = fileserver.find_file(path, "base")
    if not found.get("path"):
        return False
    try:
        return pathlib.Path(found["path"]).read_bytes() == body
    except OSError:
        return False


def _syncs(cluster):
    return cluster.log_since(cluster.primary, 0).count(
        "multimaster_watch: changes on this master: syncing")


def _percentile(values, pct):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(pct / 100 * len(ordered)) - 1))]


@pytest.mark.daemons
def test_bench_continuous(cluster_factory, capsys):
    import salt.config  # pylint: disable=import-outside-toplevel
    import salt.fileserver  # pylint: disable=import-outside-toplevel
    import salt.utils.yaml  # pylint: disable=import-outside-toplevel

    from salt_multimaster import protocol  # pylint: disable=import-outside-toplevel
    from tests.support.cluster import wait_until  # pylint: disable=import-outside-toplevel

    cluster = cluster_factory("bcn", peers=1, minions=0,
                              master_overrides={"engines": [{"multimaster_watch": {}}],
                                                "log_level_logfile": "info"})
    master_d = pathlib.Path(cluster.primary.config_file).parent / "master.d"
    master_d.mkdir(exist_ok=True)
    peers = [m.id for m in cluster.peer_minions]
    (master_d / "multimaster.conf").write_text(salt.utils.yaml.safe_dump(
        {"multimaster": {"peers": peers}, "peer_run": protocol.peer_run_config(peers)}))
    cluster.start()
    assert cluster.wait_ping(cluster.primary, peers[0])
    # what the engine replicates (the config would ask for a peer restart)
    ret = cluster.salt_run(cluster.primary, "multimaster.sync",
                           "only=minion_keys,file_roots,pillar_roots")
    assert ret.returncode == 0, ret.stdout
    peer = cluster.peers[0]
    opts = salt.config.master_config(peer.config_file)
    fileserver = salt.fileserver.Fileserver(opts)
    root = cluster.file_root(cluster.primary) / "bench"
    root.mkdir(exist_ok=True)
    time.sleep(3)  # the engine's journal settled after the first sync

    delays, lost = [], 0
    for i in range(SAMPLES):
        body = f"sample {i} {time.time()}\n".encode()
        start = time.monotonic()
        (root / f"s{i}.txt").write_bytes(body)
        if wait_until(lambda i=i, body=body: _served(fileserver, f"bench/s{i}.txt", body), 120,
                      step=0.01):
            delays.append(time.monotonic() - start)
        else:
            lost += 1
        time.sleep(0.5)  # the next write is another change, not the same burst
    last = SAMPLES - 1
    cli = cluster.salt(peer, "cp.get_file_str", f"salt://bench/s{last}.txt",
                       minion_tgt=peers[0])
    through_cli = cli.returncode == 0 and str(cli.data).startswith(f"sample {last} ")

    before = _syncs(cluster)
    burst = root / "burst"
    burst.mkdir()
    start = time.monotonic()
    for i in range(BURST):
        (burst / f"b{i:04d}.txt").write_text(f"{i}\n")
    peer_burst = cluster.file_root(peer) / "bench" / "burst"

    def all_there():
        return (all(_served(fileserver, f"bench/burst/b{i:04d}.txt", f"{i}\n".encode())
                    for i in (0, BURST // 2, BURST - 1))
                and len(list(peer_burst.glob("*"))) == BURST)

    served_all = wait_until(all_there, 300, step=0.1)
    burst_secs = time.monotonic() - start
    time.sleep(3)  # a sync started meanwhile shows in the log
    burst_syncs = _syncs(cluster) - before

    p50, p99 = (_percentile(delays, 50), _percentile(delays, 99)) if delays else (None, None)
    cron = {"p50": CRON_INTERVAL / 2, "p99": CRON_INTERVAL * 0.99}
    report = {"samples": SAMPLES, "lost": lost, "p50_s": p50, "p99_s": p99,
              "mean_s": statistics.mean(delays) if delays else None,
              "served_through_cp_get_file_str": through_cli,
              "cron_every_minute_s": cron,
              "burst": {"files": BURST, "seconds": round(burst_secs, 2), "syncs": burst_syncs,
                        "all_served": served_all}}
    daemons.save("bench_continuous", report)
    with capsys.disabled():
        print(f"\ncontinuous replication, 1 peer, {SAMPLES} writes one at a time "
              f"({lost} not served within 120 s):")
        if delays:
            print(f"  write on the primary -> served by the peer: p50 {p50:.2f} s "
                  f"(goal 2 s: {p50 / 2:.2f}x), p99 {p99:.2f} s (goal 5 s: {p99 / 5:.2f}x)")
            print(f"  a cron sync every minute: p50 {cron['p50']:.0f} s, p99 {cron['p99']:.1f} s "
                  f"(ratio p50 {p50 / cron['p50']:.3f}x, p99 {p99 / cron['p99']:.3f}x), "
                  "before its run time")
        print(f"  the last write through the peer with cp.get_file_str: "
              f"{'served' if through_cli else 'NOT served'}")
        print(f"  burst of {BURST} files: {burst_syncs} syncs (goal <= 3: "
              f"{burst_syncs / 3:.2f}x), {burst_secs:.1f} s until the peer held them all "
              f"(all served: {served_all})", flush=True)
    assert delays and served_all and through_cli


if __name__ == "__main__":
    sys.exit(daemons.main(__file__))
