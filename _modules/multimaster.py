"""
A minion's multi-master configuration: audit it, make it consistent, make it
trust the expected master key, restart it in the background.

The audit reads the minion's own configuration and cached master key and
changes nothing.  Expected values come from keyword arguments, else from the
pillar keys ``multimaster:masters`` and ``multimaster:master_finger``.  The
``minion_config_*``, ``master_key_*`` and ``restart_minion`` functions are
what the ``multimaster`` states call.  The logic lives in the
``salt_multimaster`` core (``audit``, ``masters``, ``minion_config``,
``finger``, ``restart``); this module only reads Salt's dunders.
"""

import glob
import logging
import os

import salt.config
import salt.utils.args
import salt.utils.data
import salt.utils.files
import salt.utils.yaml
from salt.exceptions import CommandExecutionError, SaltInvocationError

log = logging.getLogger(__name__)

__virtualname__ = "multimaster"

try:
    import salt_multimaster
    from salt_multimaster import audit as audit_core
    from salt_multimaster import masters as master_entries
    from salt_multimaster import minion_config as conf_core
    from salt_multimaster import guard, journal, protocol, restart, validate
    from salt_multimaster.layout import TOPOLOGIES

    HAS_CORE = True
except ImportError:
    HAS_CORE = False


# what minion_config_check/_apply take as **settings
_SETTINGS = tuple(conf_core.SETTINGS) if HAS_CORE else ()


def _answer(fun, message, args, kwargs):  # pylint: disable=unused-argument
    """How a call with bad arguments is answered (:func:`_public`): Salt's named error."""
    raise SaltInvocationError(message)


def _fail(fun, message, args, kwargs, exc):  # pylint: disable=unused-argument
    """
    How a call that failed is answered (:func:`_public`): Salt's named
    errors ("ERROR: ...", a non-zero exit, no traceback); the function's
    own (bad input, a command that failed) as they are.
    """
    if isinstance(exc, (SaltInvocationError, CommandExecutionError)):
        raise exc
    raise CommandExecutionError(message) from None


def _public(*extra):
    """
    This module's one wrapper of its public functions
    (:func:`salt_multimaster.guard.public`): ``extra`` names what a
    function's ``**kwargs`` accepts; any other keyword is answered with
    every accepted one and the closest match, nothing run; whatever it
    raises is answered with Salt's named errors.  (Without the core the
    module does not load: see ``__virtual__``.)
    """
    if not HAS_CORE:
        return lambda func: func
    return guard.public(__virtualname__, _answer, extra, fail=_fail)


def __virtual__():
    if HAS_CORE:
        return __virtualname__
    return (
        False,
        "multimaster: the salt_multimaster core is missing; pip install "
        "salt-multimaster, or run 'saltutil.sync_all' with the repository in file_roots",
    )


@_public()
def version():
    """
    Return the version of salt-multimaster and where this module was loaded from.

    CLI Example:

    .. code-block:: bash

        salt '*' multimaster.version
    """
    return {"version": salt_multimaster.__version__, "module": __file__}


def _pillar():
    """The ``multimaster`` pillar (plain values: ``__pillar__`` is not masked)."""
    data = (__pillar__ or {}).get("multimaster") or {}
    return data if isinstance(data, dict) else {}


def _expected(kwarg_value, pillar_key, default=None):
    """A keyword argument, else the ``multimaster:<pillar_key>`` pillar value."""
    if kwarg_value is not None and kwarg_value != "":
        return kwarg_value
    value = _pillar().get(pillar_key)
    return default if value is None else value


def _conf_file():
    return __opts__.get("conf_file") or "/etc/salt/minion"


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


@_public()
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
    expected_masters = master_entries.split_list(_expected(masters, "masters"))
    topology = str(_expected(topology, "topology", "shared")).lower()
    if topology not in TOPOLOGIES:
        raise SaltInvocationError(
            f"multimaster.audit: topology must be 'shared' or 'signed', not {topology!r}"
        )
    try:
        timeout = validate.timeout("timeout", timeout, maximum=60)
    except validate.InvalidInput as exc:
        raise SaltInvocationError(f"multimaster.audit: {exc}") from None
    try:
        opts = _minion_opts()
    except Exception as exc:  # pylint: disable=broad-except
        raise CommandExecutionError(f"multimaster.audit: cannot read the minion config: {exc}")
    finger = _expected(master_finger, "master_finger") or opts.get("master_finger")
    versions = audit_core.master_version_map(
        _expected(master_version, "master_version")
    )
    ret = audit_core.run_audit(
        opts,
        expected_masters=expected_masters,
        expected_finger=finger,
        master_versions=versions,
        topology=topology,
        timeout=timeout,
        running=dict(__opts__),
        restart_status=restart.last_status(__opts__),
    )
    if not ret["result"]:
        __context__["retcode"] = 1
    return ret


@_public()
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
    return conf_core.dropin_path(_conf_file(), name)


@_public(*_SETTINGS)
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
    settings = salt.utils.args.clean_kwargs(**settings)
    if masters is None:
        masters = _pillar().get("masters")
    return conf_core.check(_conf_file(), masters, settings, name=name, running=__opts__)


@_public(*_SETTINGS)
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
    settings = salt.utils.args.clean_kwargs(**settings)
    if masters is None:
        masters = _pillar().get("masters")
    try:
        ret = conf_core.apply(_conf_file(), masters, settings, name=name, running=__opts__)
    except validate.InvalidInput as exc:
        raise SaltInvocationError(str(exc)) from None
    except conf_core.WriteError as exc:
        raise CommandExecutionError(str(exc)) from None
    if ret["written"]:
        log.info("multimaster: wrote %s", ret["path"])
    return ret


