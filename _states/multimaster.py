"""
Make a minion's multi-master configuration consistent and make it trust the
expected master key.

.. code-block:: yaml

    multimaster-minion-multimaster-minion_config:
      multimaster.minion_config:
        - name: multimaster.conf          # in minion.d beside the minion config
        - masters:
          - master01.example.com
          - master02.example.com
        - master_alive_interval: 30

    multimaster-minion-multimaster-master_key:
      multimaster.master_key:
        - name: minion_master.pub         # in the minion's pki_dir
        - source: salt://keys/master.pub
        - master_finger: 'ab:cd:...'

Both states restart the minion in the background, after the state run has
returned, only when they changed something and never in test mode.  The
restart command is ``salt-call --local service.restart salt-minion`` unless
the pillar key ``multimaster:minion_restart_cmd`` (or ``restart_cmd``) says
otherwise; ``restart: False`` turns it off.  A restart that cannot happen
here (no service manager knows salt-minion for the default command, a
program of the command that is not installed) fails the state, test=True
too, and the comment says to restart the minion by hand.

The logic lives in the ``multimaster`` execution module
(``multimaster.minion_config_check``/``_apply``, ``multimaster.master_key_check``
/``_apply``, ``multimaster.restart_minion``).
"""

import logging

import salt.utils.args
import salt.utils.data
from salt.exceptions import CommandExecutionError, SaltInvocationError

log = logging.getLogger(__name__)

__virtualname__ = "multimaster"

try:
    from salt_multimaster import guard
    from salt_multimaster import minion_config as conf_core
    from salt_multimaster import restart as restart_core
    from salt_multimaster import validate

    HAS_CORE = True
except ImportError:
    HAS_CORE = False

# what minion_config takes as **settings
_SETTINGS = tuple(conf_core.SETTINGS) if HAS_CORE else ()


def _answer(fun, message, args, kwargs):  # pylint: disable=unused-argument
    """
    How a state called with bad arguments, or one that failed, is answered
    (:func:`_public`): it fails, saying why.
    """
    name = args[0] if args else kwargs.get("name", "")
    return {"name": name, "result": False, "changes": {}, "comment": message}


def _public(*extra):
    """
    This module's one wrapper of its states (:func:`salt_multimaster.guard.public`):
    ``extra`` names what a state's ``**kwargs`` accepts; any other argument
    fails the state with every accepted one and the closest match, nothing
    changed; whatever it raises fails it, named.  (Without the core the
    module does not load: see ``__virtual__``.)
    """
    if not HAS_CORE:
        return lambda func: func
    return guard.public(__virtualname__, _answer, extra)


def __virtual__():
    if HAS_CORE:
        return __virtualname__
    return (
        False,
        "multimaster: the salt_multimaster core is missing; pip install "
        "salt-multimaster, or run 'saltutil.sync_all' with the repository in file_roots",
    )


def _notes(check):
    return "".join(f" Note: {note}." for note in check.get("notes") or [])


def _check(ret, fun, what, args_what, **kwargs):
    """
    Run the execution module's check ``fun``; on failure or invalid arguments
    fill ``ret`` (result False, a comment naming the problem) and return None.
    """
    try:
        check = __salt__[fun](**kwargs)
    except (CommandExecutionError, SaltInvocationError) as exc:
        ret["result"] = False
        ret["comment"] = f"Cannot check {what}: {exc}"
        return None
    if check["errors"]:
        ret["result"] = False
        ret["comment"] = "Invalid {}, {} not written: {}".format(
            args_what, check["path"], "; ".join(check["errors"])
        )
        return None
    return check


