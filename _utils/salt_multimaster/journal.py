"""
The change journal's service: the unix socket a master's
:class:`salt_multimaster.watch.Watcher` answers on (:func:`serve`, run by
the ``multimaster_watch`` engine), its client (:func:`query`,
:func:`client`: what a sync asks), and where a master's watcher is and what
it watches.  The questions and answers are those of
:meth:`~salt_multimaster.watch.Watcher.changes`.
"""

import contextlib
import functools
import json
import logging
import os
import select
import socket
import stat
import time

from salt_multimaster import statefile, watch

log = logging.getLogger(__name__)

#: a request to :func:`serve` is one line of at most this many bytes
MAX_REQUEST = 64 * 1024
#: a reply read by :func:`query` is at most this many bytes
MAX_REPLY = 256 * 1024 * 1024
#: seconds :func:`serve` gives a client to send its request
CLIENT_TIMEOUT = 2.0


# -- the socket --------------------------------------------------------------
def _listen(sock_path):
    """
    A listening unix socket at ``sock_path``, mode 0600 whatever the umask
    (chmod before ``listen``: nobody connects in between); a stale socket
    there is removed first, anything else there (a damaged state file) is
    moved aside (``statefile.aside``: kept, never removed).  Returns the
    socket and the ``(st_dev, st_ino)`` of its file.
    """
    try:
        st = os.lstat(sock_path)
    except FileNotFoundError:
        pass
    else:
        if stat.S_ISSOCK(st.st_mode):
            os.unlink(sock_path)
        else:
            statefile.aside(sock_path, "not a socket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _short(sock_path) as short:
            sock.bind(short)
        os.chmod(sock_path, 0o600)
        st = os.lstat(sock_path)
        sock.listen(16)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock, (st.st_dev, st.st_ino)


#: a unix socket's path is at most 107 bytes (sun_path)
_SUN_PATH_MAX = 107


@contextlib.contextmanager
def _short(sock_path):
    """
    ``sock_path``, or when it is too long for a unix socket the same file
    reached through this process's descriptor of its directory
    (``/proc/self/fd/N/name``, Linux), valid while in the block.
    """
    if len(os.fsencode(sock_path)) <= _SUN_PATH_MAX:
        yield sock_path
        return
    fd = os.open(os.path.dirname(sock_path) or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{os.path.basename(sock_path)}"
    finally:
        os.close(fd)


def _read_line(conn, limit, deadline):
    """
    One line (without its newline) read from ``conn`` by ``deadline``, or
    what came before EOF; ValueError if longer than ``limit`` bytes.
    """
    data = bytearray()
    scanned = 0
    while True:
        end = data.find(b"\n", scanned)
        if end >= 0 or len(data) > limit:
            line = bytes(data[:end]) if end >= 0 else data
            if len(line) > limit:
                raise ValueError(f"line longer than {limit} bytes")
            return bytes(line)
        scanned = len(data)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise socket.timeout("timed out")
        conn.settimeout(remaining)
        chunk = conn.recv(min(1024 * 1024, limit + 1))
        if not chunk:
            return bytes(data)  # EOF: the line is what came
        data += chunk


def _parse_request(line):
    """The ``since`` of a request line, or ValueError."""
    try:
        request = json.loads(line.decode("utf-8"))
    except RecursionError:
        raise ValueError("nested too deep") from None
    if not isinstance(request, dict) or "since" not in request:
        raise ValueError('a request is {"since": <token or null>}')
    return request["since"]


def _answer(watcher, conn):
    """Read one request from ``conn``, write one reply line."""
    deadline = time.monotonic() + CLIENT_TIMEOUT
    try:
        since = _parse_request(_read_line(conn, MAX_REQUEST, deadline))
    except OSError as exc:  # socket.timeout too: no reply
        log.debug("multimaster: change journal client: %s", exc)
        return
    except ValueError as exc:  # too long, UnicodeDecodeError and JSONDecodeError too
        log.debug("multimaster: change journal client: bad request: %s", exc)
        reply = {"error": f"bad request: {exc}", "changed": None}
    else:
        reply = watcher.changes(since)
    try:
        conn.settimeout(max(0.1, deadline - time.monotonic()))
        conn.sendall(json.dumps(reply, separators=(",", ":")).encode("ascii") + b"\n")
    except OSError as exc:
        log.debug("multimaster: change journal client: reply not sent: %s", exc)


def serve(watcher, sock_path, stop=None, poll=1.0, tick=None):
    """
    Answer :func:`query` on the unix socket ``sock_path`` (its directory
    must exist; mode 0600) with ``watcher.changes(since)``, and drain the
    watcher whenever it has events, until ``stop`` (an object with
    ``is_set()``, such as a ``threading.Event``) is set; checked every
    ``poll`` seconds.  ``tick()`` (:meth:`trigger.Trigger.tick`), when
    given, is called after each batch of events and when the seconds it
    last returned have passed.  One client at a time: one request line
    (``{"since": <token or null>}``, at most :data:`MAX_REQUEST` bytes, sent
    within :data:`CLIENT_TIMEOUT` seconds), one reply line, closed.  A
    malformed request is answered ``{"error": ..., "changed": null}``; a
    client that fails is logged (debug) and forgotten.  On exit the socket
    file is removed, if it is still this server's.
    """
    sock, ident = _listen(sock_path)
    # when tick() asked to be called again (monotonic): at once, before any
    # query is answered (from then on, what changes is seen)
    due = None if tick is None else time.monotonic()
    try:
        while stop is None or not stop.is_set():
            fd = watcher.fileno()
            readers = [sock] if fd is None else [sock, fd]
            wait = poll if due is None else max(0.0, min(poll, due - time.monotonic()))
            ready = select.select(readers, [], [], wait)[0]
            if fd is not None and fd in ready:
                watcher.drain()
            if tick is not None and ((fd is not None and fd in ready)
                                     or (due is not None and time.monotonic() >= due)):
                later = tick()
                due = None if later is None else time.monotonic() + later
            if sock in ready:
                try:
                    conn = sock.accept()[0]
                except OSError as exc:  # the client went away already
                    log.debug("multimaster: change journal: accept: %s", exc)
                    continue
                with conn:
                    _answer(watcher, conn)
    finally:
        sock.close()
        try:
            st = os.lstat(sock_path)
            if (st.st_dev, st.st_ino) == ident:
                os.unlink(sock_path)
        except OSError:
            pass


def query(sock_path, since, timeout=2.0):
    """
    Ask the watcher serving ``sock_path`` which directories changed since
    ``since`` (see :meth:`watch.Watcher.changes`): its reply, or None on any
    error (no socket, refused, ``timeout`` seconds passed, a malformed
    reply).  Never raises.  Check ``reply["trees"]`` against the trees
    meant: the watcher vouches for those only.
    """
    deadline = time.monotonic() + timeout
    try:
        request = json.dumps({"since": since}, separators=(",", ":")).encode("ascii") + b"\n"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout)
            with _short(sock_path) as short:
                conn.connect(short)
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            conn.sendall(request)
            line = _read_line(conn, MAX_REPLY, deadline)
        reply = json.loads(line.decode("utf-8"))
    except (OSError, ValueError, TypeError) as exc:
        log.debug("multimaster: change journal at %s not asked: %s", sock_path, exc)
        return None
    if not _valid_reply(reply):
        log.debug("multimaster: change journal at %s: malformed reply", sock_path)
        return None
    return reply


def _valid_reply(reply):
    if not isinstance(reply, dict) or any(key not in reply for key in watch.REPLY_KEYS):
        return False
    seq = reply["seq"]
    return (isinstance(reply["session"], (str, type(None)))
            and isinstance(seq, int) and not isinstance(seq, bool)
            and isinstance(reply["trees"], list) and isinstance(reply["unwatched"], list)
            and isinstance(reply["changed"], (dict, type(None)))
            and isinstance(reply.get("names"), (dict, type(None)))
            and isinstance(reply["error"], (str, type(None))))


# ---------------------------------------------------------------------------
# Where a master's watcher is, and what it watches
# ---------------------------------------------------------------------------
#: the watcher's socket, in a master's state dir (layout.state_dir: 0700)
SOCKET_NAME = "watch.sock"


#: the engine's ``poll`` (seconds between checks for a stop), and its bounds
POLL = 1.0
POLL_MAX = 60.0


def check_poll(poll):
    """``poll`` as a float: seconds in (0, :data:`POLL_MAX`]; ``ValueError`` naming it otherwise."""
    if isinstance(poll, bool) or not isinstance(poll, (int, float)) or not 0 < poll <= POLL_MAX:
        raise ValueError(f"multimaster_watch: poll must be seconds in (0, {POLL_MAX:g}], "
                         f"not {poll!r:.50}")
    return float(poll)


def socket_path(state_dir):
    """The watcher's socket in a master's state dir."""
    return os.path.join(state_dir, SOCKET_NAME)


def master_trees(opts):
    """
    The real paths of every ``file_roots`` and ``pillar_roots`` root and of
    the ``pki_dir`` of a master's ``opts``, sorted, each once: what its
    watcher watches (a sync checks each against the watcher's reply).
    """
    trees = {os.path.realpath(opts["pki_dir"])} if opts.get("pki_dir") else set()
    for cat in ("file_roots", "pillar_roots"):
        for roots in (opts.get(cat) or {}).values():
            for root in roots or ():
                if isinstance(root, str) and root:
                    trees.add(os.path.realpath(root))
    return sorted(trees)


def client(state_dir):
    """
    ``since -> reply or None``: :func:`query` of the watcher of the master
    whose state dir is ``state_dir`` (None at once when no watcher runs:
    no socket to connect to).
    """
    return functools.partial(query, socket_path(state_dir))


#: the engine's name in a master's ``engines`` option
ENGINE = "multimaster_watch"


def engine_name(entry):
    """The engine an entry of a master's ``engines`` option names (None: malformed)."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and len(entry) == 1:
        return next(iter(entry))
    return None


def engines_config(main, dropins):
    """
    The ``engines`` option a master.d drop-in must hold so that the master
    runs the engines it runs now plus :data:`ENGINE`; None when it runs it
    already (the drop-in then sets no ``engines``).  Salt merges the
    ``engines`` lists of the master.d files and lets them replace the master
    file's: a drop-in listing only this engine would stop the others.
    ``main``: the master file's ``engines`` (None: none); ``dropins``: the
    ``engines`` of every other master.d file.  ``ValueError`` naming the
    option when one is not a list.
    """
    lists = []
    for where, value in [("the master file", main)] + [
            (f"master.d drop-in #{i + 1}", v) for i, v in enumerate(dropins)]:
        if value is None:
            lists.append([])
        elif isinstance(value, list):
            lists.append(value)
        else:
            raise ValueError(f"engines in {where} is not a list: {value!r:.100}")
    others = [e for value in lists[1:] for e in value]
    running = others if others else lists[0]
    if ENGINE in {engine_name(e) for e in running}:
        return None
    # the drop-ins' lists are merged with this one: only the master file's
    # must be repeated
    return ([] if others else list(lists[0])) + [{ENGINE: {}}]
