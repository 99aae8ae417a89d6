"""
Whether a salt-master is serving: what a peer reports about its own master.
"""

import socket

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


def master_started(mopts):
    """When the running salt-master (its pidfile's process) started, or None."""
    try:
        import psutil  # pylint: disable=import-outside-toplevel

        with open(mopts["pidfile"], encoding="utf-8") as fh:
            pid = int(fh.read().strip())
        return psutil.Process(pid).create_time()
    except Exception:  # pylint: disable=broad-except
        return None


def restart_pending(mopts, marker):
    """
    Whether the running master started before the last write that needs a
    restart (master keys, master config; ``marker`` holds its time): True,
    False, or None when it cannot be told (no marker means False).
    """
    try:
        with open(marker, encoding="utf-8") as fh:
            written = float(fh.read().strip())
    except (OSError, ValueError):
        return False
    started = master_started(mopts)
    if started is None:
        return None
    return started < written
