#!/usr/bin/env python3
"""
Benchmark ``salt-run multimaster.sync`` against ``rsync -a --delete`` over ssh.

Standalone, real daemons::

    .venv/3008/bin/python bench/bench_sync.py [--keys N] [--files N] [--size-mb N] [--peers N]

What it builds (everything under one short /tmp/mmb-* root, removed at the end):

* a real cluster from ``tests/support/cluster.py`` (salt-factories outside
  pytest): a primary master on 127.x.y.2, up to 3 peer masters on .3/.4/.5
  and one salt-minion per peer (a minion of the primary whose
  ``multimaster.master_config`` points at its peer's master config); the
  extension is ``pip install --target``-ed and put on PYTHONPATH, the way the
  test-suite does it; the primary's ``master.d/multimaster.conf`` lists the
  peers;
* N generated minion public keys in the primary's pki_dir/minions (about 50
  distinct 2048-bit keys reused under different ids) and M files (~S MB,
  several directories) in the primary's file_roots base;
* an sshd on 127.0.0.1 (free port, generated host and client keys) for
  ``rsync -a --delete`` of the same data (pki minions dir + file_roots base)
  into per-peer target dirs.

What it measures, every figure a whole command as a user runs it (wall clock,
median of --repeat runs where the operation can be repeated):

* Salt's floor: ``salt-run test.arg`` on the primary with the same keys
  (default config), and the bare floor: the same with ``runner_returns:
  False`` (Salt's start and exit, no job stored), taken right before every
  sync: each sync's figure net of the bare floor is paired with it, and the
  goals are judged on the median of those paired differences;
* ``salt-run multimaster.sync``: initial to one peer; no-op to one peer; no-op
  to all peers vs rsync to the same peers one after another; one new key + one
  changed file vs rsync of the same change (one publish: the primary sends
  the apply with the digests the peer was last confirmed to hold, issue 17
  item 7; goal <= 0.5x of rsync, net of the floor); the no-op and the change
  again with the change journal engine (``multimaster_watch``) on every
  master, the masters restarted with it (``--no-watch``: not);
* where the time goes: ``salt <peer> test.ping`` and
  ``salt <peer> multimaster_peer.inventory`` (full manifests, then digests
  only), the manifests computed in-process, and cProfile of a no-op sync and
  of ``salt-run test.arg``;
* what a user can set to lower the floor (``job_cache: False``,
  ``minion_data_cache: False``, ``runner_returns: False``), each measured on
  ``salt-run test.arg`` and on a no-op sync.

Ratios are printed against the goals of issue 3; nothing asserts on timing.
Results go to bench/results/ (gitignored).
"""

import argparse
import contextlib
import datetime
import io
import json
import logging
import os
import pathlib
import pstats
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(sys.executable).parent
RESULTS = REPO / "bench" / "results"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "_utils"))  # the core, as tests/conftest.py does

log = logging.getLogger("bench_sync")

GOALS = {
    # name: (max ratio of (sync - floor) / rsync, description)
    "initial": (1.0, "initial sync, 1 peer"),
    "noop1": (0.5, "no-op sync, 1 peer"),
    "noopN": (0.3, "no-op sync, {n} peers (rsync: {n} one after another)"),
    "change": (0.5, "1 new key + 1 changed file, 1 peer"),
    "noop1j": (0.5, "no-op sync, 1 peer, journal engine"),
    "changej": (0.5, "1 new key + 1 changed file, 1 peer, journal engine"),
}

# the bare floor's drop-in (its own file: the tunings phase writes another)
# and the label every bare floor of the run is recorded under
BARE_DROPIN = "zz-bench-bare.conf"
TUNING_DROPIN = "zz-bench-tuning.conf"
BARE_LABEL = "floor with runner_returns: False"

# the change journal engine (multimaster_watch), on every master for the
# second part of the change phase
WATCH_DROPIN = "zz-bench-watch.conf"

INITIAL_TIMEOUT = "timeout=3600"

# Settings a user can put in the master config to lower what every salt-run
# pays; each measured on a bare ``salt-run test.arg``.
FLOOR_TUNINGS = [
    ("job_cache: False", {"job_cache": False}),
    ("minion_data_cache: False", {"minion_data_cache": False}),
    ("job_cache: False + minion_data_cache: False",
     {"job_cache": False, "minion_data_cache": False}),
    # salt-run stores its own job (a listing of every key): runner_returns skips that
    ("runner_returns: False", {"runner_returns": False}),
]
FLOOR_NOTES = [
    "key_cache: sched does not help in Salt 3008.3: the Maintenance process writes "
    "pki_dir/minions/.key_cache (zeromq) while salt.key.Key.list_keys reads "
    "pki_dir/accepted/.key_cache, so every key listing still scans pki_dir/minions.",
]


