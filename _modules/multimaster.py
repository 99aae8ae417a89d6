"""
Audit a minion's multi-master configuration.

The audit reads the minion's own configuration and cached master key and
changes nothing.  Expected values come from keyword arguments, else from the
pillar keys ``multimaster:masters`` and ``multimaster:master_finger``.
"""

import logging
import os

import salt.config
import salt.utils.data
from salt.exceptions import CommandExecutionError, SaltInvocationError

log = logging.getLogger(__name__)

__virtualname__ = "multimaster"

try:
    import salt_multimaster
    import salt_multimaster.audit

    HAS_CORE = True
except ImportError:
    HAS_CORE = False


def __virtual__():
    if HAS_CORE:
        return __virtualname__
    return (
        False,
        "multimaster: the salt_multimaster core is missing; pip install "
        "salt-multimaster, or run 'saltutil.sync_all' with the repository in file_roots",
    )


def version():
    """
    Return the version of salt-multimaster and where this module was loaded from.

    CLI Example:

    .. code-block:: bash

        salt '*' multimaster.version
    """
    return {"version": salt_multimaster.__version__, "module": __file__}


def _expected(kwarg_value, pillar_key, default=None):
    """A keyword argument, else the pillar value (read unmasked from __pillar__)."""
    if kwarg_value is not None and kwarg_value != "":
        return kwarg_value
    value = salt.utils.data.traverse_dict_and_list(__pillar__, pillar_key, None)
    return default if value is None else value


def _minion_opts():
    """
    The minion configuration as written in its config files.  Inside a job of
    a multi-master minion ``__opts__["master"]`` is only the master the job
    came from: the configured list is in the files.
    """
    conf_file = __opts__.get("conf_file")
    if not conf_file or not os.path.isfile(conf_file):
        log.debug("multimaster.audit: no config file %r, using the running opts", conf_file)
        return dict(__opts__)
    opts = salt.config.minion_config(conf_file, minion_id=__opts__.get("id"))
    opts["conf_file"] = conf_file
    return opts


def _audit_timeout(timeout):
    """A finite number of seconds above 0 (a minute at most), else SaltInvocationError."""
    import salt_multimaster.validate  # pylint: disable=import-outside-toplevel

    try:
        return salt_multimaster.validate.timeout("timeout", timeout, maximum=60)
    except salt_multimaster.validate.InvalidInput as exc:
        raise SaltInvocationError(f"multimaster.audit: {exc}") from None


def audit(masters=None, master_finger=None, master_version=None, topology=None, timeout=1):
    """
    Audit this minion's multi-master configuration, changing nothing.

    Returns ``{"result": bool, "findings": [...], "masters": [...],
    "master_finger": "...", "saltversion": "..."}``.  Each finding is
    ``{"check", "severity", "message", "remedy"}`` with severity ``error``,
    ``warning`` or ``info``; ``result`` is False (and ``salt`` exits non-zero)
    when any finding is an error.  ``masters`` is the configured master list
    and ``master_finger`` the fingerprint of the master key the minion trusts.

    Checks: master_list, duplicate_master, master_reachable, master_pubkey,
    master_alive_interval, failover_settings, ipc_tcp_ports, version_skew,
    duplicate_minion_process, restart_pending.

    restart_pending compares the options of the running salt-minion (this
    job's ``__opts__``) with its config files, for the settings the formula
    manages and the master list (a multi-master job only knows its own
    master: that one must still be in the files).  Through ``salt-call`` the
    options are read fresh from the files, so it is only checked in a job of
    the salt-minion daemon (``salt '<id>' multimaster.audit``).

    masters
        The expected master list (list or comma separated).  Default: pillar
        ``multimaster:masters``.

    master_finger
        The expected master key fingerprint as ``salt-key -F master`` prints it
        (with topology ``signed``: the fingerprint of master_sign.pub).
        Default: pillar ``multimaster:master_finger``, else the minion's own
        ``master_finger`` option.

    master_version
        The masters' Salt version: one version, a list, or a mapping
        ``{master: version}``; quote it on the CLI (``master_version="'3008.10'"``)
        so YAML does not read it as a number.  Default: pillar
        ``multimaster:master_version``.  Without it version_skew is not checked.

    topology
        ``shared`` (default) or ``signed``.  Default: pillar ``multimaster:topology``.

    timeout
        Seconds for each TCP connect and for name resolution.  Default: 1.

    CLI Example:

    .. code-block:: bash

        salt '*' multimaster.audit
        salt '*' multimaster.audit masters=master01,master02 master_finger='4a:7f:...'
        salt '*' multimaster.audit master_version=3008.3 topology=signed
    """
    expected_masters = salt_multimaster.audit.split_masters(
        _expected(masters, "multimaster:masters")
    )
    topology = str(_expected(topology, "multimaster:topology", "shared")).lower()
    if topology not in salt_multimaster.audit.TOPOLOGIES:
        raise SaltInvocationError(
            f"multimaster.audit: topology must be 'shared' or 'signed', not {topology!r}"
        )
    timeout = _audit_timeout(timeout)
    try:
        opts = _minion_opts()
    except Exception as exc:  # pylint: disable=broad-except
        raise CommandExecutionError(f"multimaster.audit: cannot read the minion config: {exc}")
    finger = _expected(master_finger, "multimaster:master_finger") or opts.get("master_finger")
    versions = salt_multimaster.audit.master_version_map(
        _expected(master_version, "multimaster:master_version")
    )
    ret = salt_multimaster.audit.run_audit(
        opts,
        expected_masters=expected_masters,
        expected_finger=finger,
        master_versions=versions,
        topology=topology,
        timeout=timeout,
        running=dict(__opts__),
        restart_status=_mm_restart_status(),
    )
    if not ret["result"]:
        __context__["retcode"] = 1
    return ret

