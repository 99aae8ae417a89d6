"""
Shared fixtures: a short factories root dir, the extension installed the way
``pip install .`` installs it, and a builder for real multi-master clusters.
"""

import json
import logging
import os
import pathlib
import resource
import shutil
import sys
import tempfile
import time

import psutil
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "_utils"))
sys.path.insert(0, str(REPO))

# salt-factories leaves salt's temporary logging handler writing to closed
# streams at teardown: shut it down now and keep the root logger quiet.
try:
    import salt._logging.impl  # pylint: disable=wrong-import-position

    salt._logging.impl.shutdown_temp_handler()
except Exception:  # pylint: disable=broad-except  # pragma: no cover
    pass
logging.getLogger().addHandler(logging.NullHandler())

from tests.support.cluster import (  # noqa: E402  pylint: disable=wrong-import-position
    SPENT as cluster_spent, STARTS_IN, Cluster, install_extension)


@pytest.fixture(scope="session")
def mm_root():
    """A short per-session root: unix socket paths must stay under ~107 chars."""
    root = tempfile.mkdtemp(prefix="mm-", dir="/tmp")
    os.chmod(root, 0o755)
    yield pathlib.Path(root)
    if not os.environ.get("MM_KEEP"):
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def pip_site(mm_root, repo_tree):
    """
    ``pip install .`` (a real, non-editable wheel build) into a private site
    directory, put on PYTHONPATH for every daemon and CLI the tests start.
    Salt finds the extension through its ``salt.loader`` entry point there.
    Built from the session's own copy of the repository (``repo_tree``, left
    as it was): the build writes beside its sources, and two sessions (the
    workers of pytest-xdist) must not build in one tree.
    """
    site = install_extension(repo_tree, mm_root / "site")
    return site


@pytest.fixture(scope="session")
def salt_factories_config(mm_root, pip_site):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(pip_site), os.environ.get("PYTHONPATH", "")) if p
    )
    return {"root_dir": str(mm_root / "f"), "start_timeout": 120}


@pytest.fixture(scope="session")
def repo_tree(mm_root):
    """
    This repository as a user clones it (no .venv, .git or caches), to serve
    as a file_roots root: a root holding a virtualenv makes every fileserver
    listing walk thousands of files.
    """
    dest = mm_root / "repo"
    shutil.copytree(
        REPO,
        dest,
        ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.pyc", "build",
                                      "*.egg-info", ".pytest_cache", "results"),
    )
    return dest


@pytest.fixture(scope="session")
def clean_environ():
    """The environment without the pip-installed extension (file_roots path)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


@pytest.fixture(scope="session")
def cluster_factory(salt_factories):
    """
    ``cluster_factory(name, peers=1, minions=1, ...)`` builds (not starts) a
    :class:`tests.support.cluster.Cluster`; every cluster built is stopped at
    the end of the session at the latest.
    """
    built = []

    def factory(name, **kwargs):
        kwargs.setdefault("fork_clis", True)
        cluster = Cluster(salt_factories, name, **kwargs)
        built.append(cluster)
        return cluster

    yield factory
    for cluster in built:
        cluster.stop()


# The integration modules, slowest first (Salt 3008, one process): under
# pytest-xdist (``make test`` runs three workers, ``--dist loadfile``: a module
# and its clusters stay in one worker) they go out in this order, and the
# quick modules fill in at the end.  A module not listed comes after them.
SLOW_FIRST = (
    "test_rotate_key.py", "test_formula.py", "test_sync.py", "test_audit.py",
    "test_damage.py", "test_faults.py", "test_outage.py", "test_large_sync.py",
    "test_revocation.py",
    "test_input.py", "test_add_remove_peer.py", "test_restart_pending.py", "test_trust.py",
    "test_watch.py", "test_peer_hosts.py", "test_continuous.py",
    "test_foundation.py",
)
DAEMON_TESTS = "tests/integration/"


def _xdist_workers(config):
    """How many pytest-xdist workers run the session (0: none), in a worker as in the controller."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        return workerinput["workercount"]
    return getattr(config.option, "numprocesses", None) or 0


def pytest_collection_modifyitems(config, items):  # pylint: disable=unused-argument
    """
    The daemon tests come first, the modules of :data:`SLOW_FIRST` in its
    order, then the other daemon modules, then the rest (each module's
    tests in their order).

    ``MM_TEST_ORDER=reverse``: run the tests of each module in reverse order
    (modules keep their order), a probe for tests that rely on what an
    earlier test of the same module did.  Unset: the default order.
    """
    order = os.environ.get("MM_TEST_ORDER", "")
    if order not in ("", "reverse"):
        raise pytest.UsageError(f"MM_TEST_ORDER must be 'reverse' or unset, not {order!r}")
    groups = {}
    for item in items:
        groups.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def rank(module):
        name = module.rsplit("/", 1)[-1]
        if not module.startswith(DAEMON_TESTS):
            return (2, 0)
        return (0, SLOW_FIRST.index(name)) if name in SLOW_FIRST else (1, 0)

    modules = sorted(groups, key=rank)
    items[:] = [item for module in modules
                for item in (reversed(groups[module]) if order else groups[module])]


