"""
The roots walk with a watcher (manifest.DirRecords): a directory the watcher
vouches for is not listed, and the manifest is the one a full walk gives.

The watcher here is a fake that answers from the directories the test says it
changed; tests/unit/test_watch.py tests the real one, and
test_read_roots_with_the_real_watcher below ties the two.
"""

import hashlib
import json
import os
import random

import pytest

from salt_multimaster import manifest


class FakeWatcher:
    """Answers ``watch.query`` from the directories :meth:`touch` was told of."""

    def __init__(self, trees):
        self.trees = sorted(os.path.realpath(t) for t in trees)
        self.session, self.seq, self.log = "s1", 0, []
        self.unwatched = []
        self.asked = []

    def touch(self, path, name=None):
        """``path``: a directory whose entries changed (``name``: which one; None: unknown)."""
        path = os.path.realpath(path)
        for tree in self.trees:
            if path == tree or path.startswith(tree + os.sep):
                self.seq += 1
                rel = "" if path == tree else os.path.relpath(path, tree)
                self.log.append((self.seq, tree, rel, name))

    def __call__(self, since):
        self.asked.append(since)
        ok = (isinstance(since, dict) and since.get("session") == self.session
              and since.get("seq", -1) <= self.seq)
        changed = names = None
        if ok:
            after = [e for e in self.log if e[0] > since["seq"]]
            changed = {t: sorted({rel for _s, tree, rel, _n in after if tree == t})
                       for t in self.trees if t not in self.unwatched}
            names = {t: {rel: (None if any(n is None for _s, tr, r, n in after
                                           if tr == t and r == rel)
                               else sorted({n for _s, tr, r, n in after
                                            if tr == t and r == rel}))
                         for rel in rels}
                     for t, rels in changed.items()}
        return {"session": self.session, "seq": self.seq, "trees": self.trees,
                "unwatched": self.unwatched, "changed": changed, "names": names,
                "error": None}


def _opts(roots_a, roots_b, ignore_glob=None):
    return {"file_roots": {"base": [str(roots_a), str(roots_b)], "dev": [str(roots_b)]},
            "pillar_roots": {}, "file_ignore_regex": [], "file_ignore_glob": ignore_glob or []}


def _one_root_each(a, b):
    return {"file_roots": {"base": [str(a)], "dev": [str(b)]}, "pillar_roots": {},
            "file_ignore_regex": [], "file_ignore_glob": ["*.swp"]}


def _forty_dirs(root):
    """``d0`` to ``d39`` in ``root``, a file in each: records in many buckets."""
    for i in range(40):
        (root / f"d{i}").mkdir()
        (root / f"d{i}" / "f.sls").write_text(str(i))


def _read(opts, state, watch=None, rescan=False):
    mans, errors = manifest.read_roots(opts, ["file_roots", "pillar_roots"], str(state),
                                       rescan=rescan, watch=watch)
    return mans, sorted(map(str, errors["file_roots"]))


def _full(opts, tmp_path):
    """What a walk without a watcher and without caches reads."""
    state = tmp_path / f"fresh-{random.random()}"
    return _read(opts, state)


def _count_listings(monkeypatch):
    listed = []
    real = os.scandir

    def scandir(path):
        listed.append(path)
        return real(path)

    monkeypatch.setattr(manifest.os, "scandir", scandir)
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


def test_unchanged_directories_are_not_listed(tree, tmp_path, monkeypatch):
    a, b = tree
    opts, state = _opts(a, b, ["*.swp"]), tmp_path / "state"
    fake = FakeWatcher([a, b])
    first = _read(opts, state, fake)  # no token yet: every directory listed, then recorded
    assert fake.asked == [None]
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
    assert again[0]["file_roots"]["dev"]["top/mid/z.sls"] != first[0]["file_roots"]["dev"]["top/mid/z.sls"]


def test_a_watcher_that_says_nothing_changed_is_believed(tree, tmp_path):
    """The test of the tests: reuse is real (a lie gives the stale manifest)."""
    a, b = tree
    opts, state = _opts(a, b), tmp_path / "state"
    fake = FakeWatcher([a, b])
    first = _read(opts, state, fake)
    _read(opts, state, fake)
    (a / "x.sls").write_text("changed, and the watcher is not told")
    assert _read(opts, state, fake) == first
    assert _full(opts, tmp_path) != first


