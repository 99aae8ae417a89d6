"""
Minion-side multi-master configuration: the managed drop-in (validation,
rendering, the files Salt reads, :func:`check` and :func:`apply`) and the
trusted master key (its path per topology, the PEM check, :func:`key_check`
and :func:`key_apply` with a backup).  Master entries are parsed and
deduplicated by :mod:`salt_multimaster.masters`, fingerprints made by
:mod:`salt_multimaster.finger`.

Plain functions without Salt's loader, used by the ``multimaster`` execution
module and states (``multimaster.minion_config``, ``multimaster.master_key``)
and by the audit, and unit-tested without daemons.

The managed drop-in is a small YAML file in the minion's ``minion.d`` folder.
Salt reads ``minion.d/*.conf`` after the main ``minion`` file and a drop-in
value replaces the main file's value of the same key, so the drop-in alone
decides the master list and the HA settings.
"""

import fnmatch
import glob
import os
import re

import salt.utils.yaml

from salt_multimaster import finger, fsutil, statefile
from salt_multimaster.layout import TOPOLOGIES, state_dir
from salt_multimaster.masters import (DEFAULT_MASTER_PORT, as_int, dedup, parse_lenient,
                                      resolve_hosts)
from salt_multimaster.masters import parse as parse_master
from salt_multimaster.validate import InvalidInput

DROPIN_NAME = "multimaster.conf"
#: The master key a minion trusts (topology shared) in its pki_dir.
TRUSTED_KEY_NAME = "minion_master.pub"
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


class WriteError(RuntimeError):
    """A file that cannot be written, or does not hold what was written."""


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
    errors, unique = [], []
    if masters is None:
        errors.append("no masters given (argument masters or pillar multimaster:masters)")
    elif not isinstance(masters, (list, tuple)):
        errors.append(
            f"masters must be a list of master addresses, not {type(masters).__name__} "
            f"({masters!r})"
        )
    elif not masters:
        errors.append("masters is empty: list at least one master")
    else:
        for entry in masters:
            try:
                parse_master(entry, default_port)
            except ValueError as exc:
                errors.append(str(exc))
        if not errors:
            unique, _ = dedup(masters, default_port, resolved)
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
    unique, duplicates = dedup(masters, default_port, resolved)
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


def diff(old, new):
    """``{key: {"old": ..., "new": ...}}`` for every key whose value differs."""
    changes = {}
    for key in dict.fromkeys([*new, *old]):
        if old.get(key) != new.get(key):
            changes[key] = {"old": old.get(key), "new": new.get(key)}
    return changes


# ---------------------------------------------------------------------------
# Reading the minion's configuration files
# ---------------------------------------------------------------------------
def dropin_path(conf_file, name=None):
    """
    The managed drop-in: ``name`` (default ``multimaster.conf``) in the
    ``minion.d`` folder beside ``conf_file``, or ``name`` when absolute.
    """
    return os.path.join(os.path.dirname(conf_file), "minion.d", name or DROPIN_NAME)


def read_text(path):
    """
    A file's text (bytes that are not UTF-8 replaced), or None when it does
    not exist; ``""`` when something else stands there (a directory: what
    writes the file moves it aside, :func:`_write`).
    """
    try:
        data = statefile.read_bytes(path)
    except statefile.Damaged as exc:
        statefile.notice(path, exc.why, "read as empty, replaced when written")
        return ""
    return None if data is None else data.decode("utf-8", errors="replace")


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
        pattern = os.path.join(conf_dir, os.path.expanduser(pattern))
        found = set(glob.glob(pattern))
        if extra and fnmatch.fnmatch(extra, pattern):
            found.add(extra)
        for path in sorted(found):
            if (os.path.isfile(path) or path == extra) and path not in files:
                files.append(path)
    return files


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
    for path in files[files.index(dropin) + 1:]:
        data = _load_yaml_file(path)
        for key in keys:
            if key in data:
                ret[key] = path
    return ret


