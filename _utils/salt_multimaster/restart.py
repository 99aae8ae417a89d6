"""
The one restart helper: restart the salt-minion or the salt-master of this
host in the background, after the current job has returned (a peer's
salt-master: after its job process exited, or :data:`MASTER_JOB_WAIT`
seconds).

``multimaster.restart_minion`` (and through it the states and the formula's
``salt.multimaster.master``) and the peer's restart of its salt-master
(:class:`MasterRestart`: a sync, a restore, add_peer, a key rotation) use
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

from salt_multimaster import statefile
from salt_multimaster.layout import state_dir

log = logging.getLogger(__name__)

SERVICES = ("salt-minion", "salt-master")
DEFAULT_CMD = "salt-call --local service.restart {service}"
#: The minion option (on a master's host) naming the command that restarts
#: that host's salt-master where no systemd runs it (OpenRC, runit, s6,
#: supervisord, a container): a flat dotted key, as ``multimaster.master_config``.
MASTER_CMD_OPTION = "multimaster.master_restart_cmd"
#: Seconds between the end of the job and a salt-master's restart.
MASTER_DELAY = 1
#: Seconds between the end of the job and the restart.
DEFAULT_DELAY = 5
#: How long the background command waits for the job process at most (seconds).
JOB_WAIT = 600
#: How long a peer's salt-master restart waits for the job process at most:
#: the job's return goes to the master that published it (the primary, or
#: a promoted peer), never to the one restarting, and the restart is asked
#: for at the end of the job; Salt 3007.15 keeps a job process ~30 s after
#: its return (docs/install.rst), which delayed every peer master's restart
#: as long.
MASTER_JOB_WAIT = 5

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


def impossible(cmd, service, which=shutil.which, service_available=None, runs="salt-minion"):
    """
    Why the restart of ``service`` with ``cmd`` cannot happen here, or None
    when nothing stops it.  ``runs``: the daemon whose PATH runs ``cmd``.

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
            cmd, ", ".join(repr(p) for p in missing), runs)
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


