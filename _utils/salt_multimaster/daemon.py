"""
Whether a salt-master is serving: what a peer reports about its own master.
"""

import json
import socket
import time

from salt_multimaster import fsutil

CONNECT_TIMEOUT = 2.0


def master_address(mopts):
    """Where the master's request server listens, as a local client reaches it."""
    host = mopts.get("interface") or "0.0.0.0"
    if host == "0.0.0.0":
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return host, int(mopts.get("ret_port") or 4506)


def master_running(mopts, timeout=CONNECT_TIMEOUT):
    """
    ``(running, detail)``: whether something accepts connections on the
    master's ret_port (its request server: what minions authenticate and
    return to), with the address tried.
    """
    host, port = master_address(mopts)
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True, where
    except OSError:
        return False, where


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


def master_started(mopts):
    """When the running salt-master (its pidfile's process) started (epoch seconds), or None."""
    try:
        import psutil  # pylint: disable=import-outside-toplevel

        return psutil.Process(_pid(mopts)).create_time()
    except Exception:  # pylint: disable=broad-except
        return None


def mark_restart(mopts, marker):
    """
    Record in ``marker`` that the master must restart to load what was just
    written (master keys, master config): which master process runs now
    (:func:`master_process`, None when none does), and when.  Written
    before any restart is asked for, 0600.
    """
    fsutil.atomic_write(marker, json.dumps({"written": time.time(),
                                            "master": master_process(mopts)}), mode=0o600)


def restart_pending(mopts, marker):
    """
    Whether the master that ran at the last write needing a restart
    (``marker``, :func:`mark_restart`) still runs: True, False, or None
    when it cannot be told (no master process found, a damaged marker).
    No marker means False.

    A restart is told by the process, not by the clock: the master recorded
    at the write is pending while it runs (same pid, same start); with no
    master running at the write, the one running now started after it.
    (psutil's start time can be up to a second early against the wall
    clock: Linux gives the boot time in whole seconds, so a master
    restarted within a second of the write looked as if it had not.)  Only
    a marker of an earlier release, a bare time, is compared with the
    master's start time.
    """
    try:
        with open(marker, encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        return False
    try:
        data = json.loads(text)
    except ValueError:
        return None
    running = master_process(mopts)
    if running is None:
        return None
    if isinstance(data, dict):
        recorded = data.get("master")
        if recorded is None:
            return False
        if not (isinstance(recorded, list) and len(recorded) == 2):
            return None
        return running == recorded
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        started = master_started(mopts)
        return None if started is None else started < data
    return None