# ---------------------------------------------------------------------------
# The drop-in: check and apply
# ---------------------------------------------------------------------------
def check(conf_file, masters, settings, name=None, running=None):
    """
    Compare the drop-in ``name`` (:func:`dropin_path`) of the minion whose
    main config file is ``conf_file`` with the wanted ``masters`` and HA
    ``settings``, changing nothing.  ``running``: the running minion's
    options (its ``master_port`` when the files set none, and the notes on
    settings it has not loaded yet).

    Returns ``path``, ``errors`` (invalid input: nothing may be written),
    ``current`` and ``desired`` settings, ``changes`` (``{key: {old, new}}``),
    ``rewrite`` (the file's text differs), ``restart_needed``, ``notes`` and,
    without errors, ``content`` (the text to write).
    """
    running = running or {}
    path = dropin_path(conf_file, name)
    merged = {}  # the files' options merged as Salt merges them: a later file wins
    for file in config_files(conf_file):
        merged.update(_load_yaml_file(file))
    master_port = as_int(merged.get("master_port", running.get("master_port")),
                         DEFAULT_MASTER_PORT)
    ret = {
        "path": path,
        "errors": [],
        "current": {},
        "desired": None,
        "changes": {},
        "rewrite": False,
        "restart_needed": False,
        "notes": [],
    }
    text = read_text(path)
    current = parse(text)
    if current is None:
        ret["notes"].append(f"{path} is not valid YAML: it will be replaced")
        current = {}
    ret["current"] = current
    resolved = {}
    if isinstance(masters, (list, tuple)):
        parsed = (parse_lenient(entry, master_port) for entry in masters)
        resolved = resolve_hosts([key[0] for key, error in parsed if not error])
    ret["errors"] = validate(masters, settings, master_port, resolved)
    if ret["errors"]:
        return ret
    wanted, notes = desired(masters, settings, master_port, resolved)
    ret["notes"].extend(notes)
    overridden = overriding_files(conf_file, path, list(wanted))
    if "*" in overridden:
        ret["errors"].append(overridden["*"])
        return ret
    if overridden:
        ret["errors"].append(
            "Salt reads these files after {} and they set the same keys again: {}; "
            "remove the keys there".format(
                path, ", ".join(f"{k} ({p})" for k, p in sorted(overridden.items()))
            )
        )
        return ret
    kept = {key: value for key, value in current.items() if key not in MANAGED_KEYS}
    if kept:
        # Options the operator put in this file (e.g. a peer host's
        # multimaster.master_config) are never lost: they stay, after ours.
        wanted = {**wanted, **kept}
        ret["notes"].append(f"kept options this file holds but the state does not manage: "
                            f"{', '.join(sorted(map(str, kept)))}")
    ret["desired"] = wanted
    ret["content"] = render(wanted)
    ret["changes"] = diff(current, wanted)
    ret["rewrite"] = text != ret["content"]
    ret["restart_needed"] = bool(ret["changes"])
    for key, value in wanted.items():
        if key in ("master", "tcp_pub_port", "tcp_pull_port"):
            continue
        if not ret["changes"] and running.get(key) != value:
            ret["notes"].append(
                f"the running minion still uses {key}={running.get(key)!r}: "
                "it loads the drop-in when it restarts"
            )
    return ret


def apply(conf_file, masters, settings, name=None, running=None):
    """
    Write the drop-in (temp file in the same folder, fsync, rename) when it
    differs from :func:`check`'s ``content``; return :func:`check`'s answer
    with ``written``.  Raises InvalidInput for invalid input (nothing is
    written) and WriteError when the file cannot be written or does not hold
    the wanted settings afterwards.
    """
    ret = check(conf_file, masters, settings, name=name, running=running)
    if ret["errors"]:
        raise InvalidInput("; ".join(ret["errors"]))
    ret["written"] = False
    if ret["rewrite"]:
        _write(ret["path"], ret["content"], 0o644)
        ret["written"] = True
        after = check(conf_file, masters, settings, name=name, running=running)
        if after["rewrite"] or after["errors"]:
            raise WriteError(f"{ret['path']} does not hold the wanted settings after writing it")
    return ret


def _write(path, text, mode):
    """Temp file in the same folder, fsync, rename; OSError -> WriteError."""
    try:
        fsutil.makedirs(os.path.dirname(path) or ".")
        statefile.write(path, text, mode=mode)
    except OSError as exc:
        raise WriteError(f"cannot write {path}: {exc}") from exc


# ---------------------------------------------------------------------------
# The trusted master key
# ---------------------------------------------------------------------------
def trusted_key_name(topology, sign_key_name=None):
    """
    The key file a minion trusts: ``<master_sign_key_name>.pub`` (topology
    signed, default master_sign.pub) or ``minion_master.pub``.
    """
    if topology == "signed":
        return f"{sign_key_name or 'master_sign'}.pub"
    return TRUSTED_KEY_NAME


def trusted_key_path(opts, topology="shared", name=None):
    """
    Where the minion with options ``opts`` keeps the master key it trusts:
    ``name`` (default :func:`trusted_key_name`) in its ``pki_dir``, or
    ``name`` when absolute.
    """
    name = name or trusted_key_name(topology, opts.get("master_sign_key_name"))
    return os.path.join(opts.get("pki_dir") or "", name)