def _number(data):
    """A whole number written by the shell (ValueError else)."""
    try:
        return int(data.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise ValueError("not a number") from None


def last_status(opts, service="salt-minion"):
    """The exit status of the last background restart command of ``service``, or None."""
    # damaged: not known (the next restart writes it again)
    return statefile.load(status_path(opts, service), "the last restart's outcome is unknown",
                          parse=_number)


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
    # damaged: no restart known to be waiting (a new one is scheduled, the
    # marker written again)
    pid = statefile.load(pending_path(opts, service), "a new restart may be scheduled",
                         default=0, parse=_number)
    return pid if pid > 0 and pid_alive(pid) else 0


def script(cmd, delay, wait_pid, pending_file, status_file, wait_max=JOB_WAIT):
    """
    The shell script of a background restart: wait until process
    ``wait_pid`` (the job; 0: none) has exited (at most ``wait_max``
    seconds), ``delay`` more seconds, drop the pending marker, run ``cmd``
    and leave its exit status in ``status_file`` (a restart that worked
    usually ends the script first).
    """
    return (
        "p={pid}; i=0; "
        'while [ "$p" -gt 0 ] && [ $i -lt {steps} ] && [ -d /proc/$p ] && '
        "! grep -q ') Z' /proc/$p/stat 2>/dev/null; do sleep 0.25; i=$((i+1)); done; "
        "sleep {delay}; rm -f {pending}; ({cmd}); "
        "echo $? > {last}.tmp && mv -f {last}.tmp {last}"
    ).format(pid=int(wait_pid), steps=int(wait_max * 4), delay=delay,
             pending=shlex.quote(pending_file), cmd=cmd, last=shlex.quote(status_file))


def salt_run_bg(salt_funcs):
    """
    The ``run_bg`` of :func:`schedule` over a loader's ``__salt__``: Salt's
    ``cmd.run_bg`` with a shell, in ``/``, answering the pid.
    """
    return lambda script: salt_funcs["cmd.run_bg"](script, python_shell=True, cwd="/").get("pid")


def service_available(salt_funcs, service):
    """
    Whether this host's service manager knows ``service``, asked through a
    loader's ``__salt__`` (Salt's ``service.available``): False when no
    service module loaded (no service manager here), None when it cannot tell.
    """
    if "service.available" not in salt_funcs:
        return False
    try:
        return bool(salt_funcs["service.available"](service))
    except Exception:  # pylint: disable=broad-except
        log.debug("multimaster: service.available(%s) failed", service, exc_info=True)
        return None


def schedule(opts, run_bg, cmd, delay=DEFAULT_DELAY, service="salt-minion", wait_pid=None,
             wait_max=JOB_WAIT):
    """
    Start the background restart of ``service`` with ``cmd`` unless one is
    pending.  ``run_bg(script)`` starts a shell script in the background and
    returns its pid (:func:`salt_run_bg`).  ``wait_pid``: the process to
    outlive (at most ``wait_max`` seconds), default this one when ``opts``
    run jobs in their own process (``multiprocessing``), else none (a job
    thread of the minion itself: only the delay applies).  Call
    :func:`impossible` first.

    Returns ``{"scheduled": bool, "pid": int, "cmd": str}``; ``scheduled`` is
    False when a restart is already pending (its pid).
    """
    already = pending(opts, service)
    if already:
        return {"scheduled": False, "pid": already, "cmd": cmd}
    if wait_pid is None:
        wait_pid = os.getpid() if opts.get("multiprocessing", True) else 0
    status_file = status_path(opts, service)
    statefile.remove(status_file)
    pid = int(run_bg(script(cmd, delay, wait_pid, pending_path(opts, service), status_file,
                            wait_max)) or 0)
    try:
        statefile.write(pending_path(opts, service), f"{pid}\n")
    except OSError:
        log.warning("multimaster: cannot record the pending restart in %s",
                    pending_path(opts, service))
    return {"scheduled": True, "pid": pid, "cmd": cmd}


class MasterRestart:
    """
    The one way this host's salt-master restarts, for every path that
    restarts it (a sync that wrote master keys or options, a restore of
    them, add_peer's start, a key rotation): ``cmd`` when the caller gives
    one (a rotation's ``restart_cmd``), else the minion option
    :data:`MASTER_CMD_OPTION`, else the service manager
    (:func:`default_cmd`), in the background after the job returned (its
    process waited for at most :data:`MASTER_JOB_WAIT` seconds).

    opts
        The options of the minion running the job (its state dir holds the
        pending marker and the command's exit status).
    mark
        ``mark()`` records that the master must restart (the restart
        marker, :func:`salt_multimaster.daemon.mark_restart`) before any
        restart is asked for.
    run_bg
        As for :func:`schedule` (:func:`salt_run_bg`).
    service_available
        ``service_available()``: whether this host's service manager knows
        salt-master (True, False, or None when not known); asked only when
        no command is configured.

    :attr:`refused` says why a configured command cannot run here (a
    program not installed, not a command): the writes that need the
    restart are refused, nothing written.  With no command configured and
    no service manager knowing salt-master, the writes go ahead and the
    restart is ``restart_required``, as before this setting existed.
    """

    def __init__(self, opts, mark, run_bg, service_available, cmd=None, which=shutil.which):
        self.opts, self.mark, self.run_bg = opts, mark, run_bg
        self.service_available, self.which = service_available, which
        self.source = "restart_cmd" if cmd else MASTER_CMD_OPTION
        cmd = cmd or opts.get(MASTER_CMD_OPTION) or None
        self.configured = cmd is not None
        self.refused = None
        if cmd is not None and (not isinstance(cmd, str) or not cmd.strip()):
            self.refused = f"{self.source} must be a command string, not {cmd!r}"
            cmd = None
        elif cmd is not None:
            self.refused = impossible(cmd, "salt-master", which=which)
        self.cmd = cmd or default_cmd("salt-master")
        self._possible = None if cmd is None else self.refused is None

    @property
    def possible(self):
        """Whether a command can restart the master here (the default one: the service manager)."""
        if self._possible is not None:
            return self._possible
        return impossible(self.cmd, "salt-master", which=self.which,
                          service_available=self.service_available()) is None

    def why_refused(self, host=None):
        """The error of a write refused because of :attr:`refused` (None when not refused)."""
        if self.refused is None:
            return None
        where = f" of the salt-minion on {host}" if host else ""
        return (f"the salt-master could not restart to load it: {self.refused}; nothing "
                f"written: fix the option {self.source}{where} (or remove it to restart "
                "through the service manager)")

    def predict(self):
        """What :meth:`__call__` would answer (test mode): a refusal is :meth:`why_refused`."""
        if self.refused:
            return self.why_refused()
        return "would restart" if self.possible else "restart_required"

    def describe(self, host=None):
        """
        What a peer reports of its master's restart (inventory, host check):
        the command, whether it is configured, :meth:`why_refused`, whether
        it can run, the exit status of the last one run.
        """
        return {"cmd": self.cmd, "configured": self.configured,
                "refused": self.why_refused(host), "possible": self.possible,
                "last_status": last_status(self.opts, "salt-master")}

    def __call__(self):
        """
        Mark the restart, then start it in the background: ``"restarting"``,
        or ``"restart_required"`` when nothing here can restart the master.
        """
        self.mark()
        if self.refused or not self.possible:
            return "restart_required"
        schedule(self.opts, self.run_bg, self.cmd, delay=MASTER_DELAY, service="salt-master",
                 wait_max=MASTER_JOB_WAIT)
        return "restarting"