def _restart_args(ret, restart, restart_cmd, restart_delay):
    """
    Check the restart arguments before anything is written; on bad input fill
    ``ret`` (result False, a comment naming the argument) and return None,
    else ``(restart, restart_cmd, restart_delay)`` normalized.
    """
    try:
        restart = validate.boolean("restart", restart, default=True)
        if restart_delay is not None:
            restart_delay = validate.delay("restart_delay", restart_delay)
        else:
            # the restart falls back to this pillar key: check it now too
            pillar_delay = salt.utils.data.traverse_dict_and_list(
                __pillar__, "multimaster:minion_restart_delay", None, delimiter=":")
            if pillar_delay is not None:
                validate.delay("pillar multimaster:minion_restart_delay", pillar_delay)
        if restart_cmd is not None and (not isinstance(restart_cmd, str)
                                        or not restart_cmd.strip()):
            raise validate.InvalidInput(
                f"restart_cmd must be a non-empty command string, not {restart_cmd!r}")
    except validate.InvalidInput as exc:
        ret["result"] = False
        ret["comment"] = f"Invalid argument, nothing written: {exc}"
        return None
    return restart, restart_cmd, restart_delay


def _restart_failed(ret, service, reason, test=False):
    """Fill ``ret`` for a restart of ``service`` that cannot happen."""
    pillar_key = ("multimaster:minion_restart_cmd" if service == "salt-minion"
                  else "multimaster:master:restart_cmd (or the minion option "
                       "multimaster.master_restart_cmd)")
    ret["result"] = False
    ret["comment"] += " " + restart_core.failure_comment(
        service, reason, pillar_key, test=test)


def _restart_blocker(restart_cmd, restart_delay, service="salt-minion"):
    """
    test=True: why the restart could not happen (the state fails as it
    would without test), or None when it can.
    """
    try:
        check = __salt__["multimaster.restart_minion"](
            cmd=restart_cmd, delay=restart_delay, service=service, test=True)
    except (CommandExecutionError, SaltInvocationError) as exc:
        return str(exc)
    if not check.get("possible", True):
        return check.get("reason") or "unknown"
    return None


def _schedule_restart(ret, restart, restart_cmd, restart_delay, service="salt-minion"):
    """Schedule the background restart and record it in ``ret``."""
    what = "minion" if service == "salt-minion" else "master"
    if not restart:
        ret["comment"] += f" The {what} must restart to use it (restart: False)."
        return
    try:
        sched = __salt__["multimaster.restart_minion"](
            cmd=restart_cmd, delay=restart_delay, service=service)
    except (CommandExecutionError, SaltInvocationError) as exc:
        _restart_failed(ret, service, str(exc))
        return
    if sched.get("scheduled"):
        ret["changes"]["restart"] = f"scheduled after this job returns: {sched['cmd']}"
        ret["comment"] += f" The {what} restarts in the background after this job returns."
    else:
        ret["comment"] += f" A {what} restart is already pending (pid {sched.get('pid')})."


@_public()
def restart_scheduled(name, cmd=None, delay=None):
    """
    Restart the salt-minion or salt-master of this host in the background,
    after the state run returned (``multimaster.restart_minion``).  Use it
    with ``onchanges``; salt.multimaster.master restarts the primary's
    salt-master with it.  A restart that cannot happen here (no service
    manager knows the service for the default command, a program of ``cmd``
    that is not installed) fails the state, with test=True too.

    name
        ``salt-minion`` or ``salt-master``.

    cmd
        The restart command; default ``salt-call --local service.restart <name>``
        (for salt-minion: pillar ``multimaster:minion_restart_cmd`` first; for
        salt-master: the minion option ``multimaster.master_restart_cmd``
        first).

    delay
        Seconds between the end of the job and the restart (default 5,
        ``salt_multimaster.restart.DEFAULT_DELAY``).

    CLI Example:

    .. code-block:: bash

        salt master01 state.single multimaster.restart_scheduled salt-master
    """
    ret = {"name": name, "result": True, "changes": {}, "comment": ""}
    if name not in ("salt-minion", "salt-master"):
        ret["result"] = False
        ret["comment"] = f"name must be salt-minion or salt-master, not {name!r}"
        return ret
    if __opts__["test"]:
        blocker = _restart_blocker(cmd, delay, service=name)
        if blocker:
            _restart_failed(ret, name, blocker, test=True)
            ret["comment"] = ret["comment"].lstrip()
            return ret
        ret["result"] = None
        ret["changes"] = {"restart": f"would be scheduled after this job returns ({name})"}
        ret["comment"] = f"The {name} would restart in the background after this job returns."
        return ret
    ret["comment"] = f"Restart of the {name} requested."
    _schedule_restart(ret, True, cmd, delay, service=name)
    return ret