@_public()
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
    return conf_core.trusted_key_path(__opts__, _expected(topology, "topology") or "shared", name)


def _key_args(name, contents, source, master_finger, topology, saltenv):
    """The key arguments with the pillar's defaults, for the core's key_check/key_apply."""
    pillar = _pillar()
    topology = _expected(topology, "topology") or "shared"
    if master_finger is None:
        master_finger = pillar.get("master_finger")
    if contents is None and not source:
        # the formula's pillar keys: usable from a plain job, which (unlike
        # state.apply) needs no new pillar compile, i.e. no sign-in with the
        # stale key itself
        contents = pillar.get("master_pub") or None
        source = pillar.get("master_pub_source") or None
    return {
        "path": conf_core.trusted_key_path(__opts__, topology, name),
        "topology": topology,
        "contents": contents,
        "source": source,
        "master_finger": master_finger,
        "fetch": lambda src: __salt__["cp.get_file_str"](src, saltenv=saltenv),
    }


@_public()
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
    return conf_core.key_check(
        hash_type=__opts__.get("hash_type", "sha256"),
        **_key_args(name, contents, source, master_finger, topology, saltenv),
    )


@_public()
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
    try:
        ret = conf_core.key_apply(
            __opts__, **_key_args(name, contents, source, master_finger, topology, saltenv))
    except validate.InvalidInput as exc:
        raise SaltInvocationError(str(exc)) from None
    except conf_core.WriteError as exc:
        raise CommandExecutionError(str(exc)) from None
    if ret["written"]:
        log.info("multimaster: replaced %s (backup %s)", ret["path"], ret["backup"])
    return ret


@_public()
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
        for the salt-minion, the minion option ``multimaster.master_restart_cmd``
        for the salt-master (the one setting every restart of this host's
        master reads), else ``salt-call --local service.restart <service>``.

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
    try:
        restart.check_service(service)
    except ValueError as exc:
        raise SaltInvocationError(str(exc)) from None
    pillar = _pillar()
    if service == "salt-minion":
        cmd = cmd or pillar.get("minion_restart_cmd")
        if delay is None:
            delay = pillar.get("minion_restart_delay")
    else:
        cmd = cmd or __opts__.get(restart.MASTER_CMD_OPTION)
    cmd = cmd or restart.default_cmd(service)
    if not isinstance(cmd, str) or not cmd.strip():
        raise SaltInvocationError(f"cmd must be a non-empty command string, not {cmd!r}")
    try:
        delay = validate.delay("delay", restart.DEFAULT_DELAY if delay is None else delay)
    except validate.InvalidInput as exc:
        raise SaltInvocationError(str(exc)) from None
    reason = restart.impossible(
        cmd, service, service_available=restart.service_available(__salt__, service))
    if salt.utils.data.is_true(test):
        return {"scheduled": False, "possible": reason is None, "reason": reason, "cmd": cmd}
    if reason:
        log.error("multimaster: the %s cannot restart: %s", service, reason)
        raise CommandExecutionError(reason)
    ret = restart.schedule(__opts__, restart.salt_run_bg(__salt__), cmd, delay, service)
    if ret["scheduled"]:
        log.info("multimaster: %s restart scheduled (pid %s): %s", service, ret["pid"], cmd)
    return ret


@_public()
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
    path = _master_config_path(master_config)
    conf = salt.config.master_config(path).get("multimaster") or {}
    if not isinstance(conf, dict):
        raise CommandExecutionError(f"{path}: the multimaster option must be a mapping")
    peers = conf.get("peers") or []
    if isinstance(peers, str):
        peers = [p.strip() for p in peers.split(",") if p.strip()]
    if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
        raise CommandExecutionError(f"{path}: multimaster:peers must be a list of minion ids")
    return protocol.peer_run_config(peers)


@_public()
def engines_config(master_config=None, dropin="multimaster-reactor.conf"):
    """
    The ``engines`` option the ``salt.multimaster.master`` drop-in writes to
    run the ``multimaster_watch`` engine (the change journal of the master's
    roots and key dirs) next to the engines the master runs now: an
    ``engines`` list in master.d replaces the master file's, so the master
    file's engines are repeated.  None when the master runs the engine
    already.

    master_config
        The master's config file (default: the minion option
        ``multimaster.master_config``, else /etc/salt/master).

    dropin
        The drop-in the state writes (left out: its own ``engines``).

    CLI Example:

    .. code-block:: bash

        salt master01 multimaster.engines_config
    """
    path = _master_config_path(master_config)
    main = _config_file_option(path, "engines")
    dropins = [_config_file_option(other, "engines")
               for other in sorted(glob.glob(os.path.join(os.path.dirname(path), "master.d",
                                                          "*.conf")))
               if os.path.basename(other) != dropin]
    try:
        return journal.engines_config(main, dropins)
    except ValueError as exc:
        raise CommandExecutionError(f"{path}: {exc}") from None


def _master_config_path(master_config):
    """The master config file meant: the argument, the minion option, /etc/salt/master."""
    path = master_config or __opts__.get("multimaster.master_config") or "/etc/salt/master"
    if not os.path.isfile(path):
        raise CommandExecutionError(f"no salt-master configuration at {path}")
    return path


def _config_file_option(path, option):
    """One option of one config file as written (no includes, no defaults)."""
    try:
        with salt.utils.files.fopen(path, "r") as fh:
            data = salt.utils.yaml.safe_load(fh) or {}
    except (OSError, salt.utils.yaml.YAMLError) as exc:
        raise CommandExecutionError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise CommandExecutionError(f"{path}: not a mapping of options")
    return data.get(option)
