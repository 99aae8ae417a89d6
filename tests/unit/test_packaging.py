"""
Packaging: installing the wheel keeps the installed Salt (any supported line),
and the pinned constraints name one exact release per supported Salt line.
"""

import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import salt.version

from tests.conftest import REPO

LINES = ("3006", "3007", "3008")
TEST_VERSION = "0.0.0.dev0+wheeltest"


def test_installing_the_wheel_never_changes_salt(tmp_path):
    """
    ``pip install`` of the built wheel into this venv, offline (no index):
    it succeeds only if the installed Salt satisfies ``install_requires``,
    and it installs nothing but the extension.
    """
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".venv", ".git", "__pycache__", "*.pyc", "build", "*.egg-info", "tests", "bench"))
    # a version of its own: the check must not depend on whether this venv
    # already has the extension installed
    setup_py = src / "setup.py"
    text = setup_py.read_text()
    assert 'version="' in text
    setup_py.write_text(re.sub(r'version="[^"]+"', f'version="{TEST_VERSION}"', text, count=1))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), str(src)], check=True)
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
         "--find-links", str(wheels), "--report", str(report),
         f"salt-multimaster=={TEST_VERSION}"],
        capture_output=True, text=True, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    installs = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installs == ["salt-multimaster"], installs


def test_setup_admits_every_supported_line():
    text = (REPO / "setup.py").read_text()
    assert '"salt>=3006"' in text, "install_requires must admit Salt 3006, 3007 and 3008"


def test_constraints_pin_one_release_per_line():
    for line in LINES:
        path = REPO / "constraints" / f"salt-{line}.txt"
        pins = dict(
            re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)$", raw).groups()
            for raw in path.read_text().splitlines()
            if raw.strip() and not raw.startswith("#")
        )
        assert pins["salt"].startswith(f"{line}."), path
        for dep in ("pytest", "pytest-salt-factories", "pyyaml" if "pyyaml" in pins else "PyYAML"):
            assert dep in pins, (path, dep)


def test_running_salt_is_a_pinned_release():
    """The suite runs on one of the pinned releases (make test SALT=<line>)."""
    major = salt.version.__version__.split(".")[0]
    assert major in LINES, f"Salt {salt.version.__version__} is not a supported line"
    pinned = pathlib.Path(REPO / "constraints" / f"salt-{major}.txt").read_text()
    if f"salt=={salt.version.__version__}\n" not in pinned:
        pytest.skip(f"Salt {salt.version.__version__} is not the pinned release of its line")