# ---------------------------------------------------------------------------
# Minion configuration helpers used by the multimaster states.  Everything
# below this line belongs to the states' logic; the audit lives above it.
# ---------------------------------------------------------------------------

# The helpers below are thin: the logic (validation, deduplication,
# rendering, fingerprints) lives in salt_multimaster.minion_config.
import os as _mm_os  # pylint: disable=wrong-import-position
import time as _mm_time  # pylint: disable=wrong-import-position

import salt.utils.args as _mm_args  # pylint: disable=wrong-import-position
from salt.exceptions import (  # pylint: disable=wrong-import-position
    CommandExecutionError as _MMCommandExecutionError,
)
from salt.exceptions import (  # pylint: disable=wrong-import-position
    SaltInvocationError as _MMSaltInvocationError,
)

try:
    import salt_multimaster.minion_config  # pylint: disable=wrong-import-position

    _MM_CONF = salt_multimaster.minion_config
except ImportError:  # pragma: no cover  (reported by __virtual__)
    _MM_CONF = None

_MM_DEFAULT_RESTART_DELAY = 5


def _mm_pillar():
    """The ``multimaster`` pillar (plain values: ``__pillar__`` is not masked)."""
    data = (__pillar__ or {}).get("multimaster") or {}
    return data if isinstance(data, dict) else {}


def _mm_conf_file():
    return __opts__.get("conf_file") or "/etc/salt/minion"


def minion_config_path(name=None):
    """
    Return the path of the managed minion.d drop-in.

    name
        A file name (placed in the ``minion.d`` folder beside the minion's own
        configuration file) or an absolute path.  Default ``multimaster.conf``.

    CLI Example:

    .. code-block:: bash

        salt '*' multimaster.minion_config_path
    """
    conf_file = _mm_conf_file()
    if not name:
        return _MM_CONF.default_dropin_path(conf_file)
    if _mm_os.path.isabs(name):
        return name
    return _mm_os.path.join(_mm_os.path.dirname(conf_file), "minion.d", name)


