"""
The change journal (salt_multimaster.watch): real inotify on trees in
tmp_path, the socket server in a thread.  drain() is synchronous, so every
change a test makes is in the next reply: no sleep anywhere.
"""

import errno
import json
import logging
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

from salt_multimaster import inotify, journal, watch

UTILS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "_utils")


@pytest.fixture
def tree(tmp_path):
    """tree/{f, a/{f, b/f}}, and a directory outside it."""
    top = tmp_path / "tree"
    (top / "a" / "b").mkdir(parents=True)
    for rel in ("f", "a/f", "a/b/f"):
        (top / rel).write_bytes(b"old\n")
    (tmp_path / "outside" / "sub").mkdir(parents=True)
    return str(top)


@pytest.fixture
def started():
    """``started(*trees, **kwargs)``: a started Watcher, closed after the test."""
    made = []

    def make(*trees, **kwargs):
        watcher = watch.Watcher(trees, **kwargs)
        watcher.start()
        made.append(watcher)
        return watcher

    yield make
    for watcher in made:
        watcher.close()


def token(reply):
    return {"session": reply["session"], "seq": reply["seq"]}


def answer(watcher, changed, unwatched=(), error=None, names=None):
    """The whole reply ``watcher`` should give now."""
    return {"session": watcher.session, "seq": watcher.seq, "trees": watcher.trees,
            "unwatched": sorted(unwatched), "changed": changed, "names": names,
            "error": error}


def ask(watcher, since, changed, unwatched=(), names=None):
    """
    Assert the reply to ``since`` lists ``changed`` (and, when given, the
    entry ``names`` of the changed directories); the reply's token.
    """
    reply = watcher.changes(since)
    if names is None and changed is not None:
        names = reply["names"]
        assert {t: sorted(d) for t, d in names.items()} == changed
    assert reply == answer(watcher, changed, unwatched, names=names)
    assert reply["session"] == since["session"] and reply["seq"] >= since["seq"]
    return token(reply)


def watched_inodes(watcher):
    """The inodes the kernel watches for ``watcher`` (its fdinfo), sorted."""
    with open(f"/proc/self/fdinfo/{watcher.fileno()}", encoding="ascii") as fh:
        return sorted(int(re.search(r"\bino:([0-9a-f]+)", line).group(1), 16)
                      for line in fh if line.startswith("inotify "))


def dir_inodes(*tops):
    """The inodes of every directory of ``tops``, symlinks not followed, sorted."""
    return sorted(os.stat(dirpath).st_ino
                  for top in tops for dirpath, _d, _f in os.walk(top, followlinks=False))


def test_start_and_changes_in_place(tree, started):
    w = started(tree)
    first = w.changes(None)
    assert first == {"session": w.session, "seq": 0, "trees": [tree], "unwatched": [],
                     "changed": None, "names": None, "error": "no token given"}
    assert re.fullmatch(r"[0-9a-f]{16}", first["session"])
    assert watched_inodes(w) == dir_inodes(tree)
    start = tok = ask(w, token(first), {tree: []})

    # reading is no change
    with open(os.path.join(tree, "a", "b", "f"), "rb") as fh:
        fh.read()
    os.stat(os.path.join(tree, "a", "f"))
    os.listdir(os.path.join(tree, "a"))
    tok = ask(w, tok, {tree: []})

    # create in the top
    with open(os.path.join(tree, "new"), "wb") as fh:
        fh.write(b"x")
    tok = ask(w, tok, {tree: [""]})
    # modify in place, nested
    with open(os.path.join(tree, "a", "b", "f"), "r+b") as fh:
        fh.write(b"N")
    tok = ask(w, tok, {tree: ["a/b"]})
    # chmod
    os.chmod(os.path.join(tree, "a", "f"), 0o600)
    tok = ask(w, tok, {tree: ["a"]})
    # delete, nested
    os.unlink(os.path.join(tree, "a", "b", "f"))
    tok = ask(w, tok, {tree: ["a/b"]})
    # nothing since
    tok = ask(w, tok, {tree: []})
    # everything since the first token, each directory once
    ask(w, start, {tree: ["", "a", "a/b"]})
    assert w.session == first["session"]


