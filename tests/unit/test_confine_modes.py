"""
A peer writes only inside its roots, and never a setuid, setgid, sticky or
world-writable file: the core functions, and the peer's apply of a tree.
"""

import hashlib
import os
import stat

import pytest

from salt_multimaster import applier, fsutil, manifest, replicate, rootscan

A, B = "a" * 64, "b" * 64


def _mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


# ----- modes ---------------------------------------------------------------

def test_safe_mode_drops_special_bits_and_world_write_only():
    assert fsutil.safe_mode(0o4755) == 0o755
    assert fsutil.safe_mode(0o2750) == 0o750
    assert fsutil.safe_mode(0o1777) == 0o775
    assert fsutil.safe_mode(0o666) == 0o664
    assert fsutil.safe_mode(0o7777) == 0o775
    for kept in (0o644, 0o640, 0o400, 0o775, 0o750, 0o000):
        assert fsutil.safe_mode(kept) == kept
    assert fsutil.dropped_bits(0o7757) == ["setuid", "setgid", "sticky", "world-writable"]
    assert fsutil.dropped_bits(0o644) == []
    for bad in (-1, 0o10000, "0644", None, True, 4.0):
        with pytest.raises(ValueError, match="invalid file mode"):
            fsutil.safe_mode(bad)


def test_batch_never_writes_dropped_bits(tmp_path):
    batch = fsutil.Batch(stage_root=str(tmp_path / "stage"))
    batch.write(str(tmp_path / "suid"), b"x", mode=0o4755)
    batch.write(str(tmp_path / "ww"), b"x", mode=0o666)
    batch.write(str(tmp_path / "key"), b"x", mode=0o400)
    batch.commit()
    assert _mode(tmp_path / "suid") == 0o755
    assert _mode(tmp_path / "ww") == 0o664
    assert _mode(tmp_path / "key") == 0o400
    with pytest.raises(ValueError):
        fsutil.Batch(stage_root=str(tmp_path / "stage")).write(str(tmp_path / "bad"), b"x",
                                                               mode="0644")
    assert not (tmp_path / "bad").exists()


def test_backup_copy_keeps_no_dropped_bits_and_stays_in_its_root(tmp_path):
    src = tmp_path / "tool"
    src.write_text("x")
    os.chmod(src, 0o4757)
    dest = fsutil.backup(str(src), str(tmp_path / "bk"), "file_roots/base/tool")
    assert dest == str(tmp_path / "bk" / "file_roots" / "base" / "tool")
    assert _mode(dest) == 0o755 and _mode(src) == 0o4757
    for bad in ("../escape", "file_roots/../../escape", "/abs"):
        with pytest.raises(fsutil.PathError):
            fsutil.backup(str(src), str(tmp_path / "bk"), bad)
    # a symlinked directory inside the backup folder does not lead out of it
    (tmp_path / "out").mkdir()
    os.symlink(str(tmp_path / "out"), tmp_path / "bk" / "link")
    with pytest.raises(fsutil.PathError):
        fsutil.backup(str(src), str(tmp_path / "bk"), "link/tool")
    assert os.listdir(tmp_path / "out") == []


