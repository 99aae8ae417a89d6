"""
Whether a salt-master is serving: what a peer reports about its own master.
"""

import json
import os
import time

from salt_multimaster import checks, layout, protocol, statefile

CONNECT_TIMEOUT = 2.0


def master_address(mopts):
    """Where the master's request server listens, as a local client reaches it."""
    host = mopts.get("interface") or "0.0.0.0"
    if host == "0.0.0.0":
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return host, int(mopts.get("ret_port") or 4506)


def master_running(mopts):
    """
    ``(running, detail)``: whether something accepts connections on the
    master's ret_port (its request server: what minions authenticate and
    return to), with the address tried.
    """
    host, port = master_address(mopts)
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return checks.tcp_connect(host, port, CONNECT_TIMEOUT) is None, where


def not_running_error(peer, where):
    """The report line for a peer whose salt-master does not answer."""
    return (f"{peer}'s salt-master is not running (nothing accepts connections on {where}): "
            "the peer holds the primary's data but serves no minion; start it")


RESTART_MARKER = "restart-needed"


def _started(pid):
    """
    When process ``pid`` started, as a number that is the same for one
    process whoever reads it, and another for any later process of that
    pid: its start in clock ticks since boot where ``/proc`` tells it (not
    moved by a change of the wall clock), else psutil's start time.
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            # after "pid (comm)": state is field 3 of proc(5), starttime field 22
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        import psutil  # pylint: disable=import-outside-toplevel

        return psutil.Process(pid).create_time()


def _pid(mopts):
    with open(mopts["pidfile"], encoding="utf-8") as fh:
        return int(fh.read().strip())


def master_process(mopts):
    """
    ``[pid, start]`` of the running salt-master (its pidfile's process,
    :func:`_started`), or None when none runs.  The start tells one process
    from another; it is no time to compare with ``time.time()``.
    """
    try:
        pid = _pid(mopts)
        return [pid, _started(pid)]
    except Exception:  # pylint: disable=broad-except
        return None


def mark_restart(mopts, marker):
    """
    Record in ``marker`` that the master must restart to load what was just
    written (master keys, master config): which master process runs now
    (:func:`master_process`, None when none does), and when.  Written
    before any restart is asked for, 0600.
    """
    statefile.write(marker, json.dumps({"written": time.time(), "master": master_process(mopts)}))


def _valid_marker(data):
    """A marker: ``{"written", "master"}``."""
    if not isinstance(data, dict):
        return False
    recorded = data.get("master")
    return recorded is None or (isinstance(recorded, list) and len(recorded) == 2)


def loaded_files(mopts):
    """The files a sync writes that the master loads only when it starts: keys, drop-in."""
    files = [path for topology in layout.TOPOLOGIES
             for path in layout.master_key_files(mopts, topology)]
    return files + [protocol.dropin_path(mopts)]


def _started_before_a_write(mopts):
    """
    The restart marker rebuilt from the live state: whether the running
    master started before the last change of a file it loads only when it
    starts (True), after all of them (False), or None (no master).
    """
    try:
        import psutil  # pylint: disable=import-outside-toplevel

        started = psutil.Process(_pid(mopts)).create_time()  # epoch seconds, as the mtimes
    except Exception:  # pylint: disable=broad-except
        return None
    changed = []
    for path in loaded_files(mopts):
        try:
            changed.append(os.stat(path).st_mtime)
        except OSError:
            pass
    return bool(changed) and started < max(changed)


def restart_pending(mopts, marker):
    """
    Whether the master that ran at the last write needing a restart
    (``marker``, :func:`mark_restart`) still runs: True, False, or None
    when it cannot be told (no master process found).  No marker means
    False; a damaged one is rebuilt from the live state (the running
    master's start against the files it loads, :func:`loaded_files`) and
    written again.

    A restart is told by the process, not by the clock: the master recorded
    at the write is pending while it runs (same pid, same start); with no
    master running at the write, the one running now started after it.
    (psutil's start time can be up to a second early against the wall
    clock: Linux gives the boot time in whole seconds, so a master
    restarted within a second of the write looked as if it had not.)
    """
    try:
        data = statefile.read(marker, valid=_valid_marker)
    except statefile.Damaged as exc:
        pending = _started_before_a_write(mopts)
        statefile.notice(marker, exc.why, "rebuilt from the master's start and the files it "
                         "loads: restart " + ("pending" if pending else "not pending"))
        # pending: the running master recorded, as mark_restart does, until it restarts
        statefile.write(marker, json.dumps({"written": time.time(),
                                            "master": master_process(mopts) if pending else None}))
        return pending
    if data is None:
        return False
    running = master_process(mopts)
    if running is None:
        return None
    recorded = data.get("master")
    if recorded is None:
        return False
    return running == recorded
