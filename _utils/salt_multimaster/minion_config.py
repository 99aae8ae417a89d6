"""
Minion-side multi-master configuration: validation, deduplication, rendering
and the trusted master key.

Plain functions without Salt's loader, used by the ``multimaster`` execution
module and states (``multimaster.minion_config``, ``multimaster.master_key``)
and unit-tested without daemons.

The managed drop-in is a small YAML file in the minion's ``minion.d`` folder.
Salt reads ``minion.d/*.conf`` after the main ``minion`` file and a drop-in
value replaces the main file's value of the same key, so the drop-in alone
decides the master list and the HA settings.
"""

import ipaddress
import os
import re

import salt.utils.yaml

from salt_multimaster import finger as _fingers
from salt_multimaster import fsutil
from salt_multimaster.layout import TOPOLOGIES  # noqa: F401  (re-exported)
# one resolver and one fingerprint form for the audit and the states
from salt_multimaster.audit import normalize_finger, resolve_hosts  # noqa: F401

DEFAULT_MASTER_PORT = 4506
DROPIN_NAME = "multimaster.conf"
MASTER_KEY_NAME = "minion_master.pub"
MASTER_SIGN_KEY_NAME = "master_sign.pub"
HEADER = (
    "# Managed by Salt (multimaster.minion_config): local changes are replaced.\n"
    "# Master list and high-availability settings of this multi-master minion.\n"
)

MASTER_TYPES = ("str", "failover", "func", "disable")
IPC_MODES = ("ipc", "tcp")

# Settings this drop-in manages, with their kind.  The order is the order in
# which they are written after ``master``.
SETTINGS = {
    "master_type": "master_type",
    "master_alive_interval": "nonneg_int",
    "random_master": "bool",
    "master_failback": "bool",
    "master_failback_interval": "nonneg_int",
    "retry_dns": "nonneg_number",
    "auth_tries": "pos_int",
    "acceptance_wait_time": "nonneg_number",
    "acceptance_wait_time_max": "nonneg_number",
    "verify_master_pubkey_sign": "bool",
    "ipc_mode": "ipc_mode",
    "tcp_pub_port": "ports",
    "tcp_pull_port": "ports",
}
MANAGED_KEYS = ("master",) + tuple(SETTINGS)

_HASHES_BY_LEN = {32: "md5", 40: "sha1", 56: "sha224", 64: "sha256", 96: "sha384", 128: "sha512"}


# ---------------------------------------------------------------------------
# Master list
# ---------------------------------------------------------------------------
def split_master(entry, default_port=DEFAULT_MASTER_PORT):
    """
    Return ``(host, port)`` for a ``master`` entry (``host``, ``host:port``,
    ``[v6]:port``, ``v6``).  The host is lower-cased (DNS names are case
    insensitive) and IP addresses are normalised; the port defaults to
    ``default_port`` (the minion's ``master_port``).

    Raises ValueError for an entry Salt could not use.
    """
    if not isinstance(entry, str) or not entry.strip():
        raise ValueError(f"master entry {entry!r} is not a non-empty string")
    text = entry.strip()
    host, port = text, None
    if text.startswith("["):
        match = re.match(r"^\[([^\]]+)\](?::(\d+))?$", text)
        if not match:
            raise ValueError(f"master entry {entry!r} is not a valid [ipv6]:port")
        host, port = match.group(1), match.group(2)
    elif text.count(":") == 1:
        host, port = text.split(":")
        if not port.isdigit():
            raise ValueError(f"master entry {entry!r} has a non-numeric port")
    if not host:
        raise ValueError(f"master entry {entry!r} has no host")
    try:
        host = ipaddress.ip_address(host).compressed
    except ValueError:
        host = host.lower().rstrip(".")
    port = int(port) if port is not None else int(default_port)
    if not 0 < port < 65536:
        raise ValueError(f"master entry {entry!r} has an invalid port {port}")
    return host, port


def dedup_masters(masters, default_port=DEFAULT_MASTER_PORT, resolved=None):
    """
    Remove duplicate masters, keeping the first spelling and the order.

    ``host``, ``HOST`` and ``host:<master_port>`` are the same master, and so
    are two names sharing an address in ``resolved`` (``{host: addresses}``,
    see :func:`resolve_hosts`) with the same port: Salt would open two
    connections to it and every job would return twice.  Return
    ``(unique, duplicates)``: the entries to keep and the entries dropped.
    """
    resolved = resolved or {}
    kept = []
    unique, duplicates = [], []
    for entry in masters:
        host, port = split_master(entry, default_port)
        addrs = resolved.get(host) or set()
        if any(
            port == kport and (host == khost or addrs & kaddrs)
            for khost, kport, kaddrs in kept
        ):
            duplicates.append(entry)
            continue
        kept.append((host, port, addrs))
        unique.append(entry.strip())
    return unique, duplicates


# ---------------------------------------------------------------------------
# Validation and rendering
# ---------------------------------------------------------------------------
def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _check_port(key, value, errors):
    if not _is_int(value) or not 0 < value < 65536:
        errors.append(f"{key}: {value!r} is not a TCP port (1-65535)")
        return False
    return True


