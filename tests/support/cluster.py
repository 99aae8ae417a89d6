"""
A real multi-master Salt cluster for tests, built on pytest-salt-factories.

Layout (one cluster):

* ``primary``: a salt-master on ``<prefix>.2`` (default ports 4505/4506);
* ``peers``: N salt-masters on ``<prefix>.3``, ``<prefix>.4`` ... (same ports);
* ``peer_minions``: one salt-minion per peer host (the minion id is the peer's
  name in ``multimaster:peers``) whose ``multimaster.master_config`` points at
  that peer's master config;
* ``minions``: M salt-minions.

Every minion, a peer host's included, lists every master (``masters`` order:
primary first), the supported layout (docs/layout.rst): a peer host's minion
answers every master like any other, and the runner still reaches it from the
primary.  Its key is accepted on the primary; on the peers too unless
``accept_on_peers=False`` (fresh peers, to which a sync carries every key).

Each cluster gets its own random ``127.x.y.0/24`` prefix so that clusters of
concurrent test sessions never share an address.  Masters never auto-accept
keys: keys are pre-seeded (``seed_key``) the way an operator pre-seeds them, or
accepted with ``salt-key`` by the test.
"""

import collections
import concurrent.futures
import contextlib
import json
import logging
import os
import pathlib
import random
import resource
import shutil
import socket
import subprocess
import sys
import time

import psutil
import pytest
import salt.config
import salt.defaults.events
import salt.payload
import salt.utils.event
import salt.utils.yaml
import salt.version
from pytestshellutils.exceptions import FactoryTimeout
from salt_multimaster.rotation import gen_keypair  # noqa: F401  (the product's own; tests import it from here)

from tests.support import forkcli  # noqa: E402  pylint: disable=wrong-import-position

log = logging.getLogger(__name__)

PUBLISH_PORT = 4505
RET_PORT = 4506
KEY_DIRS = ("minions", "minions_pre", "minions_rejected", "minions_denied")


def _noop_auth_event(master, payload):  # pylint: disable=unused-argument
    """Masters in these tests never auto-accept keys."""


def _addr_free(addr):
    for port in (PUBLISH_PORT, RET_PORT):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((addr, port))
        except OSError:
            return False
        finally:
            sock.close()
    return True


def pick_prefix(count):
    """
    Return a ``127.x.y`` prefix whose ``.2`` .. ``.(2+count)`` addresses have
    ports 4505 and 4506 free.
    """
    rng = random.SystemRandom()
    for _ in range(200):
        prefix = f"127.{rng.randint(100, 250)}.{rng.randint(0, 255)}"
        if all(_addr_free(f"{prefix}.{2 + i}") for i in range(count)):
            return prefix
    raise RuntimeError("no free loopback prefix found for a test cluster")


def install_extension(src, site):
    """
    ``pip install .`` of ``src`` (this repository or a copy of it) into the
    directory ``site``: a real, non-editable wheel build, without dependencies.
    Daemons given ``site`` on PYTHONPATH find the extension through its
    ``salt.loader`` entry point.
    """
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
         "--no-build-isolation", "--target", str(site), str(src)],
        check=True,
    )
    shutil.rmtree(pathlib.Path(src) / "build", ignore_errors=True)
    for egg in pathlib.Path(src).glob("*.egg-info"):
        shutil.rmtree(egg, ignore_errors=True)
    return pathlib.Path(site)


def standalone_factories(root, stack, **kwargs):
    """
    salt-factories outside pytest (the demo, the benchmarks): an event
    listener, stopped by the ``contextlib.ExitStack`` ``stack``, and a
    factories manager rooted at ``root/f``.
    """
    # pylint: disable=import-outside-toplevel
    from saltfactories.manager import FactoriesManager
    from saltfactories.plugins.event_listener import EventListener
    from saltfactories.utils import ports

    # the manager logs its own repr as a warning when built; Salt's temporary
    # log handler prints it at exit, after the demo's last line
    logging.getLogger("saltfactories.manager").setLevel(logging.ERROR)
    listener = EventListener()
    listener.start()
    stack.callback(listener.stop)
    kwargs.setdefault("start_timeout", 120)
    return FactoriesManager(
        root_dir=pathlib.Path(root) / "f",
        # nothing listens there: the daemons' log forwarding goes nowhere
        log_server_host="127.0.0.1",
        log_server_port=ports.get_unused_localhost_port(),
        log_server_level="critical",
        event_listener=listener,
        **kwargs,
    )


