"""
The documentation builds: ``docs/`` with Sphinx and ``-W`` (as ``make docs``:
every warning fails, a broken reference included), ``README.rst`` and
``bench/README.rst`` with docutils, their relative links naming files that
exist.

Sphinx comes with ``make venv`` (constraints/salt-<line>.txt).  Outside that
venv, without Sphinx, these tests are skipped; inside it a missing Sphinx is
a failure.
"""

import pathlib
import shutil
import subprocess
import sys

import pytest

try:
    import docutils.core
    import docutils.nodes
    import sphinx  # noqa: F401  pylint: disable=unused-import

    HAS_SPHINX = True
except ImportError:
    HAS_SPHINX = False

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
VERSION_FILE = pathlib.Path("_utils", "salt_multimaster", "__init__.py")

# Broken references added to a copy of the docs: each must fail the build.
BROKEN = {
    "no-such-page": ":doc:`no-such-page`",
    "no-such-label": ":ref:`no-such-label`",
    "no such target": "`no such target`_",
}


def _need_sphinx():
    if not HAS_SPHINX:
        if pathlib.Path(sys.prefix).resolve().is_relative_to((REPO / ".venv").resolve()):
            pytest.fail("Sphinx is missing from make's venv: remove its .deps-stamp, run make venv")
        pytest.skip("Sphinx is not installed in this Python (make venv installs it)")


def _build(src, out):
    """sphinx-build as ``make docs`` runs it, into ``out``."""
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         "-d", str(out / "doctrees"), str(src), str(out / "html")],
        capture_output=True, text=True, check=False, timeout=600,
    )


def test_docs_build_without_warnings(tmp_path):
    _need_sphinx()
    res = _build(DOCS, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    built = {p.stem for p in (tmp_path / "html").glob("*.html")}
    sources = {p.stem for p in DOCS.glob("*.rst")}
    assert sources and sources <= built, sorted(sources - built)


def test_a_broken_reference_fails_the_docs_build(tmp_path):
    _need_sphinx()
    src = tmp_path / "src"
    shutil.copytree(DOCS, src / "docs", ignore=shutil.ignore_patterns("_build"))
    # conf.py reads the release from the package source beside docs/
    (src / VERSION_FILE).parent.mkdir(parents=True)
    shutil.copy(REPO / VERSION_FILE, src / VERSION_FILE)
    index = src / "docs" / "index.rst"
    index.write_text(index.read_text(encoding="utf-8") + "\nBroken: "
                     + ", ".join(BROKEN.values()) + ".\n", encoding="utf-8")
    res = _build(src / "docs", tmp_path / "out")
    assert res.returncode != 0, res.stdout + res.stderr
    for name in BROKEN:
        assert name in res.stderr, res.stderr


@pytest.mark.parametrize("name", ["README.rst", "bench/README.rst"])
def test_readme_renders_and_links_exist(name):
    _need_sphinx()
    path = REPO / name
    # halt_level 2: a warning (a broken target, a bad table) raises
    tree = docutils.core.publish_doctree(
        path.read_text(encoding="utf-8"), source_path=str(path),
        settings_overrides={"halt_level": 2, "report_level": 2},
    )
    links = [node["refuri"] for node in tree.findall(docutils.nodes.reference)
             if "refuri" in node and "://" not in node["refuri"]]
    missing = [uri for uri in links if not (path.parent / uri.split("#")[0]).exists()]
    assert not missing, missing