@pytest.mark.parametrize("how", ["no-token", "session", "unwatched", "nested", "ignore",
                                 "rescan", "no-watcher"])
def test_every_directory_is_listed_when_the_watcher_cannot_vouch(tree, tmp_path, monkeypatch,
                                                                 how):
    a, b = tree
    opts, state = _opts(a, b), tmp_path / "state"
    fake = FakeWatcher([a, b])
    _read(opts, state, fake)
    _read(opts, state, fake)
    (a / "x.sls").write_text("changed, the watcher not told")
    rescan = False
    watch = fake
    if how == "no-token":
        (state / manifest.ROOTS_DIRS).unlink()
    elif how == "session":
        fake.session = "s2"  # the watcher restarted: events may be lost
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
    the watched read equals a full walk, errors included.
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


def _cut(opts, state, watch=None, manifests=True):
    """
    The buckets of a read: ``({category: (raw digests, parts, safe digests)}, how cut)``.
    ``manifests``: False for a read as a sync makes it (no manifest wanted).
    """
    buckets = {}
    mans, _errors = manifest.read_roots(opts, ["file_roots", "pillar_roots"], str(state),
                                        watch=watch, buckets=buckets, manifests=manifests)
    if not manifests:
        assert mans == {"file_roots": None, "pillar_roots": None}
    return ({cat: (got.raw, dict(got.parts), got.safe) for cat, got in buckets.items()},
            {cat: got.cut for cat, got in buckets.items()})


@pytest.mark.parametrize("layout", ["overlapping roots", "one root each"])
@pytest.mark.parametrize("manifests", [True, False], ids=["manifests", "sync's read"])
@pytest.mark.parametrize("seed", [3, 17])
def test_random_changes_cut_in_buckets_as_a_full_walk_does(tree, tmp_path, seed, manifests,
                                                           layout):
    """
    With the journal, only the buckets of the paths of the directories
    listed are cut and digested again (RootsParts): after each round of
    random changes the parts and digests equal those of a full walk, and
    most rounds cut only buckets.  Also for a sync's read, whose
    manifests are never put together (the files of the directories taken
    from their records read back only when every bucket is cut again);
    with two roots serving the same paths (the first wins), and with one
    root per saltenv.
    """
    a, b = tree
    for i in range(60):  # enough paths for many buckets
        (a / f"many{i % 6}").mkdir(exist_ok=True)
        (a / f"many{i % 6}" / f"f{i}.sls").write_text(str(i))
    opts = _opts(a, b, ["*.swp"]) if layout == "overlapping roots" else _one_root_each(a, b)
    state = tmp_path / "state"
    fake = FakeWatcher([a, b])
    rng = random.Random(seed)
    assert _cut(opts, state, fake, manifests)[1] == {"file_roots": "all", "pillar_roots": "all"}
    cuts = []
    for _ in range(30):
        for _ in range(rng.randint(1, 3)):
            _random_change(rng, a, b, fake)
        got, how = _cut(opts, state, fake, manifests)
        assert got == _cut(opts, tmp_path / f"fresh-{rng.random()}")[0]
        cuts.append(how["file_roots"])
    assert cuts.count("buckets") >= 10, cuts


def test_a_changed_file_cuts_and_reads_its_bucket_only(tree, tmp_path):
    a, b = tree
    for i in range(200):
        (a / "top" / f"many{i}.sls").write_text(str(i))
    opts, state = _opts(a, b, ["*.swp"]), tmp_path / "state"
    fake = FakeWatcher([a, b])
    _cut(opts, state, fake)
    (a / "x.sls").write_text("x changed")
    fake.touch(a, "x.sls")
    buckets = {}
    manifest.read_roots(opts, ["file_roots"], str(state), watch=fake, buckets=buckets)
    got = buckets["file_roots"]
    # the journal names x.sls: its bucket only is read and cut again, not
    # those of every file of its directory
    assert got.cut == "buckets" and got._files.files_read == 1  # pylint: disable=protected-access
    assert (got.raw, dict(got.parts)) == _cut(opts, tmp_path / "fresh")[0]["file_roots"][:2]