def test_plan_tree_writes_safe_modes_and_warns_once():
    primary = {"base": {"suid.sh": [3, 0o4755, A], "ww.sls": [3, 0o666, A],
                        "ok.sls": [3, 0o644, A], "sticky": [3, 0o1640, B]}}
    ops, report = replicate.plan_tree(primary, {"base": {}})
    assert {op["rel"]: op["mode"] for op in ops} == {
        "suid.sh": 0o755, "ww.sls": 0o664, "ok.sls": 0o644, "sticky": 0o640}
    assert report == {
        "added": ["base:ok.sls", "base:sticky", "base:suid.sh", "base:ww.sls"],
        "updated": [], "removed": [], "conflicts": [], "errors": [],
        "warnings": [
            "base:sticky: mode 1640 on the primary, written as 0640 "
            "(a peer never gets a sticky file)",
            "base:suid.sh: mode 4755 on the primary, written as 0755 "
            "(a peer never gets a setuid file)",
            "base:ww.sls: mode 0666 on the primary, written as 0664 "
            "(a peer never gets a world-writable file)",
        ],
    }
    # the peer holds what was written: nothing to do, no warning
    peer = {"base": {op["rel"]: [op["size"], op["mode"], op["sha256"]] for op in ops}}
    ops, report = replicate.plan_tree(primary, peer)
    assert ops == [] and report == replicate.empty_report()
    # a peer that has the privileged file (written by an older version) is fixed
    peer["base"]["suid.sh"] = [3, 0o4755, A]
    peer["base"]["ww.sls"] = [3, 0o666, A]
    ops, report = replicate.plan_tree(primary, peer)
    assert [(op["rel"], op["mode"]) for op in ops] == [("suid.sh", 0o755), ("ww.sls", 0o664)]
    assert report["updated"] == ["base:suid.sh", "base:ww.sls"] and len(report["warnings"]) == 2


def test_primary_digests_of_safe_modes_match_a_peer_in_step(tmp_path):
    primary = {"base": {f"f{i}": [1, 0o644, A] for i in range(50)}}
    primary["base"]["suid.sh"] = [1, 0o4755, A]
    peer = {"base": dict(primary["base"], **{"suid.sh": [1, 0o755, A]})}
    # the primary's read: its digests as a peer in step holds them
    root = tmp_path / "root"
    root.mkdir()
    for rel, (_size, mode, _sha) in primary["base"].items():
        (root / rel).write_bytes(b"x")
        (root / rel).chmod(mode)
    read = rootscan.RootsScan({"file_roots": {"base": [str(root)]}}, "file_roots",
                              str(tmp_path / "state"))
    sha = hashlib.sha256(b"x").hexdigest()
    peer_files = {rel: [1, mode, sha] for rel, (_s, mode, _h) in peer["base"].items()}
    theirs = manifest.bucket_digests(manifest.split("file_roots", {"base": peer_files}))
    assert manifest.differing(read.safe, theirs) == []
    assert manifest.differing(read.raw, theirs) == [manifest.bucket_of("base/suid.sh")]
    assert replicate.safe_tree(peer) == peer  # nothing to change
    assert replicate.safe_tree(primary) == peer
    assert primary["base"]["suid.sh"] == [1, 0o4755, A]  # the input is left alone


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

class _Served:
    """Stands for the pull channel: the content of every op."""

    def __init__(self, data):
        self.data = data

    def get(self, cat, op):  # pylint: disable=unused-argument
        return self.data


def _apply(tmp_path, roots, ops, data=b"new"):
    mopts = {"file_roots": {"base": roots}, "cachedir": str(tmp_path / "cache")}
    app = applier.Applier(mopts, None)
    app.puller = _Served(data)
    for op in ops:
        op.setdefault("pull", 0)
    report = applier.apply_tree(app, "file_roots", ops, lambda ops: {})
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


def test_apply_tree_strips_dropped_bits_whatever_the_op_carries(tmp_path):
    root1, root2, _ = _two_roots(tmp_path)
    report, _ = _apply(tmp_path, [root1, root2],
                       [_write("suid.sh", 0o4755), _write("ww.sls", 0o666), _write("bad", "0644")])
    assert report["updated"] == ["base:suid.sh", "base:ww.sls"]
    assert report["failed"] == ["base:bad"] and "invalid file mode: '0644'" in report["errors"][0]
    assert _mode(os.path.join(root1, "suid.sh")) == 0o755
    assert _mode(os.path.join(root1, "ww.sls")) == 0o664
    assert not os.path.exists(os.path.join(root1, "bad"))


