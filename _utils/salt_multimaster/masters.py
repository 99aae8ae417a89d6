"""
A minion's ``master`` entries: one grammar for the audit and the states.

Salt's ``master`` option is a string or a list of ``host``, ``host:port``,
``[v6]:port`` or bare IPv6 entries; the port defaults to the minion's
``master_port``.  :func:`parse` is strict (the states refuse to write an entry
Salt could not use); :func:`parse_lenient` reads the same grammar for a
report (the audit names the bad entry as a finding and goes on).

Two entries name the same master when their ports match and their hosts are
equal or share an address (:func:`resolve_hosts`): :func:`group` finds them,
:func:`dedup` keeps the first spelling of each.

Plain functions, no Salt loader.
"""

import concurrent.futures
import ipaddress
import logging
import re
import socket

log = logging.getLogger(__name__)

#: Salt's defaults for ``master_port`` (request server) and ``publish_port``.
DEFAULT_MASTER_PORT = 4506
DEFAULT_PUBLISH_PORT = 4505

_BRACKETED = re.compile(r"^\[([^\]]+)\](?::(\d+))?$")


def parse(entry, default_port=DEFAULT_MASTER_PORT):
    """
    ``(host, port)`` for a ``master`` entry.  The host is lower-cased without
    a final dot (DNS names are case insensitive) and IP addresses are
    normalised; the port defaults to ``default_port``.

    Raises ValueError naming the entry when Salt could not use it: not a
    non-empty string, no host, a port that is not a number from 1 to 65535,
    a malformed ``[ipv6]:port``.
    """
    if not isinstance(entry, str) or not entry.strip():
        raise ValueError(f"master entry {entry!r} is not a non-empty string")
    text = entry.strip()
    host, port = text, None
    if text.startswith("["):
        match = _BRACKETED.match(text)
        if not match:
            raise ValueError(f"master entry {entry!r} is not a valid [ipv6]:port")
        host, port = match.group(1), match.group(2)
    elif text.count(":") == 1:
        host, port = text.split(":")
        if not port.isdigit():
            raise ValueError(f"master entry {entry!r} has a non-numeric port")
    if not host:
        raise ValueError(f"master entry {entry!r} has no host")
    try:
        host = ipaddress.ip_address(host).compressed
    except ValueError:
        host = host.lower().rstrip(".")
    port = int(port) if port is not None else int(default_port)
    if not 0 < port < 65536:
        raise ValueError(f"master entry {entry!r} has an invalid port {port}")
    return host, port


def as_int(value, default=0):
    """``int(value)``, or ``default`` for a value that is not a number (a port, seconds)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def parse_lenient(entry, default_port=DEFAULT_MASTER_PORT):
    """
    ``((host, port), error)``: :func:`parse`'s answer and None, or for an
    entry it refuses the whole entry (lower-cased) as the host, the default
    port, and the reason.  Such an entry only equals itself.
    """
    try:
        return parse(entry, default_port), None
    except ValueError as exc:
        return (str(entry).strip().lower(), int(default_port)), str(exc)


def entries(masters):
    """
    The configured master entries as a list of strings: Salt's ``master``
    option is a string or a list.
    """
    if masters is None or masters == "":
        return []
    if isinstance(masters, (list, tuple)):
        return [str(m).strip() for m in masters if str(m).strip()]
    return [str(masters).strip()]


def split_list(value):
    """
    Masters given on the command line: a list, or a comma separated string
    (``masters=m1,m2``); None stays None (not given).
    """
    if value is None:
        return None
    return entries(value if isinstance(value, (list, tuple)) else str(value).split(","))


def _getaddrinfo(host):
    infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    return {ipaddress.ip_address(info[4][0].split("%", 1)[0]).compressed for info in infos}


def resolve_hosts(hosts, timeout=2.0, resolver=None):
    """
    Resolve host names in parallel, giving up after ``timeout`` seconds.

    Returns ``{host: set of addresses}``; an IP address resolves to itself and
    a name that does not resolve (in time) maps to an empty set.
    """
    resolver = resolver or _getaddrinfo
    ret = {}
    names = []
    for host in dict.fromkeys(hosts):
        try:
            ipaddress.ip_address(host)
            ret[host] = {host}
        except ValueError:
            names.append(host)
    if not names:
        return ret
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(names)))
    futures = {pool.submit(resolver, name): name for name in names}
    try:
        done, _ = concurrent.futures.wait(futures, timeout=timeout)
        for future, name in futures.items():
            try:
                ret[name] = set(future.result(timeout=0)) if future in done else set()
            except Exception as exc:  # pylint: disable=broad-except
                log.debug("multimaster: cannot resolve %s: %s", name, exc)
                ret[name] = set()
    finally:
        pool.shutdown(wait=False)
    return ret


def same(a, b, resolved=None):
    """Two parsed entries name one master: same port, same host or a shared address."""
    (host_a, port_a), (host_b, port_b) = a, b
    if port_a != port_b:
        return False
    if host_a == host_b:
        return True
    resolved = resolved or {}
    return bool(resolved.get(host_a, set()) & resolved.get(host_b, set()))


def group(parsed, resolved=None):
    """
    ``parsed``: ``[(entry, (host, port))]``.  The entries grouped by the
    master they name, in order of first appearance; a group of two or more
    is one master listed several times (Salt opens one connection per entry
    and every job returns once per connection).
    """
    groups = []
    for entry, key in parsed:
        for grp in groups:
            if same(grp[0][1], key, resolved):
                grp.append((entry, key))
                break
        else:
            groups.append([(entry, key)])
    return groups


def dedup(masters, default_port=DEFAULT_MASTER_PORT, resolved=None):
    """
    ``(unique, duplicates)``: the entries to keep (the first spelling of each
    master, in order) and the entries dropped, in their order.  Raises
    ValueError (:func:`parse`) for an entry Salt could not use.
    """
    parsed = [(index, parse(entry, default_port)) for index, entry in enumerate(masters)]
    groups = group(parsed, resolved)
    dropped = sorted(index for grp in groups for index, _ in grp[1:])
    unique = [masters[grp[0][0]].strip() for grp in groups]
    return unique, [masters[index] for index in dropped]
