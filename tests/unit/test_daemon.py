"""
salt_multimaster.daemon: whether a peer's salt-master serves, and whether it
still has to restart to load what a sync or a rotation wrote (the restart
marker).  Real processes stand in for the master: the pidfile names them.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from salt_multimaster import daemon


@pytest.fixture
def master(tmp_path):
    """A process standing in for the running salt-master, named by its pidfile."""
    procs = []
    pidfile = tmp_path / "master.pid"

    def start():
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        procs.append(proc)
        pidfile.write_text(f"{proc.pid}\n")
        return proc

    (tmp_path / "pki").mkdir()
    (tmp_path / "etc" / "master.d").mkdir(parents=True)
    start.opts = {"pidfile": str(pidfile), "id": "m2", "pki_dir": str(tmp_path / "pki"),
                  "conf_file": str(tmp_path / "etc" / "master")}
    start.marker = str(tmp_path / daemon.RESTART_MARKER)
    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _restart(master, old):
    old.kill()
    old.wait()
    return master()


def test_no_marker_is_nothing_pending(master):
    master()
    assert daemon.restart_pending(master.opts, master.marker) is False


def test_pending_until_the_master_of_the_write_is_replaced(master):
    first = master()
    daemon.mark_restart(master.opts, master.marker)
    assert os.stat(master.marker).st_mode & 0o777 == 0o600
    assert daemon.restart_pending(master.opts, master.marker) is True
    _restart(master, first)
    # at once: a restart within a second of the write is a restart (psutil's
    # start time, counted from a boot time in whole seconds, said otherwise)
    assert daemon.restart_pending(master.opts, master.marker) is False


def test_a_master_started_after_a_write_made_while_none_ran_is_not_pending(master, tmp_path):
    daemon.mark_restart(master.opts, master.marker)
    assert json.loads(open(master.marker, encoding="utf-8").read())["master"] is None
    master()
    assert daemon.restart_pending(master.opts, master.marker) is False


def test_no_master_now_cannot_be_told(master):
    proc = master()
    daemon.mark_restart(master.opts, master.marker)
    proc.kill()
    proc.wait()
    assert daemon.restart_pending(master.opts, master.marker) is None
    os.unlink(master.opts["pidfile"])
    assert daemon.restart_pending(master.opts, master.marker) is None


def test_the_start_is_no_wall_clock_time(master):
    """The recorded start survives a change of the wall clock: ticks since boot where /proc has them."""
    proc = master()
    started = daemon.master_process(master.opts)
    assert started[0] == proc.pid
    if os.path.exists(f"/proc/{proc.pid}/stat"):
        assert isinstance(started[1], int)
    assert daemon.master_process(master.opts) == started


@pytest.mark.parametrize("text", ['{"master": "x"}', '{"master": [1]}', '"later"', "true", "1234.5",
                                  "not json", "", b"\x95\xff", "a directory"])
def test_a_damaged_marker_is_rebuilt_from_the_master_and_its_files(master, text, caplog):
    """
    Unknown, never "nothing pending": the running master against the files
    it loads only when it starts (keys, the sync's drop-in), the marker
    written again, the damage logged once.
    """
    proc = master()
    keyfile = os.path.join(master.opts["pki_dir"], "master.pub")

    def damage():
        if os.path.isfile(master.marker):
            os.unlink(master.marker)
        if text == "a directory":
            os.mkdir(master.marker)
        else:
            with open(master.marker, "wb") as fh:
                fh.write(text if isinstance(text, bytes) else text.encode())

    # a key written after the master started: pending, until it restarts
    with open(keyfile, "w", encoding="utf-8") as fh:
        fh.write("key")
    os.utime(keyfile, (time.time() + 5, time.time() + 5))
    damage()
    assert daemon.restart_pending(master.opts, master.marker) is True
    assert json.loads(open(master.marker, encoding="utf-8").read())["master"][0] == proc.pid
    assert daemon.restart_pending(master.opts, master.marker) is True
    _restart(master, proc)
    assert daemon.restart_pending(master.opts, master.marker) is False
    # every file older than the running master: not pending
    os.utime(keyfile, (time.time() - 3600, time.time() - 3600))
    damage()
    assert daemon.restart_pending(master.opts, master.marker) is False
    assert json.loads(open(master.marker, encoding="utf-8").read())["master"] is None
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and warned[0].startswith(
        f"multimaster: {master.marker} is damaged ("), warned
