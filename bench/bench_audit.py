#!/usr/bin/env python3
"""
Benchmark ``salt '*' multimaster.audit`` against ``salt '*' test.ping``
through the same master, in the same run.

Standalone, real daemons::

    .venv/3008/bin/python bench/bench_audit.py [--minions N] [--repeat N] [--keep]

What it builds (under one short /tmp/mmb-audit-* root, removed at the end):
a real cluster from ``tests/support/cluster.py`` (salt-factories outside
pytest): a primary master on 127.x.y.2, one peer master on .3 sharing its
key, and N minions of both masters; the extension is ``pip install
--target``-ed and put on PYTHONPATH, as the test-suite does.  The minions'
pillar carries the expected masters and fingerprint, so the audit runs every
check (the version is passed as ``master_version``).

What it measures (wall clock of the whole CLI command, as a user runs it):
``salt '*' test.ping`` and ``salt '*' multimaster.audit`` alternated,
``--repeat`` times each, through the primary; then the same audit with
``salt-run multimaster.audit`` (the fleet report, which also waits for
missing minions).  It prints median / min / max and the ratio of medians
audit/ping (goal of issue 4: <= 1.5x) and writes JSON to bench/results/.
Nothing asserts on timing.
"""

import argparse
import contextlib
import datetime
import json
import logging
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(sys.executable).parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "_utils"))  # the core, as tests/conftest.py does
GOAL = 1.5


def say(msg):
    print(f"[bench_audit] {msg}", flush=True)


def quiet_salt_logging():
    try:
        import salt._logging.impl  # pylint: disable=import-outside-toplevel

        salt._logging.impl.shutdown_temp_handler()
    except Exception:  # pylint: disable=broad-except
        pass
    logging.getLogger().addHandler(logging.NullHandler())


def install_extension(root):
    """``pip install --no-deps --target`` of a copy of the repo (keeps the repo clean)."""
    src = root / "src"
    shutil.copytree(
        REPO, src,
        ignore=shutil.ignore_patterns(".venv", ".git", "bench", "tests", "__pycache__",
                                      ".mm-sandbox*", "build", "dist", "*.egg-info",
                                      ".pytest_cache"),
    )
    from tests.support.cluster import install_extension  # pylint: disable=import-outside-toplevel

    return install_extension(src, root / "site")


def build_cluster(root, stack, minions):
    from tests.support.cluster import Cluster, standalone_factories  # pylint: disable=import-outside-toplevel

    factories = standalone_factories(root, stack, slow_stop=False)
    quiet = {"log_level_logfile": "warning"}
    cluster = Cluster(
        factories, "bau", peers=1, minions=minions, share_master_keys=True,
        master_overrides=dict(quiet, **{"pytest-master": {"log": {"disabled": True}}}),
        minion_overrides=dict(quiet, master_alive_interval=30,
                              **{"pytest-minion": {"log": {"disabled": True}}}),
    )
    stack.callback(cluster.stop)
    cluster.start()
    masters = [m.config["interface"] for m in cluster.masters]
    finger = cluster.master_fingerprint(cluster.primary)
    for master in cluster.masters:
        pillar = pathlib.Path(master.config["pillar_roots"]["base"][0])
        pillar.mkdir(parents=True, exist_ok=True)
        (pillar / "top.sls").write_text("base:\n  'bau-minion*':\n    - multimaster\n")
        (pillar / "multimaster.sls").write_text(
            f"multimaster:\n  masters: {json.dumps(masters)}\n  master_finger: '{finger}'\n")
    for minion in cluster.minions:
        if not cluster.wait_ping(cluster.primary, minion.id, deadline=120):
            raise RuntimeError(f"minion {minion.id} does not answer the primary")
    return cluster


def timed(cmd, env):
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    return time.perf_counter() - start, proc


