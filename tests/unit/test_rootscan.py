"""
The roots scanner (salt_multimaster.rootscan): what a scan finds, with the
change journal or without, whatever the store held, is what a full walk
with an empty store finds, errors included.

The journal here is a fake that answers from the directories the test says
changed (tests/support/watcher.py); tests/unit/test_watch.py tests the real
one, and test_a_scan_with_the_real_watcher below ties the two.
"""

import gc
import hashlib
import os
import random

import pytest

from salt_multimaster import manifest, replicate, rootscan, store
from tests.support import store as store_damage
from tests.support.watcher import FakeWatcher

CATS = rootscan.ROOTS


def _opts(roots_a, roots_b, ignore_glob=None):
    return {"file_roots": {"base": [str(roots_a), str(roots_b)], "dev": [str(roots_b)]},
            "pillar_roots": {}, "file_ignore_regex": [], "file_ignore_glob": ignore_glob or []}


def _one_root_each(a, b):
    return {"file_roots": {"base": [str(a)], "dev": [str(b)]}, "pillar_roots": {"base": [str(b)]},
            "file_ignore_regex": [], "file_ignore_glob": ["*.swp"]}


def _scans(opts, state, watch=None, rescan=False):
    return {cat: rootscan.RootsScan(opts, cat, str(state), rescan=rescan, watch=watch)
            for cat in CATS}


def _read(opts, state, watch=None, rescan=False):
    """Every category's manifest, parts, digests and errors."""
    got = {}
    for cat, scan in _scans(opts, state, watch, rescan).items():
        got[cat] = {"manifest": manifest.merge(scan.parts, scan.parts), "parts": scan.parts,
                    "raw": scan.raw, "safe": scan.safe, "errors": sorted(map(str, scan.errors)),
                    "damaged": scan.damaged}
    return got


def _full(opts, tmp_path):
    """What a scan with an empty store reads."""
    return _read(opts, tmp_path / f"fresh-{random.random()}")


def _count_listings(monkeypatch):
    listed = []
    real = os.scandir

    def scandir(path):
        listed.append(str(path))
        return real(path)

    monkeypatch.setattr(rootscan.os, "scandir", scandir)
    return listed