def test_new_directories_are_watched(tree, started):
    w = started(tree)
    tok = token(w.changes(None))
    os.mkdir(os.path.join(tree, "new"))
    for name in ("one", "two"):
        with open(os.path.join(tree, "new", name), "wb") as fh:
            fh.write(b"x")
    # a whole tree made before the watcher reads a single event
    os.makedirs(os.path.join(tree, "x", "y", "z"))
    with open(os.path.join(tree, "x", "y", "z", "f"), "wb") as fh:
        fh.write(b"x")
    tok = ask(w, tok, {tree: ["", "new", "x", "x/y", "x/y/z"]})
    assert watched_inodes(w) == dir_inodes(tree)

    # the new directories are watched: later changes in them are seen
    with open(os.path.join(tree, "x", "y", "z", "f"), "r+b") as fh:
        fh.write(b"y")
    tok = ask(w, tok, {tree: ["x/y/z"]})
    os.unlink(os.path.join(tree, "new", "one"))
    tok = ask(w, tok, {tree: ["new"]})
    os.mkdir(os.path.join(tree, "new", "sub"))
    os.mkdir(os.path.join(tree, "new", "sub", "deeper"))
    tok = ask(w, tok, {tree: ["new", "new/sub", "new/sub/deeper"]})
    # a directory's own attributes: its parent's entry, and the directory
    # itself (the only place the top of a tree is told of)
    os.chmod(os.path.join(tree, "new", "sub", "deeper"), 0o700)
    tok = ask(w, tok, {tree: ["new/sub", "new/sub/deeper"]})
    os.chmod(tree, 0o700)
    ask(w, tok, {tree: [""]})


def test_removed_directories(tree, started):
    w = started(tree)
    session = w.session
    tok = token(w.changes(None))
    shutil.rmtree(os.path.join(tree, "a"))
    tok = ask(w, tok, {tree: ["", "a", "a/b"]})
    # their watches are gone, no reset
    assert w.session == session
    assert watched_inodes(w) == dir_inodes(tree)

    # removed and made again between two questions: the new one is watched
    os.mkdir(os.path.join(tree, "c"))
    tok = ask(w, tok, {tree: ["", "c"]})
    os.rmdir(os.path.join(tree, "c"))
    os.mkdir(os.path.join(tree, "c"))
    tok = ask(w, tok, {tree: ["", "c"]})
    assert watched_inodes(w) == dir_inodes(tree)
    with open(os.path.join(tree, "c", "f"), "wb") as fh:
        fh.write(b"x")
    ask(w, tok, {tree: ["c"]})
    assert w.session == session


def test_renames(tree, started, tmp_path):
    w = started(tree)
    tok = token(w.changes(None))
    # a file renamed in its directory, then to another
    os.rename(os.path.join(tree, "a", "f"), os.path.join(tree, "a", "g"))
    tok = ask(w, tok, {tree: ["a"]})
    os.rename(os.path.join(tree, "a", "g"), os.path.join(tree, "a", "b", "g"))
    tok = ask(w, tok, {tree: ["a", "a/b"]})
    # a file moved in from outside
    with open(tmp_path / "outside" / "in", "wb") as fh:
        fh.write(b"x")
    os.rename(tmp_path / "outside" / "in", os.path.join(tree, "in"))
    tok = ask(w, tok, {tree: [""]})

    # a directory renamed: reset
    old = w.session
    os.rename(os.path.join(tree, "a"), os.path.join(tree, "c"))
    reply = w.changes(tok)
    assert reply["session"] != old
    assert reply == answer(w, None, error=reply["error"])
    assert "moved" in reply["error"] and reply["seq"] == 0
    # the paths of the new session are right
    tok = token(reply)
    assert watched_inodes(w) == dir_inodes(tree)
    with open(os.path.join(tree, "c", "b", "f"), "r+b") as fh:
        fh.write(b"N")
    tok = ask(w, tok, {tree: ["c/b"]})

    # a directory moved out, one moved in: reset each time, and the one
    # moved in is watched
    for src, dst in ((os.path.join(tree, "c", "b"), tmp_path / "outside" / "b"),
                     (tmp_path / "outside" / "sub", os.path.join(tree, "sub"))):
        old = w.session
        os.rename(src, dst)
        reply = w.changes(tok)
        assert reply["changed"] is None and reply["session"] != old
        tok = token(reply)
    assert watched_inodes(w) == dir_inodes(tree)
    with open(os.path.join(tree, "sub", "f"), "wb") as fh:
        fh.write(b"x")
    with open(tmp_path / "outside" / "b" / "f", "r+b") as fh:
        fh.write(b"N")  # moved out: not reported
    ask(w, tok, {tree: ["sub"]})


