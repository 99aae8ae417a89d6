"""
The tests' Salt CLIs started from a fork server: Salt's own CLI code in a
process of its own, without paying Salt's import each time.

A ``salt``, ``salt-run``, ``salt-key`` or ``salt-call`` costs about a second
of CPU before it does anything, most of it importing Salt (``python -X
importtime``: ``salt.cli.run`` 1.0 s); the suite makes over a thousand such
calls on two cores, beside the daemons.  The server (one per pytest
process, :func:`start`) imports what the CLIs import, then forks a child for
each call; the child takes the caller's stdin, stdout and stderr, its
arguments, environment, ``sys.path``, working directory and umask, and runs
the very entry point salt-factories' scripts run (``salt.scripts.salt_run``
...) as they run it.  The caller is a small client script (:data:`CLIENT`,
given to the CLI factory as its script): it exits with the child's exit code,
or by the child's signal; killed, its connection closes and the child's
process group is killed.  Without the server it runs salt-factories' script.

Only the calls the tests make through :class:`tests.support.cluster.Cluster`
go this way; a test that starts a CLI itself (to kill it, or as an operator
types it) runs the real script.  ``MM_FORK_CLIS=0``: no server, every call
runs the real script.  The benchmarks never use it: they time real commands.
"""

import atexit
import importlib
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback

# what the CLI scripts import before they run (salt.scripts imports each
# command's module when it runs)
PRELOAD = ("salt.scripts", "salt.cli.salt", "salt.cli.run", "salt.cli.key", "salt.cli.call")
# the entry point of each command (salt-factories' scripts call these)
ENTRIES = {"salt": "salt_main", "salt-run": "salt_run", "salt-key": "salt_key",
           "salt-call": "salt_call"}
MAX_REQUEST = 4 * 1024 * 1024

log = logging.getLogger(__name__)

# The client: no Salt import; without the server it runs salt-factories'
# own script of the command (beside its directory) in its place.
CLIENT = '''\
import json, os, socket, struct, sys

SOCK, ENTRY = {sock!r}, {entry!r}


def _fallback():
    real = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        os.path.basename(__file__))
    os.execv(sys.executable, [sys.executable, real, *sys.argv[1:]])


try:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(SOCK)
except OSError:
    _fallback()
umask = os.umask(0o022)
os.umask(umask)
request = json.dumps({{"entry": ENTRY, "argv": sys.argv, "env": dict(os.environ),
                      "cwd": os.getcwd(), "path": sys.path, "umask": umask}}).encode()
socket.send_fds(conn, [struct.pack("!I", len(request))], [0, 1, 2])
conn.sendall(request)
status = b""
while len(status) < 4:
    chunk = conn.recv(4 - len(status))
    if not chunk:
        sys.stderr.write("the tests' CLI fork server went away\\n")
        os._exit(255)
    status += chunk
code = struct.unpack("!i", status)[0]
if code < 0:
    os.kill(os.getpid(), -code)
os._exit(code)
'''