@pytest.fixture(name="tree")
def _tree(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        (root / "top" / "mid").mkdir(parents=True)
        (root / "x.sls").write_text(f"x of {root.name}")
        (root / "top" / "y.sls").write_text("y")
        (root / "top" / "mid" / "z.sls").write_text("z")
    (a / "a.swp").write_text("swap")
    (b / "only-b.sls").write_text("b")
    return a, b


@pytest.fixture(name="reads")
def _reads(monkeypatch):
    """The files a scan reads (hashes)."""
    got = []
    real = manifest.sha256_file
    monkeypatch.setattr(manifest, "sha256_file", lambda path: got.append(path) or real(path))
    return got


def test_a_scan_ignores_and_confines_symlinks(tmp_path, reads):
    root = tmp_path / "root"
    (root / ".git").mkdir(parents=True)
    (root / ".git" / "config").write_text("x")
    (root / "a.sls").write_text("a")
    (root / "a.sls.swp").write_text("s")
    (root / "link.sls").symlink_to("a.sls")
    (tmp_path / "outside").write_text("secret")
    (root / "escape").symlink_to(tmp_path / "outside")
    opts = {"file_roots": {"base": [str(root)]}, "file_ignore_regex": [r"/\.git($|/)"],
            "file_ignore_glob": ["*.swp"]}
    scan = rootscan.RootsScan(opts, "file_roots", str(tmp_path / "state"))
    man = manifest.merge(scan.parts, scan.parts)["base"]
    assert sorted(man) == ["a.sls", "link.sls"]
    assert man["a.sls"][2] == man["link.sls"][2] == hashlib.sha256(b"a").hexdigest()
    assert [e.split(": ", 1)[1] for e in scan.errors] == [
        "escape: symlink leads outside the root, not replicated"]
    assert len(reads) == 2
    reads.clear()
    again = rootscan.RootsScan(opts, "file_roots", str(tmp_path / "state"))
    assert again.parts == scan.parts and reads == []  # unchanged files statted, never read


def test_a_scan_follows_inner_dir_symlinks_once_and_globs_in_subdirs(tmp_path):
    root = tmp_path / "root"
    (root / "sub" / "deep").mkdir(parents=True)
    (root / "sub" / "deep" / "x.sls").write_text("x")
    (root / "sub" / "deep" / "x.sls.swp").write_text("s")
    (root / "sub" / "loop").symlink_to("..")  # a loop inside the root
    (root / "alias").symlink_to("sub/deep")  # served twice, as Salt does
    (tmp_path / "away").mkdir()
    (root / "out").symlink_to(tmp_path / "away")
    opts = {"file_roots": {"base": [str(root)]}, "file_ignore_glob": ["*.swp"]}
    scan = rootscan.RootsScan(opts, "file_roots", str(tmp_path / "state"))
    assert sorted(manifest.merge(scan.parts, scan.parts)["base"]) == [
        "alias/x.sls", "sub/deep/x.sls"]
    assert [e.split(": ", 1)[1] for e in scan.errors] == [
        "out: symlinked directory leads outside the root, not replicated"]


def test_the_first_root_serving_a_path_wins_and_shadows_its_errors(tree, tmp_path,
                                                                   monkeypatch):
    a, b = tree
    opts = _opts(a, b)
    got = _full(opts, tmp_path)["file_roots"]["manifest"]
    assert got["base"]["x.sls"][2] == hashlib.sha256(b"x of a").hexdigest()
    assert got["dev"]["x.sls"][2] == hashlib.sha256(b"x of b").hexdigest()
    assert got["base"]["only-b.sls"] == got["dev"]["only-b.sls"]
    real = manifest.sha256_file
    unreadable = {str(b / "x.sls"), str(b / "only-b.sls")}

    def sha256_file(path):
        if path in unreadable:
            raise PermissionError(13, "Permission denied")
        return real(path)

    monkeypatch.setattr(manifest, "sha256_file", sha256_file)
    got = _full(opts, tmp_path)["file_roots"]
    # base: a serves x.sls (b's error shadowed), only-b.sls is damaged; dev: both
    assert got["manifest"]["base"]["x.sls"][2] == hashlib.sha256(b"x of a").hexdigest()
    assert "only-b.sls" not in got["manifest"]["base"] and "x.sls" not in got["manifest"]["dev"]
    assert got["damaged"] == {"base": ["only-b.sls"], "dev": ["only-b.sls", "x.sls"]}
    assert got["errors"] == sorted([f"{b}: only-b.sls: unreadable: Permission denied"] * 2
                                   + [f"{b}: x.sls: unreadable: Permission denied"])


def test_an_unreadable_directory_is_damaged_never_removed(tree, tmp_path, monkeypatch):
    a, b = tree
    real = os.scandir

    def scandir(path):
        if str(path) == str(b / "top"):
            raise PermissionError(13, "Permission denied")
        return real(path)

    monkeypatch.setattr(rootscan.os, "scandir", scandir)
    got = _full(_one_root_each(a, b), tmp_path)["file_roots"]
    assert got["damaged"] == {"dev": ["top/"]}
    assert got["errors"] == [f"{b}: top: Permission denied"]
    assert "top/y.sls" not in got["manifest"]["dev"]


def test_previous_is_the_scan_replaced_as_a_peer_in_step_holds_it(tree, tmp_path):
    a, b = tree
    opts, state = _opts(a, b), tmp_path / "state"
    assert _scans(opts, state)["file_roots"].previous() is None  # none before the first
    before = _read(opts, state)["file_roots"]
    (a / "x.sls").write_text("x changed")
    (a / "run.sh").write_text("#!/bin/sh")
    (a / "run.sh").chmod(0o4755)  # setuid: never written by a sync
    (b / "top" / "mid" / "z.sls").unlink()
    scan = _scans(opts, state)["file_roots"]
    digest, parts = scan.previous()
    assert digest == before["safe"]
    assert parts() == {b: replicate.safe_tree(p) for b, p in before["parts"].items()}
    assert scan.safe != scan.raw


def test_a_scan_in_test_mode_sees_the_change_and_changes_no_store(tree, tmp_path):
    a, b = tree
    opts, state = _opts(a, b), tmp_path / "state"
    before = _read(opts, state)["file_roots"]
    (a / "x.sls").write_text("x changed")
    dry = rootscan.RootsScan(opts, "file_roots", str(state), keep=False)
    assert dry.safe == _read(opts, tmp_path / "fresh")["file_roots"]["safe"] != before["safe"]
    assert store.read(str(state), lambda found: found.digests("file_roots")) == before[
        "raw"] != dry.raw
    digest, parts = _scans(opts, state)["file_roots"].previous()
    assert (digest, parts()) == (
        before["safe"], {b: replicate.safe_tree(p) for b, p in before["parts"].items()})


def test_other_roots_or_ignore_rules_start_afresh(tree, tmp_path):
    a, b = tree
    opts, state = _opts(a, b), tmp_path / "state"
    _read(opts, state)
    opts["file_ignore_glob"] = ["*.swp"]
    assert _read(opts, state) == _full(opts, tmp_path)
    opts["file_roots"] = {"base": [str(b)]}
    assert _read(opts, state) == _full(opts, tmp_path)


@pytest.mark.parametrize("how", store_damage.DAMAGES)
def test_a_damaged_store_is_rebuilt_by_a_full_scan(tree, tmp_path, how, reads):
    a, b = tree
    opts, state = _opts(a, b), tmp_path / "state"
    first = _read(opts, state)
    store_damage.damage(state, how, table="files")
    reads.clear()
    assert _read(opts, state) == first and reads
    assert [p.name for p in state.iterdir() if ".damaged-" in p.name]


# ----- with the change journal ---------------------------------------------------------------
def test_unchanged_directories_are_not_listed(tree, tmp_path, monkeypatch):
    a, b = tree
    opts, state = _opts(a, b, ["*.swp"]), tmp_path / "state"
    fake = FakeWatcher([a, b])
    first = _read(opts, state, fake)  # no token yet: every directory listed
    assert fake.asked[:2] == [None, None]
    listed = _count_listings(monkeypatch)
    assert _read(opts, state, fake) == first
    assert fake.asked[-1] == {"session": "s1", "seq": 0}
    assert listed == []
    # one file changed in place: only its directory is listed again
    (b / "top" / "mid" / "z.sls").write_text("z2")
    fake.touch(b / "top" / "mid")
    again = _read(opts, state, fake)
    assert listed == [str(b / "top" / "mid")] * 2  # served in base and in dev
    assert again == _full(opts, tmp_path)
    assert again["file_roots"]["manifest"]["dev"]["top/mid/z.sls"] != first["file_roots"][
        "manifest"]["dev"]["top/mid/z.sls"]


def test_a_journal_that_says_nothing_changed_is_believed(tree, tmp_path):
    """The test of the tests: reuse is real (a lie gives the stale manifest)."""
    a, b = tree
    opts, state = _opts(a, b), tmp_path / "state"
    fake = FakeWatcher([a, b])
    first = _read(opts, state, fake)
    _read(opts, state, fake)
    (a / "x.sls").write_text("changed, and the journal is not told")
    assert _read(opts, state, fake) == first
    assert _full(opts, tmp_path) != first


@pytest.mark.parametrize("how", ["no-token", "session", "unwatched", "nested", "ignore",
                                 "rescan", "no-watcher"])
def test_every_directory_is_listed_when_the_journal_cannot_vouch(tree, tmp_path, monkeypatch,
                                                                 how):
    a, b = tree
    opts, state = _opts(a, b), tmp_path / "state"
    fake = FakeWatcher([a, b])
    _read(opts, state, fake)
    _read(opts, state, fake)
    (a / "x.sls").write_text("changed, the journal not told")
    rescan = False
    watch = fake
    if how == "no-token":
        gc.collect()
        for name in os.listdir(state):
            if name.startswith(store.NAME):
                os.unlink(state / name)
    elif how == "session":
        fake.session = "s2"  # the engine restarted: events may be lost
    elif how == "unwatched":
        fake.unwatched = [os.path.realpath(a)]
    elif how == "nested":
        fake.trees.append(os.path.realpath(a / "top"))
    elif how == "ignore":
        opts["file_ignore_glob"] = ["*.tmp"]
    elif how == "rescan":
        rescan = True
    elif how == "no-watcher":
        watch = lambda since: None  # noqa: E731  (the socket is gone)
    listed = _count_listings(monkeypatch)
    got = _read(opts, state, watch, rescan=rescan)
    assert got == _full(opts, tmp_path)
    assert str(a) in listed


def _random_change(rng, a, b, fake):
    """
    One random change in root ``a`` or ``b``, told to ``fake`` with the
    name of the entry changed: a file added, rewritten in place, chmodded,
    removed; a directory added with files or removed; a symlink; an ignored
    file.
    """
    root = rng.choice([a, b])
    dirs = [root] + [p for p in root.rglob("*") if p.is_dir() and not p.is_symlink()]
    d = rng.choice(dirs)
    files = [p for p in d.iterdir() if p.is_file() and not p.is_symlink()]
    op = rng.choice(["add", "write", "chmod", "rm", "mkdir", "rmdir", "link", "swp"])
    if op == "add" or (op in ("write", "chmod", "rm") and not files):
        path = d / f"f{rng.randrange(1000)}.sls"
        path.write_text(str(rng.random()))
    elif op == "write":
        path = rng.choice(files)
        with open(path, "r+b") as fh:
            fh.write(os.urandom(4))
    elif op == "chmod":
        path = rng.choice(files)
        path.chmod(rng.choice([0o600, 0o644, 0o755]))
    elif op == "rm":
        path = rng.choice(files)
        path.unlink()
    elif op == "mkdir":
        path = d / f"d{rng.randrange(1000)}"
        (path / "inner").mkdir(parents=True, exist_ok=True)
        (path / "inner" / "n.sls").write_text("n")
        fake.touch(path, "inner")
        fake.touch(path / "inner", "n.sls")
    elif op == "rmdir" and d != root:
        for p in sorted(d.rglob("*"), reverse=True):
            p.unlink() if not p.is_dir() or p.is_symlink() else p.rmdir()
        d.rmdir()
        fake.touch(d.parent, d.name)
        return
    elif op == "link" and files:
        path = d / f"l{rng.randrange(1000)}.sls"
        if not os.path.lexists(path):
            path.symlink_to(rng.choice(files).name)
    else:
        path = d / f"s{rng.randrange(10)}.swp"
        path.write_text("ignored")
    fake.touch(d, path.name)


def test_random_changes_read_as_a_full_walk_does(tree, tmp_path):
    """
    Random changes (:func:`_random_change`), 40 rounds: after each round
    the scan through the journal equals a full walk, errors included.
    """
    a, b = tree
    opts, state = _opts(a, b, ["*.swp"]), tmp_path / "state"
    fake = FakeWatcher([a, b])
    rng = random.Random(17)
    _read(opts, state, fake)
    for _ in range(40):
        for _ in range(rng.randint(1, 4)):
            _random_change(rng, a, b, fake)
        assert _read(opts, state, fake) == _full(opts, tmp_path)


@pytest.mark.parametrize("layout", ["overlapping roots", "one root each"])
@pytest.mark.parametrize("seed", [3, 17])
def test_random_changes_keep_previous_as_the_scan_replaced(tree, tmp_path, seed, layout):
    """
    With two roots serving the same paths (the first wins) and with one
    root per saltenv: after each round of random changes the scan equals a
    full walk, and its ``previous`` is the scan before.
    """
    a, b = tree
    for i in range(60):  # enough paths for many buckets
        (a / f"many{i % 6}").mkdir(exist_ok=True)
        (a / f"many{i % 6}" / f"f{i}.sls").write_text(str(i))
    opts = _opts(a, b, ["*.swp"]) if layout == "overlapping roots" else _one_root_each(a, b)
    state = tmp_path / "state"
    fake = FakeWatcher([a, b])
    rng = random.Random(seed)
    last = _read(opts, state, fake)
    for _ in range(30):
        for _ in range(rng.randint(1, 3)):
            _random_change(rng, a, b, fake)
        scans = _scans(opts, state, fake)
        for cat, scan in scans.items():
            if last[cat]["safe"]:
                digest, parts = scan.previous()
                assert digest == last[cat]["safe"]
                assert parts() == {b: replicate.safe_tree(p) for b, p in last[cat]["parts"].items()}
        last = _read(opts, state, fake)
        assert last == _full(opts, tmp_path)


def test_a_scan_with_the_real_watcher(tree, tmp_path, monkeypatch):
    """
    The real watcher serving on a socket whose path is too long for a unix
    socket (reached through /proc/self/fd): a change is seen, the unchanged
    directories are not listed, and a stopped watcher means a full walk.
    """
    import threading

    from salt_multimaster import journal, watch

    a, b = tree
    opts = _opts(a, b, ["*.swp"])
    state = tmp_path / ("long-" * 20) / "multimaster"
    state.mkdir(parents=True)
    assert len(str(journal.socket_path(str(state)))) > 108
    watcher = watch.Watcher(journal.master_trees(opts))
    watcher.start()
    stop = threading.Event()
    server = threading.Thread(target=journal.serve,
                              args=(watcher, journal.socket_path(str(state)), stop, 0.05))
    server.start()
    try:
        ask = journal.client(str(state))
        for _ in range(100):  # the server binds its socket
            if ask(None) is not None:
                break
            threading.Event().wait(0.02)
        _read(opts, state, ask)
        first = _read(opts, state, ask)
        listed = _count_listings(monkeypatch)
        (a / "top" / "y.sls").write_text("y, again")
        (b / "new" / "deeper").mkdir(parents=True)
        (b / "new" / "deeper" / "n.sls").write_text("n")
        second = _read(opts, state, ask)
        assert sorted(set(listed)) == sorted([str(a / "top"), str(b), str(b / "new"),
                                              str(b / "new" / "deeper")])
        assert second == _full(opts, tmp_path) != first
    finally:
        stop.set()
        server.join()
        watcher.close()
    assert journal.client(str(state))(None) is None  # no socket left: a full walk, at once


def test_a_name_that_is_not_utf8_is_reported_not_stored(tmp_path):
    """The store holds UTF-8 text: a file or key named otherwise is an error, never a crash."""
    from salt_multimaster import keyscan

    root = tmp_path / "root"
    root.mkdir()
    (root / "ok.sls").write_text("ok")
    with open(os.path.join(os.fsencode(root), b"bad\xff.sls"), "wb") as fh:
        fh.write(b"x")
    scan = rootscan.RootsScan({"file_roots": {"base": [str(root)]}}, "file_roots",
                              str(tmp_path / "state"))
    assert list(manifest.merge(scan.parts, scan.parts)["base"]) == ["ok.sls"]
    assert [e.split(": ", 1)[1] for e in scan.errors] == [
        "bad\ufffd.sls: not a UTF-8 name, not replicated"]
    pki = tmp_path / "pki"
    (pki / "minions").mkdir(parents=True)
    with open(os.path.join(os.fsencode(pki / "minions"), b"m\xff"), "wb") as fh:
        fh.write(b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")
    snap = keyscan.KeysSnapshot(str(pki), str(tmp_path / "state"))
    assert snap.digest == {} and [e.split(":")[0] for e in snap.errors] == ["minions/'m\\udcff'"]


def test_a_directory_gone_takes_only_its_own_rows(tmp_path):
    """``Foo`` removed beside ``foo`` and ``Foo_x``: the others' files stay (byte-wise names)."""
    root = tmp_path / "root"
    for name in ("Foo", "foo", "Foo_x", "Foo0"):
        (root / name / "in").mkdir(parents=True)
        (root / name / "in" / "f.sls").write_text(name)
    opts = {"file_roots": {"base": [str(root)]}}
    fake = FakeWatcher([root])
    state = tmp_path / "state"
    _read(opts, state, fake)
    for path in (root / "Foo" / "in" / "f.sls", root / "Foo" / "in", root / "Foo"):
        path.unlink() if path.is_file() else path.rmdir()
    fake.touch(root, "Foo")
    got = _read(opts, state, fake)
    assert sorted(got["file_roots"]["manifest"]["base"]) == [
        "Foo0/in/f.sls", "Foo_x/in/f.sls", "foo/in/f.sls"]
    assert got == _full(opts, tmp_path)
