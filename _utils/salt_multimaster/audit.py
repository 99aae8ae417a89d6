"""
Checks behind ``salt '*' multimaster.audit``.

Every check is a plain function over a minion configuration dictionary (the
options ``salt.config.minion_config`` returns) and a few observed facts, and
returns a list of findings::

    {"check": "<id>", "severity": "error|warning|info",
     "message": "...", "remedy": "..."}

Nothing here changes the system.  Functions that observe the system (name
resolution, TCP connects, the process table, the cached master key) take the
observation as an argument or accept a replacement callable, so the checks
are testable without daemons.
"""

import concurrent.futures
import logging
import os
import re
import socket
import time

import salt.config
import salt.version

from salt_multimaster import finger
from salt_multimaster.layout import TOPOLOGIES
from salt_multimaster.masters import (
    DEFAULT_MASTER_PORT,
    DEFAULT_PUBLISH_PORT,
    entries as master_entries,
    group,
    parse_lenient,
    resolve_hosts,
    same,
)
from salt_multimaster.minion_config import SETTINGS, trusted_key_name, trusted_key_path

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
SEVERITIES = ("error", "warning", "info")
DEFAULT_CONF_DIR = "/etc/salt"


def finding(check, severity, message, remedy):
    """Build one finding."""
    if severity not in SEVERITIES:
        raise ValueError(f"unknown severity {severity!r}")
    return {"check": check, "severity": severity, "message": message, "remedy": remedy}


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------
def _invalid_entries(names, default_port, where, remedy):
    """One master_list error per entry :func:`masters.parse` refuses."""
    ret = []
    for name in names:
        error = parse_lenient(name, default_port)[1]
        if error:
            ret.append(finding(
                "master_list", "error",
                f"Master entry {name!r} in {where} cannot be used: {error}.", remedy))
    return ret


def check_master_list(masters, expected, default_port=DEFAULT_MASTER_PORT, resolved=None):
    """
    master_list: the configured masters against the expected list.  Entries
    are compared as Salt connects to them: host (or any of its addresses) and
    request port.  An entry the ``multimaster.minion_config`` state would
    refuse (same parser: :func:`masters.parse`) is an error naming it.
    """
    resolved = resolved or {}
    if not masters:
        return [
            finding(
                "master_list",
                "error",
                "No master is configured.",
                "Set 'master' in the minion configuration to the list of masters.",
            )
        ]
    ret = _invalid_entries(
        masters, default_port, "'master'",
        "Fix or remove the entry in 'master' in the minion configuration (a host, "
        "host:port with a port from 1 to 65535, or [ipv6]:port) and restart salt-minion; "
        "the salt.multimaster.minion state refuses to write it too.")
    if expected is None:
        return ret + [
            finding(
                "master_list",
                "info",
                "No expected master list given: configured masters not compared.",
                "Set pillar 'multimaster:masters' (or pass masters=...) to the list "
                "every minion must use.",
            )
        ]
    ret += _invalid_entries(
        expected, default_port, "the expected list",
        "Fix the entry in pillar 'multimaster:masters' (or masters=...).")
    conf = [(m, parse_lenient(m, default_port)[0]) for m in masters]
    want = [(m, parse_lenient(m, default_port)[0]) for m in expected]
    missing = [
        name for name, parsed in want
        if not any(same(parsed, c, resolved) for _, c in conf)
    ]
    unexpected = [
        name for name, parsed in conf
        if not any(same(parsed, w, resolved) for _, w in want)
    ]
    if missing:
        ret.append(
            finding(
                "master_list",
                "error",
                "Expected master(s) missing from the minion configuration: "
                + ", ".join(missing),
                "Add {} to 'master' in the minion configuration (or apply the "
                "salt.multimaster.minion state) and restart salt-minion.".format(
                    ", ".join(missing)
                ),
            )
        )
    if unexpected:
        ret.append(
            finding(
                "master_list",
                "error",
                "Configured master(s) not in the expected list: " + ", ".join(unexpected),
                "Remove {} from 'master' in the minion configuration, or add it to "
                "pillar 'multimaster:masters' if it is a real master; then restart "
                "salt-minion.".format(", ".join(unexpected)),
            )
        )
    return ret