def minion_config_check(masters=None, name=None, **settings):
    """
    Compare the managed drop-in with the wanted master list and HA settings,
    changing nothing.

    masters
        The masters (a list); default pillar ``multimaster:masters``.
        Duplicates (also ``host`` vs ``host:<master_port>``) are removed,
        the order is kept.

    name
        The drop-in, see :py:func:`minion_config_path`.

    settings
        Any of master_type, master_alive_interval, random_master,
        master_failback, master_failback_interval, retry_dns, auth_tries,
        verify_master_pubkey_sign, ipc_mode, tcp_pub_port, tcp_pull_port.

    Returns ``path``, ``errors`` (invalid input: nothing may be written),
    ``current`` and ``desired`` settings, ``changes`` (``{key: {old, new}}``),
    ``rewrite`` (the file's text differs), ``restart_needed`` and ``notes``.

    CLI Example:

    .. code-block:: bash

        salt '*' multimaster.minion_config_check masters='[m1, m2]' master_alive_interval=30
    """
    settings = _mm_args.clean_kwargs(**settings)
    if masters is None:
        masters = _mm_pillar().get("masters")
    path = minion_config_path(name)
    conf_file = _mm_conf_file()
    merged, _ = _MM_CONF.effective_config(conf_file)
    master_port = merged.get("master_port", __opts__.get("master_port", 4506))
    try:
        master_port = int(master_port)
    except (TypeError, ValueError):
        master_port = _MM_CONF.DEFAULT_MASTER_PORT
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
    text = _MM_CONF.read_text(path)
    current = _MM_CONF.parse(text)
    if current is None:
        ret["notes"].append(f"{path} is not valid YAML: it will be replaced")
        current = {}
    ret["current"] = current
    resolved = {}
    if isinstance(masters, (list, tuple)):
        hosts = []
        for entry in masters:
            try:
                hosts.append(_MM_CONF.split_master(entry, master_port)[0])
            except ValueError:
                pass
        resolved = _MM_CONF.resolve_hosts(hosts)
    ret["errors"] = _MM_CONF.validate(masters, settings, master_port, resolved)
    if ret["errors"]:
        return ret
    desired, notes = _MM_CONF.desired(masters, settings, master_port, resolved)
    ret["notes"].extend(notes)
    overridden = _MM_CONF.overriding_files(conf_file, path, list(desired))
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
    ret["desired"] = desired
    ret["content"] = _MM_CONF.render(desired)
    ret["changes"] = _MM_CONF.diff(current, desired)
    ret["rewrite"] = text != ret["content"]
    ret["restart_needed"] = bool(ret["changes"])
    for key, value in desired.items():
        if key in ("master", "tcp_pub_port", "tcp_pull_port"):
            continue
        if not ret["changes"] and __opts__.get(key) != value:
            ret["notes"].append(
                f"the running minion still uses {key}={__opts__.get(key)!r}: "
                "it loads the drop-in when it restarts"
            )
    return ret


def minion_config_apply(masters=None, name=None, **settings):
    """
    Write the managed drop-in (temp file in the same folder, fsync, rename)
    when it differs, and return :py:func:`minion_config_check`'s answer with
    ``written``.  The minion is not restarted here: see
    :py:func:`restart_minion` (the ``multimaster.minion_config`` state does
    both).

    Raises SaltInvocationError for invalid input (nothing is written).

    CLI Example:

    .. code-block:: bash

        salt '*' multimaster.minion_config_apply masters='[m1, m2]' master_alive_interval=30
    """
    ret = minion_config_check(masters=masters, name=name, **settings)
    if ret["errors"]:
        raise _MMSaltInvocationError("; ".join(ret["errors"]))
    ret["written"] = False
    if ret["rewrite"]:
        try:
            _MM_CONF.atomic_write(ret["path"], ret["content"], mode=0o644)
        except OSError as exc:
            raise _MMCommandExecutionError(f"cannot write {ret['path']}: {exc}") from exc
        ret["written"] = True
        log.info("multimaster: wrote %s", ret["path"])
        after = minion_config_check(masters=masters, name=name, **settings)
        if after["rewrite"] or after["errors"]:
            raise _MMCommandExecutionError(
                f"{ret['path']} does not hold the wanted settings after writing it"
            )
    return ret


def _mm_backup_dir():
    stamp = _mm_time.strftime("%Y%m%dT%H%M%S", _mm_time.gmtime())
    return _mm_os.path.join(
        __opts__.get("cachedir", "/var/cache/salt/minion"),
        "multimaster",
        "backup",
        f"{stamp}-{_mm_os.getpid()}",
    )


def master_key_path(name=None, topology=None):
    """
    Return the path of the master key this minion trusts: ``pki_dir``'s
    ``minion_master.pub``, or ``master_sign.pub`` in topology ``signed``.

    name
        A file name in the minion's ``pki_dir`` or an absolute path.

    topology
        ``shared`` or ``signed``; default pillar ``multimaster:topology``.

    CLI Example:

    .. code-block:: bash

        salt '*' multimaster.master_key_path topology=signed
    """
    topology = topology or _mm_pillar().get("topology") or "shared"
    if not name:
        name = _MM_CONF.master_key_name(topology, __opts__.get("master_sign_key_name"))
    if _mm_os.path.isabs(name):
        return name
    return _mm_os.path.join(__opts__["pki_dir"], name)


