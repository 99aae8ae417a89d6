"""
The one restart helper: restart the salt-minion or the salt-master of this
host in the background, after the current job has returned.

``multimaster.restart_minion`` (and through it the states and the formula's
``salt.multimaster.master``) and the peer's restart of its salt-master use
:func:`schedule`.  A background command's own failure is never seen by the
job that scheduled it, so what can be told before is told here: a restart
that cannot happen (no service manager knows the service for the default
command, a program of the command that is not installed) is a failure
(:func:`impossible`), with what to do, never "restarts in the background".
The command's exit status is left in :func:`status_path` for the audit.
"""

import logging
import os
import shlex
import shutil

from salt_multimaster import fsutil
from salt_multimaster.layout import state_dir

log = logging.getLogger(__name__)

SERVICES = ("salt-minion", "salt-master")
DEFAULT_CMD = "salt-call --local service.restart {service}"
#: Seconds between the end of the job and the restart.
DEFAULT_DELAY = 5
#: How long the background command waits for the job process (in 0.25 s steps).
_WAIT_STEPS = 2400

# Words that start a simple shell command but are no program to look up.
_SHELL_WORDS = frozenset((
    "!", "{", "}", "(", ")", "[", "[[", ":", ".", "case", "cd", "do", "done", "elif",
    "else", "esac", "eval", "exec", "exit", "export", "false", "fi", "for", "if",
    "in", "set", "source", "then", "true", "umask", "unset", "until", "wait", "while",
    "echo", "printf", "test", "command", "nohup", "env", "sleep",
))
_OPERATORS = frozenset((";", "&&", "||", "|", "&", "(", ")", ";;", "\n"))


def default_cmd(service):
    """The default restart command of ``service`` (salt-minion, salt-master)."""
    return DEFAULT_CMD.format(service=service)