def validate(masters, settings, default_port=DEFAULT_MASTER_PORT, resolved=None):
    """
    Return a list of error messages (empty when valid) for a master list and
    HA settings.  Nothing is normalised here: see :func:`desired`.
    """
    errors = []
    if masters is None:
        errors.append("no masters given (argument masters or pillar multimaster:masters)")
        unique = []
    elif not isinstance(masters, (list, tuple)):
        errors.append(
            f"masters must be a list of master addresses, not {type(masters).__name__} "
            f"({masters!r})"
        )
        unique = []
    elif not masters:
        errors.append("masters is empty: list at least one master")
        unique = []
    else:
        unique = []
        for entry in masters:
            try:
                split_master(entry, default_port)
            except ValueError as exc:
                errors.append(str(exc))
        if not errors:
            unique, _ = dedup_masters(masters, default_port, resolved)
    if not isinstance(settings, dict):
        errors.append(f"settings must be a mapping, not {type(settings).__name__}")
        return errors
    for key, value in settings.items():
        kind = SETTINGS.get(key)
        if kind is None:
            errors.append(
                f"{key}: not a setting this state manages (known: {', '.join(SETTINGS)})"
            )
        elif kind == "bool":
            if not isinstance(value, bool):
                errors.append(f"{key}: {value!r} is not a boolean (True or False)")
        elif kind == "nonneg_int":
            if not _is_int(value) or value < 0:
                errors.append(f"{key}: {value!r} is not a non-negative integer (seconds)")
        elif kind == "pos_int":
            if not _is_int(value) or value < 1:
                errors.append(f"{key}: {value!r} is not a positive integer")
        elif kind == "nonneg_number":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                errors.append(f"{key}: {value!r} is not a non-negative number (seconds)")
        elif kind == "master_type":
            if value not in MASTER_TYPES:
                errors.append(f"{key}: {value!r} is not one of {', '.join(MASTER_TYPES)}")
        elif kind == "ipc_mode":
            if value not in IPC_MODES:
                errors.append(f"{key}: {value!r} is not one of {', '.join(IPC_MODES)}")
        elif kind == "ports":
            if isinstance(value, (list, tuple)):
                if unique and len(value) != len(unique):
                    errors.append(
                        f"{key}: {len(value)} ports listed for {len(unique)} masters "
                        f"({', '.join(unique)}): list one port per master"
                    )
                if not all(_check_port(key, port, errors) for port in value):
                    continue
                if len(set(value)) != len(value):
                    errors.append(f"{key}: ports {list(value)} are not unique")
            else:
                _check_port(key, value, errors)
    pub, pull = settings.get("tcp_pub_port"), settings.get("tcp_pull_port")
    if isinstance(pub, (list, tuple)) and isinstance(pull, (list, tuple)):
        both = set(pub) & set(pull)
        if both:
            errors.append(
                f"tcp_pub_port and tcp_pull_port share ports {sorted(both)}: "
                "every port must be distinct"
            )
    elif _is_int(pub) and pub == pull:
        errors.append(f"tcp_pub_port and tcp_pull_port are both {pub}")
    if settings.get("master_type") == "failover" and unique and len(unique) < 2:
        errors.append("master_type failover needs at least two masters")
    if settings.get("master_failback") and settings.get("master_type", "failover") != "failover":
        errors.append("master_failback only works with master_type failover")
    return errors


def desired(masters, settings, default_port=DEFAULT_MASTER_PORT, resolved=None):
    """
    Return ``(config, notes)``: the drop-in's content as an ordered dict
    (``master`` first, then the settings in :data:`SETTINGS` order) and notes
    for the state's comment.  Call :func:`validate` first.

    ``tcp_pub_port``/``tcp_pull_port`` given as per-master lists (the layout of
    Salt's multi-master tutorial) are validated as lists, and written as the
    list's first port: since Salt 3006 one minion process binds one IPC
    publisher for all its masters and reads both options as integers, so a
    list would keep the minion from starting in ``ipc_mode: tcp``.
    """
    unique, duplicates = dedup_masters(masters, default_port, resolved)
    notes = []
    if duplicates:
        notes.append(f"removed duplicate masters: {', '.join(duplicates)}")
    config = {"master": unique}
    for key in SETTINGS:
        if key not in settings:
            continue
        value = settings[key]
        if SETTINGS[key] == "ports" and isinstance(value, (list, tuple)):
            notes.append(
                f"{key}: one IPC publisher serves all masters in this Salt version: "
                f"writing {value[0]} (first of {list(value)})"
            )
            value = value[0]
        config[key] = value
    return config, notes


def render(config):
    """The drop-in's text for ``config`` (deterministic)."""
    body = salt.utils.yaml.safe_dump(dict(config), default_flow_style=False, sort_keys=False)
    return HEADER + body


def parse(text):
    """Parse a drop-in's text into a dict (``{}`` for empty, None if invalid)."""
    if text is None:
        return {}
    try:
        data = salt.utils.yaml.safe_load(text)
    except Exception:  # pylint: disable=broad-except
        return None
    if data is None:
        return {}
    return data if isinstance(data, dict) else None