def master_key_check(
    name=None, contents=None, source=None, master_finger=None, topology=None, saltenv="base"
):
    """
    Compare the cached master key with the expected one, changing nothing.

    name
        See :py:func:`master_key_path`.

    contents
        The expected PEM public key (``master.pub``, or ``master_sign.pub`` in
        topology ``signed``).  Default pillar ``multimaster:master_pub``.

    source
        Where to fetch the expected key instead, e.g.
        ``salt://keys/master.pub``.  Default pillar
        ``multimaster:master_pub_source``.

    master_finger
        The expected fingerprint (``salt-key -F master``); default pillar
        ``multimaster:master_finger``.  With contents or source it must match
        them; alone it checks the cached key.

    Returns ``path``, ``errors``, ``match``, ``current_finger``,
    ``expected_finger`` and ``expected`` (the key text, when known).

    CLI Example:

    .. code-block:: bash

        salt '*' multimaster.master_key_check master_finger='ab:cd:...'
    """
    topology = topology or _mm_pillar().get("topology") or "shared"
    if master_finger is None:
        master_finger = _mm_pillar().get("master_finger")
    if contents is None and not source:
        # the formula's pillar keys: usable from a plain job, which (unlike
        # state.apply) needs no new pillar compile, i.e. no sign-in with the
        # stale key itself
        contents = _mm_pillar().get("master_pub") or None
        source = _mm_pillar().get("master_pub_source") or None
    path = master_key_path(name, topology)
    ret = {
        "path": path,
        "errors": [],
        "match": False,
        "current_finger": None,
        "expected_finger": None,
        "expected": None,
    }
    if topology not in _MM_CONF.TOPOLOGIES:
        ret["errors"].append(f"topology {topology!r} is not one of shared, signed")
        return ret
    if master_finger and not _MM_CONF.valid_finger(master_finger):
        ret["errors"].append(f"master_finger {master_finger!r} is not a key fingerprint")
        return ret
    expected = contents
    if expected is None and source:
        try:
            expected = __salt__["cp.get_file_str"](source, saltenv=saltenv)
        except Exception as exc:  # pylint: disable=broad-except
            ret["errors"].append(f"cannot fetch {source}: {exc}")
            return ret
        if not expected:
            ret["errors"].append(f"cannot fetch {source}: no such file on the master")
            return ret
    if expected is not None:
        expected = _MM_CONF.normalize_pem(expected)
        if not _MM_CONF.looks_like_public_key(expected):
            ret["errors"].append("the expected master key is not a PEM public key")
            return ret
        if master_finger and not _MM_CONF.finger_matches(expected, master_finger):
            ret["errors"].append(
                "the expected master key does not have fingerprint {}".format(master_finger)
            )
            return ret
    elif not master_finger:
        ret["errors"].append(
            "give the expected key (contents or source) or its master_finger"
        )
        return ret
    sum_type = __opts__.get("hash_type", "sha256")
    if master_finger:
        sum_type = {
            32: "md5", 40: "sha1", 56: "sha224", 64: "sha256", 96: "sha384", 128: "sha512"
        }[len(_MM_CONF.normalize_finger(master_finger))]
    current = _MM_CONF.read_text(path)
    if current:
        ret["current_finger"] = _MM_CONF.key_finger(current, sum_type)
    if expected is not None:
        ret["expected"] = expected
        ret["expected_finger"] = _MM_CONF.key_finger(expected, sum_type)
        ret["match"] = current is not None and _MM_CONF.normalize_pem(current) == expected
    else:
        ret["expected_finger"] = master_finger
        ret["match"] = bool(current) and _MM_CONF.finger_matches(current, master_finger)
    return ret


