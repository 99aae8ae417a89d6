"""
Shared fixtures: a short factories root dir, the extension installed the way
``pip install .`` installs it, and a builder for real multi-master clusters.
"""

import logging
import os
import pathlib
import shutil
import sys
import tempfile

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

from tests.support.cluster import Cluster, install_extension  # noqa: E402  pylint: disable=wrong-import-position


@pytest.fixture(scope="session")
def mm_root():
    """A short per-session root: unix socket paths must stay under ~107 chars."""
    root = tempfile.mkdtemp(prefix="mm-", dir="/tmp")
    os.chmod(root, 0o755)
    yield pathlib.Path(root)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def pip_site(mm_root):
    """
    ``pip install .`` (a real, non-editable wheel build) into a private site
    directory, put on PYTHONPATH for every daemon and CLI the tests start.
    Salt finds the extension through its ``salt.loader`` entry point there.
    """
    site = install_extension(REPO, mm_root / "site")
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
        cluster = Cluster(salt_factories, name, **kwargs)
        built.append(cluster)
        return cluster

    yield factory
    for cluster in built:
        cluster.stop()


def pytest_collection_modifyitems(config, items):  # pylint: disable=unused-argument
    """
    ``MM_TEST_ORDER=reverse``: run the tests of each module in reverse order
    (modules keep their order), a probe for tests that rely on what an
    earlier test of the same module did.  Unset: the default order.
    """
    order = os.environ.get("MM_TEST_ORDER", "")
    if not order:
        return
    if order != "reverse":
        raise pytest.UsageError(f"MM_TEST_ORDER must be 'reverse' or unset, not {order!r}")
    groups = {}
    for item in items:
        groups.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    items[:] = [item for group in groups.values() for item in reversed(group)]
