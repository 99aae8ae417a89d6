"""
The whole ``salt '*' multimaster.audit`` of one minion (:func:`run_audit`):
it reads the facts (the masters' addresses, the trusted master key, the
process table), runs the per-setting checks of the configuration
(:mod:`salt_multimaster.checks`) and the checks of the running system here:
``duplicate_minion_process`` (the salt-minion daemons in the process table)
and ``restart_pending`` (the running minion's options against its config
files).  Findings are :func:`salt_multimaster.checks.finding` dicts, in the
order of :data:`CHECKS`.

Nothing here changes the system.  Functions that observe the system (name
resolution, TCP connects, the process table, the cached master key) take the
observation as an argument or accept a replacement callable, so the audit
is testable without daemons.
"""

import logging
import os
import re
import time

import salt.version

from salt_multimaster import checks, finger
from salt_multimaster.masters import (
    DEFAULT_MASTER_PORT,
    DEFAULT_PUBLISH_PORT,
    entries as master_entries,
    parse_lenient,
    resolve_hosts,
)
from salt_multimaster.minion_config import SETTINGS, trusted_key_path

log = logging.getLogger(__name__)

CHECKS = (
    "master_list",
    "duplicate_master",
    "master_reachable",
    "master_pubkey",
    "master_alive_interval",
    "failover_settings",
    "ipc_tcp_ports",
    "version_skew",
    "duplicate_minion_process",
    "restart_pending",
)
DEFAULT_CONF_DIR = "/etc/salt"


# ----- processes --------------------------------------------------------------
_MINION_SCRIPT = re.compile(r"(^|[-_])salt[-_]minion(\.py)?$")


