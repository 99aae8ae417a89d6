"""
Whether a background restart of a Salt daemon can happen on this host.

The states restart the salt-minion (and, in salt.multimaster.master, the
salt-master) in the background after the state run returned, so the restart
command's own failure is never seen by the state.  What can be told before
scheduling it is told here: a restart that cannot happen (no service manager
knows the service for the default command, a program of the command that is
not installed) is a failure of the state, with what to do, never "restarts
in the background".
"""

import shlex
import shutil

DEFAULT_CMD = "salt-call --local service.restart {service}"

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