# ----- where the time goes: printed at the end of every run ------------------
# Each test's setup + call + teardown, summed per top-level test directory
# (the phases: unit, functional, integration) and per module.  A module's
# clusters start in its first test's setup and stop in its last test's
# teardown, so a module's sum is what it costs; session fixtures (the wheel
# build) count in the first test that asks for them.
_SPENT = {"dirs": {}, "modules": {}}


def _machine_busy():
    """
    ``(busy, stolen, time.monotonic())``: CPU seconds of all cores since
    boot, busy (user, nice, system, irq, softirq) and stolen by the
    hypervisor (/proc/stat); None: unknown.
    """
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = [int(v) for v in fh.readline().split()[1:]] + [0] * 8
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    user, nice, system, _, _, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq) / ticks, steal / ticks, time.monotonic()


# the machine's CPU when this run began (every process's, not only the tests')
_BUSY_AT_START = _machine_busy()
_FAILED = []  # "FAILED <nodeid> (<phase>, <s>)": printed last, pytest_unconfigure


def pytest_runtest_logreport(report):
    if report.failed:
        _FAILED.append(f"{'FAILED' if report.when == 'call' else 'ERROR'} {report.nodeid}"
                       f" ({report.when}, {report.duration:.0f} s)")
    path = report.nodeid.split("::", 1)[0]
    parts = path.split("/")
    top = "/".join(parts[:2]) if len(parts) > 2 else path
    for kind, key in (("dirs", top), ("modules", path)):
        _SPENT[kind][key] = _SPENT[kind].get(key, 0.0) + report.duration


def pytest_sessionfinish(session):
    """A pytest-xdist worker hands its daemon times to the controller."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    entry = cluster_spent.setdefault("test processes' lives (pytest)", [0, 0.0, 0.0])
    entry[0] += 1
    entry[1] += time.time() - psutil.Process().create_time()
    entry[2] += used.ru_utime + used.ru_stime
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["mm_cluster_spent"] = json.dumps(cluster_spent)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # pylint: disable=unused-argument
    """pytest-xdist's controller: add up the daemon times of a finished worker."""
    spent = json.loads(getattr(node, "workeroutput", {}).get("mm_cluster_spent", "{}"))
    for what, (count, seconds, cpu) in spent.items():
        entry = cluster_spent.setdefault(what, [0, 0.0, None])
        entry[0] += count
        entry[1] += seconds
        if cpu is not None:
            entry[2] = (entry[2] or 0.0) + cpu


def pytest_unconfigure(config):
    """
    The failed tests, one short line each, printed last (after pytest's own
    summary, whose messages can run for pages): the tail of a CI log names them.
    """
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if _FAILED and reporter is not None:
        reporter.write_sep("=", f"{len(_FAILED)} failed (setup, call or teardown)")
        for line in _FAILED:
            reporter.write_line(line)


def pytest_terminal_summary(terminalreporter):
    if not _SPENT["dirs"]:
        return
    write = terminalreporter.write_line
    workers = _xdist_workers(terminalreporter.config)
    terminalreporter.write_sep(
        "=", "time per test directory and module (setup + call + teardown"
        + (f", summed over {workers} workers)" if workers else ")"))
    for top, spent in sorted(_SPENT["dirs"].items()):
        write(f"{spent:8.1f}s {top}")
    write(f"{sum(_SPENT['dirs'].values()):8.1f}s in all")
    slow = sorted(((s, m) for m, s in _SPENT["modules"].items() if s >= 5), reverse=True)
    if slow:
        write("modules of 5 s and more:")
        for spent, module in slow:
            write(f"{spent:8.1f}s {module}")
    if cluster_spent:
        write("real daemons (tests/support/cluster.py): the waits of the tests above, the"
              " daemons' and the tests' lives")
        for what, (count, spent, cpu) in sorted(cluster_spent.items()):
            if not what.startswith(STARTS_IN):
                write(f"{spent:8.1f}s {count:4d} {what}"
                      + ("" if cpu is None else f" ({cpu:.1f} s of CPU)"))
        starts = sorted(((spent, count, what[len(STARTS_IN):])
                         for what, (count, spent, _) in cluster_spent.items()
                         if what.startswith(STARTS_IN)), reverse=True)
        if starts:
            write("daemon starts by test module, the 12 longest:")
            for spent, count, what in starts[:12]:
                write(f"{spent:8.1f}s {count:4d} {what}")
    busy = _machine_busy()
    if busy is not None and _BUSY_AT_START is not None:
        used, stolen, elapsed = (now - then for now, then in zip(busy, _BUSY_AT_START))
        write(f"the machine's CPU, this run: {used:.0f} s busy of {elapsed:.0f} s x "
              f"{os.cpu_count()} cores ({100 * used / max(elapsed * os.cpu_count(), 1):.0f}%), "
              f"{stolen:.0f} s stolen by the hypervisor")