# ---------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------
def say(msg):
    print(f"[{datetime.datetime.now():%H:%M:%S}] {msg}", flush=True)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def timed(cmd, env=None, check=True, cwd=None):
    """Run a whole command; return (seconds, CompletedProcess)."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, check=False)
    secs = time.perf_counter() - start
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"command failed ({proc.returncode}) after {secs:.1f}s: {' '.join(map(str, cmd))}\n"
            f"stdout: {proc.stdout[-3000:]}\nstderr: {proc.stderr[-3000:]}"
        )
    return secs, proc


def _yaml_mapping(text):
    import salt.utils.yaml  # pylint: disable=import-outside-toplevel

    value = salt.utils.yaml.safe_load(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a YAML mapping: {text!r}")
    return value


def _positive(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a whole number of 1 or more: {text!r}")
    return value


def median(values):
    return statistics.median(values) if values else float("nan")


def fmt(value, unit="s"):
    if value is None or value != value:  # NaN
        return "-"
    return f"{value:.2f}{unit}"


def du_bytes(path):
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


# ---------------------------------------------------------------------------
# tools: rsync + sshd
# ---------------------------------------------------------------------------
def ensure_tools():
    missing = [p for p, b in (("rsync", "rsync"), ("openssh-server", "/usr/sbin/sshd"),
                              ("openssh-client", "ssh"))
               if not shutil.which(b)]
    if not missing:
        return
    say(f"installing {' '.join(missing)} (apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
    if subprocess.run(cmd, env=env, capture_output=True, check=False).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, check=False)
        subprocess.run(cmd, env=env, capture_output=True, check=True)


class Sshd:
    """A private sshd on 127.0.0.1:<free port>, root login by a generated key."""

    def __init__(self, root):
        self.dir = root / "ssh"
        self.dir.mkdir(mode=0o700)
        self.port = free_port()
        self.proc = None
        self.client_key = self.dir / "client_ed25519"

    def start(self):
        for key in ("host_ed25519", "client_ed25519"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
                            str(self.dir / key)], check=True)
        auth = self.dir / "authorized_keys"
        shutil.copyfile(self.dir / "client_ed25519.pub", auth)
        os.chmod(auth, 0o600)
        conf = self.dir / "sshd_config"
        conf.write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\n"
            f"HostKey {self.dir / 'host_ed25519'}\n"
            f"AuthorizedKeysFile {auth}\n"
            f"PidFile {self.dir / 'sshd.pid'}\n"
            "PermitRootLogin prohibit-password\nPubkeyAuthentication yes\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "UsePAM no\nStrictModes no\nPrintMotd no\nUseDNS no\n"
            "Subsystem sftp internal-sftp\n"
        )
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation dir
        self.proc = subprocess.Popen(
            ["/usr/sbin/sshd", "-D", "-e", "-f", str(conf)],
            stdout=open(self.dir / "sshd.log", "wb"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        end = time.time() + 20
        while time.time() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {(self.dir / 'sshd.log').read_text()}")
            ret = subprocess.run(self.ssh_cmd() + ["root@127.0.0.1", "true"],
                                 capture_output=True, check=False)
            if ret.returncode == 0:
                return self
            time.sleep(0.3)
        raise RuntimeError(f"sshd did not answer: {(self.dir / 'sshd.log').read_text()}")

    def ssh_cmd(self):
        return ["ssh", "-p", str(self.port), "-i", str(self.client_key),
                "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "BatchMode=yes", "-o", "LogLevel=ERROR"]

    def rsync_cmd(self, sources, dest):
        return ["rsync", "-a", "--delete", "-e", " ".join(self.ssh_cmd()),
                *[str(s) for s in sources], f"root@127.0.0.1:{dest}/"]

    def stop(self):
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


# ---------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------
def gen_public_keys(count=50):
    from tests.support.cluster import gen_keypair  # pylint: disable=import-outside-toplevel

    return [gen_keypair(2048)[1] for _ in range(count)]


def write_keys(pki_dir, pubs, count, prefix="bench-minion"):
    dest = pathlib.Path(pki_dir) / "minions"
    dest.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (dest / f"{prefix}-{i:06d}").write_bytes(pubs[i % len(pubs)])


def write_files(base, count, size_mb, seed=1):
    """``count`` files, ~``size_mb`` MB in all, in 20 top dirs x 10 subdirs."""
    rng = random.Random(seed)
    weights = [rng.lognormvariate(0, 1.3) for _ in range(count)]
    scale = size_mb * 1_000_000 / sum(weights)
    blob = os.urandom(8 << 20)
    base = pathlib.Path(base)
    paths = []
    for i, weight in enumerate(weights):
        size = max(16, min(int(weight * scale), len(blob) - 1))
        rel = f"formula{i % 20:02d}/sub{(i // 20) % 10}/file{i:05d}.sls"
        path = base / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        off = rng.randrange(0, len(blob) - size)
        path.write_bytes(blob[off:off + size])
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------
# the cluster
# ---------------------------------------------------------------------------
def repo_commit(worktree=False):
    """HEAD of the repo measured (+ "-dirty" for a working tree with product changes)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                              check=False).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "_runners", "_modules", "_utils")
    return head + ("-dirty" if worktree and dirty else "")


REPO_COMMIT = None


def install_extension(root, worktree=False):
    """
    ``pip install --no-deps --target`` of the product: the committed HEAD
    (``git archive``), or with ``worktree`` a copy of the working tree.  The
    repo itself is left untouched (no build/ or egg-info in it).
    """
    src = root / "src"
    if worktree:
        shutil.copytree(
            REPO, src,
            ignore=shutil.ignore_patterns(".venv", ".git", "bench", "tests", "__pycache__",
                                          ".mm-sandbox*", "build", "dist", "*.egg-info",
                                          ".pytest_cache"),
        )
    else:
        src.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", "HEAD"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    from tests.support.cluster import install_extension  # pylint: disable=import-outside-toplevel

    return install_extension(src, root / "site")


def find_pyspy(root):
    """py-spy from PATH, else ``pip install --target`` it into the bench root; None if neither."""
    found = shutil.which("py-spy")
    if found:
        return found
    target = root / "tools"
    ret = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target",
                          str(target), "py-spy"], capture_output=True, check=False)
    candidate = target / "bin" / "py-spy"
    return str(candidate) if ret.returncode == 0 and candidate.exists() else None


def quiet_salt_logging():
    try:
        import salt._logging.impl  # pylint: disable=import-outside-toplevel

        salt._logging.impl.shutdown_temp_handler()
    except Exception:  # pylint: disable=broad-except
        pass
    logging.getLogger().addHandler(logging.NullHandler())


BLOB_RUNNER = '''
import os


def blob(size):
    """bench only: ``size`` random bytes, returned like a multimaster.pull chunk"""
    return {"outputter": "no_return", "data": {"sealed": os.urandom(int(size))}}
'''


def build_cluster(root, stack, peers, primary_conf=None):
    from tests.support.cluster import Cluster, standalone_factories  # pylint: disable=import-outside-toplevel

    factories = standalone_factories(root, stack, slow_stop=False)
    # a user's default log level (no debug logging cost); no pytest log server here
    quiet = {"log_level_logfile": "warning"}
    cluster = Cluster(
        factories, "bench", peers=peers, minions=0, share_master_keys=True,
        accept_on_peers=False,
        master_overrides=dict(quiet, **{"pytest-master": {"log": {"disabled": True}}}),
        minion_overrides=dict(quiet, **{"pytest-minion": {"log": {"disabled": True}}}),
    )
    stack.callback(cluster.stop)
    dropin = pathlib.Path(cluster.primary.config_file).parent / "master.d" / "multimaster.conf"
    dropin.parent.mkdir(exist_ok=True)
    import salt.utils.yaml

    peer_ids = [m.id for m in cluster.peer_minions]
    # the product's recommended setup: peers pull bulk key/pillar contents
    # point-to-point (multimaster.pull through peer_run) instead of the publish
    # bench only: a runner returning N random bytes the way multimaster.pull
    # returns a chunk, to measure what Salt's peer_run costs per byte
    runners = pathlib.Path(root) / "bench-runners"
    runners.mkdir(exist_ok=True)
    (runners / "mmbench.py").write_text(BLOB_RUNNER)
    dropin.write_text(salt.utils.yaml.safe_dump({
        "multimaster": {"peers": peer_ids},
        "peer_run": {"^(" + "|".join(peer_ids) + ")$": ["multimaster.pull", "mmbench.blob"]},
        "runner_dirs": [str(runners)],
    }))
    if primary_conf:
        # a tuning measured on the whole run (the primary daemon reads it)
        (dropin.parent / "zz-bench-primary.conf").write_text(salt.utils.yaml.safe_dump(primary_conf))
    cluster.start()
    for minion in cluster.peer_minions:
        if not cluster.wait_ping(cluster.primary, minion.id, deadline=120):
            raise RuntimeError(f"peer minion {minion.id} does not answer the primary")
    return cluster