def test_tree_top_removed_and_made_again(tree, started, tmp_path):
    other = str(tmp_path / "outside")
    w = started(tree, other)
    tok = token(w.changes(None))
    shutil.rmtree(tree)
    reply = w.changes(tok)
    assert reply == answer(w, None, unwatched=[tree], error=reply["error"])
    assert reply["session"] != tok["session"]
    # an unwatched tree is never vouched for
    tok = ask(w, token(reply), {other: []}, unwatched=[tree])
    os.mkdir(os.path.join(other, "x"))
    tok = ask(w, tok, {other: ["", "x"]}, unwatched=[tree])

    # made again: watched from then on, the older token answered None
    os.makedirs(os.path.join(tree, "d"))
    reply = w.changes(tok)
    assert reply == answer(w, None, error=reply["error"])
    assert reply["session"] != tok["session"]
    tok = token(reply)
    with open(os.path.join(tree, "d", "f"), "wb") as fh:
        fh.write(b"x")
    ask(w, tok, {tree: ["d"], other: []})
    assert watched_inodes(w) == dir_inodes(tree, other)


def test_tree_top_renamed_or_replaced(tree, started, tmp_path):
    w = started(tree)
    tok = token(w.changes(None))
    # renamed away: unwatched
    os.rename(tree, tmp_path / "away")
    reply = w.changes(tok)
    assert reply == answer(w, None, unwatched=[tree], error=reply["error"])
    # another directory renamed in its place (its parent is not watched:
    # the watcher sees the top's inode changed)
    os.rename(tmp_path / "away", tree)
    tok = token(w.changes(None))
    os.rename(tree, tmp_path / "old")
    os.mkdir(tree)
    reply = w.changes(tok)
    assert reply == answer(w, None, error=reply["error"])
    assert reply["session"] != tok["session"]
    tok = token(reply)
    with open(tmp_path / "old" / "a" / "f", "r+b") as fh:
        fh.write(b"N")  # the old tree: not reported
    with open(os.path.join(tree, "f"), "wb") as fh:
        fh.write(b"x")
    ask(w, tok, {tree: [""]})
    assert watched_inodes(w) == dir_inodes(tree)


def test_tree_ancestor_renamed(started, tmp_path):
    # no event tells of it (only the top and what is under it are watched):
    # the top's inode is checked at every drain
    tree = str(tmp_path / "parent" / "tree")
    os.makedirs(os.path.join(tree, "d"))
    w = started(tree)
    tok = token(w.changes(None))
    os.rename(tmp_path / "parent", tmp_path / "old")
    os.makedirs(os.path.join(tree, "d"))
    with open(tmp_path / "old" / "tree" / "d" / "f", "wb") as fh:
        fh.write(b"x")  # the old tree
    reply = w.changes(tok)
    assert reply == answer(w, None, error=reply["error"])
    assert "replaced" in reply["error"] and reply["session"] != tok["session"]
    tok = token(reply)
    assert watched_inodes(w) == dir_inodes(tree)
    with open(tmp_path / "old" / "tree" / "d" / "f", "wb") as fh:
        fh.write(b"y")
    tok = ask(w, tok, {tree: []})
    with open(os.path.join(tree, "d", "f"), "wb") as fh:
        fh.write(b"x")
    ask(w, tok, {tree: ["d"]})


def test_tree_missing_at_start(tree, started, tmp_path):
    late = str(tmp_path / "late")
    w = started(late, tree, tree + "/", os.path.join(tree, "a", ".."))
    assert w.trees == sorted([late, tree])
    reply = w.changes(None)
    assert reply == answer(w, None, unwatched=[late], error="no token given")
    tok = ask(w, token(reply), {tree: []}, unwatched=[late])
    os.mkdir(late)
    reply = w.changes(tok)
    assert reply == answer(w, None, error=reply["error"])
    assert reply["session"] != tok["session"] and "appeared" in reply["error"]
    tok = token(reply)
    os.mkdir(os.path.join(late, "x"))
    with open(os.path.join(late, "x", "f"), "wb") as fh:
        fh.write(b"x")
    ask(w, tok, {late: ["", "x"], tree: []})