def looks_like_public_key(text):
    """True for a PEM public key (``-----BEGIN ... PUBLIC KEY-----``)."""
    text = text.strip()
    return bool(
        re.match(r"^-----BEGIN (RSA )?PUBLIC KEY-----\n", text + "\n")
        and re.search(r"\n-----END (RSA )?PUBLIC KEY-----$", text)
    )


def key_check(path, topology="shared", contents=None, source=None, master_finger=None,
              fetch=None, hash_type="sha256"):
    """
    Compare the trusted master key at ``path`` with the expected one,
    changing nothing.  The expected key is ``contents`` (PEM), else
    ``fetch(source)``'s answer; ``master_finger`` alone checks the key at
    ``path`` by its fingerprint (either of Salt's forms, :mod:`finger`).

    Returns ``path``, ``errors``, ``match``, ``current_finger``,
    ``expected_finger`` and ``expected`` (the key text, when known).  The
    fingerprints are in the installed Salt's ``salt-key -F master`` form,
    with the hash of ``master_finger`` when given, else ``hash_type``.
    """
    ret = {
        "path": path,
        "errors": [],
        "match": False,
        "current_finger": None,
        "expected_finger": None,
        "expected": None,
    }
    if topology not in TOPOLOGIES:
        ret["errors"].append(f"topology {topology!r} is not one of {', '.join(TOPOLOGIES)}")
        return ret
    if master_finger and not finger.valid(master_finger):
        ret["errors"].append(f"master_finger {master_finger!r} is not a key fingerprint")
        return ret
    expected = contents
    if expected is None and source:
        try:
            expected = fetch(source)
        except Exception as exc:  # pylint: disable=broad-except
            ret["errors"].append(f"cannot fetch {source}: {exc}")
            return ret
        if not expected:
            ret["errors"].append(f"cannot fetch {source}: no such file on the master")
            return ret
    if expected is not None:
        expected = finger.normalize_pem(expected)
        if not looks_like_public_key(expected):
            ret["errors"].append("the expected master key is not a PEM public key")
            return ret
        if master_finger and not finger.matches(expected, master_finger):
            ret["errors"].append(
                f"the expected master key does not have fingerprint {master_finger}")
            return ret
    elif not master_finger:
        ret["errors"].append("give the expected key (contents or source) or its master_finger")
        return ret
    sum_type = finger.sum_type(master_finger) if master_finger else hash_type or "sha256"
    current = read_text(path)
    if current:
        ret["current_finger"] = finger.master_finger(current, sum_type)
    if expected is not None:
        ret["expected"] = expected
        ret["expected_finger"] = finger.master_finger(expected, sum_type)
        ret["match"] = current is not None and finger.normalize_pem(current) == expected
    else:
        ret["expected_finger"] = master_finger
        ret["match"] = bool(current) and finger.matches(current, master_finger)
    return ret


def key_apply(opts, path, topology="shared", contents=None, source=None, master_finger=None,
              fetch=None):
    """
    Make the key at ``path`` the expected one (:func:`key_check`): a stale key
    is copied to a new ``<cachedir>/multimaster/backup/<UTC timestamp>``
    folder first, then replaced (temp file, fsync, rename).  Returns
    :func:`key_check`'s answer with ``written`` and ``backup``.  Raises
    InvalidInput for invalid input and WriteError when the key is wrong but
    no expected key content was given, or cannot be written.
    """
    hash_type = opts.get("hash_type", "sha256")
    ret = key_check(path, topology, contents, source, master_finger, fetch, hash_type)
    if ret["errors"]:
        raise InvalidInput("; ".join(ret["errors"]))
    ret["written"] = False
    ret["backup"] = None
    if ret["match"]:
        return ret
    if ret["expected"] is None:
        raise WriteError(
            "{} has fingerprint {}, not {}, and no key content was given to replace "
            "it".format(path, ret["current_finger"], ret["expected_finger"])
        )
    try:
        backup = os.path.join(state_dir(opts), "backup", statefile.stamp())
        ret["backup"] = fsutil.backup(path, backup, os.path.basename(path))
        fsutil.makedirs(os.path.dirname(path), mode=0o700)
    except OSError as exc:
        raise WriteError(f"cannot replace {path}: {exc}") from exc
    _write(path, ret["expected"], 0o644)
    ret["written"] = True
    after = key_check(path, topology, ret["expected"], None, master_finger, None, hash_type)
    if not after["match"]:
        raise WriteError(f"{path} does not hold the expected key after writing it")
    return ret
