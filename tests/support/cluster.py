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

import concurrent.futures
import json
import logging
import os
import pathlib
import random
import shutil
import socket
import subprocess
import sys
import time

import pytest
import salt.config
import salt.defaults.events
import salt.payload
import salt.utils.event
import salt.utils.yaml
from pytestshellutils.exceptions import FactoryTimeout
from salt_multimaster.rotation import gen_keypair  # noqa: F401  (the product's own; tests import it from here)

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


def _each(fn, daemons):
    """``fn(daemon)`` for every daemon at once (threads); the first error raised, after all ended."""
    daemons = list(daemons)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(daemons))) as pool:
        for future in [pool.submit(fn, daemon) for daemon in daemons]:
            future.result()


class Cluster:
    """
    A primary master, its peers, the peers' own minions and ordinary minions.
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
    ):
        self.factories = factories
        self.name = name
        self.prefix = pick_prefix(peers + 1)
        self.share_master_keys = share_master_keys
        self.accept_on_peers = accept_on_peers
        self.environ = environ
        self.minion_overrides = minion_overrides or {}
        base = {
            "publish_port": PUBLISH_PORT,
            "ret_port": RET_PORT,
            "log_level_logfile": "debug",
            # salt-factories serves files in 8 KiB chunks; a real master uses
            # Salt's default (1 MiB): keep what users run
            "file_buffer_size": salt.config.DEFAULT_MASTER_OPTS["file_buffer_size"],
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
        self._env(self.primary)
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
            self._env(peer)
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
            "log_level_logfile": "debug",
        }
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
        return minion

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

    # ----- lifecycle ----------------------------------------------------
    def start(self, before_minions=None):
        """
        Start primary, peers (sharing keys if asked), then all minions;
        ``before_minions(cluster)`` runs once the masters are up.
        """
        for minion in self.all_minions:
            self.seed_key(self.primary, minion)
            if self.accept_on_peers:
                for peer in self.peers:
                    self.seed_key(peer, minion)
        self.primary.start()
        if self.share_master_keys:
            for peer in self.peers:
                self.copy_master_keys(self.primary, peer)
        _each(lambda peer: peer.start(), self.peers)
        if before_minions is not None:
            before_minions(self)
        _each(lambda minion: minion.start(), self.all_minions)
        return self

    def running(self, minions=None, before_minions=None):
        """
        A module fixture's body, ``yield from cluster.running()``: started,
        every minion (``minions``, default all, peer hosts' included)
        answering the primary, stopped when the module is done.
        """
        self.start(before_minions=before_minions)
        for minion in self.all_minions if minions is None else minions:
            assert self.wait_ping(self.primary, minion.id)
        yield self
        self.stop()

    def stop(self):
        """
        Stop every daemon for good: the minions at once (killed, see
        :meth:`_minion`), then the masters at once.
        """
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
    def salt(self, master, *args, minion_tgt="*", timeout=60, **kwargs):
        cli = self._env(master.salt_cli(timeout=timeout))
        return cli.run(*args, minion_tgt=minion_tgt, **kwargs)

    def salt_run(self, master, *args, timeout=180, **kwargs):
        return self._env(master.salt_run_cli(timeout=timeout)).run(*args, **kwargs)

    def salt_key(self, master, *args, **kwargs):
        return self._env(master.salt_key_cli()).run(*args, **kwargs)

    def salt_call(self, minion, *args, timeout=120, **kwargs):
        return self._env(minion.salt_call_cli(timeout=timeout)).run(*args, **kwargs)

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
        minion's returns.  Here the test listens on the minion's own event
        bus and counts one completion per entry (a failed refresh completes
        too).
        """
        entries = salt.config.minion_config(minion.config_file)["master"]
        expected = len(entries) if isinstance(entries, list) else 1
        seen = 0
        with salt.utils.event.get_event("minion", opts=dict(minion.config), listen=True) as bus:
            ret = self.salt(master, "saltutil.refresh_pillar", minion_tgt=minion.id)
            end = time.time() + deadline
            while seen < expected and time.time() < end:
                if bus.get_event(wait=1, tag=salt.defaults.events.MINION_PILLAR_REFRESH_COMPLETE):
                    seen += 1
        assert seen == expected, f"{minion.id}: {seen} of {expected} pillar refreshes completed"
        return ret

    def ping(self, master, minion_id, timeout=10):
        """True when ``minion_id`` answers test.ping through ``master``."""
        try:
            ret = self.salt(master, "test.ping", f"--timeout={timeout}",
                            minion_tgt=minion_id, timeout=timeout + 30)
        except FactoryTimeout:
            return False
        return ret.returncode == 0 and ret.data is True

    def wait_ping(self, master, minion_id, deadline=90):
        """Ping until ``minion_id`` answers through ``master`` or ``deadline`` s pass."""
        end = time.time() + deadline
        while time.time() < end:
            if self.ping(master, minion_id, timeout=5):
                return True
            time.sleep(1)
        return False

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



def _started_with_pull(cluster_factory, name, master_overrides=None):
    """
    A started cluster of one peer and no plain minion whose primary grants
    the pull channel (``peer_run``) and lists the peer in
    ``master.d/multimaster.conf``: the setting of a large sync.
    ``master_overrides``: options of every master.
    """
    cluster = cluster_factory(
        name, peers=1, minions=0, master_overrides=master_overrides,
        primary_overrides={"peer_run": {".*": ["multimaster.pull"]}},
    )
    dropin = pathlib.Path(cluster.primary.config_file).parent / "master.d" / "multimaster.conf"
    dropin.parent.mkdir(exist_ok=True)
    dropin.write_text(salt.utils.yaml.safe_dump(
        {"multimaster": {"peers": [m.id for m in cluster.peer_minions]}}))
    cluster.start()
    assert cluster.wait_ping(cluster.primary, cluster.peer_minions[0].id)
    return cluster


def pull_cluster(name, master_overrides=None):
    """
    A module-scoped ``cluster`` fixture: one peer and no plain minion, the
    primary granting the pull channel (``peer_run``) and listing the peer
    in ``master.d/multimaster.conf`` (the setting of a large sync); stopped
    after the module.  In a test module: ``cluster = pull_cluster("abc")``;
    ``master_overrides``: options of every master.
    """

    @pytest.fixture(scope="module")
    def cluster(cluster_factory):
        started = _started_with_pull(cluster_factory, name, master_overrides)
        yield started
        started.stop()

    return cluster