def test_nested_trees(tree, started):
    inner = os.path.join(tree, "a")
    w = started(tree, inner)
    assert watched_inodes(w) == dir_inodes(tree)  # one watch per directory
    tok = token(w.changes(None))
    with open(os.path.join(inner, "b", "f"), "r+b") as fh:
        fh.write(b"N")
    os.makedirs(os.path.join(inner, "n", "m"))
    ask(w, tok, {tree: ["a", "a/b", "a/n", "a/n/m"], inner: ["", "b", "n", "n/m"]})


def test_bad_tokens(tree, started):
    w = started(tree)
    tok = token(w.changes(None))
    with open(os.path.join(tree, "f"), "r+b") as fh:
        fh.write(b"N")
    assert w.changes(tok)["changed"] == {tree: [""]}
    now = token(w.changes(tok))
    assert now["seq"] > 0
    bad = [
        {"session": "0123456789abcdef", "seq": 0},  # another session
        {"session": now["session"], "seq": now["seq"] + 1},  # from the future
        {"session": now["session"]},
        {"session": now["session"], "seq": "1"},
        {"session": now["session"], "seq": True},
        {"session": now["session"], "seq": -1},
        {"session": now["session"], "seq": 1.0},
        {"session": None, "seq": 0},
        [now["session"], now["seq"]],
        "garbage",
        0,
    ]
    for since in bad:
        reply = w.changes(since)
        assert reply == answer(w, None, error=reply["error"]), since
        assert isinstance(reply["error"], str) and reply["error"]
    # the good token still works after all that
    ask(w, now, {tree: []})


def test_max_changes_resets(tree, started):
    w = started(tree, max_changes=3)
    tok = token(w.changes(None))
    os.mkdir(os.path.join(tree, "d1"))
    tok = ask(w, tok, {tree: ["", "d1"]})
    # "", d1, d2, d3: four directories recorded, one too many
    os.mkdir(os.path.join(tree, "d2"))
    os.mkdir(os.path.join(tree, "d3"))
    reply = w.changes(tok)
    assert reply == answer(w, None, error=reply["error"])
    assert reply["session"] != tok["session"] and "3" in reply["error"]
    # the new session counts anew
    tok = token(reply)
    os.mkdir(os.path.join(tree, "d3", "e"))
    ask(w, tok, {tree: ["d3", "d3/e"]})


def test_queue_overflow_resets(tree, started):
    with open("/proc/sys/fs/inotify/max_queued_events", encoding="ascii") as fh:
        limit = int(fh.read())
    if limit > 200000:
        pytest.skip(f"max_queued_events is {limit}: too many events to make")
    w = started(tree)
    tok = token(w.changes(None))
    paths = [os.path.join(tree, "f"), os.path.join(tree, "a", "f")]
    for i in range(limit + 10):
        os.utime(paths[i % 2])  # alternating: the kernel merges no two
    reply = w.changes(tok)
    assert reply == answer(w, None, error=reply["error"])
    assert "overflow" in reply["error"] and reply["session"] != tok["session"]
    tok = token(reply)
    os.utime(paths[1])
    ask(w, tok, {tree: ["a"]})


def test_symlinks_not_followed(tree, started, tmp_path):
    outside = tmp_path / "outside"
    os.symlink(outside, os.path.join(tree, "link"))
    os.symlink("..", os.path.join(tree, "a", "up"))
    w = started(tree)
    assert watched_inodes(w) == dir_inodes(tree)
    assert os.stat(outside).st_ino not in watched_inodes(w)
    tok = token(w.changes(None))
    with open(outside / "f", "wb") as fh:
        fh.write(b"x")
    os.mkdir(outside / "sub" / "deeper")
    with open(os.path.join(tree, "link", "sub", "g"), "wb") as fh:
        fh.write(b"x")  # through the link: still outside
    tok = ask(w, tok, {tree: []})
    # a symlink to a directory made later: an entry of its directory, no watch
    os.symlink(outside / "sub", os.path.join(tree, "a", "b", "link2"))
    tok = ask(w, tok, {tree: ["a/b"]})
    assert watched_inodes(w) == dir_inodes(tree)

    # a tree whose top is a symlink is never vouched for
    top_link = str(tmp_path / "top-link")
    os.symlink(tree, top_link)
    w2 = started(top_link)
    reply = w2.changes(None)
    assert reply == answer(w2, None, unwatched=[top_link], error="no token given")
    assert watched_inodes(w2) == []
    ask(w2, token(reply), {}, unwatched=[top_link])


