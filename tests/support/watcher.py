"""A stand-in for the change journal (``journal.query``) in unit tests."""

import os


class FakeWatcher:
    """Answers ``journal.query`` from the directories :meth:`touch` was told of."""

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