def test_read_roots_with_the_real_watcher(tree, tmp_path, monkeypatch):
    """
    The real watcher serving on a socket whose path is too long for a unix
    socket (reached through /proc/self/fd): a change is seen, the unchanged
    directories are not listed, and a stopped watcher means a full walk.
    """
    import threading

    from salt_multimaster import watch

    a, b = tree
    opts = _opts(a, b, ["*.swp"])
    state = tmp_path / ("long-" * 20) / "multimaster"
    state.mkdir(parents=True)
    assert len(str(watch.socket_path(str(state)))) > 108
    watcher = watch.Watcher(watch.master_trees(opts))
    watcher.start()
    stop = threading.Event()
    server = threading.Thread(target=watch.serve,
                              args=(watcher, watch.socket_path(str(state)), stop, 0.05))
    server.start()
    try:
        ask = watch.client(str(state))
        for _ in range(100):  # the server binds its socket
            if ask(None) is not None:
                break
            threading.Event().wait(0.02)
        first = manifest.read_roots(opts, ["file_roots", "pillar_roots"], str(state), watch=ask)
        listed = _count_listings(monkeypatch)
        (a / "top" / "y.sls").write_text("y, again")
        (b / "new" / "deeper").mkdir(parents=True)
        (b / "new" / "deeper" / "n.sls").write_text("n")
        second = manifest.read_roots(opts, ["file_roots", "pillar_roots"], str(state), watch=ask)
        assert sorted(set(listed)) == sorted([str(a / "top"), str(b), str(b / "new"),
                                              str(b / "new" / "deeper")])
        assert (second[0], sorted(map(str, second[1]["file_roots"]))) == _full(opts, tmp_path)
        assert second != first
    finally:
        stop.set()
        server.join()
        watcher.close()
    assert watch.client(str(state))(None) is None  # no socket left: a full walk, at once


@pytest.mark.parametrize("files,size,recorded", [(2, 10, False), (2, 5 << 20, True),
                                                  (70, 10, True)])
def test_an_apply_records_the_hashes_it_wrote_only_when_it_pays(tmp_path, files, size,
                                                                 recorded):
    """
    The peer records what it wrote in its hash cache (megabytes of JSON,
    read and rewritten) only for many or large files; a few small ones are
    read again by the next inventory instead.
    """
    import hashlib

    from salt_multimaster import peer

    root = tmp_path / "root"
    root.mkdir()
    state = tmp_path / "state"
    app = peer.Applier({"cachedir": str(tmp_path / "cache")}, str(state), None)
    data = b"x" * size
    sha = hashlib.sha256(data).hexdigest()
    for i in range(files):
        path = str(root / f"f{i}")
        app.write(path, data, 0o644, f"file_roots/base/f{i}", sha, cache_path=path)
    app.commit()
    cache = state / manifest.ROOTS_HASHCACHE
    assert cache.exists() is recorded
    if recorded:
        st = os.stat(root / "f0")
        assert json.loads(cache.read_text())[str(root / "f0")] == [
            st.st_ino, st.st_size, st.st_mtime_ns, sha]
    assert app.written == []


# ----- the key snapshot with a watcher ------------------------------------------------------
def _keys(pki, state_dir, watch=None):
    snap = manifest.KeysSnapshot(str(pki), str(state_dir), watch=watch)
    return snap, {"manifest": snap.manifest, "digest": snap.digest, "counts": snap.counts,
                  "errors": snap.errors}


@pytest.fixture(name="pki")
def _pki(tmp_path):
    from tests.support.cluster import gen_keypair

    pki = tmp_path / "pki"
    for state in manifest.KEY_DIRS:
        (pki / state).mkdir(parents=True)
    pub = gen_keypair(1024)[1]
    for i in range(30):
        (pki / "minions" / f"m{i}").write_bytes(pub)
    (pki / "minions_pre" / "p0").write_bytes(pub)
    return pki