@_public(*_SETTINGS)
def minion_config(
    name, masters=None, restart=True, restart_cmd=None, restart_delay=None, **settings
):
    """
    Manage the minion.d drop-in holding the master list and the multi-master
    HA settings.

    name
        The drop-in: a file name in the ``minion.d`` folder beside the
        minion's own configuration file (``multimaster.conf`` gives
        ``/etc/salt/minion.d/multimaster.conf`` on a packaged install), or an
        absolute path.

    masters
        The masters, a list; default pillar ``multimaster:masters``.
        Duplicates are removed (``host``, ``HOST`` and ``host:<master_port>``
        are one master) and the order is kept.

    restart
        Restart the minion in the background, after the state run returned,
        when the drop-in changed.  Default True.  Never in test mode.

    restart_cmd
        The restart command; default pillar ``multimaster:minion_restart_cmd``,
        else ``salt-call --local service.restart salt-minion``.

    restart_delay
        Seconds between the end of the job and the restart (default 5).

    Settings written to the drop-in when given (omitted: not managed):
    ``master_type`` (str, failover, func, disable), ``master_alive_interval``,
    ``random_master``, ``master_failback``, ``master_failback_interval``,
    ``retry_dns``, ``auth_tries``, ``verify_master_pubkey_sign``,
    ``ipc_mode``, ``tcp_pub_port``, ``tcp_pull_port`` (an int, or a list of one
    port per master).

    Invalid values (masters not a list, negative intervals, port lists of the
    wrong length, unknown settings) fail the state and write nothing.

    .. code-block:: yaml

        multimaster-minion-multimaster-minion_config:
          multimaster.minion_config:
            - name: multimaster.conf
            - masters: [master01.example.com, master02.example.com]
            - master_alive_interval: 30

    CLI Example:

    .. code-block:: bash

        salt '*' state.single multimaster.minion_config multimaster.conf masters='[m1, m2]'
    """
    ret = {"name": name, "result": True, "changes": {}, "comment": ""}
    restart_args = _restart_args(ret, restart, restart_cmd, restart_delay)
    if restart_args is None:
        return ret
    restart, restart_cmd, restart_delay = restart_args
    settings = salt.utils.args.clean_kwargs(**settings)
    check = _check(ret, "multimaster.minion_config_check", "the multi-master minion config",
                   "multi-master minion settings", masters=masters, name=name, **settings)
    if check is None:
        return ret
    path = check["path"]
    if not check["rewrite"]:
        ret["comment"] = f"Multi-master minion config {path} is already set.{_notes(check)}"
        return ret
    changes = dict(check["changes"])
    if not changes:
        changes = {"file": f"{path} rewritten (same settings)"}
    if __opts__["test"]:
        ret["result"] = None
        ret["changes"] = changes
        restarts = check["restart_needed"] and restart
        blocker = _restart_blocker(restart_cmd, restart_delay) if restarts else None
        ret["comment"] = "Multi-master minion config {} would be updated{}.{}".format(
            path,
            " and the minion restarted" if restarts and not blocker else "",
            _notes(check),
        )
        if blocker:
            _restart_failed(ret, "salt-minion", blocker, test=True)
        return ret
    try:
        applied = __salt__["multimaster.minion_config_apply"](
            masters=masters, name=name, **settings
        )
    except (CommandExecutionError, SaltInvocationError) as exc:
        ret["result"] = False
        ret["comment"] = f"Failed to write the multi-master minion config {path}: {exc}"
        return ret
    ret["changes"] = dict(applied["changes"]) or changes
    ret["comment"] = f"Updated the multi-master minion config {path}.{_notes(applied)}"
    if applied["restart_needed"]:
        _schedule_restart(ret, restart, restart_cmd, restart_delay)
    return ret


