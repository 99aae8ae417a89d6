"""
Strict checks of user and wire input: booleans, timeouts, delays, keyword
arguments, the ``multimaster:`` config, peers, replicated master options,
the operations a peer applies and the ids of key events.

Every check raises :class:`InvalidInput` (a ``ValueError``) with a message
naming the input, or returns the normalized value.  Plain Python: no Salt
dunders, nothing touches disk.
"""

import difflib
import math
import re

from salt_multimaster import manifest, replicate

# A timeout longer than a day is a typo (e.g. milliseconds), not a wish.
MAX_TIMEOUT = 24 * 3600
MAX_DELAY = 3600

TRUE = ("true", "yes", "1", "on")
FALSE = ("false", "no", "0", "off")

# Master options that are cluster-wide policy: the same on every master of
# the cluster, and holding no path, address or identity of one host.
SHARED_CONFIG_KEYS = (
    "nodegroups",
    "external_auth",
    "publisher_acl",
    "publisher_acl_blacklist",
    "peer",
    "peer_run",
    "client_acl_verify",
    "sudo_acl",
    "token_expire",
    "token_expire_user_override",
    "keep_acl_in_token",
    "eauth_acl_module",
    "file_ignore_regex",
    "file_ignore_glob",
    "top_file_merging_strategy",
    "env_order",
    "default_top",
    "state_top",
    "pillar_source_merging_strategy",
    "pillar_merge_lists",
)

# Shell/target glob characters, whitespace and control characters: never in
# a minion id a key event may queue (a queued "*" means every key).
_EVENT_ID_BAD = re.compile(r"[\s\x00-\x1f\x7f*?\[\]!,]")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class InvalidInput(ValueError):
    """Bad input; the message names it."""


def as_list(name, value):
    """
    ``value`` as a list of strings: None gives ``[]``, a string is split at
    its commas (blanks dropped), a list, tuple or set gives its items, a
    number one item.  Anything else (a mapping, a bool) is an error naming
    ``name``.
    """
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, (list, tuple, set, frozenset)):
        return [str(v) for v in value]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [str(value)]
    raise InvalidInput(f"{name} must be a list or a comma separated string, not {value!r}")


def boolean(name, value, default=False):
    """
    ``value`` as a bool: a bool, 0/1, or true/false/yes/no/on/off/1/0 in any
    case; None gives ``default``.  Anything else is an error naming ``name``.
    """
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in TRUE:
            return True
        if text in FALSE:
            return False
    raise InvalidInput(f"{name} must be a boolean (True/False, yes/no, 1/0), not {value!r}")