def test_key_snapshot_stats_only_the_keys_the_journal_names(pki, tmp_path, monkeypatch):
    from tests.support.cluster import gen_keypair

    fake = FakeWatcher([pki])
    state = tmp_path / "state"
    _keys(pki, state, fake)  # no token yet: listed, the token saved
    assert fake.asked == [None]
    pub = gen_keypair(1024)[1]
    (pki / "minions" / "new").write_bytes(pub)
    fake.touch(pki / "minions", "new")
    (pki / "minions_pre" / "p0").unlink()
    fake.touch(pki / "minions_pre", "p0")
    listed = []
    real = manifest._list_key_dir  # pylint: disable=protected-access

    def counting(pki_dir, state_name, *args):
        listed.append(state_name)
        return real(pki_dir, state_name, *args)

    monkeypatch.setattr(manifest, "_list_key_dir", counting)
    snap, got = _keys(pki, state, fake)
    assert listed == [] and not snap.reused
    assert fake.asked[-1] == {"session": "s1", "seq": 0}
    monkeypatch.undo()
    assert got == _keys(pki, tmp_path / "fresh")[1]
    assert got["manifest"]["minions"]["new"] and "p0" not in got["manifest"]["minions_pre"]
    # nothing named since: reused, no key dir looked at
    snap, again = _keys(pki, state, fake)
    assert snap.reused and again == got


def test_key_rewritten_in_place_is_found_through_the_journal(pki, tmp_path):
    """What the stamps alone miss (same dir mtime), the journal names."""
    from tests.support.cluster import gen_keypair

    fake = FakeWatcher([pki])
    watched, stamped = tmp_path / "watched", tmp_path / "stamped"
    _keys(pki, watched, fake)
    _keys(pki, stamped)
    key, before = pki / "minions" / "m3", (pki / "minions").stat()
    old = _keys(pki, stamped)[1]
    with open(key, "r+b") as fh:
        fh.write(gen_keypair(2048)[1])
        fh.truncate()
    os.utime(pki / "minions", ns=(before.st_atime_ns, before.st_mtime_ns))
    fake.touch(pki / "minions", "m3")
    assert _keys(pki, stamped)[1] == old  # the stamps: unchanged
    got = _keys(pki, watched, fake)[1]
    assert got == _keys(pki, tmp_path / "fresh")[1] != old


@pytest.mark.parametrize("how", ["names-unknown", "dir-itself", "errors", "session", "rescan"])
def test_key_dirs_are_listed_when_the_journal_cannot_name_the_keys(pki, tmp_path, monkeypatch,
                                                                   how):
    fake = FakeWatcher([pki])
    state = tmp_path / "state"
    if how == "errors":
        (pki / "minions" / "junk").write_text("not a key")
    _keys(pki, state, fake)
    (pki / "minions" / "m1").unlink()
    fake.touch(pki / "minions", {"names-unknown": None, "dir-itself": ""}.get(how, "m1"))
    if how == "dir-itself":
        fake.touch(pki / "minions", "m1")
    if how == "session":
        fake.session = "s2"
    listed = []
    real = manifest._list_key_dir  # pylint: disable=protected-access
    monkeypatch.setattr(manifest, "_list_key_dir",
                        lambda pki_dir, st, *a: listed.append(st) or real(pki_dir, st, *a))
    snap = manifest.KeysSnapshot(str(pki), str(state), watch=fake, rescan=how == "rescan")
    assert "minions" in listed
    monkeypatch.undo()
    assert snap.manifest == _keys(pki, tmp_path / "fresh")[1]["manifest"]


def test_a_listing_without_the_journal_keeps_its_token(pki, tmp_path):
    """
    A snapshot taken without the journal (the peer's history record) is
    newer than the last token: that token stays, and still covers it.
    """
    fake = FakeWatcher([pki])
    state = tmp_path / "state"
    _keys(pki, state, fake)
    (pki / "minions" / "m2").unlink()
    fake.touch(pki / "minions", "m2")
    _keys(pki, state)  # no journal: listed by the stamps
    saved = manifest.read_json(str(state / manifest.KEYS_SNAPSHOT))  # pylint: disable=protected-access
    assert saved["watch"] == {"session": "s1", "seq": 0}
    (pki / "minions" / "m4").unlink()
    fake.touch(pki / "minions", "m4")
    assert _keys(pki, state, fake)[1] == _keys(pki, tmp_path / "fresh")[1]