def test_remote_filesystem_not_vouched_for(tree, started, tmp_path, monkeypatch):
    other = str(tmp_path / "outside")
    mounts = [(1, "/", "ext4"), (2, os.path.join(os.path.realpath(tree), "a"), "nfs4")]
    monkeypatch.setattr(inotify, "read_mounts", lambda path=None: mounts)
    w = started(tree, other)
    assert watched_inodes(w) == dir_inodes(other)
    tok = ask(w, token(w.changes(None)), {other: []}, unwatched=[tree])
    os.mkdir(os.path.join(tree, "x"))
    ask(w, tok, {other: []}, unwatched=[tree])
    # a filesystem the watcher does not know
    monkeypatch.setattr(inotify, "read_mounts", lambda path=None: [(1, "/", "fuse.sshfs")])
    w2 = started(tree)
    assert w2.changes(None)["unwatched"] == [tree]


MOUNT_SCRIPT = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS: these mounts vanish with this process
    print("SKIP unshare: " + os.strerror(ctypes.get_errno()))
    sys.exit(0)
MS_REC, MS_PRIVATE = 0x4000, 0x40000
if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
    print("SKIP mount: " + os.strerror(ctypes.get_errno()))
    sys.exit(0)
from salt_multimaster import watch

def mount(where):
    if libc.mount(b"tmpfs", where.encode(), b"tmpfs", 0, None) != 0:
        raise OSError(ctypes.get_errno(), "mount " + where)

tree, other = sys.argv[1], sys.argv[2]
w = watch.Watcher([tree])
w.start()
reply = w.changes(None)
tok = {"session": reply["session"], "seq": reply["seq"]}
mount(os.path.join(tree, "a"))
reply = w.changes(tok)
assert reply["changed"] is None and "mounted" in reply["error"], reply
tok = {"session": reply["session"], "seq": reply["seq"]}
open(os.path.join(tree, "a", "f"), "w").close()  # on the tmpfs
reply = w.changes(tok)
assert reply["changed"] == {tree: ["a"]}, reply
tok = {"session": reply["session"], "seq": reply["seq"]}
mount(other)  # elsewhere: no reset
reply = w.changes(tok)
assert reply["changed"] == {tree: []}, reply
libc.umount2(os.path.join(tree, "a").encode(), 0)
reply = w.changes(tok)
assert reply["changed"] is None, reply
print("OK")
"""


def test_mounts_under_a_tree_reset(tree, tmp_path):
    env = dict(os.environ, PYTHONPATH=UTILS)
    proc = subprocess.run([sys.executable, "-c", MOUNT_SCRIPT, tree, str(tmp_path / "outside")],
                          env=env, capture_output=True, text=True, timeout=30, check=False)
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stdout + proc.stderr


def test_unable_when_out_of_watches(tree, started, monkeypatch, caplog):
    def no_space(fd, path, mask):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    caplog.set_level(logging.WARNING, logger=watch.__name__)
    real = inotify.add_watch
    monkeypatch.setattr(inotify, "add_watch", no_space)
    w = started(tree)
    reply = w.changes(None)
    assert reply == answer(w, None, unwatched=[tree], error=reply["error"])
    assert "max_user_watches" in reply["error"]
    assert "max_user_watches" in caplog.text

    # out of watches later: a new directory cannot be watched
    monkeypatch.setattr(inotify, "add_watch", real)
    w2 = started(tree)
    tok = token(w2.changes(None))
    monkeypatch.setattr(inotify, "add_watch", no_space)
    os.mkdir(os.path.join(tree, "new"))
    reply = w2.changes(tok)
    assert reply == answer(w2, None, unwatched=[tree], error=reply["error"])
    assert "No space left" in reply["error"]
    # for good, and its watches are given back
    monkeypatch.setattr(inotify, "add_watch", real)
    with open(os.path.join(tree, "f"), "r+b") as fh:
        fh.write(b"N")
    for since in (tok, token(reply)):
        assert w2.changes(since)["changed"] is None
    assert watched_inodes(w2) == []


def test_not_linux_is_unavailable(monkeypatch):
    monkeypatch.setattr(inotify, "_LIBC", None)
    monkeypatch.setattr(inotify.sys, "platform", "freebsd14")
    with pytest.raises(inotify.Unavailable):
        watch.Watcher(["/nonexistent"]).start()


def _until(check, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _raw(sock_path, data):
    """Send ``data`` to the server, return its reply line decoded."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(5)
        conn.connect(sock_path)
        conn.sendall(data)
        received = b""
        while not received.endswith(b"\n"):
            chunk = conn.recv(65536)
            assert chunk, received
            received += chunk
    return json.loads(received)