def master_key_apply(
    name=None, contents=None, source=None, master_finger=None, topology=None, saltenv="base"
):
    """
    Make the cached master key the expected one: a stale key is moved to
    ``<cachedir>/multimaster/backup/<timestamp>/`` and replaced (temp file,
    fsync, rename), so the minion authenticates with the right key the next
    time it connects.  Returns :py:func:`master_key_check`'s answer with
    ``written`` and ``backup``.

    Raises SaltInvocationError for invalid input and CommandExecutionError
    when the cached key is wrong but no expected key content was given.

    This is also the remedy for a minion whose cached key is already stale:
    Salt verifies the signature of every freshly compiled pillar with the
    cached key, so ``state.apply`` fails on such a minion ("Exception getting
    pillar") while a plain job like this one still runs on the minion's live
    session (the key from pillar ``multimaster:master_pub``, or ``source``).

    CLI Example:

    .. code-block:: bash

        salt '*' multimaster.master_key_apply
        salt '*' multimaster.master_key_apply source=salt://keys/master.pub
    """
    ret = master_key_check(
        name=name, contents=contents, source=source, master_finger=master_finger,
        topology=topology, saltenv=saltenv,
    )
    if ret["errors"]:
        raise _MMSaltInvocationError("; ".join(ret["errors"]))
    ret["written"] = False
    ret["backup"] = None
    if ret["match"]:
        return ret
    if ret["expected"] is None:
        raise _MMCommandExecutionError(
            "{} has fingerprint {}, not {}, and no key content was given to replace "
            "it".format(ret["path"], ret["current_finger"], ret["expected_finger"])
        )
    path = ret["path"]
    try:
        if _mm_os.path.lexists(path):
            backup_dir = _mm_backup_dir()
            _mm_os.makedirs(backup_dir, mode=0o700, exist_ok=True)
            backup = _mm_os.path.join(backup_dir, _mm_os.path.basename(path))
            with open(path, "rb") as src, open(backup, "wb") as dst:
                dst.write(src.read())
            ret["backup"] = backup
        _mm_os.makedirs(_mm_os.path.dirname(path), mode=0o700, exist_ok=True)
        _MM_CONF.atomic_write(path, ret["expected"], mode=0o644)
    except OSError as exc:
        raise _MMCommandExecutionError(f"cannot replace {path}: {exc}") from exc
    ret["written"] = True
    log.info("multimaster: replaced %s (backup %s)", path, ret["backup"])
    after = master_key_check(
        name=name, contents=ret["expected"], master_finger=master_finger,
        topology=topology, saltenv=saltenv,
    )
    if not after["match"]:
        raise _MMCommandExecutionError(f"{path} does not hold the expected key after writing it")
    return ret


def _mm_pid_alive(pid):
    try:
        _mm_os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _mm_service_available(service):
    """Whether this host's service manager knows ``service``; None if unknown."""
    if "service.available" not in __salt__:
        return False  # no service module loaded: no service manager here
    try:
        return bool(__salt__["service.available"](service))
    except Exception:  # pylint: disable=broad-except
        log.debug("multimaster: service.available(%s) failed", service, exc_info=True)
        return None


def _mm_restart_status_path(service="salt-minion"):
    """Where the background restart of ``service`` leaves its command's exit status."""
    return _mm_os.path.join(__opts__.get("cachedir", "/var/cache/salt/minion"), "multimaster",
                            f"restart-{service}.status")