def test_many_changed_files_are_looked_up_in_the_hash_cache(tree, tmp_path):
    """
    A few changed files of a recorded directory are hashed without opening
    the hash cache; past that many (what a peer's apply records from), the
    hash cache is read, and what it holds is not read again.
    """
    a, b = tree
    opts, state = _opts(a, b), tmp_path / "state"
    fake = FakeWatcher([a, b])
    _read(opts, state, fake)
    many = a / "top" / "many"
    many.mkdir()
    fake.touch(a / "top")
    fake.touch(many)
    _read(opts, state, fake)  # the new directory recorded (empty)
    cache = manifest.HashCache(str(state / manifest.ROOTS_HASHCACHE))
    for i in range(100):
        path = many / f"f{i}"
        path.write_text(f"file {i}\n")
        st = path.stat()
        # what an apply of 100 files records
        cache.entries[str(path)] = [st.st_ino, st.st_size, st.st_mtime_ns,
                                    manifest.sha256_file(str(path))]
    cache.dirty = True
    cache.save()
    fake.touch(many)
    counted = manifest.HashCache(str(state / manifest.ROOTS_HASHCACHE))
    mans = manifest.roots_manifest(opts["file_roots"], manifest.Ignore(), counted,
                                   records=_records(state, fake))
    assert counted.hashed == manifest.DIRECT_FILES - 1  # then the cache is read: 37 from it
    assert mans == _full(opts, tmp_path)[0]["file_roots"]


def _edit_records(state, edit):
    """Apply ``edit`` to the records (``{real dir: record}``) of each saved bucket of DirRecords."""
    for path in (state / manifest.ROOTS_DIRS_BUCKETS).iterdir():
        saved = json.loads(path.read_text())
        edit(saved["bucket"])
        path.write_text(json.dumps(saved))


def _records(state, fake):
    records = manifest.DirRecords(str(state), manifest.Ignore())
    records.use(fake(records.token))
    return records


@pytest.mark.parametrize("damage", [
    "not json", '{"token": 1}', None,
])
def test_damaged_records_are_read_as_none(tree, tmp_path, damage):
    """A records file that is not one (or whose entries are not records): a full walk."""
    a, b = tree
    opts, state = _opts(a, b), tmp_path / "state"
    fake = FakeWatcher([a, b])
    _read(opts, state, fake)
    path = state / manifest.ROOTS_DIRS
    if damage is None:  # valid JSON, entries of the wrong shape
        def wrong(dirs):
            for rec in dirs.values():
                rec["files"] = [[f[0], "x", 0o644, f[3], 1, 2] for f in rec["files"]]
                rec["subdirs"] = [1]

        _edit_records(state, wrong)
    else:
        path.write_text(damage)
    (a / "x.sls").write_text("changed, the watcher not told")
    assert _read(opts, state, fake) == _full(opts, tmp_path)


def test_the_journal_s_keys_cost_their_buckets_only(pki, tmp_path, monkeypatch):
    """
    A key the journal names is looked up in its bucket's file only; only
    that bucket is digested and saved again, and the snapshot it replaced
    is still there for the plan (``previous_parts``).
    """
    from salt_multimaster import fsutil
    from tests.support.cluster import gen_keypair

    fake = FakeWatcher([pki])
    state = tmp_path / "state"
    before = _keys(pki, state, fake)[1]
    # a bucket that holds keys already
    new = next(f"new{i}" for i in range(1000) if manifest.bucket_of(f"new{i}") in before["digest"])
    (pki / "minions" / new).write_bytes(gen_keypair(1024)[1])
    fake.touch(pki / "minions", new)
    written = []
    real = fsutil.atomic_write
    monkeypatch.setattr(fsutil, "atomic_write",
                        lambda path, *a, **k: written.append(os.path.basename(path))
                        or real(path, *a, **k))
    snap = manifest.KeysSnapshot(str(pki), str(state), watch=fake)
    bucket = manifest.bucket_of(new)
    assert snap.buckets_read == 1 and written == [f"{bucket}.json", manifest.KEYS_SNAPSHOT]
    got = _keys(pki, state, fake)[1]  # reused
    assert got == _keys(pki, tmp_path / "fresh")[1]
    assert [b for b in got["digest"] if got["digest"][b] != before["digest"].get(b)] == [bucket]
    digest, parts = snap.previous_parts()
    assert digest == before["digest"]
    assert dict(parts()) == manifest.split("minion_keys", before["manifest"])


