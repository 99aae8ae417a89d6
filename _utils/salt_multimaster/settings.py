"""
The runner's settings: the primary's ``multimaster`` master config,
overridden by the keyword arguments of a call (:func:`conf`), and the
checks of a call's input, bad input as Salt's ``SaltInvocationError`` and
answered as the runner answers it (:func:`invalid`: ``result: False``, the
error, a ``retcode``).  The checks themselves are :mod:`salt_multimaster.validate`'s.

Plain Python: the runner passes its ``__opts__`` and ``__context__``.
"""

import logging
import math
import os

from salt.exceptions import SaltInvocationError

from salt_multimaster import backup, layout, protocol, replicate, transport, validate
from salt_multimaster import sync as sync_core

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 120

#: the options a call's keyword arguments override (the runner's sync and
#: status take them, and ``rescan``, as keyword arguments: its ``_CONF_KWARGS``)
OVERRIDES = ("peers", "topology", "replicate", "master_config_keys", "timeout", "inline_limit",
             "pull_min_files", "backup_keep")


def conf(opts, kwargs):
    """The primary's ``multimaster`` config, overridden by runner kwargs."""
    conf = valid(validate.conf_mapping, opts.get("multimaster"))
    configured = as_list(conf.get("peers"), "multimaster:peers")
    for key in OVERRIDES:
        if kwargs.get(key) is not None:
            conf[key] = kwargs[key]
    conf.setdefault("topology", "shared")
    conf.setdefault("replicate", list(replicate.CATEGORIES))
    conf.setdefault("master_config_keys", list(replicate.DEFAULT_CONFIG_KEYS))
    conf.setdefault("timeout", DEFAULT_TIMEOUT)
    conf.setdefault("inline_limit", transport.INLINE_LIMIT)
    conf.setdefault("pull_min_files", transport.PULL_MIN_FILES)
    conf.setdefault("backup_keep", backup.DEFAULT_KEEP)
    conf.setdefault("verify_interval", sync_core.VERIFY_INTERVAL)
    conf["timeout"] = timeout(conf["timeout"])
    conf["backup_keep"] = valid(validate.keep, "backup_keep", conf["backup_keep"])
    for key in ("inline_limit", "pull_min_files", "verify_interval"):
        try:
            conf[key] = int(conf[key])
        except (TypeError, ValueError):
            raise SaltInvocationError(f"{key} must be an integer, not {conf[key]!r}") from None
    if conf["verify_interval"] < 0:
        raise SaltInvocationError("multimaster:verify_interval must be seconds >= 0 (0: never), "
                                  f"not {conf['verify_interval']!r}")
    for key in ("peers", "replicate", "master_config_keys"):
        conf[key] = as_list(conf.get(key), key)
    # only configured peers receive secrets; only shared policy options travel
    valid(validate.peers, conf["peers"], configured)
    valid(validate.config_keys, conf["master_config_keys"])
    conf["rescan"] = flag("rescan", kwargs.get("rescan"))
    # every peer configured: what this primary's epoch claim names (epoch.claim)
    conf["configured_peers"] = configured
    return conf


def valid(check, *args):
    """Run a ``salt_multimaster.validate`` check; bad input as SaltInvocationError."""
    try:
        return check(*args)
    except validate.InvalidInput as exc:
        raise SaltInvocationError(str(exc)) from None


def timeout(value):
    """A timeout in whole seconds; bad input as SaltInvocationError."""
    return int(math.ceil(valid(validate.timeout, "timeout", value)))


def checked_args(minion_ids=None, only=None):
    """``only`` and ``minion_ids`` not empty when given (the keywords: ``guard.public``)."""
    if only is not None and not as_list(only, "only"):
        raise validate.InvalidInput(
            f"only is empty ({only!r}): name the categories to sync, or leave only out")
    if minion_ids is not None and not as_list(minion_ids, "minion_ids"):
        raise validate.InvalidInput(
            f"minion_ids is empty ({minion_ids!r}): name the minions whose keys to sync, "
            "or leave minion_ids out for a full sync")


def as_list(value, name):
    """``value`` as a list (:func:`validate.as_list`); bad input as SaltInvocationError."""
    return valid(validate.as_list, name, value)


def flag(name, value):
    """``value`` as a bool (:func:`validate.boolean`); bad input as SaltInvocationError."""
    return valid(validate.boolean, name, value)


def invalid(context, message):
    """The runner's answer to bad input or a failed call: logged, a non-zero exit (``context``)."""
    log.error("multimaster: %s", message)
    context["retcode"] = 1
    return {"result": False, "error": message, "retcode": 1}


def check(opts, conf, only):
    """Return an error message for bad input, or None."""
    if conf["topology"] not in layout.TOPOLOGIES:
        return f"unknown topology {conf['topology']!r} (known: {', '.join(layout.TOPOLOGIES)})"
    for cat in only + conf["replicate"]:
        if cat not in replicate.CATEGORIES:
            return f"unknown category {cat!r} (known: {', '.join(replicate.CATEGORIES)})"
    if not conf["peers"]:
        dropin = protocol.dropin_path(opts) if opts.get("conf_file") else None
        if dropin and os.path.isfile(dropin):
            return (f"this master is a peer: it holds {dropin}, written by a primary's "
                    "multimaster.sync; run salt-run multimaster.sync on the primary")
        return "no peers: set multimaster:peers in the master config or pass peers=..."
    return None
