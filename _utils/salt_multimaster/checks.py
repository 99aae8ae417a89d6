"""
The per-setting checks of a minion's multi-master configuration, behind
``salt '*' multimaster.audit`` (:func:`salt_multimaster.audit.run_audit`
runs them): the master list, duplicate masters, the masters' ports, the
trusted master key, master_alive_interval, the failover settings, the
ipc_mode tcp ports and the version skew to the masters.

Every check is a plain function over a minion configuration dictionary (the
options ``salt.config.minion_config`` returns) and a few observed facts, and
returns a list of findings (:func:`finding`)::

    {"check": "<id>", "severity": "error|warning|info",
     "message": "...", "remedy": "..."}

Nothing here changes the system.  A check that needs an observation (the
resolved addresses, a TCP connect, the trusted key's fingerprint) takes it
as an argument or accepts a replacement callable, so the checks are
testable without daemons.
"""

import concurrent.futures
import socket

import salt.version

from salt_multimaster import finger
from salt_multimaster.masters import (
    DEFAULT_MASTER_PORT,
    DEFAULT_PUBLISH_PORT,
    as_int,
    group,
    parse_lenient,
    same,
)
from salt_multimaster.minion_config import trusted_key_name

SEVERITIES = ("error", "warning", "info")


def finding(check, severity, message, remedy):
    """Build one finding."""
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
        finger.matches(finger.read_key(path), expected_finger)
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


def check_master_alive_interval(opts, masters):
    """
    master_alive_interval: unset or 0 with several masters is a warning: the
    first command after a master comes back may be lost.
    """
    if len(masters) < 2 and opts.get("master_type") != "failover":
        return []
    if as_int(opts.get("master_alive_interval")) > 0:
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


def check_ipc_tcp_ports(opts, masters):
    """
    ipc_tcp_ports: with ipc_mode tcp, per-master tcp_pub_port/tcp_pull_port
    lists must have one port per master and never repeat a port, and every
    supported Salt (3006 to 3008) reads one port for each option: a list
    keeps salt-minion from starting.
    """
    if opts.get("ipc_mode") != "tcp":
        return []
    ret = []
    seen = {}
    for key in ("tcp_pub_port", "tcp_pull_port"):
        value = opts.get(key)
        ports = list(value) if isinstance(value, (list, tuple)) else [value]
        ports = [p for p in ports if p is not None]
        if isinstance(value, (list, tuple)):
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
            seen.setdefault(as_int(port, port), []).append(key)
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