def test_random_key_changes_through_the_journal_read_as_a_listing(pki, tmp_path):
    """Keys added, accepted, rejected, deleted and rewritten, named by the journal, 30 rounds."""
    from tests.support.cluster import gen_keypair

    rng = random.Random(5)
    pubs = [gen_keypair(1024)[1] for _ in range(3)]
    fake = FakeWatcher([pki])
    state = tmp_path / "state"
    last = _keys(pki, state, fake)[1]
    for rnd in range(30):
        for _ in range(rng.randrange(1, 6)):
            here = [(s, n) for s in manifest.KEY_DIRS for n in os.listdir(pki / s)]
            what = rng.choice(["add", "move", "delete", "rewrite"]) if here else "add"
            if what == "add":
                st, name = rng.choice(manifest.KEY_DIRS), f"k{rnd}-{rng.randrange(1000)}"
                (pki / st / name).write_bytes(rng.choice(pubs))
                fake.touch(pki / st, name)
                continue
            st, name = rng.choice(here)
            if what == "move":
                to = rng.choice([s for s in manifest.KEY_DIRS if s != st])
                if (pki / to / name).exists():
                    continue
                os.rename(pki / st / name, pki / to / name)
                fake.touch(pki / to, name)
            elif what == "delete":
                (pki / st / name).unlink()
            else:
                (pki / st / name).write_bytes(rng.choice(pubs) + b"\n" * rng.randrange(3))
            fake.touch(pki / st, name)
        snap, got = _keys(pki, state, fake)
        fresh = _keys(pki, tmp_path / f"fresh{rnd}")[1]
        assert got == fresh, rnd
        digest, parts = snap.previous_parts()
        assert digest == last["digest"], rnd
        assert dict(parts()) == manifest.split("minion_keys", last["manifest"]), rnd
        last = got


@pytest.mark.parametrize("damage", ["record", "subdir-record", "parts-older"])
def test_buckets_are_cut_from_a_full_walk_when_the_last_one_is_not_known(tree, tmp_path,
                                                                          damage):
    """
    A listed directory whose last listing is unknown (its record damaged),
    though it is no new one, or saved buckets older than the records the
    walk started from (a crash between the two saves): what changed there
    cannot be told, and everything is cut again.
    """
    a, b = tree
    opts, state = _opts(a, b, ["*.swp"]), tmp_path / "state"
    fake = FakeWatcher([a, b])
    _cut(opts, state, fake)
    parts_meta = (state / "roots-file_roots.json").read_text()
    (a / "top" / "gone.sls").write_text("soon gone")
    fake.touch(a / "top", "gone.sls")
    _cut(opts, state, fake)
    if damage == "parts-older":
        (state / "roots-file_roots.json").write_text(parts_meta)  # before gone.sls
    else:
        (a / "top" / "gone.sls").unlink()
        fake.touch(a / "top", "gone.sls")
        if damage == "subdir-record":
            (a / "x.sls").write_text("x again")  # the parent listed too
            fake.touch(a, "x.sls")
        top = os.path.realpath(a / "top")
        _edit_records(state, lambda dirs: dirs.update({top: {"rel": "top"}}) if top in dirs
                      else None)  # not a record
    got, how = _cut(opts, state, fake)
    assert how["file_roots"] == "all"
    assert got == _cut(opts, tmp_path / "fresh")[0]