def _number(name, value):
    if isinstance(value, bool):
        raise InvalidInput(f"{name} must be a number of seconds, not {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise InvalidInput(f"{name} must be a number of seconds, not {value!r}") from None
    if not math.isfinite(number):
        raise InvalidInput(f"{name} must be a finite number of seconds, not {value!r}")
    return number


def timeout(name, value, maximum=MAX_TIMEOUT):
    """A timeout in seconds: a finite number above 0 and at most ``maximum``."""
    number = _number(name, value)
    if number <= 0:
        raise InvalidInput(f"{name} must be more than 0 seconds, not {value!r}")
    if number > maximum:
        raise InvalidInput(f"{name} must be at most {maximum} seconds, not {value!r}")
    return number


def delay(name, value, maximum=MAX_DELAY):
    """A delay in whole seconds: 0 to ``maximum``."""
    number = _number(name, value)
    if number < 0 or number > maximum or number != int(number):
        raise InvalidInput(f"{name} must be a whole number of seconds from 0 to {maximum}, "
                           f"not {value!r}")
    return int(number)


def keep(name, value):
    """How many backups to keep: a whole number of at least 1."""
    if isinstance(value, bool) or not str(value).isdigit() or int(value) < 1:
        raise InvalidInput(f"{name} must be a whole number of at least 1, not {value!r}")
    return int(value)


def known_kwargs(kwargs, allowed):
    """
    Refuse keyword arguments a function does not know (a misspelt
    ``tset=True`` must not run a real sync), naming every accepted one
    (``allowed``) and the closest match of each unknown one::

        unknown argument peer: did you mean peers? (accepted: force, only, peers, ...)

    Keys starting with ``__`` are Salt's own (``__pub_user``, ``__pub_jid``,
    ``__kwarg__``...) and pass.
    """
    unknown = sorted(str(k) for k in kwargs if not str(k).startswith("__") and k not in allowed)
    if not unknown:
        return
    names = sorted(set(allowed))
    guesses = {k: difflib.get_close_matches(k, names, n=1) for k in unknown}
    if len(unknown) == 1:
        (key,) = unknown
        what = f"unknown argument {key}" + (f": did you mean {guesses[key][0]}?"
                                            if guesses[key] else "")
    else:
        what = "unknown arguments " + ", ".join(
            k + (f" (did you mean {guesses[k][0]}?)" if guesses[k] else "") for k in unknown)
    raise InvalidInput(f"{what} (accepted: {', '.join(names) or 'none'})")


def conf_mapping(value, name="multimaster"):
    """The ``multimaster:`` master config: a mapping (absent: empty)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(
            f"the master config option {name} must be a mapping (peers:, topology:, ...), "
            f"not a {type(value).__name__}: {value!r}"
        )
    return dict(value)


def peers(requested, configured):
    """Every peer named must be one of ``multimaster:peers``: only those receive secrets."""
    configured = set(configured or ())
    unknown = [p for p in requested if p not in configured]
    if unknown:
        raise InvalidInput(
            f"peer(s) {', '.join(map(repr, unknown))} not in multimaster:peers of the master "
            f"config (configured: {', '.join(sorted(configured)) or 'none'}); only configured "
            "peers are synced"
        )
    return list(requested)


def config_keys(keys):
    """Master options that may be replicated: cluster-wide policy only."""
    refused = [k for k in keys if k not in SHARED_CONFIG_KEYS]
    if refused:
        raise InvalidInput(
            f"master_config_keys: {', '.join(map(repr, refused))} not replicable: only "
            f"cluster-wide policy options are ({', '.join(SHARED_CONFIG_KEYS)}); host-specific "
            "options such as id, interface, pki_dir, cachedir or multimaster stay on each host"
        )
    return list(keys)


def categories(value, name="categories"):
    """A list of known categories (a string is refused: it would be read letter by letter)."""
    if not isinstance(value, (list, tuple)):
        raise InvalidInput(f"{name} must be a list of categories, not {value!r}")
    for cat in value:
        if cat not in replicate.CATEGORIES:
            raise InvalidInput(
                f"{name}: unknown category {cat!r} (known: {', '.join(replicate.CATEGORIES)})")
    return list(value)


def event_minion_id(minion_id):
    """Whether a key event's minion id may be queued for a sync."""
    return manifest.valid_minion_id(minion_id) and not _EVENT_ID_BAD.search(minion_id)


# ----- operations a peer applies ---------------------------------------------


def _need(where, op, field, kind, check=None):
    if field not in op:
        raise InvalidInput(f"{where}: missing field {field!r}")
    value = op[field]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        article = "an" if names[0] in "aeiou" else "a"
        raise InvalidInput(f"{where}: field {field!r} must be {article} {names}, not {value!r}")
    if check is not None and not check(value):
        raise InvalidInput(f"{where}: invalid {field} {value!r}")
    return value


def _sha(value):
    return bool(_SHA256.match(value))


def _rel(value):
    parts = value.split("/")
    return (bool(value) and not value.startswith("/") and "\x00" not in value
            and not any(p in ("", ".", "..") for p in parts))


def _content(where, op):
    if "data" in op and not isinstance(op["data"], str):
        raise InvalidInput(f"{where}: field 'data' must be a str")
    if "pull" in op and (not isinstance(op["pull"], int) or isinstance(op["pull"], bool)
                         or op["pull"] < 0):
        raise InvalidInput(f"{where}: field 'pull' must be a chunk index")


def _op(cat, index, op):
    where = f"ops[{cat!r}][{index}]"
    if not isinstance(op, dict):
        raise InvalidInput(f"{where} must be a mapping, not {op!r}")
    kind = _need(where, op, "op", str, lambda v: v in (replicate.WRITE, replicate.REMOVE))
    if cat == "minion_keys":
        _need(where, op, "state", str, lambda v: v in manifest.KEY_DIRS)
        _need(where, op, "id", str, manifest.valid_minion_id)
        if kind == replicate.WRITE:
            _need(where, op, "sha256", str, _sha)
            _content(where, op)
    elif cat in ("file_roots", "pillar_roots"):
        _need(where, op, "env", str, bool)
        _need(where, op, "rel", str, _rel)
        if kind == replicate.WRITE:
            _need(where, op, "sha256", str, _sha)
            _need(where, op, "mode", int, lambda v: 0 <= v <= 0o7777)
            if "size" in op:
                _need(where, op, "size", int, lambda v: v >= 0)
            _content(where, op)
    elif cat == "master_keys":
        if kind != replicate.WRITE:
            raise InvalidInput(f"{where}: master keys are only written")
        pem = _need(where, op, "kind", str, lambda v: v in ("pem", "pub")) == "pem"
        _need(where, op, "name", str, bool)
        _need(where, op, "sha256", str, _sha)
        if pem:
            _need(where, op, "sealed", (str, bytes))
        else:
            _need(where, op, "data", str)
    elif cat == "master_config":
        if kind != replicate.WRITE:
            raise InvalidInput(f"{where}: master_config is only written")
        values = _need(where, op, "values", dict)
        config_keys(list(values))


def ops(value):
    """
    The operations of a sync, as ``multimaster_peer.apply`` receives them:
    ``{category: [op, ...]}`` with the fields each category needs.  Returns
    them, or raises naming the first bad one; nothing is applied when any is
    bad.
    """
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f"ops must be a mapping of category to operations, not {value!r}")
    for cat, cat_ops in value.items():
        if cat not in replicate.CATEGORIES:
            raise InvalidInput(
                f"ops: unknown category {cat!r} (known: {', '.join(replicate.CATEGORIES)})")
        if not isinstance(cat_ops, list):
            raise InvalidInput(f"ops[{cat!r}] must be a list of operations, not {cat_ops!r}")
        for index, op in enumerate(cat_ops):
            _op(cat, index, op)
    return value