def _root_id(path):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def list_processes():
    """
    ``[(pid, ppid, argv, cwd)]`` for every process readable under /proc that
    shares this process's root directory (a minion in a container seen from
    the host is another minion, not a duplicate).
    """
    ret = []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return ret
    own_root = _root_id("/")
    for pid in pids:
        root = _root_id(f"/proc/{pid}/root")
        if root is not None and root != own_root:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                raw = fh.read()
            if not raw:
                continue
            with open(f"/proc/{pid}/stat", "rb") as fh:
                stat = fh.read().decode("utf-8", "replace")
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        argv = [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            cwd = "/"
        ret.append((pid, ppid, argv, cwd))
    return ret


def minion_config_dir(argv, cwd="/"):
    """
    When ``argv`` runs salt-minion, the configuration directory it uses
    (``-c``/``--config-dir``, default /etc/salt), else None.  Process titles
    set by Salt (setproctitle) put every argument into one string: split it.
    """
    words = []
    for arg in argv:
        words.extend(arg.split())
    for index, word in enumerate(words[:3]):
        if _MINION_SCRIPT.search(os.path.basename(word)):
            args = words[index + 1:]
            break
    else:
        return None
    conf_dir = DEFAULT_CONF_DIR
    for index, word in enumerate(args):
        if word in ("-c", "--config-dir") and index + 1 < len(args):
            conf_dir = args[index + 1]
        elif word.startswith("--config-dir="):
            conf_dir = word.split("=", 1)[1]
        elif word.startswith("-c") and len(word) > 2 and not word.startswith("--"):
            conf_dir = word[2:]
    return os.path.realpath(os.path.join(cwd, conf_dir))


def minion_daemons(conf_file, processes):
    """
    The top-level salt-minion daemons using the configuration directory of
    ``conf_file``: processes running salt-minion with that config dir whose
    parent is not one of them (job processes and the process manager are
    children of the daemon and do not count).
    """
    conf_dir = os.path.realpath(os.path.dirname(conf_file))
    mine = {
        pid: ppid
        for pid, ppid, argv, cwd in processes
        if minion_config_dir(argv, cwd) == conf_dir
    }
    return sorted(pid for pid, ppid in mine.items() if ppid not in mine)


def check_duplicate_minion_process(conf_file, processes):
    """
    duplicate_minion_process: more than one salt-minion daemon for this
    configuration; every job runs and returns once per daemon.
    """
    daemons = minion_daemons(conf_file, processes)
    if len(daemons) < 2:
        return []
    return [
        checks.finding(
            "duplicate_minion_process",
            "error",
            "{} salt-minion daemons run with the configuration {} (PIDs {}): every "
            "job runs and returns {} times.".format(
                len(daemons), conf_file, ", ".join(str(p) for p in daemons), len(daemons)
            ),
            "Stop all but one (e.g. 'systemctl stop salt-minion', kill the stray PIDs "
            "{}, 'systemctl start salt-minion') and make sure only one service or init "
            "script starts salt-minion.".format(", ".join(str(p) for p in daemons[1:])),
        )
    ]


# ---------------------------------------------------------------------------
# restart_pending: the running minion vs its config files
# ---------------------------------------------------------------------------
def _running_masters(running, default_port):
    """
    ``(entries, complete)``: the masters the running minion was started with,
    as ``(host, port)``.  A failover minion keeps its whole list
    (``master_list``); a multi-master (``str``) minion runs one connection per
    master and a job sees only the master it came from: that one entry,
    ``complete`` False.
    """
    value = running.get("master_list")
    if isinstance(value, (list, tuple)) and value:
        return [parse_lenient(m, default_port)[0] for m in master_entries(value)], True
    entries = master_entries(running.get("master"))
    complete = not running.get("multimaster")
    return [parse_lenient(m, default_port)[0] for m in entries], complete


def check_restart_pending(running, files, restart_status=None):
    """
    Compare the options of the running salt-minion (``running``: the
    ``__opts__`` of a job of the salt-minion daemon) with what its config
    files say (``files``: ``salt.config.minion_config``).  A setting that
    differs was changed on disk after the minion started, and the minion
    keeps using the old value until it restarts.

    Compared: the settings in :data:`salt_multimaster.minion_config.SETTINGS`
    (those the formula's drop-in manages), and the master list:
    a failover minion's whole list (``master_list``, in order unless
    random_master shuffled it); a
    multi-master minion's job only knows the master it came from
    (``__opts__["master"]`` is that one master), so that master is checked to
    be in the files' list (a master removed from the files is found, a master
    added is not); a single-master minion's master exactly.

    ``running`` must come from the daemon: ``salt-call`` starts with fresh
    options read from the files, so under salt-call (``caller`` set, or a
    ``__cli`` naming salt-call) or without ``__cli`` (not options of a Salt
    process) nothing is compared: run the audit through a master,
    ``salt '<id>' multimaster.audit``.

    ``restart_status``: the exit status of the last background restart
    command the multimaster states scheduled (None: unknown); a non-zero one
    is named in the finding.

    Severity ``error``: the rest of the audit reads the files, so with a
    restart pending its "no findings" describes a configuration the minion
    does not run (a master_alive_interval of 0 in memory means no failover);
    operators expect ``salt`` to exit non-zero when a host needs action.
    Right after a state run that restarts the minion in the background it is
    expected for the restart delay; audit again after the restart.
    """
    cli = str(running.get("__cli") or "")
    if not cli or running.get("caller") or "call" in cli:
        return []
    differ = []
    # what a salt-minion reads only when it starts: the settings the formula's
    # drop-in manages.  publish_port and master_port are left out: a running
    # minion takes them from its master's reply and from "host:port" entries.
    for key in SETTINGS:
        if key in running and key in files and running[key] != files[key]:
            differ.append(f"{key} (running {running[key]!r}, files {files[key]!r})")
    default_port = checks.as_int(files.get("master_port"), DEFAULT_MASTER_PORT)
    on_disk = [parse_lenient(m, default_port)[0] for m in master_entries(files.get("master"))]
    started, complete = _running_masters(running, default_port)
    if complete and running.get("random_master"):
        # a failover minion with random_master shuffled its list at start
        started, on_disk = sorted(started), sorted(on_disk)
    if (complete and started != on_disk) or (not complete and not set(started) <= set(on_disk)):
        differ.append("master (running {}, files {})".format(
            ", ".join(f"{h}:{p}" for h, p in started) or "none",
            ", ".join(f"{h}:{p}" for h, p in on_disk) or "none"))
    if not differ:
        return []
    failed = ""
    if restart_status not in (None, 0):
        failed = (" The last restart command scheduled by the multimaster states exited "
                  f"with status {restart_status}.")
    return [
        checks.finding(
            "restart_pending",
            "error",
            "The running salt-minion does not use its config files: it started before "
            "these options changed: {}.{}".format("; ".join(differ), failed),
            "Restart the salt-minion; the options in its config files take effect then.",
        )
    ]


# ---------------------------------------------------------------------------
# The whole audit
# ---------------------------------------------------------------------------
def run_audit(
    opts,
    expected_masters=None,
    expected_finger=None,
    master_versions=None,
    topology="shared",
    timeout=1.0,
    processes=None,
    resolver=None,
    connect=None,
    running=None,
    restart_status=None,
):
    """
    Run every check over the minion options ``opts`` and return the audit:
    ``{"result", "findings", "masters", "master_finger", "saltversion"}``.
    ``running``: the running minion's options, for restart_pending (see
    :func:`check_restart_pending`, with ``restart_status``); None skips
    that check.
    """
    started = time.monotonic()
    minion_version = salt.version.__version__
    masters = master_entries(opts.get("master"))
    default_port = checks.as_int(opts.get("master_port"), DEFAULT_MASTER_PORT)
    hosts = [parsed[0] for (parsed, error) in (
        parse_lenient(m, default_port) for m in masters + list(expected_masters or [])
    ) if not error]
    resolved = resolve_hosts(hosts, timeout=max(timeout, 1.0), resolver=resolver)

    key_path = trusted_key_path(opts, topology)
    key_finger = finger.file_finger(key_path, opts.get("hash_type") or "sha256")
    sign_key_present = os.path.isfile(trusted_key_path(opts, "signed"))
    if processes is None:
        processes = list_processes()

    findings = []
    findings += checks.check_master_list(masters, expected_masters, default_port, resolved)
    findings += checks.check_duplicate_master(masters, default_port, resolved)
    findings += checks.check_master_reachable(
        masters,
        publish_port=checks.as_int(opts.get("publish_port"), DEFAULT_PUBLISH_PORT),
        default_port=default_port,
        timeout=timeout,
        connect=connect,
    )
    findings += checks.check_master_pubkey(key_path, key_finger, expected_finger, topology)
    findings += checks.check_master_alive_interval(opts, masters)
    findings += checks.check_failover_settings(opts, masters, sign_key_present)
    findings += checks.check_ipc_tcp_ports(opts, masters)
    findings += checks.check_version_skew(minion_version, master_versions)
    findings += check_duplicate_minion_process(opts.get("conf_file") or "", processes)
    if running is not None:
        findings += check_restart_pending(running, opts, restart_status)
    log.debug("multimaster.audit: %d findings in %.3fs", len(findings),
              time.monotonic() - started)
    return {
        "result": not any(f["severity"] == "error" for f in findings),
        "findings": findings,
        "masters": masters,
        "master_finger": key_finger,
        "saltversion": minion_version,
    }


def master_version_map(value):
    """
    ``master_version`` as given (one version for every master, a list, or a
    ``{master: version}`` mapping) -> ``{label: version}``.
    """
    if value is None or value == "" or value == {}:
        return {}
    if isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return {f"#{i + 1}": str(v) for i, v in enumerate(value)}
    if isinstance(value, str) and "," in value:
        return {f"#{i + 1}": v.strip() for i, v in enumerate(value.split(",")) if v.strip()}
    return {"(all)": str(value)}