def test_apply_minion_keys_never_writes_or_removes_through_a_key_dir_leading_out(tmp_path):
    pki, out = tmp_path / "pki", tmp_path / "elsewhere"
    pki.mkdir()
    out.mkdir()
    (out / "victim").write_text("not a key of this master")
    os.symlink(str(out), pki / "minions_pre")
    app = applier.Applier({"pki_dir": str(pki), "cachedir": str(tmp_path / "cache")}, None)
    key = "-----BEGIN PUBLIC KEY-----\nx\n-----END PUBLIC KEY-----\n"
    ops = [{"op": "write", "state": "minions_pre", "id": "web1", "sha256": manifest.key_sha(key.encode()),
            "data": key},
           {"op": "remove", "state": "minions_pre", "id": "victim"},
           {"op": "write", "state": "minions", "id": "web1", "sha256": manifest.key_sha(key.encode()),
            "data": key}]
    report = applier.apply_minion_keys(app, ops)
    app.batch.commit()
    assert report["updated"] == ["minions/web1"]
    assert report["failed"] == ["minions_pre/web1", "minions_pre/victim"]
    assert all("leaves its root through a symlink" in e for e in report["errors"])
    assert os.listdir(out) == ["victim"] and (pki / "minions" / "web1").read_text() == key


def test_apply_tree_replaces_a_symlinked_file_never_its_target(tmp_path):
    root1, root2, out = _two_roots(tmp_path)
    os.symlink(str(out / "y.sls"), os.path.join(root1, "link.sls"))
    report, app = _apply(tmp_path, [root1, root2],
                         [_write("link.sls"), {"op": "remove", "env": "base", "rel": "alt2.sls"}])
    assert report["updated"] == ["base:link.sls"] and report["errors"] == []
    assert not os.path.islink(os.path.join(root1, "link.sls"))
    assert open(os.path.join(root1, "link.sls")).read() == "new"
    assert (out / "y.sls").read_text() == "outside"
    # the backup is the link itself, not a copy of what it pointed to
    assert os.readlink(os.path.join(app.backup_root, "file_roots", "base", "link.sls")) == str(out / "y.sls")


def test_master_keys_never_written_through_a_link_out_of_pki_dir(tmp_path):
    import hashlib  # pylint: disable=import-outside-toplevel

    pki, out = tmp_path / "pki", tmp_path / "elsewhere"
    pki.mkdir()
    out.mkdir()
    (out / "master.pub").write_text("outside")
    os.symlink(out / "master.pub", pki / "master.pub")
    mopts = {"pki_dir": str(pki), "id": "m2_master", "cachedir": str(tmp_path / "cache")}
    app = applier.Applier(mopts, None)
    data = "-----BEGIN PUBLIC KEY-----\nnew\n-----END PUBLIC KEY-----\n"
    ops = [{"op": "write", "kind": "pub", "name": "master.pub", "data": data,
            "sha256": hashlib.sha256(data.encode()).hexdigest()}]
    report = applier.apply_master_keys(app, ops, "shared")
    app.batch.commit()
    assert report["failed"] == ["master.pub"]
    assert "outside" in report["errors"][0]
    assert (out / "master.pub").read_text() == "outside"


@pytest.mark.parametrize("count", [2, 40])
def test_apply_backs_up_every_replaced_key(tmp_path, count):
    pki = tmp_path / "pki"
    (pki / "minions").mkdir(parents=True)
    old = "-----BEGIN PUBLIC KEY-----\nold\n-----END PUBLIC KEY-----\n"
    new = "-----BEGIN PUBLIC KEY-----\nnew\n-----END PUBLIC KEY-----\n"
    for i in range(0, 2 * count, 2):  # every other id exists
        (pki / "minions" / f"m{i:03d}").write_text(old)
    app = applier.Applier({"pki_dir": str(pki), "cachedir": str(tmp_path / "cache")}, None)
    ops = [{"op": "write", "state": "minions", "id": f"m{i:03d}", "data": new,
            "sha256": manifest.key_sha(new.encode())} for i in range(count)]
    report = applier.apply_minion_keys(app, ops)
    app.batch.commit()
    assert report["errors"] == [] and len(report["updated"]) == count
    backed = sorted(os.listdir(os.path.join(app.backup_root, "minion_keys", "minions")))
    assert backed == [f"m{i:03d}" for i in range(0, count, 2)]
