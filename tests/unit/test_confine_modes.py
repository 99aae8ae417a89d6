"""
A peer writes only inside its roots: the core functions, and the peer's
apply of a tree.
"""

import importlib.util
import os

import pytest

from salt_multimaster import fsutil, manifest
from tests.conftest import REPO

A, B = "a" * 64, "b" * 64


def test_backup_stays_in_its_root(tmp_path):
    src = tmp_path / "tool"
    src.write_text("x")
    dest = fsutil.backup(str(src), str(tmp_path / "bk"), "file_roots/base/tool")
    assert dest == str(tmp_path / "bk" / "file_roots" / "base" / "tool")
    for bad in ("../escape", "file_roots/../../escape", "/abs"):
        with pytest.raises(fsutil.PathError):
            fsutil.backup(str(src), str(tmp_path / "bk"), bad)
    # a symlinked directory inside the backup folder does not lead out of it
    (tmp_path / "out").mkdir()
    os.symlink(str(tmp_path / "out"), tmp_path / "bk" / "link")
    with pytest.raises(fsutil.PathError):
        fsutil.backup(str(src), str(tmp_path / "bk"), "link/tool")
    assert os.listdir(tmp_path / "out") == []


# ----- confinement -----------------------------------------------------------

def test_confine_follows_symlinked_parents(tmp_path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    os.symlink(str(tmp_path / "out"), root / "away")
    os.symlink("sub", root / "inner")
    assert fsutil.confine(str(root), str(root / "sub" / "x")) == str(root / "sub" / "x")
    assert fsutil.confine(str(root), str(root / "inner" / "x"))
    assert fsutil.confine(str(root) + "/", str(root / "x"))
    for bad in (root / "away" / "x", root / "away" / "deeper" / "x", tmp_path / "x"):
        with pytest.raises(fsutil.PathError, match="outside"):
            fsutil.confine(str(root), str(bad))
    # a sibling whose name starts like the root is outside it
    (tmp_path / "root2").mkdir()
    with pytest.raises(fsutil.PathError):
        fsutil.confine(str(root), str(tmp_path / "root2" / "x"))


def _two_roots(tmp_path):
    root1, root2, out = tmp_path / "r1", tmp_path / "r2", tmp_path / "elsewhere"
    for path in (root1, root2, out):
        path.mkdir()
    (out / "y.sls").write_text("outside")
    os.symlink(str(out), root2 / "alt")
    (root2 / "mine").mkdir()
    (root2 / "mine" / "z.sls").write_text("inside")
    return str(root1), str(root2), out


def test_locate_confined_refuses_a_file_found_through_a_dir_leading_out(tmp_path):
    root1, root2, _ = _two_roots(tmp_path)
    roots = [root1, root2]
    assert manifest.locate(roots, "alt/y.sls") == os.path.join(root2, "alt", "y.sls")  # follows
    with pytest.raises(fsutil.PathError, match=r"'alt/y.sls' is found in .*r2 through a symlinked"):
        manifest.locate_confined(roots, "alt/y.sls")
    assert manifest.locate_confined(roots, "mine/z.sls") == os.path.join(root2, "mine", "z.sls")
    assert manifest.locate_confined(roots, "missing.sls") is None
    for bad in ("../x", "/etc/passwd", "a//b", ""):
        with pytest.raises(fsutil.PathError, match="invalid relative path"):
            manifest.locate_confined(roots, bad)


# ----- the peer's apply of a tree ------------------------------------------------

def _peer_module():
    spec = importlib.util.spec_from_file_location(
        "mm_peer_confine", REPO / "_modules" / "multimaster_peer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Served:
    """Stands for the pull channel: the content of every op."""

    def __init__(self, data):
        self.data = data

    def get(self, cat, op):  # pylint: disable=unused-argument
        return self.data


def _apply(tmp_path, roots, ops, data=b"new"):
    peer = _peer_module()
    mopts = {"file_roots": {"base": roots}, "cachedir": str(tmp_path / "cache")}
    app = peer._Applier(mopts)
    app.puller = _Served(data)
    for op in ops:
        op.setdefault("pull", 0)
    report = peer._apply_tree(app, "file_roots", ops)
    app.batch.commit()
    return report, app


def _write(rel, mode=0o644, data=b"new"):
    import hashlib  # pylint: disable=import-outside-toplevel

    return {"op": "write", "env": "base", "rel": rel, "mode": mode,
            "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def test_apply_tree_never_writes_or_removes_through_a_dir_leading_out(tmp_path):
    root1, root2, out = _two_roots(tmp_path)
    ops = [_write("alt/y.sls"), {"op": "remove", "env": "base", "rel": "alt/y.sls"},
           _write("mine/z.sls"), _write("new/deep/n.sls")]
    report, app = _apply(tmp_path, [root1, root2], ops)
    assert report["updated"] == ["base:mine/z.sls", "base:new/deep/n.sls"]
    assert report["removed"] == []
    assert report["failed"] == ["base:alt/y.sls", "base:alt/y.sls"]
    assert len(report["errors"]) == 2
    assert all("through a symlinked directory that leads outside" in e for e in report["errors"])
    assert os.listdir(out) == ["y.sls"] and (out / "y.sls").read_text() == "outside"
    assert not os.path.exists(os.path.join(root1, "alt"))
    assert open(os.path.join(root2, "mine", "z.sls")).read() == "new"
    assert open(os.path.join(root1, "new", "deep", "n.sls")).read() == "new"
    # the backup of the file replaced inside the roots, and of nothing else
    assert app.backed_up
    assert sorted(os.listdir(os.path.join(app.backup_root, "file_roots", "base"))) == ["mine"]


def test_apply_tree_refuses_a_symlinked_intermediate_dir_in_the_first_root(tmp_path):
    root1, root2, out = _two_roots(tmp_path)
    os.symlink(str(out), os.path.join(root1, "sub"))
    report, _ = _apply(tmp_path, [root1, root2], [_write("sub/new/x.sls"), _write("sub/x.sls")])
    assert report["updated"] == [] and report["failed"] == ["base:sub/new/x.sls", "base:sub/x.sls"]
    assert all("leaves its root through a symlink" in e for e in report["errors"])
    assert os.listdir(out) == ["y.sls"]