def test_serve_and_query(tree, started, tmp_path):
    w = started(tree)
    sock_path = str(tmp_path / "w.sock")
    assert journal.query(sock_path, None) is None  # no socket yet
    # a stale socket left by a dead server
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(sock_path)
    stale.close()
    stop = threading.Event()
    old_umask = os.umask(0)
    try:
        server = threading.Thread(target=journal.serve, args=(w, sock_path),
                                  kwargs={"stop": stop, "poll": 0.02}, daemon=True)
        server.start()
        _until(lambda: journal.query(sock_path, None) is not None)
    finally:
        os.umask(old_umask)
    try:
        assert stat.S_IMODE(os.lstat(sock_path).st_mode) == 0o600
        first = journal.query(sock_path, None)
        assert first == {"session": first["session"], "seq": first["seq"], "trees": [tree],
                         "unwatched": [], "changed": None, "names": None,
                         "error": "no token given"}
        tok = token(first)
        # events drained by the server loop meanwhile are kept
        os.mkdir(os.path.join(tree, "new"))
        with open(os.path.join(tree, "a", "b", "f"), "r+b") as fh:
            fh.write(b"N")
        reply = journal.query(sock_path, tok)
        assert reply == {"session": tok["session"], "seq": reply["seq"], "trees": [tree],
                         "unwatched": [], "changed": {tree: ["", "a/b", "new"]},
                         "names": {tree: {"": ["new"], "a/b": ["f"], "new": None}},
                         "error": None}
        assert reply["seq"] > tok["seq"]
        # bad clients get an error, and the server goes on
        for garbage in (b"not json\n", b"[1, 2]\n", b'{"token": 1}\n', b"\xff\n",
                        b"[" * 70000 + b"\n", b"[" * 30000 + b"\n"):
            bad = _raw(sock_path, garbage)
            assert bad == {"changed": None, "error": bad["error"]}
            assert bad["error"].startswith("bad request: "), bad
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(sock_path)  # and hangs up without a word
        malformed = _raw(sock_path, b'{"since": 5}\n')  # a valid request, a bad token
        assert malformed["changed"] is None and malformed["trees"] == [tree]
        again = journal.query(sock_path, tok)
        assert again == reply
        last = journal.query(sock_path, token(reply))
        assert last["changed"] == {tree: []}
    finally:
        stop.set()
        server.join(5)
    assert not server.is_alive()
    assert not os.path.lexists(sock_path)
    # what the server answered is what changes() answers
    assert w.changes(tok) == reply
    assert journal.query(sock_path, tok) is None


def test_serve_moves_a_file_aside_and_keeps_a_socket_not_its_own(tree, started, tmp_path):
    w = started(tree)
    path = tmp_path / "not-a-socket"
    path.write_text("data")
    stop = threading.Event()
    server = threading.Thread(target=journal.serve, args=(w, str(path)),
                              kwargs={"stop": stop, "poll": 0.02}, daemon=True)
    server.start()
    _until(lambda: journal.query(str(path), None) is not None)
    stop.set()
    server.join(5)
    (aside,) = tmp_path.glob("not-a-socket.damaged-*")  # kept, not removed
    assert aside.read_text() == "data"
    # replaced by another server's socket meanwhile: left alone at exit
    sock_path = str(tmp_path / "w.sock")
    stop = threading.Event()
    server = threading.Thread(target=journal.serve, args=(w, sock_path),
                              kwargs={"stop": stop, "poll": 0.02}, daemon=True)
    server.start()
    _until(lambda: journal.query(sock_path, None) is not None)
    os.unlink(sock_path)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        other.bind(sock_path)
        stop.set()
        server.join(5)
        assert stat.S_ISSOCK(os.lstat(sock_path).st_mode)
    finally:
        other.close()


