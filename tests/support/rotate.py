"""
Test support for ``salt-run multimaster.rotate_key``: a stand-in for the
service manager that restarts a master when asked, and pki snapshots.

A rotation asks for a master restart by writing the restart marker
(``<cachedir>/multimaster/restart-needed`` of the primary, or of the peer
host's minion) and running ``multimaster:master_restart_cmd`` (``true`` in
these tests).  :class:`RestartWatcher` restarts the salt-factories daemon
whose marker changed, as systemd would restart the unit.
"""

import logging
import os
import pathlib
import stat
import threading
import time

log = logging.getLogger(__name__)

MARKER = pathlib.Path("multimaster") / "restart-needed"


def marker_of(daemon):
    return pathlib.Path(daemon.config["cachedir"]) / MARKER


class Background:
    """
    A daemon thread running ``self._run`` while the ``with`` block runs;
    ``self._stop`` is set at its end (``_run`` loops until it is).
    """

    def __init__(self, name):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self):
        raise NotImplementedError

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=300)


class RestartWatcher(Background):
    """
    Restart ``master`` when the restart marker in ``marker_owner``'s cachedir
    changes, for every ``(master, marker_owner)`` pair; ``enabled`` holds the
    masters it may restart now (a master left out stays down-level: a
    restart that did not happen).
    """

    def __init__(self, pairs):
        self.pairs = list(pairs)
        self.enabled = {id(m) for m, _ in self.pairs}
        self.seen = {id(m): self._stamp(o) for m, o in self.pairs}
        self.restarts = []
        super().__init__("restart-watcher")

    def enable(self, master):
        """Restart ``master`` on the next request (a request made while disabled is dropped)."""
        for one, owner in self.pairs:
            if one is master:
                self.seen[id(master)] = self._stamp(owner)
        self.enabled.add(id(master))

    @staticmethod
    def _stamp(owner):
        try:
            return marker_of(owner).stat().st_mtime_ns
        except OSError:
            return None

    def _run(self):
        while not self._stop.is_set():
            for master, owner in self.pairs:
                stamp = self._stamp(owner)
                if id(master) not in self.enabled or stamp == self.seen[id(master)]:
                    continue
                self.seen[id(master)] = stamp
                time.sleep(1)  # the service manager's own delay
                log.info("restart watcher: restarting %s", master.id)
                master.terminate()
                master.start()
                self.restarts.append(master.id)
            self._stop.wait(0.5)


def pki_snapshot(*daemons):
    """Every file under the daemons' pki dirs: ``{path: (mode, bytes)}``."""
    ret = {}
    for daemon in daemons:
        root = pathlib.Path(daemon.config["pki_dir"])
        for dirpath, _, files in os.walk(root):
            for name in files:
                path = pathlib.Path(dirpath) / name
                st = path.lstat()
                data = os.readlink(path) if stat.S_ISLNK(st.st_mode) else path.read_bytes()
                ret[str(path)] = (stat.S_IMODE(st.st_mode), data)
    return ret


def key_body_lines(path):
    """The base64 lines of a PEM key (needles to look for where keys must not be)."""
    lines = [ln for ln in pathlib.Path(path).read_text().splitlines()
             if ln and not ln.startswith("-----")]
    return [ln.encode() for ln in lines[1:-1]]


def files_holding(roots, needles, skip=()):
    """Files under ``roots`` (outside the ``skip`` dirs) holding any of ``needles``."""
    skip = [os.path.realpath(s) for s in skip]
    hits = []
    for root in roots:
        for dirpath, _, files in os.walk(os.path.realpath(root)):
            if any(dirpath == s or dirpath.startswith(s + os.sep) for s in skip):
                continue
            for name in files:
                try:
                    with open(os.path.join(dirpath, name), "rb") as fh:
                        data = fh.read()
                except OSError:
                    continue
                if any(n in data for n in needles):
                    hits.append(os.path.join(dirpath, name))
    return hits