def master_key_paths(pki_dir):
    """
    The files a running master loads for its keypair: Salt 3008 keeps
    ``<id>.pem``/``<id>.pub`` with ``master.pem``/``master.pub`` symlinks to
    them, Salt 3007 keeps ``master.pem``/``master.pub``.  Return resolved
    (private, public) paths.
    """
    pki_dir = pathlib.Path(pki_dir)
    return (
        pathlib.Path(os.path.realpath(pki_dir / "master.pem")),
        pathlib.Path(os.path.realpath(pki_dir / "master.pub")),
    )


# Where a session's daemon time goes (printed at the end of a pytest run, see
# tests/conftest.py): {what: [count, seconds, CPU seconds or None]}.  The CPU
# is counted for the CLIs (salt, salt-run, salt-key, salt-call: each a
# process of its own, reaped when it returns): what the children of this
# process and of the CLI fork server used meanwhile, not known for the daemons.
SPENT = {}
# the SPENT entries of the starts in one test module: "<STARTS_IN><module>: <role> starts"
STARTS_IN = "starts in "


def _children_cpu():
    """CPU seconds of the children reaped so far (the CLI fork server's commands too)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime + forkcli.cpu_used()


def _spent(what, began, cpu_before=None):
    entry = SPENT.setdefault(what, [0, 0.0, None])
    entry[0] += 1
    entry[1] += time.monotonic() - began
    if cpu_before is not None:
        entry[2] = (entry[2] or 0.0) + _children_cpu() - cpu_before


# master_alive_interval of the tests' minions on Salt 3007 (Cluster._minion).
MASTER_ALIVE_3007 = 10
# on the PYTHONPATH of the tests' salt-minion daemons on Salt 3007
SALT3007_SHIM = str(pathlib.Path(__file__).resolve().parent / "salt3007")

# How often a start looks for the daemon's start event (salt-factories'
# own check looks every 1.5 s: on average most of a second lost per start).
START_POLL = 0.1


def _no_check_events():
    return []


def _wait_started(daemon, patterns, after, timeout):
    """
    Wait until ``daemon`` (started at ``after``, a ``time.time()``) sent the
    start events ``patterns`` (salt-factories' own start check, polled every
    :data:`START_POLL` seconds).
    """
    patterns = set(patterns)
    end = time.monotonic() + timeout
    while patterns:
        if not daemon.is_running():
            raise RuntimeError(f"{daemon} is no longer running")
        patterns -= {(event.daemon_id, event.tag)
                     for event in daemon.event_listener.get_events(patterns, after_time=after)}
        if patterns and time.monotonic() > end:
            raise RuntimeError(f"{daemon} sent no {sorted(patterns)} within {timeout} s")
        if patterns:
            time.sleep(START_POLL)


def _kill_tree(daemon):
    """
    SIGKILL ``daemon`` and every process it started (salt-factories kills
    the daemon, then sends its orphaned children a SIGTERM they take a
    second to act on: a salt-master has a dozen).
    """
    pid = getattr(daemon, "pid", None)
    if not pid or not daemon.is_running():
        return
    try:
        main = psutil.Process(pid)
        family = [main, *main.children(recursive=True)]
    except psutil.Error:
        return
    for proc in family:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def _tree_cpu(pid):
    """CPU seconds of process ``pid`` and its children, the ones it reaped too (None: gone)."""
    try:
        main = psutil.Process(pid)
        family = [main, *main.children(recursive=True)]
    except psutil.Error:
        return None
    used = 0.0
    for proc in family:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            used += times.user + times.system + times.children_user + times.children_system
    return used


def _spent_living(daemon, role):
    """Count the CPU ``daemon`` used since it started (its whole process tree), as it stops."""
    pid = getattr(daemon, "pid", None)
    cpu = _tree_cpu(pid) if pid and daemon.is_running() else None
    with contextlib.suppress(psutil.Error):
        if cpu is not None:
            lived = time.time() - psutil.Process(pid).create_time()
            entry = SPENT.setdefault(f"{role} lives", [0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += lived
            entry[2] += cpu


def _timed(daemon, role):
    """
    Count the time ``daemon``'s start and terminate take (whoever calls them)
    in SPENT; a start returns once the daemon's start event arrived
    (:func:`_wait_started`), unless a test replaced ``get_check_events``.
    """
    start, terminate = daemon.start, daemon.terminate
    check_events = daemon.get_check_events
    daemon.get_check_events = _no_check_events

    def timed_start(*args, **kwargs):
        began, after = time.monotonic(), time.time()
        try:
            ret = start(*args, **kwargs)
            if daemon.get_check_events is _no_check_events:
                _wait_started(daemon, check_events(), after, daemon.start_timeout)
            return ret
        finally:
            _spent(f"{role} starts", began)
            test = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[0]
            _spent(f"{STARTS_IN}{test.rsplit('/', 1)[-1]}: {role} starts", began)

    def timed_terminate(*args, **kwargs):
        began = time.monotonic()
        _spent_living(daemon, role)
        try:
            if not daemon.slow_stop:
                _kill_tree(daemon)
            return terminate(*args, **kwargs)
        finally:
            _spent(f"{role} stops", began)

    daemon.start, daemon.terminate = timed_start, timed_terminate
    return daemon


def _each(fn, daemons):
    """``fn(daemon)`` for every daemon at once (threads); the first error raised, after all ended."""
    daemons = list(daemons)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(daemons))) as pool:
        for future in [pool.submit(fn, daemon) for daemon in daemons]:
            future.result()


class Cluster:
    """
    A primary master, its peers, the peers' own minions and ordinary minions.
    ``fork_clis``: its CLI calls from the fork server (:mod:`tests.support.forkcli`).
    ``log_level``: the daemons' and CLIs' log file level; a test that reads a
    debug message, or searches the debug log for a leak, asks for "debug".
    """

    def __init__(
        self,
        factories,
        name,
        peers=1,
        minions=1,
        share_master_keys=True,
        accept_on_peers=True,
        master_overrides=None,
        primary_overrides=None,
        minion_overrides=None,
        environ=None,
        fork_clis=False,
        log_level="info",
    ):
        self.factories = factories
        self.fork_clis = fork_clis
        self.name = name
        self.prefix = pick_prefix(peers + 1)
        self.share_master_keys = share_master_keys
        self.accept_on_peers = accept_on_peers
        self.environ = environ
        self.log_level = log_level
        self.minion_overrides = minion_overrides or {}
        base = {
            "publish_port": PUBLISH_PORT,
            "ret_port": RET_PORT,
            # Salt's debug log costs a tenth of the daemons' and CLIs' CPU
            # (test_sync: 162 s of CPU at debug, 143 s at info, one run each)
            "log_level_logfile": log_level,
            # salt-factories serves files in 8 KiB chunks; a real master uses
            # Salt's default (1 MiB): keep what users run
            "file_buffer_size": salt.config.DEFAULT_MASTER_OPTS["file_buffer_size"],
            # a salt-master's start is CPU-bound: each of its worker_threads
            # builds its loaders, and each loader set computes the host's
            # grains (salt-run's too): 10-12 s of CPU a master start with
            # Salt's 5 workers and the grains computed, 4.6-6.1 s with 3 workers
            # (the least Salt allows with ``peer``) and the grains cached
            # (docs/development.rst)
            "worker_threads": 3,
            "grains_cache": True,
        }
        base.update(master_overrides or {})
        primary_conf = dict(base, interface=f"{self.prefix}.2")
        primary_conf.update(primary_overrides or {})
        self.primary = factories.salt_master_daemon(
            f"{name}-primary",
            overrides=primary_conf,
            on_auth_event_callback=_noop_auth_event,
            start_timeout=120,
        )
        _timed(self._env(self.primary), "master")
        self.peers = [
            factories.salt_master_daemon(
                f"{name}-peer{i + 1}",
                overrides=dict(base, interface=f"{self.prefix}.{3 + i}"),
                on_auth_event_callback=_noop_auth_event,
                start_timeout=120,
            )
            for i in range(peers)
        ]
        for peer in self.peers:
            _timed(self._env(peer), "master")
        self.peer_minions = [
            self._minion(
                f"{name}-peer{i + 1}",
                self.masters,
                {"multimaster.master_config": str(peer.config_file)},
            )
            for i, peer in enumerate(self.peers)
        ]
        self.minions = [
            self._minion(f"{name}-minion{j + 1}", self.masters, {})
            for j in range(minions)
        ]

    # ----- construction -------------------------------------------------
    def _env(self, factory):
        """Give a daemon or CLI factory this cluster's own environment."""
        if self.environ is not None:
            factory.environ = dict(self.environ)
        return factory

    def _minion(self, minion_id, masters, extra):
        overrides = {
            "master": [m.config["interface"] for m in masters],
            "master_port": RET_PORT,
            "publish_port": PUBLISH_PORT,
            "acceptance_wait_time": 1,
            "acceptance_wait_time_max": 2,
            "random_reauth_delay": 0,
            "recon_default": 100,
            "recon_max": 500,
            "recon_randomize": False,
            "log_level_logfile": self.log_level,
            # a salt-minion computes its grains several times as it starts
            # (for each master); cached, it computes them once and reads them
            # back (for grains_cache_expiration, 5 minutes), restarts included
            "grains_cache": True,
        }
        if salt.version.__saltstack_version__.major == 3007:
            # Salt 3007's minion watches its publish socket (zmq_monitor, on
            # by default since 3007): when a master restarts it closes that
            # master's channels and connects again; without the alive check
            # (master_alive_interval, which the formula sets: 30 s) it often
            # never answered the restarted master again (test_rotate_key,
            # test_outage, test_formula's reactor fixture).  The tests'
            # minions run as the formula configures them, with a shorter
            # interval.  On 3006 (no monitor: zeromq reconnects by itself)
            # and 3008 they reconnect without it.
            overrides["master_alive_interval"] = MASTER_ALIVE_3007
        overrides.update(self.minion_overrides)
        overrides.update(extra)
        minion = self._env(
            self.primary.salt_minion_daemon(
                minion_id, overrides=overrides, start_timeout=120
            )
        )
        # stopped with SIGKILL (its children too), as a crash or the OOM
        # killer stops it: a salt-minion acts on SIGTERM only when its process
        # manager wakes, and salt-factories waits up to 10 s for it (5 s a
        # stop on 3008, 12 s on 3007); no test needs a minion's clean exit
        minion.slow_stop = False
        if salt.version.__saltstack_version__.major == 3007:
            # the check Salt 3008.3 added to RequestClient.connect: without
            # it a 3007 minion's main loop can block for good in zmq's
            # Context.term after a master stops (salt3007/sitecustomize.py)
            # (a dict of its own: salt-factories hands the minion its
            # master's environ)
            paths = [SALT3007_SHIM, minion.environ.get("PYTHONPATH")]
            minion.environ = dict(minion.environ,
                                  PYTHONPATH=os.pathsep.join(p for p in paths if p))
        return _timed(minion, "minion")

    @property
    def masters(self):
        return [self.primary, *self.peers]

    @property
    def all_minions(self):
        return [*self.peer_minions, *self.minions]

    # ----- keys ---------------------------------------------------------
    @staticmethod
    def ensure_minion_key(minion):
        """Generate the minion's keypair now, as its first start would."""
        pki = pathlib.Path(minion.config["pki_dir"])
        pki.mkdir(parents=True, exist_ok=True)
        if not (pki / "minion.pub").exists():
            priv, pub = gen_keypair(2048)
            (pki / "minion.pem").write_bytes(priv)
            os.chmod(pki / "minion.pem", 0o400)
            (pki / "minion.pub").write_bytes(pub)
        return (pki / "minion.pub").read_text()

    @staticmethod
    def seed_key(master, minion, state="minions"):
        """Pre-seed ``minion``'s public key into ``master``'s pki_dir/<state>."""
        pub = Cluster.ensure_minion_key(minion)
        dest = pathlib.Path(master.config["pki_dir"]) / state
        dest.mkdir(parents=True, exist_ok=True)
        (dest / minion.id).write_text(pub)

    def copy_master_keys(self, src, dst):
        """Copy ``src``'s master keypair to ``dst`` (stopped), as the seeds do by hand."""
        priv, pub = master_key_paths(src.config["pki_dir"])
        dst_pki = pathlib.Path(dst.config["pki_dir"])
        dst_pki.mkdir(parents=True, exist_ok=True)
        dst_priv, dst_pub = master_key_paths(dst_pki)
        for path in (dst_priv, dst_pub):
            if path.exists() and path.name not in ("master.pem", "master.pub"):
                path.unlink()
        for link in ("master.pem", "master.pub"):
            if (dst_pki / link).is_symlink() or (dst_pki / link).exists():
                (dst_pki / link).unlink()
        shutil.copyfile(priv, dst_pki / "master.pem")
        os.chmod(dst_pki / "master.pem", 0o400)
        shutil.copyfile(pub, dst_pki / "master.pub")

    def seed_master_keys(self):
        """
        One master keypair for every master (``share_master_keys``), placed
        before any of them starts (as the seeds place it by hand): the
        primary's own when it has one, else a new one written where a first
        start finds it (``master.pem``/``master.pub``: Salt 3008 moves them to
        ``<id>.pem``/``<id>.pub`` and links them at its first start, as for a
        keypair it generates).  The masters then start at once.
        """
        pki = self.pki_dir(self.primary)
        pki.mkdir(parents=True, exist_ok=True)
        if not (pki / "master.pem").exists():
            priv, pub = gen_keypair(salt.config.DEFAULT_MASTER_OPTS["keysize"])
            (pki / "master.pem").write_bytes(priv)
            os.chmod(pki / "master.pem", 0o400)
            (pki / "master.pub").write_bytes(pub)
        for peer in self.peers:
            self.copy_master_keys(self.primary, peer)

    # ----- lifecycle ----------------------------------------------------
    def start(self, before_minions=None, before_masters=None):
        """
        Start every master at once (sharing one keypair if asked, placed
        before the first start), then every minion at once;
        ``before_masters(cluster)`` runs once the keys are placed, before any
        daemon starts, ``before_minions(cluster)`` once the masters are up.
        """
        for minion in self.all_minions:
            self.seed_key(self.primary, minion)
            if self.accept_on_peers:
                for peer in self.peers:
                    self.seed_key(peer, minion)
        if self.share_master_keys:
            self.seed_master_keys()
        if before_masters is not None:
            before_masters(self)
        _each(lambda master: master.start(), self.masters)
        if before_minions is not None:
            before_minions(self)
        _each(lambda minion: minion.start(), self.all_minions)
        return self

    def running(self, minions=None, before_minions=None, before_masters=None):
        """
        A module fixture's body, ``yield from cluster.running()``: started
        (:meth:`start`), every minion (``minions``, default all, peer hosts'
        included) answering the primary, stopped when the module is done.
        """
        self.start(before_minions=before_minions, before_masters=before_masters)
        assert self.wait_pings(self.primary, self.all_minions if minions is None else minions)
        yield self
        self.stop()

    def stop(self):
        """
        Stop every daemon for good, killed (SIGKILL, children too): the
        minions at once (see :meth:`_minion`), then the masters at once.  No
        test looks at a daemon after this, and a salt-master's clean exit
        took 2.5 s on 3006 (0.7 s on 3008) against well under a second
        killed.  A master a test restarts stops cleanly, as a service
        manager stops it.
        """
        for master in self.masters:
            master.slow_stop = False

        def terminate(daemon):
            try:
                daemon.terminate()
            except Exception:  # pylint: disable=broad-except
                log.exception("stopping %s", daemon)

        _each(terminate, self.all_minions)
        _each(terminate, self.masters)

    def restart(self, daemon):
        daemon.terminate()
        daemon.start()

    # ----- CLIs -----------------------------------------------------------
    def _run(self, command, cli, *args, **kwargs):
        """
        ``cli.run(*args, **kwargs)`` (``cli``: the CLI factory of
        ``command``), from the fork server when the cluster was built with
        ``fork_clis`` (:mod:`tests.support.forkcli`); its time and CPU
        counted in SPENT.
        """
        if self.fork_clis:
            scripts = os.path.dirname(cli.get_script_path())
            server = forkcli.start(scripts)
            if server is not None:
                cli.script_name = forkcli.client_script(scripts, command, server.sock)
        began, cpu = time.monotonic(), _children_cpu()
        try:
            return self._env(cli).run(*args, **kwargs)
        finally:
            _spent(f"{command} calls", began, cpu)

    def salt(self, master, *args, minion_tgt="*", timeout=60, **kwargs):
        return self._run("salt", master.salt_cli(timeout=timeout), *args,
                         minion_tgt=minion_tgt, **kwargs)

    def salt_run(self, master, *args, timeout=180, **kwargs):
        return self._run("salt-run", master.salt_run_cli(timeout=timeout), *args, **kwargs)

    def salt_key(self, master, *args, **kwargs):
        return self._run("salt-key", master.salt_key_cli(), *args, **kwargs)

    def salt_call(self, minion, *args, timeout=120, **kwargs):
        return self._run("salt-call", minion.salt_call_cli(timeout=timeout), *args, **kwargs)

    def refresh_pillar(self, master, minion, deadline=120):
        """
        Refresh ``minion``'s pillar through ``master``, wait until every one
        of its Minion objects is done, and return the CLI's return (which a
        failed refresh may keep from arriving).

        A multi-master salt-minion runs one Minion object per ``master``
        entry (a duplicate entry too), and each refreshes on the one
        ``pillar_refresh`` event.  ``saltutil.refresh_pillar wait=True``
        returns at the first completion event, with the others still
        compiling: a test that then makes the cached master key stale would
        catch one of them half way, and a pillar that fails its signature
        check (3006.28, 3007.15, 3008) leaves that master without the
        minion's returns.  Here the test counts one completion per entry (a
        failed refresh completes too) in salt-factories' event listener (the
        minion's engine forwards its bus): a subscription of the test's own
        loses events on Salt 3007, whose event client reconnects each time a
        wait runs out (tests/integration/test_revocation.py).
        """
        entries = salt.config.minion_config(minion.config_file)["master"]
        expected = len(entries) if isinstance(entries, list) else 1
        since = time.time()
        tag = salt.defaults.events.MINION_PILLAR_REFRESH_COMPLETE

        def completed():
            return len(minion.event_listener.get_events([(minion.id, tag)], after_time=since))

        ret = self.salt(master, "saltutil.refresh_pillar", minion_tgt=minion.id)
        wait_until(lambda: completed() >= expected, deadline=deadline, step=0.2)
        seen = completed()
        assert seen >= expected, f"{minion.id}: {seen} of {expected} pillar refreshes completed"
        return ret

    def ping(self, master, minion_id, timeout=10):
        """True when ``minion_id`` answers test.ping through ``master``."""
        began = time.monotonic()
        try:
            ret = self.salt(master, "test.ping", f"--timeout={timeout}",
                            minion_tgt=minion_id, timeout=timeout + 30)
        except FactoryTimeout:
            ret = None
        answered = ret is not None and ret.returncode == 0 and ret.data is True
        _spent("pings answered" if answered else "pings not answered", began)
        return answered

    def wait_ping(self, master, minion_id, deadline=90):
        """Ping until ``minion_id`` answers through ``master`` or ``deadline`` s pass."""
        end = time.time() + deadline
        while time.time() < end:
            if self.ping(master, minion_id, timeout=5):
                return True
            time.sleep(1)
        return False

    def wait_pings(self, master, minions, deadline=90):
        """
        :meth:`wait_ping` for several minions (daemons or ids) with one
        ``test.ping`` per round, targeting those that have not answered
        yet: True once every one answered through ``master``.
        """
        waiting = {getattr(m, "id", m) for m in minions}
        end = time.time() + deadline
        while waiting and time.time() < end:
            began = time.monotonic()
            try:
                ret = self.salt(master, "test.ping", "--timeout=5", "-L",
                                minion_tgt=",".join(sorted(waiting)), timeout=35)
            except FactoryTimeout:
                ret = None
            data = ret.data if ret is not None else None
            if len(waiting) == 1 and data is True:
                data = {next(iter(waiting)): True}
            if isinstance(data, dict):
                waiting -= {mid for mid, answer in data.items() if answer is True}
            _spent("pings not answered" if waiting else "pings answered", began)
            if waiting:
                time.sleep(1)
        return not waiting

    # ----- reading a master's state ---------------------------------------
    @staticmethod
    def pki_dir(master):
        return pathlib.Path(master.config["pki_dir"])

    @staticmethod
    def keys(master):
        """``{state_dir: {id: pub}}`` read straight from a master's pki_dir."""
        ret = {}
        for state in KEY_DIRS:
            path = pathlib.Path(master.config["pki_dir"]) / state
            ret[state] = (
                {p.name: p.read_text() for p in sorted(path.iterdir()) if p.is_file()}
                if path.is_dir()
                else {}
            )
        return ret

    @staticmethod
    def write_contract_pillar(master, tgt, masters, finger, topology="shared"):
        """
        The formula's contract pillar (``multimaster:masters``,
        ``master_finger``, ``topology``) for the minions ``tgt`` matches, in
        ``master``'s first base pillar root (its top file included).
        """
        root = pathlib.Path(master.config["pillar_roots"]["base"][0])
        root.mkdir(parents=True, exist_ok=True)
        (root / "top.sls").write_text(f"base:\n  '{tgt}':\n    - multimaster\n")
        (root / "multimaster.sls").write_text(salt.utils.yaml.safe_dump({"multimaster": {
            "masters": list(masters), "master_finger": finger, "topology": topology}}))

    @staticmethod
    def file_root(master, saltenv="base", kind="file_roots"):
        return pathlib.Path(master.config[kind][saltenv][0])

    @staticmethod
    def job_cache(master):
        return pathlib.Path(master.config["cachedir"]) / "jobs"

    def job_records(self, master, fun):
        """``[(jid, load, minions)]`` of every ``fun`` job in the master's job cache, oldest first."""
        ret = []
        for load in self.job_cache(master).glob("*/*/.load.p"):
            with open(load, "rb") as fh:
                data = salt.payload.load(fh)
            if data.get("fun") == fun:
                with open(load.parent / ".minions.p", "rb") as fh:
                    ret.append((data["jid"], data, salt.payload.load(fh)))
        return sorted(ret, key=lambda rec: rec[0])

    def master_fingerprint(self, master):
        """
        The master fingerprint as an operator reads it: the real
        ``salt-key -F master`` on ``master`` (its ``*.pub`` line: master.pub
        on Salt 3006/3007, ``<id>.pub`` on 3008, whose salt-key hashes the
        whole PEM text).
        """
        ret = self.salt_key(master, "-F", "master")
        assert ret.returncode == 0, ret
        local = (ret.data or {}).get("local") or {}
        # 3006/3007 list master.pub, 3008 <id>.pub (master.pub is a symlink
        # there); master_sign.pub too where present
        for name in (f"{master.config['id']}.pub", "master.pub"):
            if name in local:
                return local[name]
        raise AssertionError(f"no master public key in salt-key -F master: {ret}")

    @staticmethod
    def log_files(daemon):
        return [pathlib.Path(daemon.config["log_file"])]

    def log_size(self, daemon):
        """Where ``daemon``'s log ends now: an offset for ``log_since``."""
        return self.log_files(daemon)[0].stat().st_size

    def log_since(self, daemon, offset):
        """What ``daemon`` logged after ``offset`` (bytes, as ``log_size`` gives)."""
        return self.log_files(daemon)[0].read_bytes()[offset:].decode(errors="replace")