def test_records_save_their_changed_buckets_and_use_only_their_own_generation(
        tree, tmp_path, monkeypatch):
    """
    DirRecords: a save writes the files of the buckets whose records
    changed; a bucket's file of another save (a crash between the two
    writes, two saves at once) is not used, and its directories are listed.
    """
    from salt_multimaster import fsutil

    a, b = tree
    _forty_dirs(a)
    opts, state = _opts(a, b), tmp_path / "state"
    fake = FakeWatcher([a, b])
    _read(opts, state, fake)
    older = {p.name: p.read_text() for p in (state / manifest.ROOTS_DIRS_BUCKETS).iterdir()}
    (a / "d7" / "f.sls").write_text("changed")
    fake.touch(a / "d7", "f.sls")
    written = []
    real = fsutil.atomic_write
    monkeypatch.setattr(fsutil, "atomic_write",
                        lambda path, *a, **k: written.append(os.path.basename(path))
                        or real(path, *a, **k))
    _read(opts, state, fake)
    bucket = f"{manifest.bucket_of(os.path.realpath(a / 'd7'))}.json"
    assert bucket in written and manifest.ROOTS_DIRS in written
    assert len([w for w in written if w.endswith(".json") and w[0].isdigit()]) == 1
    monkeypatch.undo()
    # that bucket's file as the save before wrote it: its records are not used
    (state / manifest.ROOTS_DIRS_BUCKETS / bucket).write_text(older[bucket])
    (a / "d7" / "f.sls").write_text("changed again, the journal not told")
    listed = _count_listings(monkeypatch)
    assert _read(opts, state, fake) == _full(opts, tmp_path)
    assert os.path.join(str(a), "d7") in listed


def test_records_of_an_earlier_format_are_not_used(tree, tmp_path, monkeypatch):
    """
    The records of the release before (bucket files named by a generation,
    not by their sha256) are not used: every directory is listed once, then
    recorded in this format and vouched for again.
    """
    a, b = tree
    opts, state = _opts(a, b), tmp_path / "state"
    fake = FakeWatcher([a, b])
    _read(opts, state, fake)
    meta = json.loads((state / manifest.ROOTS_DIRS).read_text())
    assert meta["format"] == manifest.ROOTS_DIRS_FORMAT
    del meta["format"]
    (state / manifest.ROOTS_DIRS).write_text(json.dumps(meta))
    (a / "x.sls").write_text("changed, the watcher not told")
    full = _full(opts, tmp_path)
    listed = _count_listings(monkeypatch)
    assert _read(opts, state, fake) == full
    assert str(a) in listed and os.path.join(str(a), "top", "mid") in listed
    listed.clear()
    assert _read(opts, state, fake) == full
    assert listed == []


# ---------------------------------------------------------------------------
# A sync's read: the buckets only (read_roots(manifests=False)); the files of
# the directories the watcher vouches for stay in their records (Deferred)
# ---------------------------------------------------------------------------
def _records_made(monkeypatch):
    made = []

    class Recorded(manifest.DirRecords):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(manifest, "DirRecords", Recorded)
    return made


def test_a_sync_s_read_parses_the_records_of_the_listed_directories_only(tree, tmp_path,
                                                                         monkeypatch):
    a, b = tree
    _forty_dirs(a)
    opts, state = _one_root_each(a, b), tmp_path / "state"
    fake = FakeWatcher([a, b])
    _cut(opts, state, fake, manifests=False)
    _cut(opts, state, fake, manifests=False)
    (a / "d7" / "f.sls").write_text("changed")
    fake.touch(a / "d7", "f.sls")
    made = _records_made(monkeypatch)
    got, how = _cut(opts, state, fake, manifests=False)
    assert how["file_roots"] == "buckets"
    assert got == _cut(opts, tmp_path / "fresh")[0]
    # every bucket file read and checked, one parsed: d7's (its last listing)
    assert made[0].reused > 40 and made[0].files.files_read == len(made[0].files.shas) > 1
    assert made[0].files.parsed == 1
    # the records saved again are those of the next walk
    monkeypatch.undo()
    listed = _count_listings(monkeypatch)
    assert _cut(opts, state, fake, manifests=False) == (got, how)
    assert listed == []