def command_programs(cmd):
    """
    The programs a shell command line starts: the first word of each simple
    command (after ``VAR=value`` assignments), shell keywords and builtins
    left out.  Raises ValueError for a line the shell cannot parse (quotes).
    """
    lexer = shlex.shlex(cmd, posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    programs = []
    first = True
    for token in lexer:
        if token in _OPERATORS or set(token) <= set(";&|()"):
            first = True
            continue
        if not first:
            continue
        if "=" in token and not token.startswith("=") and token.split("=", 1)[0].isidentifier():
            continue  # an environment assignment before the program
        first = False
        if token not in _SHELL_WORDS:
            programs.append(token)
    return programs


def impossible(cmd, service, which=shutil.which, service_available=None):
    """
    Why the restart of ``service`` with ``cmd`` cannot happen here, or None
    when nothing stops it.

    which
        ``shutil.which``-like: the path of a program, or None.

    service_available
        Whether this host's service manager knows ``service`` (Salt's
        ``service.available``; False when no service module loaded); None
        when not known.  Only used for the default command, which restarts
        through the service manager.
    """
    try:
        programs = command_programs(cmd)
    except ValueError as exc:
        return f"the restart command {cmd!r} cannot be parsed ({exc})"
    missing = [p for p in programs if not which(p)]
    if missing:
        return "the restart command {!r} cannot run: {} not found (PATH of the {})".format(
            cmd, ", ".join(repr(p) for p in missing), "salt-minion")
    if cmd.strip() == default_cmd(service) and service_available is False:
        return (f"no service manager on this host knows the {service} service, so the "
                f"default restart command {cmd!r} cannot restart it")
    return None


def failure_comment(service, reason, pillar_key, test=False):
    """The comment of a state whose restart of ``service`` cannot happen."""
    return (
        f"The {service} {'would NOT be' if test else 'was NOT'} restarted: {reason}. "
        f"Restart the {service} yourself "
        f"(the new configuration takes effect then), or set pillar {pillar_key} to a "
        "command that restarts it here."
    )


def check_service(service):
    """``service`` when it is one this helper restarts, else ValueError naming it."""
    if service not in SERVICES:
        raise ValueError(f"service must be salt-minion or salt-master, not {service!r}")
    return service


def pending_path(opts, service="salt-minion"):
    """The file holding the pid of the pending background restart of ``service``."""
    name = "restart.pending" if service == "salt-minion" else f"restart-{service}.pending"
    return os.path.join(state_dir(opts), name)


def status_path(opts, service="salt-minion"):
    """Where the background restart of ``service`` leaves its command's exit status."""
    return os.path.join(state_dir(opts), f"restart-{service}.status")


def last_status(opts, service="salt-minion"):
    """The exit status of the last background restart command of ``service``, or None."""
    try:
        with open(status_path(opts, service), encoding="utf-8") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def pid_alive(pid):
    """True while process ``pid`` runs (a zombie does not count)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def pending(opts, service="salt-minion"):
    """The pid of a background restart of ``service`` still waiting to run, or 0."""
    try:
        with open(pending_path(opts, service), encoding="utf-8") as fh:
            pid = int(fh.read().strip() or 0)
    except (OSError, ValueError):
        return 0
    return pid if pid and pid_alive(pid) else 0


def script(cmd, delay, wait_pid, pending_file, status_file):
    """
    The shell script of a background restart: wait until process
    ``wait_pid`` (the job; 0: none) has exited, ``delay`` more seconds, drop
    the pending marker, run ``cmd`` and leave its exit status in
    ``status_file`` (a restart that worked usually ends the script first).
    """
    return (
        "p={pid}; i=0; "
        'while [ "$p" -gt 0 ] && [ $i -lt {steps} ] && [ -d /proc/$p ] && '
        "! grep -q ') Z' /proc/$p/stat 2>/dev/null; do sleep 0.25; i=$((i+1)); done; "
        "sleep {delay}; rm -f {pending}; ({cmd}); "
        "echo $? > {last}.tmp && mv -f {last}.tmp {last}"
    ).format(pid=int(wait_pid), steps=_WAIT_STEPS, delay=delay,
             pending=shlex.quote(pending_file), cmd=cmd, last=shlex.quote(status_file))


def salt_run_bg(salt_funcs):
    """
    The ``run_bg`` of :func:`schedule` over a loader's ``__salt__``: Salt's
    ``cmd.run_bg`` with a shell, in ``/``, answering the pid.
    """
    return lambda script: salt_funcs["cmd.run_bg"](script, python_shell=True, cwd="/").get("pid")


def schedule(opts, run_bg, cmd, delay=DEFAULT_DELAY, service="salt-minion", wait_pid=None):
    """
    Start the background restart of ``service`` with ``cmd`` unless one is
    pending.  ``run_bg(script)`` starts a shell script in the background and
    returns its pid (:func:`salt_run_bg`).  ``wait_pid``: the process to
    outlive, default this one when ``opts`` run jobs in their own process
    (``multiprocessing``), else none (a job thread of the minion itself: only
    the delay applies).  Call :func:`impossible` first.

    Returns ``{"scheduled": bool, "pid": int, "cmd": str}``; ``scheduled`` is
    False when a restart is already pending (its pid).
    """
    check_service(service)
    already = pending(opts, service)
    if already:
        return {"scheduled": False, "pid": already, "cmd": cmd}
    if wait_pid is None:
        wait_pid = os.getpid() if opts.get("multiprocessing", True) else 0
    status_file = status_path(opts, service)
    try:
        os.unlink(status_file)
    except OSError:
        pass
    pid = int(run_bg(script(cmd, delay, wait_pid, pending_path(opts, service), status_file)) or 0)
    try:
        fsutil.atomic_write(pending_path(opts, service), f"{pid}\n", mode=0o600)
    except OSError:
        log.warning("multimaster: cannot record the pending restart in %s",
                    pending_path(opts, service))
    return {"scheduled": True, "pid": pid, "cmd": cmd}
