"""
Shared by the benchmarks that drive pytest and the repository's real-daemon
fixtures (``tests/conftest.py``): ``main(__file__)`` runs one of them
standalone.
"""

import json
import os
import pathlib
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "_utils"))  # the core, as tests/conftest.py does

# A benchmark module imports this fixture from here: the one of ``-p
# tests.conftest`` is overridden by salt-factories' own plugin fixture
# (``{}``, registered after it), which leaves the daemons without the
# extension (no ``multimaster`` runners on the primary).
from tests.conftest import salt_factories_config  # noqa: E402,F401  pylint: disable=unused-import


def main(script):
    """Run the benchmark module ``script`` under pytest with the tests' fixtures; its exit code."""
    os.chdir(REPO)
    return pytest.main([
        str(pathlib.Path(script).resolve()), "-q", "-p", "tests.conftest",
        "--rootdir", str(REPO), "-c", str(REPO / "pytest.ini"), "-o", "testpaths=bench",
    ])


def save(name, report):
    """Write ``report`` as JSON to bench/results/<name>-<time>.json."""
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}-{time.strftime('%Y%m%dT%H%M%S')}.json").write_text(
        json.dumps(report, indent=2))