def test_the_first_root_serving_a_path_wins_whichever_is_listed(tree, tmp_path):
    """
    base: [a, b], both serving top/y.sls.  b's top listed while a's is
    taken from its record: a's y.sls is still served; a's y.sls removed
    (a's top listed), b's is served, b's top taken from its record.
    """
    a, b = tree
    opts, state = _opts(a, b, ["*.swp"]), tmp_path / "state"
    fake = FakeWatcher([a, b])
    _cut(opts, state, fake, manifests=False)
    _cut(opts, state, fake, manifests=False)
    (b / "top" / "y.sls").write_text("b's y, changed")
    fake.touch(b / "top", "y.sls")
    got, how = _cut(opts, state, fake, manifests=False)
    assert how["file_roots"] == "buckets"
    assert got == _cut(opts, tmp_path / "fresh1")[0]
    (a / "top" / "y.sls").unlink()
    fake.touch(a / "top", "y.sls")
    got, how = _cut(opts, state, fake, manifests=False)
    assert how["file_roots"] == "buckets"
    assert got == _cut(opts, tmp_path / "fresh2")[0]
    base = got["file_roots"][1][manifest.bucket_of("base/top/y.sls")]["base"]
    assert base["top/y.sls"][2] == manifest.sha256_file(str(b / "top" / "y.sls"))


@pytest.mark.parametrize("read", ["manifests", "buckets, all cut again"])
def test_a_record_that_cannot_be_read_back_lists_every_directory(tree, tmp_path, read):
    """
    A bucket file that is the one its index names (its sha256) but holds
    no records, never written so: the read lists every directory, as
    without the watcher, and the records go (the next read lists them all
    and records them again).
    """
    a, b = tree
    opts, state = _one_root_each(a, b), tmp_path / "state"
    fake = FakeWatcher([a, b])
    _read(opts, state, fake)
    _read(opts, state, fake)
    meta = json.loads((state / manifest.ROOTS_DIRS).read_text())
    bucket = manifest.bucket_of(os.path.realpath(a / "top"))
    text = json.dumps({"bucket": "no records"}).encode()
    (state / manifest.ROOTS_DIRS_BUCKETS / f"{bucket}.json").write_bytes(text)
    meta["buckets"][bucket] = hashlib.sha256(text).hexdigest()
    (state / manifest.ROOTS_DIRS).write_text(json.dumps(meta))
    (a / "x.sls").write_text("changed, the watcher not told")
    if read == "manifests":
        assert _read(opts, state, fake) == _full(opts, tmp_path)
    else:
        assert not (state / "roots-file_roots.json").exists()  # no saved buckets: all cut
        assert _cut(opts, state, fake, manifests=False)[0] == _cut(opts, tmp_path / "fresh")[0]
    assert not (state / manifest.ROOTS_DIRS).exists()
    assert _read(opts, state, fake) == _full(opts, tmp_path)
    assert (state / manifest.ROOTS_DIRS).exists()


def test_a_sync_s_read_keeps_the_hashes_of_the_directories_it_did_not_list(tree, tmp_path):
    """
    A sync's read that opens the hash cache (a changed file past
    DIRECT_BYTES) drops the entries of files gone, and keeps those of the
    directories taken from their records, whose files it never put in a
    manifest.
    """
    a, b = tree
    opts, state = _one_root_each(a, b), tmp_path / "state"
    fake = FakeWatcher([a, b])
    _cut(opts, state, fake, manifests=False)  # every file hashed through the cache
    _cut(opts, state, fake, manifests=False)
    mid = a / "top" / "mid"
    (mid / "big.sls").write_bytes(b"b" * (manifest.DIRECT_BYTES + 1))
    (mid / "z.sls").unlink()
    fake.touch(mid)
    got, how = _cut(opts, state, fake, manifests=False)
    assert how["file_roots"] == "buckets"
    assert got == _cut(opts, tmp_path / "fresh")[0]
    held = set(json.loads((state / manifest.ROOTS_HASHCACHE).read_text()))
    real = os.path.realpath
    assert {real(a / "x.sls"), real(a / "top" / "y.sls"), real(b / "only-b.sls"),
            real(mid / "big.sls")} <= held
    assert real(mid / "z.sls") not in held