def _mm_restart_status():
    """The exit status of the last background salt-minion restart command, or None."""
    try:
        with open(_mm_restart_status_path(), encoding="utf-8") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def restart_minion(cmd=None, delay=None, service="salt-minion", test=False):
    """
    Restart this minion in the background once the current job has returned,
    the way salt-formula does it (a ``bg`` command running
    ``salt-call --local service.restart salt-minion``).  The one restart
    helper of salt-multimaster: ``service=salt-master`` restarts the master
    of this host the same way (salt.multimaster.master).

    The command waits until the job's process has exited (its return is sent
    by then), then ``delay`` more seconds, then runs ``cmd``.  While a restart
    is pending a second call schedules nothing.

    A restart that cannot happen here is an error (CommandExecutionError),
    never scheduled: a program of ``cmd`` that is not installed, or, for the
    default command, no service manager that knows ``service``.

    cmd
        The command to run; default pillar ``multimaster:minion_restart_cmd``
        (salt-minion only), else ``salt-call --local service.restart <service>``.

    delay
        Seconds to wait after the job exited; default pillar
        ``multimaster:minion_restart_delay``, else 5.

    service
        ``salt-minion`` (default) or ``salt-master``: what restarts.

    test
        Only tell whether the restart can happen: returns
        ``{"scheduled": False, "possible": bool, "reason": str|None, "cmd": str}``.

    Returns ``{"scheduled": bool, "pid": int, "cmd": str}``.

    CLI Example:

    .. code-block:: bash

        salt '*' multimaster.restart_minion
        salt '*' multimaster.restart_minion test=True
        salt master01 multimaster.restart_minion service=salt-master
    """
    import salt_multimaster.restart  # pylint: disable=import-outside-toplevel
    import salt_multimaster.validate  # pylint: disable=import-outside-toplevel

    if service not in ("salt-minion", "salt-master"):
        raise _MMSaltInvocationError(
            f"service must be salt-minion or salt-master, not {service!r}")
    pillar = _mm_pillar()
    if service == "salt-minion":
        cmd = cmd or pillar.get("minion_restart_cmd")
    cmd = cmd or salt_multimaster.restart.default_cmd(service)
    if not isinstance(cmd, str) or not cmd.strip():
        raise _MMSaltInvocationError(f"cmd must be a non-empty command string, not {cmd!r}")
    if delay is None:
        delay = pillar.get("minion_restart_delay", _MM_DEFAULT_RESTART_DELAY)

    try:
        delay = salt_multimaster.validate.delay("delay", delay)
    except salt_multimaster.validate.InvalidInput as exc:
        raise _MMSaltInvocationError(str(exc)) from None
    available = None
    if cmd.strip() == salt_multimaster.restart.default_cmd(service):
        available = _mm_service_available(service)
    reason = salt_multimaster.restart.impossible(cmd, service, service_available=available)
    if salt.utils.data.is_true(test):
        return {"scheduled": False, "possible": reason is None, "reason": reason, "cmd": cmd}
    if reason:
        log.error("multimaster: the %s cannot restart: %s", service, reason)
        raise _MMCommandExecutionError(reason)
    state_dir = _mm_os.path.join(__opts__.get("cachedir", "/var/cache/salt/minion"), "multimaster")
    _mm_os.makedirs(state_dir, mode=0o700, exist_ok=True)
    pending = _mm_os.path.join(
        state_dir, "restart.pending" if service == "salt-minion" else f"restart-{service}.pending")
    try:
        with open(pending, encoding="utf-8") as fh:
            pending_pid = int(fh.read().strip() or 0)
    except (OSError, ValueError):
        pending_pid = 0
    if pending_pid and _mm_pid_alive(pending_pid):
        return {"scheduled": False, "pid": pending_pid, "cmd": cmd}
    # In a job process (multiprocessing), wait for it to exit: its return has
    # been sent then.  Without multiprocessing the job is a thread of the
    # minion itself: only the delay applies.
    wait_pid = _mm_os.getpid() if __opts__.get("multiprocessing", True) else 0
    script = (
        "p={pid}; i=0; "
        'while [ "$p" -gt 0 ] && [ $i -lt 2400 ] && [ -d /proc/$p ] && '
        "! grep -q ') Z' /proc/$p/stat 2>/dev/null; do sleep 0.25; i=$((i+1)); done; "
        "sleep {delay}; rm -f {pending}; ({cmd}); "
        # the outcome, for the audit's restart_pending (a restart that worked
        # usually ends this script before it gets here)
        "echo $? > {last}.tmp && mv -f {last}.tmp {last}"
    ).format(pid=wait_pid, delay=delay, pending=_mm_quote(pending), cmd=cmd,
             last=_mm_quote(_mm_restart_status_path(service)))
    try:
        _mm_os.unlink(_mm_restart_status_path(service))
    except OSError:
        pass
    ret = __salt__["cmd.run_bg"](script, python_shell=True, cwd="/")
    pid = int(ret.get("pid") or 0)
    try:
        _MM_CONF.atomic_write(pending, f"{pid}\n", mode=0o600)
    except OSError:
        log.warning("multimaster: cannot record the pending restart in %s", pending)
    log.info("multimaster: %s restart scheduled (pid %s): %s", service, pid, cmd)
    return {"scheduled": True, "pid": pid, "cmd": cmd}


def _mm_quote(text):
    import shlex  # pylint: disable=import-outside-toplevel

    return shlex.quote(text)


def pull_config(master_config=None):
    """
    The ``peer_run`` option that lets each peer of a primary master pull the
    bulk of a sync (``multimaster.pull``) point-to-point: one entry per peer
    listed in the primary's ``multimaster:peers``, matching that id only.
    ``salt.multimaster.master`` writes it into the primary's master.d.

    master_config
        The primary's master config file (default: the minion option
        ``multimaster.master_config``, else /etc/salt/master).

    CLI Example:

    .. code-block:: bash

        salt master01 multimaster.pull_config
    """
    # pylint: disable=import-outside-toplevel
    from salt_multimaster import protocol

    path = master_config or __opts__.get("multimaster.master_config") or "/etc/salt/master"
    if not os.path.isfile(path):
        raise CommandExecutionError(f"no salt-master configuration at {path}")
    conf = salt.config.master_config(path).get("multimaster") or {}
    if not isinstance(conf, dict):
        raise CommandExecutionError(f"{path}: the multimaster option must be a mapping")
    peers = conf.get("peers") or []
    if isinstance(peers, str):
        peers = [p.strip() for p in peers.split(",") if p.strip()]
    if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
        raise CommandExecutionError(f"{path}: multimaster:peers must be a list of minion ids")
    return protocol.peer_run_config(peers)