def diff(old, new, keys=None):
    """``{key: {"old": ..., "new": ...}}`` for every key whose value differs."""
    old = old or {}
    new = new or {}
    keys = keys or list(dict.fromkeys([*new, *old]))
    changes = {}
    for key in keys:
        if old.get(key) != new.get(key):
            changes[key] = {"old": old.get(key), "new": new.get(key)}
    return changes


# ---------------------------------------------------------------------------
# Reading the minion's configuration files
# ---------------------------------------------------------------------------
def default_dropin_path(conf_file):
    """``<dir of conf_file>/minion.d/multimaster.conf``."""
    return os.path.join(os.path.dirname(conf_file), "minion.d", DROPIN_NAME)


def read_text(path):
    """A file's text, or None when it does not exist."""
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def _load_yaml_file(path):
    data = parse(read_text(path))
    return data if isinstance(data, dict) else {}


def config_files(conf_file, extra=None):
    """
    The minion's configuration files in the order Salt reads them: the main
    file, then ``default_include`` (``minion.d/*.conf``, sorted), then
    ``include`` entries.  Only existing files are returned, plus ``extra``
    (a file about to be written) where Salt would read it.
    """
    import fnmatch  # pylint: disable=import-outside-toplevel
    import glob  # pylint: disable=import-outside-toplevel

    files = [conf_file] if os.path.isfile(conf_file) else []
    main = _load_yaml_file(conf_file)
    conf_dir = os.path.dirname(conf_file)
    patterns = [main.get("default_include", "minion.d/*.conf")]
    include = main.get("include", [])
    patterns.extend(include if isinstance(include, list) else [include])
    extra = os.path.abspath(extra) if extra else None
    for pattern in patterns:
        if not isinstance(pattern, str):
            continue
        pattern = os.path.expanduser(pattern)
        if not os.path.isabs(pattern):
            pattern = os.path.join(conf_dir, pattern)
        found = set(glob.glob(pattern))
        if extra and fnmatch.fnmatch(extra, pattern):
            found.add(extra)
        for path in sorted(found):
            if (os.path.isfile(path) or path == extra) and path not in files:
                files.append(path)
    return files


def effective_config(conf_file):
    """
    The top-level keys of the minion's configuration files merged the way
    Salt merges them (later files replace earlier keys), and
    ``{key: path}``: which file set each managed key last.
    """
    merged, origin = {}, {}
    for path in config_files(conf_file):
        data = _load_yaml_file(path)
        merged.update(data)
        for key in MANAGED_KEYS:
            if key in data:
                origin[key] = path
    return merged, origin


def overriding_files(conf_file, dropin, keys):
    """
    ``{key: path}`` for managed ``keys`` that a file Salt reads after
    ``dropin`` sets again (a later file would win); ``{"*": "..."}`` when
    the minion would not read ``dropin`` at all.
    """
    dropin = os.path.abspath(dropin)
    files = config_files(conf_file, extra=dropin)
    if dropin not in files:
        return {"*": f"{dropin} is not read by the minion (not in its includes)"}
    ret = {}
    for path in files[files.index(dropin) + 1 :]:
        data = _load_yaml_file(path)
        for key in keys:
            if key in data:
                ret[key] = path
    return ret


def atomic_write(path, text, mode=0o644):
    """Write ``text`` to ``path``: temp file in the same folder, fsync, rename."""
    fsutil.makedirs(os.path.dirname(path) or ".")
    fsutil.atomic_write(path, text, mode=mode)


def key_finger(text, sum_type="sha256"):
    """
    The master fingerprint of a PEM public key's text, as the installed Salt's
    ``salt-key -F master`` prints it (``finger.master_finger``).
    """
    return _fingers.master_finger(text, sum_type)


def finger_matches(text, finger):
    """
    True when the PEM ``text`` has fingerprint ``finger`` in either of Salt's
    forms (``finger.matches``); the hash is chosen by the fingerprint's length
    (md5, sha1, sha224, sha256, sha384, sha512).
    """
    return _fingers.matches(text, finger)


def valid_finger(finger):
    """True when ``finger`` is a fingerprint of a hash Salt can produce."""
    return _fingers.valid(finger)


def normalize_pem(text):
    """A PEM public key's text with normalised line ends and one final newline."""
    if text is None:
        return None
    lines = [line.strip() for line in str(text).replace("\r\n", "\n").split("\n")]
    return "\n".join(line for line in lines if line) + "\n"


def looks_like_public_key(text):
    """True for a PEM public key (``-----BEGIN ... PUBLIC KEY-----``)."""
    if not text:
        return False
    text = text.strip()
    return bool(
        re.match(r"^-----BEGIN (RSA )?PUBLIC KEY-----\n", text + "\n")
        and re.search(r"\n-----END (RSA )?PUBLIC KEY-----$", text)
    )


def master_key_name(topology, sign_key_name=None):
    """
    The key file a minion trusts: ``<master_sign_key_name>.pub`` (topology
    signed, default master_sign.pub) or ``minion_master.pub``.
    """
    if topology == "signed":
        return f"{sign_key_name or 'master_sign'}.pub"
    return MASTER_KEY_NAME