def log_tail(daemon, last=60, keep=lambda line: True):
    """
    The last ``last`` lines of ``daemon``'s log above DEBUG that ``keep``,
    for failure messages (read line by line: a log may be hundreds of MB).
    """
    tail = collections.deque(maxlen=last)
    with open(daemon.config["log_file"], encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if keep(line) and not any(level in line for level in ("[DEBUG", "[TRACE",
                                                                  "[GARBAGE")):
                tail.append(line.rstrip("\n"))
    return list(tail)


def wait_until(predicate, deadline=120, step=0.5):
    """Poll ``predicate`` until it is true (True) or ``deadline`` seconds pass (False)."""
    end = time.time() + deadline
    while time.time() < end:
        if predicate():
            return True
        time.sleep(step)
    return False


def read_json(text):
    return json.loads(text)


def run(cmd, **kwargs):
    """subprocess.run with text output, for non-Salt commands in tests."""
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    return subprocess.run(cmd, check=False, **kwargs)  # pylint: disable=subprocess-run-check


# A primary serving a large sync's pulls: each pull (peer_run) holds one of
# its request workers while it runs, and a peer keeps up to three in flight
# (salt_multimaster.applier.PULL_AHEAD + 1); with the 3 workers of the other
# test masters a loaded machine left no worker for the peer minion's
# returns, whose request then timed out (a find_job answer lost: the sync
# reported the peer gone).  Salt's own default: 5.  And a find_job answer
# is awaited 30 s (gather_job_timeout; Salt's default 10): a peer minion
# restarted beside three test workers on two cores had its returns reach
# the primary 24 s (the find_job's) and 34 s (the inventory's) after it sent
# them, each request timed out and sent again (Salt 3008, test_faults.py's
# minion killed mid-apply), and the sync reported it gone.
PULL_PRIMARY = {"peer_run": {".*": ["multimaster.pull"]},
                "worker_threads": salt.config.DEFAULT_MASTER_OPTS["worker_threads"],
                "gather_job_timeout": 30}


def _started_with_pull(cluster_factory, name, master_overrides=None, **kwargs):
    """
    A started cluster of one peer and no plain minion whose primary grants
    the pull channel (``peer_run``) and lists the peer in
    ``master.d/multimaster.conf``: the setting of a large sync.
    ``master_overrides``: options of every master; ``kwargs``: more of
    :class:`Cluster`'s.
    """
    cluster = cluster_factory(
        name, peers=1, minions=0, master_overrides=master_overrides,
        primary_overrides={**PULL_PRIMARY, **kwargs.pop("primary_overrides", {})}, **kwargs,
    )
    dropin = pathlib.Path(cluster.primary.config_file).parent / "master.d" / "multimaster.conf"
    dropin.parent.mkdir(exist_ok=True)
    dropin.write_text(salt.utils.yaml.safe_dump(
        {"multimaster": {"peers": [m.id for m in cluster.peer_minions]}}))
    cluster.start()
    assert cluster.wait_ping(cluster.primary, cluster.peer_minions[0].id)
    return cluster


def pull_cluster(name, master_overrides=None, **kwargs):
    """
    A module-scoped ``cluster`` fixture: one peer and no plain minion, the
    primary granting the pull channel (``peer_run``) and listing the peer
    in ``master.d/multimaster.conf`` (the setting of a large sync); stopped
    after the module.  In a test module: ``cluster = pull_cluster("abc")``;
    ``master_overrides``: options of every master; ``kwargs``: more of
    :class:`Cluster`'s.
    """

    @pytest.fixture(scope="module")
    def cluster(cluster_factory):
        started = _started_with_pull(cluster_factory, name, master_overrides, **kwargs)
        yield started
        started.stop()

    return cluster