# ---------------------------------------------------------------------------
# the benchmark
# ---------------------------------------------------------------------------
class Bench:
    def __init__(self, args, root, cluster, sshd, env):
        self.args = args
        self.root = root
        self.cluster = cluster
        self.sshd = sshd
        self.env = env
        self.primary = cluster.primary
        self.conf_dir = str(pathlib.Path(self.primary.config_file).parent)
        self.peer_ids = [m.id for m in cluster.peer_minions]
        self.pki = pathlib.Path(self.primary.config["pki_dir"])
        self.base = pathlib.Path(self.primary.config["file_roots"]["base"][0])
        self.targets = {p: root / "rsync" / p for p in self.peer_ids}
        self.res = {"runs": {}, "notes": []}
        self.tuning = None  # the setting the tunings phase has on, if any
        self.pyspy = find_pyspy(root)

    # ----- commands ---------------------------------------------------------
    def salt_run(self, *args, check=True):
        return timed([str(BIN / "salt-run"), "-c", self.conf_dir, *args, "--out=json"],
                     env=self.env, check=check)

    def salt(self, tgt, *args, check=True):
        return timed([str(BIN / "salt"), "-c", self.conf_dir, "-t", "120", tgt, *args,
                      "--out=json", "--static"], env=self.env, check=check)

    @contextlib.contextmanager
    def dropin(self, name, values):
        """``values`` in the primary's ``master.d/<name>`` (read by each salt-run) while in the block."""
        import salt.utils.yaml  # pylint: disable=import-outside-toplevel

        path = pathlib.Path(self.conf_dir) / "master.d" / name
        path.write_text(salt.utils.yaml.safe_dump(values))
        try:
            yield
        finally:
            path.unlink(missing_ok=True)

    def bare_floor(self):
        """One bare ``salt-run test.arg``: ``runner_returns: False`` for that run only."""
        with self.dropin(BARE_DROPIN, {"runner_returns": False}):
            secs, _ = self.salt_run("test.arg", "bench")
        return secs

    def sync(self, peers, label, *extra):
        # Salt's floor drifts by tenths of a second within a run (0.66 to
        # 1.11 s for the bare floor in one run on the 2-core machine): the
        # bare floor taken right before each sync gives the paired net
        # figure the goals are judged on
        floor_secs = self.bare_floor()
        self.record(f"paired bare floor: {label}", floor_secs)
        if self.tuning is None:  # not with a setting of the tunings phase on
            self.record(BARE_LABEL, floor_secs)
        since = time.time()
        secs, proc = self.salt_run("multimaster.sync", "peers=" + ",".join(peers), *extra,
                                   check=False)
        try:
            data = json.loads(proc.stdout)
        except ValueError:
            data = None
        summary = self.summarize(data, peers)
        ok = proc.returncode == 0 and summary["ok"]
        self.record(label, secs, ok=ok, summary=summary, jobs=self.job_timings(since))
        if not ok:
            say(f"  !! {label}: exit {proc.returncode}: {proc.stdout[-1500:]} {proc.stderr[-1500:]}")
        return secs

    def job_timings(self, since):
        """
        From the primary's job cache: for each multimaster_peer job published
        since ``since`` (the salt-run start), seconds from ``since`` to its jid
        (publish) and to each peer's stored return, and the size of the
        published load.
        """
        import salt.payload  # pylint: disable=import-outside-toplevel

        jobs = pathlib.Path(self.primary.config["cachedir"]) / "jobs"
        out = []
        for load in jobs.glob("*/*/.load.p"):
            try:
                if load.stat().st_mtime < since:
                    continue
                with open(load, "rb") as fh:
                    data = salt.payload.load(fh)
            except (OSError, ValueError):
                continue
            fun = data.get("fun")
            if not isinstance(fun, str) or not fun.startswith("multimaster_peer."):
                continue
            jid = data.get("jid") or (load.parent / "jid").read_text().strip()
            start = datetime.datetime.strptime(str(jid)[:20], "%Y%m%d%H%M%S%f").timestamp()
            rets = {}
            for ret in load.parent.glob("*/return.p"):
                rets[ret.parent.name] = round(ret.stat().st_mtime - since, 2)
            out.append({"fun": fun.split(".", 1)[1], "jid": str(jid),
                        "published_after_s": round(start - since, 2),
                        "load_mb": round(load.stat().st_size / 1e6, 2), "returned_after_s": rets})
        return sorted(out, key=lambda j: j["jid"])

    @staticmethod
    def summarize(data, peers):
        out = {"ok": isinstance(data, dict)}
        if not isinstance(data, dict):
            return out
        for peer in peers:
            res = data.get(peer) or {}
            out["ok"] = out["ok"] and res.get("result") is True
            counts = {}
            for cat, rep in res.items():
                if isinstance(rep, dict) and "added" in rep:
                    # a list Salt trimmed (max_event_size) comes back as a string
                    counts[cat] = {k: (len(v) if isinstance(v, list) else f"NOT A LIST: {v!r:.40}")
                                   for k, v in rep.items() if v}
            out[peer] = {"result": res.get("result"), "changes": counts,
                         "error": res.get("error")}
        return out

    def rsync(self, peers, label):
        """rsync the pki minions dir and file_roots base to each peer's target, one after another."""
        start = time.perf_counter()
        for peer in peers:
            self.targets[peer].mkdir(parents=True, exist_ok=True)
            timed(self.sshd.rsync_cmd([self.pki / "minions", self.base], self.targets[peer]))
        secs = time.perf_counter() - start
        self.record(label, secs)
        return secs

    def record(self, label, secs, **extra):
        extra.setdefault("load1", round(os.getloadavg()[0], 1))
        self.res["runs"].setdefault(label, []).append(dict(secs=round(secs, 3), **extra))
        say(f"  {label}: {secs:.2f}s" + ("" if extra.get("ok", True) else "  (FAILED)"))

    def med(self, label):
        return median([r["secs"] for r in self.res["runs"].get(label, [])])

    def repeat(self, n, fn, *args):
        for _ in range(n):
            fn(*args)

    # ----- phases -------------------------------------------------------------
    def floor(self, label="floor: salt-run test.arg", runs=None):
        for _ in range(runs or self.args.repeat):
            secs, _ = self.salt_run("test.arg", "bench")
            self.record(label, secs)

    def restart_masters(self, peers):
        """
        Restart the peers' salt-masters, as an operator does after an initial
        sync (it writes the replicated master options): until then every
        sync reports ``restart_required`` and fails.
        """
        for index, peer in enumerate(self.peer_ids):
            if peer in peers:
                self.cluster.restart(self.cluster.peers[index])
        for peer in peers:
            if not self.cluster.wait_ping(self.primary, peer, deadline=120):
                raise RuntimeError(f"peer minion {peer} does not answer after the restart")
        self.settle("restarting " + ", ".join(peers))

    QUIET_BUSY = 0.15  # fraction of all CPUs busy over a window that counts as quiet
    QUIET_WINDOW = 2.0  # seconds
    QUIET_WAIT = 120  # seconds at the most

    @staticmethod
    def _cpu_times():
        """``(busy, total)`` jiffies of all CPUs since boot (/proc/stat)."""
        with open("/proc/stat", encoding="ascii") as stat_file:
            fields = [int(x) for x in stat_file.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        total = sum(fields[:8])  # guest time is already counted in user
        return total - idle, total

    def settle(self, label):
        """
        Wait (up to QUIET_WAIT seconds) until the machine is quiet: less than
        QUIET_BUSY of its CPUs busy over QUIET_WINDOW seconds.  Restarted
        masters could keep a core busy after they answer (their maintenance
        process lists every key, the journal engine watches every
        directory), and a sync timed then would pay for it; on 2026-11-27
        they were quiet within the first window, and this stays as a guard.
        Records the wait.
        """
        start = time.monotonic()
        while True:
            busy0, total0 = self._cpu_times()
            time.sleep(self.QUIET_WINDOW)
            busy1, total1 = self._cpu_times()
            busy = (busy1 - busy0) / max(1, total1 - total0)
            waited = time.monotonic() - start
            if busy < self.QUIET_BUSY or waited > self.QUIET_WAIT:
                break
        self.record(f"settle: seconds until quiet, after {label}", waited, busy=round(busy, 2))
        if busy >= self.QUIET_BUSY:
            self.res["notes"].append(
                f"the machine was still {busy:.0%} busy {waited:.0f}s after {label}: "
                "the next figures include that load")

    def reset_peer(self, index=0):
        """
        Make peer ``index`` fresh again: no keys, no files, no sync state.
        The old directories are moved aside, not deleted: creating 20,000
        files right after deleting 20,000 in the same place is several times
        slower on ext4 (mounted with discard here) than on a fresh peer.
        """
        master, minion = self.cluster.peers[index], self.cluster.peer_minions[index]
        trash = self.root / "trash" / str(time.time_ns())
        trash.mkdir(parents=True)
        pki = pathlib.Path(master.config["pki_dir"])
        for state in ("minions", "minions_pre", "minions_rejected", "minions_denied"):
            own = [p for p in (pki / state).glob("*") if p.name == minion.id]
            (pki / state).rename(trash / state)
            (pki / state).mkdir()
            for path in own:
                shutil.copy2(trash / state / path.name, pki / state / path.name)
        for i, root in enumerate(master.config["file_roots"]["base"]):
            pathlib.Path(root).rename(trash / f"base{i}")
            pathlib.Path(root).mkdir()
        for cache in (master.config["cachedir"], minion.config["cachedir"]):
            shutil.rmtree(pathlib.Path(cache) / "multimaster", ignore_errors=True)
        subprocess.run(["sync"], check=False)

    # 5,000 creations take 0.14-0.28 s here when the filesystem is settled,
    # 1-1.8 s within minutes of a mass deletion (a previous run's clean-up)
    PROBE_SETTLED = 0.5
    PROBE_WAIT = 420

    def disk_probe(self, label):
        """
        Time 5,000 small file creations in a fresh directory (kept, not
        deleted).  On an ext4 without a journal, as here, creating files
        within minutes of many deletions scans the recently freed inodes
        (find_inode_bit / recently_deleted in perf) and costs several times
        more, for the sync and for rsync alike.  Wait (up to PROBE_WAIT
        seconds) until the probe is back under PROBE_SETTLED, and record the
        probe, so each initial copy runs, and shows that it ran, on a
        settled filesystem.
        """
        deadline = time.monotonic() + self.PROBE_WAIT
        waited = 0.0
        while True:
            probe = self.root / "trash" / f"probe-{time.time_ns()}"
            probe.mkdir(parents=True)
            start = time.perf_counter()
            for i in range(5000):
                fd = os.open(probe / str(i), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                os.write(fd, b"x" * 450)
                os.close(fd)
            secs = time.perf_counter() - start
            if secs <= self.PROBE_SETTLED or time.monotonic() > deadline:
                break
            say(f"  filesystem not settled (5,000 creations in {secs:.2f}s), waiting")
            time.sleep(30)
            waited += 30
        self.record(f"disk probe: 5,000 file creations, before {label}", secs, waited=waited)
        if waited:
            self.res["notes"].append(
                f"waited {waited:.0f}s before {label} for the filesystem to settle "
                f"(last probe {secs:.2f}s)")

    def run_initial(self):
        """``--only initial``: the initial sync to one peer, reset before each run."""
        peer1 = self.peer_ids[0]
        self.salt_run("test.arg", "warm-up")
        self.floor()
        for i in range(self.args.repeat):
            self.reset_peer(0)
            self.disk_probe("sync initial")
            self.sync([peer1], "sync initial, 1 peer", INITIAL_TIMEOUT)
        self.disk_probe("rsync initial")
        self.rsync([peer1], "rsync initial, 1 peer")
        self.transport_floor(peer1)
        if self.args.profile:
            self.reset_peer(0)
            self.profile("initial-sync", ["multimaster.sync", f"peers={peer1}", INITIAL_TIMEOUT])

    def run_change(self):
        """
        ``--only change``: the initial sync untimed, then the change sync next
        to rsync, the default config's floor measured before each change run
        (the bare floor is taken before every sync).
        """
        peer1, n = self.peer_ids[0], self.args.repeat
        # setup, not a case of the report (the peer's master restarts after it)
        self.sync([peer1], "setup: initial sync, 1 peer", INITIAL_TIMEOUT)
        self.rsync([peer1], "setup: initial rsync, 1 peer")
        self.restart_masters([peer1])
        self.salt_run("test.arg", "warm-up")
        self.repeat(n, self.sync, [peer1], "sync no-op, 1 peer")
        self.repeat(n, self.rsync, [peer1], "rsync no-op, 1 peer")
        pubs = sorted((self.pki / "minions").iterdir())[:3]
        files = sorted(p for p in self.base.rglob("*.sls"))
        rng = random.Random(7)
        for i in range(n):
            self.floor(runs=1)
            self.change(pubs, files, rng, i)
            self.sync([peer1], "sync 1 key + 1 file, 1 peer")
            self.rsync([peer1], "rsync 1 key + 1 file, 1 peer")
        self.journal_phase(peer1, pubs, files, rng)

    def journal_phase(self, peer1, pubs, files, rng):
        """
        The no-op and the change sync again with the change journal engine
        on every master (``--watch``, default), next to rsync.
        """
        if not self.args.watch:
            return
        say("with the change journal engine (multimaster_watch) on every master")
        self.enable_watch()
        n = self.args.repeat
        self.repeat(n, self.sync, [peer1], "sync no-op, 1 peer, journal")
        for i in range(n):
            self.change(pubs, files, rng, 500 + i)
            self.sync([peer1], "sync 1 key + 1 file, 1 peer, journal")
            self.rsync([peer1], "rsync 1 key + 1 file, 1 peer")

    def enable_watch(self):
        """
        ``engines: [multimaster_watch]`` on the primary and every peer
        master, each restarted; then one sync (the journal's first token).
        """
        import salt.utils.yaml  # pylint: disable=import-outside-toplevel

        for master in (self.primary, *self.cluster.peers):
            # an engines list in master.d replaces the master file's (the
            # harness's event forwarder): both
            # the journal only: the syncs measured are the bench's own
            engines = list(master.config.get("engines") or []) + [
                {"multimaster_watch": {"replicate": False}}]
            dropin = pathlib.Path(master.config_file).parent / "master.d" / WATCH_DROPIN
            dropin.parent.mkdir(exist_ok=True)
            dropin.write_text(salt.utils.yaml.safe_dump({"engines": engines}))
            self.cluster.restart(master)
        for peer in self.peer_ids:
            if not self.cluster.wait_ping(self.primary, peer, deadline=120):
                raise RuntimeError(f"peer minion {peer} does not answer after the restart")
        for master in (self.primary, *self.cluster.peers):
            sock = pathlib.Path(master.config["cachedir"]) / "multimaster" / "watch.sock"
            end = time.time() + 60
            while not sock.is_socket():
                if time.time() > end:
                    raise RuntimeError(f"no change journal at {sock}")
                time.sleep(0.2)
        self.salt_run("multimaster.sync", "peers=" + ",".join(self.peer_ids), check=False)
        self.settle("restarting every master with the engine")

    def run(self):
        if self.args.only == "initial":
            return self.run_initial()
        if self.args.only == "change":
            return self.run_change()
        a, n = self.args, self.args.repeat
        peer1, peers = self.peer_ids[0], self.peer_ids
        say(f"primary has {len(os.listdir(self.pki / 'minions'))} accepted keys, "
            f"file_roots base {du_bytes(self.base) / 1e6:.1f} MB")

        say("Salt floor (after one untimed warm-up salt-run)")
        self.salt_run("test.arg", "warm-up")
        self.floor()

        say("initial sync vs rsync, 1 peer")
        # multimaster.sync waits ``timeout`` (default 120 s) for a peer's apply;
        # an initial apply of this size takes longer (see the report).
        self.disk_probe("sync initial")
        self.sync([peer1], "sync initial, 1 peer", INITIAL_TIMEOUT)
        self.disk_probe("rsync initial")
        self.rsync([peer1], "rsync initial, 1 peer")
        self.restart_masters([peer1])

        say("no-op, 1 peer")
        self.repeat(n, self.sync, [peer1], "sync no-op, 1 peer")
        self.repeat(n, self.rsync, [peer1], "rsync no-op, 1 peer")

        self.res["notes"].append(
            f"initial syncs run with {INITIAL_TIMEOUT}: with the default (120 s) the runner "
            "stops waiting for a long apply and reports the peer failed while it keeps writing")
        if len(peers) > 1:
            say(f"initial sync of the other {len(peers) - 1} peer(s), in parallel (one salt-run)")
            self.disk_probe("sync initial, more peers")
            self.sync(peers[1:], f"sync initial, {len(peers) - 1} more peers in parallel",
                      INITIAL_TIMEOUT)
            self.disk_probe("rsync initial, more peers")
            self.rsync(peers[1:], f"rsync initial, {len(peers) - 1} more peers sequentially")
            self.restart_masters(peers[1:])
            say(f"no-op, {len(peers)} peers")
            self.repeat(n, self.sync, peers, f"sync no-op, {len(peers)} peers")
            self.repeat(n, self.rsync, peers, f"rsync no-op, {len(peers)} peers sequentially")

        say("1 new key + 1 changed file, 1 peer")
        pubs = sorted((self.pki / "minions").iterdir())[:3]
        files = sorted(p for p in self.base.rglob("*.sls"))
        rng = random.Random(7)
        for i in range(n):
            self.change(pubs, files, rng, i)
            self.sync([peer1], "sync 1 key + 1 file, 1 peer")
            # the same change again for rsync (the sync already wrote peer1's
            # master dirs, rsync's target dirs are separate)
            self.rsync([peer1], "rsync 1 key + 1 file, 1 peer")

        phases = [("where the time goes", self.breakdown, peer1),
                  ("Salt's transport floor (peer_run)", self.transport_floor, peer1),
                  ("what lowers the floor", self.tunings)]
        if a.profile:
            phases += [
                ("profile: no-op sync", self.profile, "noop-sync",
                 ["multimaster.sync", f"peers={peer1}"]),
                ("profile: 1 key + 1 file sync", self.profile_change, peer1),
                ("profile: salt-run test.arg", self.profile, "floor", ["test.arg", "bench"]),
            ]
        for name, fn, *fargs in phases:
            say(name)
            try:
                fn(*fargs)
            except Exception as exc:  # pylint: disable=broad-except
                say(f"  !! {name} failed: {exc}")
                self.res["notes"].append(f"phase '{name}' failed: {str(exc)[:300]}")
        # last: it restarts every master with the engine
        self.journal_phase(peer1, pubs, files, rng)

    def profile_change(self, peer):
        pubs = sorted((self.pki / "minions").iterdir())[:3]
        files = sorted(p for p in self.base.rglob("*.sls"))
        self.change(pubs, files, random.Random(99), 900)
        self.profile("change-sync", ["multimaster.sync", f"peers={peer}"])

    def change(self, pubs, files, rng, i):
        key = self.pki / "minions" / f"bench-new-{i:03d}"
        key.write_bytes(pubs[i % len(pubs)].read_bytes())
        path = files[rng.randrange(len(files))]
        data = path.read_bytes()
        path.write_bytes(os.urandom(min(len(data), 4096)) + data[4096:])

    # ----- breakdown ----------------------------------------------------------
    def breakdown(self, peer):
        n = self.args.repeat
        for _ in range(n):
            secs, _ = self.salt(peer, "test.ping")
            self.record("salt <peer> test.ping", secs)
        cats = "categories=[master_keys,minion_keys,file_roots,pillar_roots,master_config]"
        secs, proc = self.salt(peer, "multimaster_peer.inventory", cats)
        self.record("salt <peer> multimaster_peer.inventory (full manifests)", secs,
                    out_bytes=len(proc.stdout))
        inv = json.loads(proc.stdout)[peer]
        digests = {c: inv[c]["digest"] for c in ("minion_keys", "file_roots", "pillar_roots")}
        for _ in range(n):
            secs, _ = self.salt(peer, "multimaster_peer.inventory", cats,
                                "digests=" + json.dumps(digests))
            self.record("salt <peer> multimaster_peer.inventory (digests only: no-op)", secs)
        # the manifests themselves, in this process, warm hash cache (copy)
        self.in_process_manifests()
        self.client_roundtrip(peer)
        # the return size of a no-op inventory vs a full one
        self.res["inventory_full_json_bytes"] = len(json.dumps(inv))

    CLIENT_CODE = """
import json, sys, time, salt.config, salt.client, salt.key
opts = salt.config.master_config(sys.argv[1])
peer, n = sys.argv[2], int(sys.argv[3])
out = {"key listing (salt.key.Key.list_keys)": [], "LocalClient.cmd test.ping (default)": [],
       "LocalClient.cmd test.ping (expect_minions=False)": []}
for _ in range(n):
    t = time.perf_counter(); salt.key.Key(opts).list_keys()
    out["key listing (salt.key.Key.list_keys)"].append(time.perf_counter() - t)
with salt.client.LocalClient(mopts=opts) as client:
    client.cmd([peer], "test.ping", tgt_type="list", timeout=60, expect_minions=False)
    for _ in range(n):
        for label, kw in (("LocalClient.cmd test.ping (default)", {}),
                          ("LocalClient.cmd test.ping (expect_minions=False)",
                           {"expect_minions": False})):
            t = time.perf_counter()
            client.cmd([peer], "test.ping", tgt_type="list", timeout=60, full_return=True, **kw)
            out[label].append(time.perf_counter() - t)
print(json.dumps(out))
"""

    TRANSPORT_CODE = """
import concurrent.futures, contextvars, json, sys, time
import salt.client, salt.config, salt.minion
opts = salt.config.minion_config(sys.argv[1])
opts["master"] = sys.argv[2]
opts.update(salt.minion.resolve_dns(opts))
caller = salt.client.Caller(mopts=opts)
sizes, ahead, n = json.loads(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
total = sum(sizes)

def one(size):
    ret = caller.cmd("publish.runner", "mmbench.blob", arg=[f"size={size}"], timeout=300)
    return len(ret["data"]["sealed"])

def run(sizes):
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(ahead) as pool:
        got = list(pool.map(lambda z: contextvars.copy_context().run(one, z), sizes))
    assert got == sizes, (got, sizes)
    return time.perf_counter() - t

run([10])  # connect and authenticate once
out = {"calls": len(sizes), "bytes": total, "empty": [], "full": []}
for _ in range(n):
    out["empty"].append(run([10] * len(sizes)))
    out["full"].append(run(sizes))
print(json.dumps(out))
"""

    def transport_floor(self, peer):
        """
        Salt's own cost of moving an initial sync's bytes by peer_run, as the
        sync's pull does (same chunk size, same requests in flight), from the
        peer minion's identity in one process, with nothing read or written
        on either side: what the sync cannot go under on this machine.
        """
        sys.path.insert(0, str(self.root / "site"))
        from salt_multimaster import replicate  # pylint: disable=import-outside-toplevel

        minion = self.cluster.peer_minions[self.peer_ids.index(peer)]
        # the chunks the sync pulls: its keys and files cut the way it cuts them
        items = [("minion_keys", {"state": "minions", "id": p.name, "size": p.stat().st_size})
                 for p in sorted((self.pki / "minions").iterdir())]
        items += [("file_roots", {"env": "base", "rel": str(p.relative_to(self.base)),
                                  "size": p.stat().st_size})
                  for p in sorted(self.base.rglob("*")) if p.is_file()]
        sizes = [0] * len(replicate.assign_chunks(items))
        for _, op in items:
            sizes[op["pull"]] += op["size"]
        total = sum(sizes)
        proc = subprocess.run(
            [sys.executable, "-c", self.TRANSPORT_CODE, minion.config_file,
             self.primary.config["interface"], json.dumps(sizes), str(self._pull_ahead()),
             str(self.args.repeat)],
            env=self.env, capture_output=True, text=True, check=False, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"transport floor failed: {proc.stderr[-2000:]}")
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        calls = out["calls"]
        for secs in out["empty"]:
            self.record(f"transport: {calls} peer_run calls of 10 bytes", secs)
        for secs in out["full"]:
            self.record(f"transport: {calls} peer_run calls, {total / 1e6:.0f} MB in all", secs)
        self.res["transport"] = {"calls": calls, "bytes": total,
                                 "empty": f"transport: {calls} peer_run calls of 10 bytes",
                                 "full": f"transport: {calls} peer_run calls, {total / 1e6:.0f} MB in all"}

    def _pull_ahead(self):
        text = (self.root / "site" / "salt_multimaster" / "applier.py").read_text()
        return int(re.search(r"^PULL_AHEAD = (\d+)", text, re.M).group(1))

    def client_roundtrip(self, peer):
        """
        In one process on the primary: a key listing, and a publish round trip
        the way the runner does it (LocalClient.cmd), with and without Salt
        3008's listing of every accepted key after the returns (expect_minions).
        """
        proc = subprocess.run(
            [sys.executable, "-c", self.CLIENT_CODE, self.primary.config_file, peer,
             str(self.args.repeat)],
            env=self.env, capture_output=True, text=True, check=False, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"client round trip failed: {proc.stderr[-2000:]}")
        for label, values in json.loads(proc.stdout.strip().splitlines()[-1]).items():
            for secs in values:
                self.record(f"in-process: {label}", secs)

    def in_process_manifests(self):
        sys.path.insert(0, str(self.root / "site"))
        # pylint: disable=import-outside-toplevel
        from salt_multimaster import keyscan, rootscan, store

        src = pathlib.Path(self.primary.config["cachedir"]) / "multimaster"
        state = self.root / "manifest-state"
        shutil.rmtree(state, ignore_errors=True)
        state.mkdir()
        if (src / store.NAME).exists():
            shutil.copyfile(src / store.NAME, state / store.NAME)
        for _ in range(self.args.repeat):
            t0 = time.perf_counter()
            keyscan.KeysSnapshot(str(self.pki), str(state), rescan=True)
            t1 = time.perf_counter()
            keyscan.KeysSnapshot(str(self.pki), str(state))
            t2 = time.perf_counter()
            rootscan.RootsScan(self.primary.config, "file_roots", str(state))
            t3 = time.perf_counter()
            self.record("in-process: keys scanned, each read (rescan=True)", t1 - t0)
            self.record("in-process: keys scanned, each statted", t2 - t1)
            self.record("in-process: file_roots scanned, each statted", t3 - t2)

    def tunings(self):
        self.floor("floor: salt-run test.arg (again, default config)")
        for label, values in FLOOR_TUNINGS:
            with self.dropin(TUNING_DROPIN, values):
                self.floor(f"floor with {label}")
        # the same settings on a no-op sync (salt-run side only; the daemon keeps its config)
        for label, values in (("job_cache: False", {"job_cache": False}),
                              ("runner_returns: False", {"runner_returns": False})):
            self.tuning = label
            try:
                with self.dropin(TUNING_DROPIN, values):
                    self.repeat(self.args.repeat, self.sync, [self.peer_ids[0]],
                                f"sync no-op, 1 peer, salt-run with {label}")
            finally:
                self.tuning = None

    def profile(self, name, args):
        if self.pyspy:
            return self.profile_pyspy(name, args)
        out = self.root / f"{name}.prof"
        cmd = [sys.executable, "-m", "cProfile", "-o", str(out), str(BIN / "salt-run"),
               "-c", self.conf_dir, *args, "--out=json"]
        secs, _ = timed(cmd, env=self.env, check=False)
        self.record(f"cProfile run: salt-run {' '.join(args)}", secs)
        buf = io.StringIO()
        stats = pstats.Stats(str(out), stream=buf)
        stats.sort_stats("cumulative").print_stats(45)
        text = buf.getvalue()
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"profile-{name}-{self.args.stamp}.txt").write_text(text)
        self.res.setdefault("profiles", {})[name] = self.profile_summary(stats)

    def profile_pyspy(self, name, args, rate=100):
        """py-spy record of a whole salt-run: wall clock (idle included), every thread."""
        out = self.root / f"{name}.pyspy.txt"
        cmd = [self.pyspy, "record", "--idle", "--threads", "--subprocesses", "-r", str(rate),
               "-f", "raw", "-o", str(out), "--", sys.executable, str(BIN / "salt-run"),
               "-c", self.conf_dir, *args, "--out=json"]
        secs, _ = timed(cmd, env=self.env, check=False)
        self.record(f"py-spy run: salt-run {' '.join(args)}", secs)
        incl, threads = {}, {}
        for line in out.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            frames = stack.split(";")
            thread = frames[0].split(" (")[0] if frames else "?"
            threads[thread] = threads.get(thread, 0) + int(count)
            seen = set()
            for frame in frames[1:]:
                func = frame.split(" (")[0]
                where = frame.split(" (", 1)[1].split(":")[0] if " (" in frame else ""
                key = f"{where.rsplit('/', 1)[-1]}:{func}"
                if key not in seen:
                    seen.add(key)
                    incl[key] = incl.get(key, 0) + int(count)
        wanted = ("multimaster.py:", "primary.py:", "jobs.py:", "sync.py:", "transport.py:",
                  "memory.py:", "manifest.py:", "replicate.py:",
                  "client/__init__.py",
                  "__init__.py:LocalClient", "job.py:", "local_cache.py:", "minions.py:",
                  "key.py:", "localfs_key.py:", "mixins.py:", "runner.py:", "event.py:",
                  "_base.py:result", "thread.py:", "run.py:")
        top = sorted(((k, v / rate) for k, v in incl.items()
                      if any(w in k for w in wanted) or k.startswith(("__init__.py:cmd",
                                                                      "__init__.py:get_",
                                                                      "__init__.py:run_job",
                                                                      "__init__.py:pub",
                                                                      "__init__.py:returns_for"))),
                     key=lambda kv: -kv[1])[:45]
        RESULTS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out, RESULTS / f"pyspy-{name}-{self.args.stamp}.txt")
        self.res.setdefault("profiles", {})[name] = dict(
            [("threads (samples/rate, s)", {t: round(c / rate, 2) for t, c in threads.items()})]
            + [(k, round(v, 2)) for k, v in top])

    @staticmethod
    def profile_summary(stats):
        """Cumulative seconds of the functions that explain a salt-run."""
        wanted = {
            ("multimaster.py", "sync"), ("sync.py", "read_primary"),
            ("jobs.py", "replies"), ("sync.py", "plan"), ("sync.py", "peer_errors"),
            ("keyscan.py", "_scan"), ("rootscan.py", "_scan"),
            ("client/__init__.py", "cmd"), ("client/__init__.py", "pub"),
            ("client/__init__.py", "run_job"), ("client/__init__.py", "get_cli_event_returns"),
            ("minions.py", "check_minions"), ("minions.py", "_check_glob_minions"),
            ("minions.py", "_pki_minions"), ("minions.py", "_check_list_minions"),
            ("job.py", "store_job"), ("local_cache.py", "save_load"),
            ("local_cache.py", "prep_jid"), ("local_cache.py", "returner"),
            ("runner.py", "run"), ("mixins.py", "low"), ("mixins.py", "_low"),
            ("loader/__init__.py", "runner"), ("loader/__init__.py", "returners"),
            ("concurrent/futures/_base.py", "result"), ("threading.py", "wait"),
        }
        out = {}
        for (path, _line, func), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():
            for suffix, fname in wanted:
                if func == fname and path.endswith(suffix):
                    key = f"{'/'.join(path.split('/')[-2:])}:{func}"
                    out[key] = round(max(out.get(key, 0), ct), 3)
        out["total"] = round(stats.total_tt, 3)
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    # ----- report -------------------------------------------------------------
    def report(self):
        # the floor: every default-config salt-run test.arg of the run (start and end)
        floor = median([r["secs"] for label in ("floor: salt-run test.arg",
                                                "floor: salt-run test.arg (again, default config)")
                        for r in self.res["runs"].get(label, [])])
        n = len(self.peer_ids)
        rows = [
            ("initial", "sync initial, 1 peer", "rsync initial, 1 peer"),
            ("noop1", "sync no-op, 1 peer", "rsync no-op, 1 peer"),
        ]
        if n > 1:
            rows.append(("noopN", f"sync no-op, {n} peers", f"rsync no-op, {n} peers sequentially"))
        rows.append(("change", "sync 1 key + 1 file, 1 peer", "rsync 1 key + 1 file, 1 peer"))
        rows.append(("noop1j", "sync no-op, 1 peer, journal", "rsync no-op, 1 peer"))
        rows.append(("changej", "sync 1 key + 1 file, 1 peer, journal",
                     "rsync 1 key + 1 file, 1 peer"))
        lines = []
        add = lines.append
        args = self.args
        add(f"salt-multimaster sync benchmark  {args.stamp}  (product at {self.res.get('commit')})")
        add(f"data: {self.res['keys']} accepted keys, {self.res['files']} files "
            f"({self.res['bytes'] / 1e6:.1f} MB) in file_roots base; {n} peer(s); "
            f"median of {args.repeat} where repeated; every figure a whole command")
        if args.primary_conf:
            add(f"primary config added for the whole run: {args.primary_conf}")
        loads = [r["load1"] for runs in self.res["runs"].values() for r in runs]
        add(f"machine: {os.cpu_count()} CPUs, 1-min load average during the runs "
            f"{min(loads):.1f} .. {max(loads):.1f} (other work on the machine inflates every "
            "figure; compare ratios measured in the same run)")
        add(f"Salt floor (salt-run test.arg, default config, same keys; median of the runs at start "
            "and end): "
            f"{fmt(floor)}")
        add("")
        hdr = f"{'case':<52} {'sync':>8} {'sync-floor':>11} {'rsync':>8} {'ratio':>7} {'goal':>6}  met"
        add(hdr)
        add("-" * len(hdr))
        table = {}
        for key, s_label, r_label in rows:
            if s_label not in self.res["runs"]:
                continue
            goal, desc = GOALS[key]
            s, r = self.med(s_label), self.med(r_label)
            net = s - floor
            ratio = net / r if r else float("nan")
            ok = all(x.get("ok", True) for x in self.res["runs"].get(s_label, []))
            met = ("yes" if ratio <= goal else "NO ") + ("" if ok else " (sync FAILED)")
            add(f"{desc.format(n=n):<52} {fmt(s):>8} {fmt(net):>11} {fmt(r):>8} "
                f"{ratio:>6.2f}x {goal:>5.1f}x  {met}")
            table[key] = {"sync": s, "net": net, "rsync": r, "ratio": ratio, "goal": goal,
                          "met": ratio <= goal, "sync_ok": ok, "s_label": s_label}
        self.res["floor"] = floor
        # Salt records the sync's job as it records the floor's (a listing
        # of every key: about 2 s at 20,000 keys on Salt 3008): net of the
        # default floor that record cancels out.  Net of the bare floor (a
        # salt-run whose job is not stored: Salt's start and exit only),
        # every second the sync spends is counted, Salt's record of its job
        # included; the goals are judged on the paired figure: each sync net
        # of the bare floor taken right before it, the median of those
        # differences.
        bare = self.med(BARE_LABEL)
        if bare == bare:  # measured (not NaN)
            add("")
            add(f"net of the bare floor (salt-run test.arg with runner_returns: False: "
                f"Salt's start and exit, no job store; median of the run {fmt(bare)}): "
                "Salt's record of the sync's job (a listing of every key) counts as the sync's. "
                "paired: each sync net of the bare floor taken right before it (median of the "
                "differences), not charged with the floor's drift within the run; "
                "met: judged on the paired ratio")
            hdr2 = (f"{'case':<52} {'sync':>8} {'sync-bare':>10} {'ratio':>7} {'paired':>8} "
                    f"{'ratio':>7} {'rsync':>8} {'goal':>6}  met")
            add(hdr2)
            add("-" * len(hdr2))
            for key, row in table.items():
                net2 = row["sync"] - bare
                ratio2 = net2 / row["rsync"] if row["rsync"] else float("nan")
                pairs = list(zip(
                    [x["secs"] for x in self.res["runs"].get(row["s_label"], [])],
                    [x["secs"] for x in self.res["runs"].get(f"paired bare floor: {row['s_label']}", [])]))
                paired = median([a - b for a, b in pairs]) if pairs else float("nan")
                pratio = paired / row["rsync"] if row["rsync"] else float("nan")
                verdict = pratio if pratio == pratio else ratio2
                add(f"{GOALS[key][1].format(n=n):<52} {fmt(row['sync']):>8} {fmt(net2):>10} "
                    f"{ratio2:>6.2f}x {fmt(paired):>8} {pratio:>6.2f}x {fmt(row['rsync']):>8} "
                    f"{row['goal']:>5.1f}x  " + ("yes" if verdict <= row["goal"] else "NO"))
                row.update(bare_net=net2, bare_ratio=ratio2, paired_bare_net=paired,
                           paired_bare_ratio=pratio, bare_met=verdict <= row["goal"])
            self.res["bare_floor"] = bare
        self.res["table"] = table
        tr = self.res.get("transport")
        if tr and tr["full"] in self.res["runs"]:
            full, empty = self.med(tr["full"]), self.med(tr["empty"])
            add("")
            add(f"Salt's transport floor: {tr['calls']} peer_run calls from the peer's minion moving "
                f"{tr['bytes'] / 1e6:.0f} MB (the initial sync's bytes, its chunk size and requests "
                f"in flight), nothing read or written: {fmt(full)} ({fmt(empty)} for the same calls "
                "carrying 10 bytes)")
            initial = table.get("initial")
            if initial and bare == bare:
                rest = initial["sync"] - bare - full
                add(f"initial sync, 1 peer, net of the bare floor and of that transport: {fmt(rest)} "
                    f"against rsync's whole {fmt(initial['rsync'])} ({rest / initial['rsync']:.2f}x); "
                    f"the transport alone is {full / initial['rsync']:.2f}x rsync")
                initial.update(transport=full, net_of_transport=rest)
        add("")
        add("all runs (median, [each run]):")
        for label, runs in self.res["runs"].items():
            add(f"  {label:<66} {fmt(self.med(label)):>8}  "
                "[" + ", ".join(f"{r['secs']:.2f}" for r in runs) + "]")
        add("")
        add("sync returns (changes per category, first run of each case):")
        for label, runs in self.res["runs"].items():
            summ = runs[0].get("summary")
            if summ:
                add(f"  {label}: ok={summ.get('ok')}")
                for peer in self.peer_ids:
                    if peer in summ:
                        add(f"    {peer}: {json.dumps(summ[peer]['changes'])}"
                            + (f" error={summ[peer]['error']}" if summ[peer].get("error") else ""))
        add("")
        add("peer jobs (seconds from the salt-run start to the publish (jid) and to each peer's "
            "return stored on the primary; published load size):")
        for label, runs in self.res["runs"].items():
            for i, run in enumerate(runs):
                for job in run.get("jobs") or []:
                    add(f"  {label} #{i + 1} ({run['secs']:.2f}s): {job['fun']:<9} "
                        f"load {job['load_mb']:>6.2f} MB  published {job.get('published_after_s', 0):.2f}s, "
                        "returned " + ", ".join(f"{p} {s:.2f}s" for p, s in job["returned_after_s"].items()))
        add("")
        add("notes:")
        for note in FLOOR_NOTES + self.res["notes"]:
            add(f"  - {note}")
        for name, prof in self.res.get("profiles", {}).items():
            add("")
            add(f"profile {name} (inclusive seconds; py-spy: wall clock summed over threads, "
                "cProfile: main thread only):")
            for func, secs in prof.items():
                if isinstance(secs, dict):
                    add(f"  {func}: {json.dumps(secs)}")
                else:
                    add(f"  {func:<58} {secs:>8.3f}")
        text = "\n".join(lines)
        print("\n" + text, flush=True)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"sync-{args.stamp}.txt").write_text(text + "\n")
        (RESULTS / f"sync-{args.stamp}.json").write_text(json.dumps(self.res, indent=1, default=str))
        say(f"results in {RESULTS}/sync-{args.stamp}.{{txt,json}}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--keys", type=int, default=20000, help="accepted minion keys (20000)")
    parser.add_argument("--files", type=int, default=10000, help="files in file_roots base (10000)")
    parser.add_argument("--size-mb", type=float, default=110, help="total MB of those files (110)")
    parser.add_argument("--peers", type=int, default=3, choices=(1, 2, 3),
                        help="peer masters, for the parallel case (3)")
    parser.add_argument("--repeat", type=_positive, default=5,
                        help="runs of each repeatable case (5)")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="skip the cProfile runs")
    parser.add_argument("--only", choices=("all", "initial", "change"), default="all",
                        help="'initial': only the initial sync to one peer (the peer reset before "
                             "each run), then a profile of it; 'change': only the no-op and the "
                             "change sync to one peer, next to rsync and both floors")
    parser.add_argument("--hold", action="store_true",
                        help="after the run, keep the cluster running until SIGTERM/SIGINT "
                             "(prints how to reach it); implies --keep")
    parser.add_argument("--keep", action="store_true", help="keep the /tmp/mmb-* root")
    parser.add_argument("--primary-conf", type=_yaml_mapping, default=None,
                        help="YAML mapping added to the primary's config for the whole run, "
                             "e.g. '{runner_returns: False}'")
    parser.add_argument("--no-watch", dest="watch", action="store_false",
                        help="skip the second change phase, with the change journal engine "
                             "(multimaster_watch) on every master")
    parser.add_argument("--worktree", action="store_true",
                        help="measure the working tree instead of the committed HEAD")
    args = parser.parse_args(argv)
    args.keep = args.keep or args.hold
    args.stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")

    # A SIGTERM/SIGINT still runs every cleanup below.
    def _stop(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)
    quiet_salt_logging()

    root = pathlib.Path(tempfile.mkdtemp(prefix="mmb-", dir="/tmp"))
    os.chmod(root, 0o755)
    with contextlib.ExitStack() as stack:
        if not args.keep:
            stack.callback(shutil.rmtree, root, ignore_errors=True)
        else:
            stack.callback(say, f"kept {root}")
        ensure_tools()
        global REPO_COMMIT  # pylint: disable=global-statement
        REPO_COMMIT = repo_commit(args.worktree)
        say(f"root {root}; installing the extension at {REPO_COMMIT}")
        site = install_extension(root, args.worktree)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ)
        say("generating keys")
        pubs = gen_public_keys(50)
        sshd = Sshd(root)
        stack.callback(sshd.stop)
        sshd.start()
        say(f"sshd on 127.0.0.1:{sshd.port}")
        say(f"starting the cluster (primary + {args.peers} peers + their minions)")
        t0 = time.time()
        cluster = build_cluster(root, stack, args.peers, args.primary_conf)
        say(f"cluster up in {time.time() - t0:.0f}s")
        pki = pathlib.Path(cluster.primary.config["pki_dir"])
        base = pathlib.Path(cluster.primary.config["file_roots"]["base"][0])
        say(f"writing {args.keys} keys and {args.files} files (~{args.size_mb} MB)")
        write_keys(pki, pubs, args.keys)
        write_files(base, args.files, args.size_mb)
        subprocess.run(["sync"], check=False)
        bench = Bench(args, root, cluster, sshd, env)
        bench.res.update(keys=len(os.listdir(pki / "minions")), files=args.files,
                         bytes=du_bytes(base), args=vars(args), commit=REPO_COMMIT)
        try:
            bench.run()
        finally:
            if bench.res["runs"]:
                bench.report()
        if args.hold:
            say(f"holding the cluster: PYTHONPATH={site} {BIN}/salt-run -c {bench.conf_dir} ...; "
                "SIGTERM or Ctrl-C stops it")
            while True:
                time.sleep(3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