def client_script(scripts_dir, command, sock):
    """
    The client script of ``command`` for the server ``sock`` (written once):
    ``scripts_dir/fork/`` under the name of salt-factories' script in
    ``scripts_dir`` (Salt names itself after ``sys.argv[0]`` in its messages).
    """
    os.makedirs(os.path.join(scripts_dir, "fork"), exist_ok=True)
    path = os.path.join(scripts_dir, "fork", f"cli_{command.replace('-', '_')}.py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(CLIENT.format(sock=sock, entry=ENTRIES[command]))
        os.replace(tmp, path)
    return path


def enabled():
    return os.environ.get("MM_FORK_CLIS", "1") != "0"


class Server:
    """The fork server of this pytest process (:func:`start`), stopped at exit."""

    def __init__(self, sock):
        self.sock = sock
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
        env.pop("PYTHONPATH", None)  # each call brings its own sys.path
        # pylint: disable-next=consider-using-with
        self.proc = subprocess.Popen([sys.executable, __file__, sock], env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not os.path.exists(sock):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"the CLI fork server did not start (exit {self.proc.returncode})")
            time.sleep(0.05)
        atexit.register(self.stop)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_SERVER = {}


def cpu_file(sock):
    """The file in which the server at ``sock`` keeps the CPU seconds its commands used."""
    return f"{sock}.cpu"


def cpu_used():
    """The CPU seconds the commands of this process's server used so far (0: none, or no server)."""
    server = _SERVER.get("server")
    try:
        with open(cpu_file(server.sock), encoding="ascii") as fh:
            return float(fh.read())
    except (AttributeError, OSError, ValueError):
        return 0.0


def start(scripts_dir):
    """
    This process's server (started once), or None: ``MM_FORK_CLIS=0``, or
    it did not start (logged once; the calls run the real scripts).
    """
    if not enabled():
        return None
    if "server" not in _SERVER:
        try:
            _SERVER["server"] = Server(os.path.join(scripts_dir, f"fork-{os.getpid()}.sock"))
        except (OSError, RuntimeError) as exc:
            log.warning("%s; every CLI call runs the real script", exc)
            _SERVER["server"] = None
    return _SERVER["server"]


# ----- the server process ------------------------------------------------------
def _recv_exact(conn, size):
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise OSError("the client went away")
        data += chunk
    return data


def _run_child(conn, fds, request):
    """In the forked child: become the command the client runs; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

        def watch():  # the client killed: so is this command, and what it started
            try:
                conn.recv(1)
            except OSError:
                pass
            os.killpg(0, signal.SIGKILL)

        threading.Thread(target=watch, daemon=True).start()
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = list(request["argv"])
        sys.path[:] = request["path"]
        entry = getattr(importlib.import_module("salt.scripts"), request["entry"])
        code = 0
        try:
            entry()
        except SystemExit as exc:
            code = exc.code
            if code is None:
                code = 0
            if not isinstance(code, int):
                sys.stderr.write(str(code))
                code = 1
        except Exception as exc:  # pylint: disable=broad-except
            sys.stderr.write("An un-handled exception was caught: " + str(exc) + "\n"
                             + traceback.format_exc())
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        atexit._run_exitfuncs()  # pylint: disable=protected-access
    finally:
        os._exit(code)  # pylint: disable=protected-access


def serve(sock_path):
    """Preload, listen at ``sock_path``, fork a child per request; exit with the parent."""
    for name in PRELOAD:
        importlib.import_module(name)
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = f"{sock_path}.tmp"
    if os.path.exists(tmp):
        os.unlink(tmp)
    listener.bind(tmp)
    os.chmod(tmp, 0o600)
    listener.listen(128)
    os.rename(tmp, sock_path)
    children = {}  # pid -> the client's connection
    used = 0.0  # the CPU seconds of the commands run, in cpu_file(sock_path)
    while os.getppid() == parent:
        ready = select.select([listener], [], [], 0.05)[0]
        while children:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            used += usage.ru_utime + usage.ru_stime
            with open(f"{sock_path}.cpu.tmp", "w", encoding="ascii") as fh:
                fh.write(f"{used:.3f}")
            os.replace(f"{sock_path}.cpu.tmp", cpu_file(sock_path))
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(struct.pack("!i", os.waitstatus_to_exitcode(status)))
                except OSError:
                    pass
                conn.close()
        if not ready:
            continue
        conn = listener.accept()[0]
        fds = []
        try:
            conn.settimeout(10)
            msg, fds, _, _ = socket.recv_fds(conn, 4, 3)
            if len(msg) != 4 or len(fds) != 3:
                raise OSError("a malformed request")
            size = struct.unpack("!I", msg)[0]
            if size > MAX_REQUEST:
                raise OSError("a request too large")
            request = json.loads(_recv_exact(conn, size))
            conn.settimeout(None)
        except (OSError, ValueError):
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            listener.close()
            for other in children.values():
                other.close()
            _run_child(conn, fds, request)
        for fd in fds:
            os.close(fd)
        children[pid] = conn
    os.unlink(sock_path)


if __name__ == "__main__":
    serve(sys.argv[1])