def test_query_never_raises(tmp_path):
    sock_path = str(tmp_path / "q.sock")
    assert journal.query(sock_path, None) is None
    assert journal.query(str(tmp_path / "nodir" / "q.sock"), None) is None
    # refused: a socket file nobody listens on
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(sock_path)
    dead.close()
    assert journal.query(sock_path, None) is None
    os.unlink(sock_path)
    assert journal.query(sock_path, {"session": object()}) is None  # not JSON

    replies = [b"nope\n", b'{"changed": null}\n', b'{"session": "s", "seq": "1", "trees": [], '
               b'"unwatched": [], "changed": null, "error": null}\n', None]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(4)

    def fake_server():
        for reply in replies:
            conn = listener.accept()[0]
            with conn:
                conn.recv(65536)
                if reply is None:
                    time.sleep(0.3)  # never answers in time
                    continue
                try:
                    conn.sendall(reply)
                except OSError:
                    pass

    thread = threading.Thread(target=fake_server, daemon=True)
    thread.start()
    try:
        for _ in replies[:-1]:
            assert journal.query(sock_path, None) is None
        assert journal.query(sock_path, None, timeout=0.1) is None
    finally:
        thread.join(5)
        listener.close()


def test_names_of_the_changed_entries(tree, started, monkeypatch):
    """
    Per changed directory, the entries that changed: "" for the directory
    itself, None for a directory new to the watcher, and None as well for a
    token from before the directory had more than MAX_NAMES entries changed
    (known again for a token taken after that).
    """
    monkeypatch.setattr(watch, "MAX_NAMES", 3)
    w = started(tree)
    tok = start = token(w.changes(None))
    with open(os.path.join(tree, "a", "b", "f"), "r+b") as fh:
        fh.write(b"N")
    os.chmod(os.path.join(tree, "a"), 0o750)
    with open(os.path.join(tree, "new"), "wb"):
        pass
    os.unlink(os.path.join(tree, "new"))
    os.makedirs(os.path.join(tree, "d", "e"))
    tok = ask(w, tok, {tree: ["", "a", "a/b", "d", "d/e"]},
              names={tree: {"": ["a", "d", "new"], "a": [""], "a/b": ["f"], "d": None,
                            "d/e": None}})
    for i in range(5):  # more than MAX_NAMES entries of one directory
        with open(os.path.join(tree, "a", f"k{i}"), "wb"):
            pass
    after = ask(w, tok, {tree: ["a"]}, names={tree: {"a": None}})
    with open(os.path.join(tree, "a", "k0"), "ab") as fh:
        fh.write(b"more")
    ask(w, after, {tree: ["a"]}, names={tree: {"a": ["k0"]}})
    assert w.changes(start)["names"][tree]["a"] is None


@pytest.mark.parametrize("poll", ["1", None, True, 0, -1, 61, float("nan")])
def test_a_bad_poll_is_named(poll):
    with pytest.raises(ValueError, match=r"multimaster_watch: poll must be seconds in \(0, 60\]"):
        journal.check_poll(poll)
    assert journal.check_poll(2) == 2.0 and journal.check_poll(0.2) == 0.2


def test_serve_ticks_before_its_first_answer_and_when_the_tick_asks(tree, started, tmp_path):
    w = started(tree)
    sock_path, calls, stop = str(tmp_path / "t.sock"), [], threading.Event()

    def tick():
        calls.append(time.monotonic())
        return 0.01 if len(calls) < 3 else None

    server = threading.Thread(target=journal.serve, args=(w, sock_path),
                              kwargs={"stop": stop, "poll": 0.05, "tick": tick}, daemon=True)
    server.start()
    try:
        _until(lambda: journal.query(sock_path, None) is not None)
        assert calls  # before the first answer
        # the seconds the first tick asked for are kept, with no event at all
        _until(lambda: len(calls) == 3)
    finally:
        stop.set()
        server.join(5)
    assert not server.is_alive()