def stats(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "mean": statistics.fmean(values), "runs": values}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--minions", type=int, default=2, help="minions of both masters (2)")
    parser.add_argument("--repeat", type=int, default=7, help="runs of each command (7)")
    parser.add_argument("--keep", action="store_true", help="keep the /tmp/mmb-audit-* root")
    args = parser.parse_args(argv)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")

    def _stop(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)
    quiet_salt_logging()
    root = pathlib.Path(tempfile.mkdtemp(prefix="mmb-audit-", dir="/tmp"))
    os.chmod(root, 0o755)
    with contextlib.ExitStack() as stack:
        if not args.keep:
            stack.callback(shutil.rmtree, root, ignore_errors=True)
        say(f"root {root}; installing the extension")
        site = install_extension(root)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ)
        say(f"starting primary + 1 peer + {args.minions} minions")
        t0 = time.time()
        cluster = build_cluster(root, stack, args.minions)
        say(f"cluster up in {time.time() - t0:.0f}s")
        conf = str(pathlib.Path(cluster.primary.config_file).parent)
        import salt.version  # pylint: disable=import-outside-toplevel

        base = [str(BIN / "salt"), "-c", conf, "-t", "60", "--out=json", "--static", "*"]
        ping = base + ["test.ping"]
        audit = base + ["multimaster.audit", f"master_version='{salt.version.__version__}'"]
        fleet = [str(BIN / "salt-run"), "-c", conf, "--out=json", "multimaster.audit"]
        refresh = base + ["saltutil.refresh_pillar", "wait=True"]
        subprocess.run(refresh, capture_output=True, env=env, check=False)
        # warm-up: first loads of the modules on every minion
        for cmd in (ping, audit):
            timed(cmd, env)
        res = {"ping": [], "audit": [], "fleet": []}
        codes = {"ping": set(), "audit": set(), "fleet": set()}
        for i in range(args.repeat):
            for name, cmd in (("ping", ping), ("audit", audit)):
                secs, proc = timed(cmd, env)
                res[name].append(secs)
                codes[name].add(proc.returncode)
                if name == "audit" and i == 0:
                    try:
                        data = json.loads(proc.stdout)
                        say("audit results: " + ", ".join(
                            f"{mid}={ret.get('result')}" for mid, ret in sorted(data.items())))
                    except (ValueError, AttributeError):
                        say(f"audit output not JSON: {proc.stdout[:300]!r}")
            say(f"run {i + 1}: ping {res['ping'][-1]:.2f}s  audit {res['audit'][-1]:.2f}s")
        for _ in range(max(3, args.repeat // 2)):
            secs, proc = timed(fleet, env)
            res["fleet"].append(secs)
            codes["fleet"].add(proc.returncode)
        out = {name: stats(values) for name, values in res.items()}
        ratio = out["audit"]["median"] / out["ping"]["median"]
        fleet_ratio = out["fleet"]["median"] / out["ping"]["median"]
        print()
        print(f"salt '*' (primary, {args.minions} minions of 2 masters + 1 peer minion), "
              f"{args.repeat} runs each, alternated")
        for name, label in (("ping", "salt '*' test.ping"),
                            ("audit", "salt '*' multimaster.audit"),
                            ("fleet", "salt-run multimaster.audit")):
            s = out[name]
            print(f"  {label:<30} median {s['median']:.2f}s  min {s['min']:.2f}s  "
                  f"max {s['max']:.2f}s  exit codes {sorted(codes[name])}")
        print(f"  ratio audit/ping (medians): {ratio:.2f}x  (goal <= {GOAL}x: "
              f"{'met' if ratio <= GOAL else 'NOT met'})")
        print(f"  ratio salt-run fleet report/ping (medians): {fleet_ratio:.2f}x")
        results = REPO / "bench" / "results"
        results.mkdir(parents=True, exist_ok=True)
        path = results / f"audit-{stamp}.json"
        path.write_text(json.dumps({"args": vars(args), "stats": out, "ratio": ratio,
                                    "fleet_ratio": fleet_ratio,
                                    "codes": {k: sorted(v) for k, v in codes.items()}},
                                   indent=2))
        say(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