@_public()
def master_key(
    name,
    contents=None,
    contents_pillar=None,
    source=None,
    master_finger=None,
    topology=None,
    saltenv="base",
    restart=True,
    restart_cmd=None,
    restart_delay=None,
):
    """
    Make the minion trust the expected master key: its cached
    ``minion_master.pub`` (topology ``shared``) or ``master_sign.pub``
    (topology ``signed``) must be that key.  A stale key is backed up to
    ``<cachedir>/multimaster/backup/<timestamp>/`` and replaced; the minion
    then restarts in the background (as in
    :py:func:`minion_config <salt.states.multimaster.minion_config>`) so that
    it authenticates again with the right key.

    name
        A file name in the minion's ``pki_dir`` (``minion_master.pub`` or
        ``master_sign.pub``) or an absolute path.

    contents
        The expected PEM public key.

    contents_pillar
        A pillar key (``a:b`` notation) holding the expected PEM public key,
        e.g. ``multimaster:master_pub``.

    source
        Fetch the expected key from the master's file server instead, e.g.
        ``salt://keys/master.pub``.

    master_finger
        The expected fingerprint (``salt-key -F master``); default pillar
        ``multimaster:master_finger``.  With ``contents``/``source`` the key
        must have it; alone, the cached key is checked and a mismatch fails
        (there is nothing to replace it with).

    topology
        ``shared`` or ``signed``; default pillar ``multimaster:topology``.

    restart, restart_cmd, restart_delay
        As for ``multimaster.minion_config``.

    .. code-block:: yaml

        multimaster-minion-multimaster-master_key:
          multimaster.master_key:
            - name: minion_master.pub
            - contents_pillar: multimaster:master_pub   # or contents / source
            - master_finger: 'ab:cd:...'

    CLI Example:

    .. code-block:: bash

        salt '*' state.single multimaster.master_key minion_master.pub source=salt://keys/master.pub
    """
    ret = {"name": name, "result": True, "changes": {}, "comment": ""}
    restart_args = _restart_args(ret, restart, restart_cmd, restart_delay)
    if restart_args is None:
        return ret
    restart, restart_cmd, restart_delay = restart_args
    if contents is None and contents_pillar:
        contents = salt.utils.data.traverse_dict_and_list(
            __pillar__, contents_pillar, None, delimiter=":"
        )
        if not contents:
            ret["result"] = False
            ret["comment"] = f"Pillar key {contents_pillar} holds no master key"
            return ret
    kwargs = dict(
        name=name,
        contents=contents,
        source=source,
        master_finger=master_finger,
        topology=topology,
        saltenv=saltenv,
    )
    check = _check(ret, "multimaster.master_key_check", "the trusted master key",
                   "trusted master key arguments", **kwargs)
    if check is None:
        return ret
    path = check["path"]
    if check["match"]:
        ret["comment"] = "Trusted master key {} is already {}.".format(
            path, check["expected_finger"]
        )
        return ret
    if check["expected"] is None:
        ret["result"] = False
        ret["comment"] = (
            "Trusted master key {} has fingerprint {}, not {}, and no key content was "
            "given to replace it (contents or source)".format(
                path, check["current_finger"] or "(missing)", check["expected_finger"]
            )
        )
        return ret
    changes = {
        "master_key": {"old": check["current_finger"], "new": check["expected_finger"]}
    }
    if __opts__["test"]:
        ret["result"] = None
        ret["changes"] = changes
        blocker = _restart_blocker(restart_cmd, restart_delay) if restart else None
        ret["comment"] = "Trusted master key {} would be replaced{}.".format(
            path, " and the minion restarted" if restart and not blocker else ""
        )
        if blocker:
            _restart_failed(ret, "salt-minion", blocker, test=True)
        return ret
    try:
        applied = __salt__["multimaster.master_key_apply"](**kwargs)
    except (CommandExecutionError, SaltInvocationError) as exc:
        ret["result"] = False
        ret["comment"] = f"Failed to replace the trusted master key {path}: {exc}"
        return ret
    ret["changes"] = changes
    if applied.get("backup"):
        ret["changes"]["backup"] = applied["backup"]
    ret["comment"] = f"Replaced the trusted master key {path}."
    _schedule_restart(ret, restart, restart_cmd, restart_delay)
    return ret