def check_duplicate_master(masters, default_port=DEFAULT_MASTER_PORT, resolved=None):
    """
    duplicate_master: one master listed twice, also under different spellings
    (name and address, with and without the default port).  The minion then
    holds two connections to that master and every job returns twice.
    """
    resolved = resolved or {}
    parsed = [(m, parse_lenient(m, default_port)[0]) for m in masters]
    ret = []
    for grp in group(parsed, resolved):
        if len(grp) < 2:
            continue
        names = [name for name, _ in grp]
        host, port = grp[0][1]
        ret.append(
            finding(
                "duplicate_master",
                "error",
                "The same master is configured {} times: {} (all reach {}:{}); "
                "every job from it returns {} times.".format(
                    len(names), ", ".join(repr(n) for n in names),
                    sorted(resolved.get(host) or {host})[0], port, len(names),
                ),
                "Keep one entry for this master in 'master' (remove {}) and restart "
                "salt-minion.".format(", ".join(repr(n) for n in names[1:])),
            )
        )
    return ret


def tcp_connect(host, port, timeout):
    """Return None when a TCP connection to host:port succeeds, else the reason."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return exc.strerror or str(exc) or exc.__class__.__name__


def check_master_reachable(masters, publish_port=DEFAULT_PUBLISH_PORT,
                           default_port=DEFAULT_MASTER_PORT, timeout=1.0,
                           connect=None):
    """
    master_reachable: a TCP connect to each master's publish and request port
    (in parallel, ``timeout`` seconds each); one finding per unreachable master.
    """
    connect = connect or tcp_connect
    targets, seen = [], set()
    for name in masters:
        (host, ret_port), error = parse_lenient(name, default_port)
        if error or (host, ret_port) in seen:  # a bad entry: a master_list finding
            continue
        seen.add((host, ret_port))
        targets.append((name, host, [("publish", int(publish_port)), ("request", ret_port)]))
    jobs = [(name, host, kind, port) for name, host, ports in targets for kind, port in ports]
    if not jobs:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(jobs))) as pool:
        results = list(pool.map(lambda j: connect(j[1], j[3], timeout), jobs))
    failures = {}
    for (name, host, kind, port), error in zip(jobs, results):
        if error is not None:
            failures.setdefault(name, []).append(f"{kind} port {port} ({error})")
    ret = []
    for name, problems in failures.items():
        ret.append(
            finding(
                "master_reachable",
                "error",
                "Master {} is not reachable: {}.".format(name, "; ".join(problems)),
                "Start salt-master on {} or open TCP ports {} from this minion "
                "(firewall, interface, publish_port/ret_port); remove the entry if "
                "the master is retired.".format(
                    name, "/".join(p.split(" ")[2] for p in problems)
                ),
            )
        )
    return ret


def check_master_pubkey(path, actual_finger, expected_finger, topology="shared"):
    """
    master_pubkey: the master key this minion trusts vs the expected
    fingerprint (``salt-key -F master``; with topology signed the fingerprint
    of master_sign.pub).
    """
    what = "master signing key" if topology == "signed" else "cached master key"
    if not actual_finger:
        if topology == "signed":
            remedy = (
                "Copy the masters' shared master_sign.pub to {} (or apply the "
                "salt.multimaster.minion state, multimaster.master_key) and restart "
                "salt-minion.".format(path)
            )
        else:
            remedy = (
                "Start salt-minion so it authenticates and caches the master key at {} "
                "(or apply the salt.multimaster.minion state), then run the audit "
                "again.".format(path)
            )
        return [finding("master_pubkey", "error", f"No {what}: {path} is missing.", remedy)]
    if not expected_finger:
        return [
            finding(
                "master_pubkey",
                "info",
                "The {} {} has fingerprint {}; no expected fingerprint given.".format(
                    what, path, actual_finger
                ),
                "Set pillar 'multimaster:master_finger' to the output of "
                "'salt-key -F master' on the primary.",
            )
        ]
    if finger.normalize(actual_finger) != finger.normalize(expected_finger) and not (
        finger.file_matches(path, expected_finger)
    ):
        if topology == "signed":
            remedy = (
                "Replace {} with the masters' master_sign.pub (fingerprint {}) and "
                "restart salt-minion (or apply the salt.multimaster.minion state, "
                "multimaster.master_key).".format(path, expected_finger)
            )
        else:
            remedy = (
                "The minion trusts a stale or foreign master key: remove {} and restart "
                "salt-minion so it caches the masters' key (or apply the "
                "salt.multimaster.minion state, multimaster.master_key); check that "
                "every master serves the same master.pub (salt-key -F master on "
                "each).".format(path)
            )
        return [
            finding(
                "master_pubkey",
                "error",
                "The {} {} has fingerprint {}, expected {}.".format(
                    what, path, actual_finger, expected_finger
                ),
                remedy,
            )
        ]
    return []


def _as_int(value, default=0):
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def check_master_alive_interval(opts, masters):
    """
    master_alive_interval: unset or 0 with several masters is a warning: the
    first command after a master comes back may be lost.
    """
    if len(masters) < 2 and opts.get("master_type") != "failover":
        return []
    if _as_int(opts.get("master_alive_interval")) > 0:
        return []
    return [
        finding(
            "master_alive_interval",
            "warning",
            "master_alive_interval is {} with {} masters: the minion does not notice "
            "a master going away, and the first command after it comes back may be "
            "lost.".format(opts.get("master_alive_interval") or "unset", len(masters)),
            "Set master_alive_interval (e.g. 30) in the minion configuration and "
            "restart salt-minion.",
        )
    ]


def check_failover_settings(opts, masters, sign_key_present):
    """
    failover_settings: master_type failover without signed master keys
    (verify_master_pubkey_sign and master_sign.pub), and the reverse.
    """
    ret = []
    failover = opts.get("master_type") == "failover"
    verify = bool(opts.get("verify_master_pubkey_sign"))
    sign_name = trusted_key_name("signed", opts.get("master_sign_key_name"))
    if failover and len(masters) < 2:
        ret.append(
            finding(
                "failover_settings",
                "warning",
                "master_type is failover but only {} master is configured.".format(
                    len(masters)
                ),
                "List every master in 'master' or drop master_type: failover.",
            )
        )
    if failover and not verify:
        ret.append(
            finding(
                "failover_settings",
                "warning",
                "master_type is failover but verify_master_pubkey_sign is off: the "
                "minion cannot tell a legitimate failover master from an impostor.",
                "Use the signed topology: set verify_master_pubkey_sign: True and place "
                "the masters' {} in the minion pki_dir, or keep one shared master key "
                "on every master.".format(sign_name),
            )
        )
    if verify and not sign_key_present:
        ret.append(
            finding(
                "failover_settings",
                "error",
                "verify_master_pubkey_sign is on but {} is missing from the minion "
                "pki_dir: authentication with a signed master fails.".format(sign_name),
                "Copy the masters' {} into the minion pki_dir (or apply the "
                "salt.multimaster.minion state with topology signed).".format(sign_name),
            )
        )
    if verify and not failover and len(masters) > 1:
        ret.append(
            finding(
                "failover_settings",
                "warning",
                "verify_master_pubkey_sign is on but master_type is {}: the signed "
                "multi-master PKI is meant for master_type failover.".format(
                    opts.get("master_type") or "str"
                ),
                "Set master_type: failover (with master_alive_interval), or drop "
                "verify_master_pubkey_sign when all masters share one key.",
            )
        )
    return ret


def ports_list_supported(key):
    """
    Whether the running Salt accepts a list for ``key``: Salt 3008 types
    tcp_pub_port/tcp_pull_port as one int and cannot start with a list.
    """
    valid = salt.config.VALID_OPTS.get(key)
    types = valid if isinstance(valid, tuple) else (valid,)
    return any(t in (list, tuple) for t in types if isinstance(t, type))


def check_ipc_tcp_ports(opts, masters, list_supported=None):
    """
    ipc_tcp_ports: with ipc_mode tcp, per-master tcp_pub_port/tcp_pull_port
    lists must have one port per master and never repeat a port.
    ``list_supported(key)`` tells whether this Salt takes a list for ``key``.
    """
    if opts.get("ipc_mode") != "tcp":
        return []
    list_supported = list_supported or ports_list_supported
    ret = []
    seen = {}
    for key in ("tcp_pub_port", "tcp_pull_port"):
        value = opts.get(key)
        ports = list(value) if isinstance(value, (list, tuple)) else [value]
        ports = [p for p in ports if p is not None]
        if isinstance(value, (list, tuple)) and not list_supported(key):
            ret.append(
                finding(
                    "ipc_tcp_ports",
                    "error",
                    "ipc_mode is tcp and {} is a list, but this Salt reads one port "
                    "for it: salt-minion fails to start with this configuration.".format(key),
                    "Set {} to a single port (this Salt binds one event publisher "
                    "for all masters), or upgrade/downgrade to a Salt that takes a "
                    "list per master.".format(key),
                )
            )
        if isinstance(value, (list, tuple)) and len(ports) != len(masters):
            ret.append(
                finding(
                    "ipc_tcp_ports",
                    "error",
                    "ipc_mode is tcp and {} lists {} port(s) for {} master(s).".format(
                        key, len(ports), len(masters)
                    ),
                    "Give {} exactly one port per master, in the order of "
                    "'master'.".format(key),
                )
            )
        for port in ports:
            seen.setdefault(_as_int(port, port), []).append(key)
    repeated = {port: keys for port, keys in seen.items() if len(keys) > 1}
    if repeated:
        ret.append(
            finding(
                "ipc_tcp_ports",
                "error",
                "ipc_mode is tcp and port(s) {} are used more than once in "
                "tcp_pub_port/tcp_pull_port.".format(
                    ", ".join(str(p) for p in sorted(repeated, key=str))
                ),
                "Give every minion connection its own tcp_pub_port and tcp_pull_port; "
                "no port may repeat.",
            )
        )
    return ret


def release(version):
    """
    The feature release of a Salt version: ``(3008,)`` for 3008.3,
    ``(2018, 3)`` for 2018.3.2 (date-based versions), plus the full info tuple.
    """
    parsed = salt.version.SaltStackVersion.parse(str(version))
    rel = (parsed.major,) if parsed.major >= 3000 else (parsed.major, parsed.minor or 0)
    return rel, parsed


def check_version_skew(minion_version, master_versions):
    """
    version_skew: a minion newer than a master is an error (Salt does not
    support it); a minion older by a feature release or more is a warning.

    ``master_versions`` is ``{label: version}``.
    """
    if not master_versions:
        return [
            finding(
                "version_skew",
                "info",
                "Master versions unknown: version skew not checked.",
                "Pass master_version=... or set pillar 'multimaster:master_version'; "
                "'salt-run multimaster.audit' always passes it.",
            )
        ]
    ret = []
    minion_rel, minion_parsed = release(minion_version)
    for label, master_version in master_versions.items():
        try:
            master_rel, master_parsed = release(master_version)
        except Exception:  # pylint: disable=broad-except
            ret.append(
                finding(
                    "version_skew",
                    "warning",
                    f"Cannot parse the version {master_version!r} of master {label}.",
                    "Give master versions as Salt prints them (salt --version).",
                )
            )
            continue
        if minion_parsed > master_parsed:
            ret.append(
                finding(
                    "version_skew",
                    "error",
                    "This minion runs Salt {}, newer than master {} (Salt {}): "
                    "unsupported.".format(minion_version, label, master_version),
                    "Upgrade the masters first (to {} or later), or pin salt-minion to "
                    "{}.".format(minion_version, master_version),
                )
            )
        elif minion_rel < master_rel:
            ret.append(
                finding(
                    "version_skew",
                    "warning",
                    "This minion runs Salt {}, a feature release or more behind master "
                    "{} (Salt {}): targeting and modules may silently differ.".format(
                        minion_version, label, master_version
                    ),
                    f"Upgrade salt-minion to {master_version}.",
                )
            )
    return ret


# ----- processes --------------------------------------------------------------
_MINION_SCRIPT = re.compile(r"(^|[-_])salt[-_]minion(\.py)?$")


def _root_id(path):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def list_processes(proc="/proc"):
    """
    ``[(pid, ppid, argv, cwd)]`` for every process readable under /proc that
    shares this process's root directory (a minion in a container seen from
    the host is another minion, not a duplicate).
    """
    ret = []
    try:
        pids = [int(p) for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return ret
    own_root = _root_id(os.path.join(proc, "self", "root")) or _root_id("/")
    for pid in pids:
        root = _root_id(os.path.join(proc, str(pid), "root"))
        if root is not None and own_root is not None and root != own_root:
            continue
        try:
            with open(os.path.join(proc, str(pid), "cmdline"), "rb") as fh:
                raw = fh.read()
            if not raw:
                continue
            with open(os.path.join(proc, str(pid), "stat"), "rb") as fh:
                stat = fh.read().decode("utf-8", "replace")
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        argv = [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]
        try:
            cwd = os.readlink(os.path.join(proc, str(pid), "cwd"))
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
        finding(
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
# What a salt-minion reads only when it starts: the settings the formula's
# drop-in manages (minion_config.SETTINGS).  publish_port and master_port are
# left out: a running minion takes them from its master's reply and from
# "host:port" master entries.
RESTART_COMPARED = tuple(SETTINGS)


def _running_masters(running, default_port):
    """
    ``(entries, complete)``: the masters the running minion was started with,
    as ``(host, port)``.  A failover minion keeps its whole list
    (``master_list``); a multi-master (``str``) minion runs one connection per
    master and a job sees only the master it came from: that one entry,
    ``complete`` False.
    """
    for key in ("master_list", "local_masters"):
        value = running.get(key)
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

    Compared: the settings in :data:`RESTART_COMPARED`, and the master list:
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
    for key in RESTART_COMPARED:
        if key in running and key in files and running[key] != files[key]:
            differ.append(f"{key} (running {running[key]!r}, files {files[key]!r})")
    default_port = _as_int(files.get("master_port"), DEFAULT_MASTER_PORT)
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
        finding(
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
    minion_version=None,
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
    if topology not in TOPOLOGIES:
        raise ValueError(
            "topology must be one of {}, not {!r}".format(", ".join(TOPOLOGIES), topology)
        )
    minion_version = minion_version or salt.version.__version__
    masters = master_entries(opts.get("master"))
    default_port = _as_int(opts.get("master_port"), DEFAULT_MASTER_PORT)
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
    findings += check_master_list(masters, expected_masters, default_port, resolved)
    findings += check_duplicate_master(masters, default_port, resolved)
    findings += check_master_reachable(
        masters,
        publish_port=_as_int(opts.get("publish_port"), DEFAULT_PUBLISH_PORT),
        default_port=default_port,
        timeout=timeout,
        connect=connect,
    )
    findings += check_master_pubkey(key_path, key_finger, expected_finger, topology)
    findings += check_master_alive_interval(opts, masters)
    findings += check_failover_settings(opts, masters, sign_key_present)
    findings += check_ipc_tcp_ports(opts, masters)
    findings += check_version_skew(minion_version, master_versions)
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
