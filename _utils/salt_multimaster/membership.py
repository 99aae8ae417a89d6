"""
Who the peers of a primary are, and which minions list a master: the logic
behind ``salt-run multimaster.add_peer`` and ``multimaster.remove_peer``.

The peers the product added live in a drop-in it owns on the primary,
``<master.d>/multimaster-peers.conf`` (0600, written atomically)::

    multimaster:
      peers: [master03]

How Salt merges it (``salt.config.master_config``, 3006 to 3008): the
``master.d/*.conf`` files are merged into one another in file name order,
mappings recursively and lists as a union (``salt.utils.dictupdate.update``
with ``merge_lists``); the result then *replaces* each top-level key of the
main config file.  Hence:

* the operator's ``multimaster`` block in ``master.d`` (e.g.
  ``master.d/multimaster.conf``): the effective ``multimaster:peers`` is the
  operator's list followed by the drop-in's peers not already in it; every
  other setting stays the operator's.  The operator's list is authoritative:
  ``remove_peer`` never removes a peer listed there, it says where it is.
* the operator's ``multimaster`` block in the main config file: any
  ``master.d`` file with a ``multimaster`` key would hide that whole block
  from Salt, so the drop-in is refused (:func:`shadowed`) with the remedy:
  move the block into ``master.d/multimaster.conf``.

The steps of both commands: :mod:`salt_multimaster.membership_steps`.
Plain Python: no Salt dunders.
"""

import logging
import os
import re

import salt.config
import salt.utils.yaml

from salt_multimaster import (checks, daemon, fsutil, layout, manifest, masters, report,
                              statefile, validate)

log = logging.getLogger(__name__)

DROPIN_NAME = "multimaster-peers.conf"
DROPIN_MODE = 0o600
HEADER = (
    "# Managed by salt-run multimaster.add_peer / multimaster.remove_peer: do not edit.\n"
    "# Merged with multimaster:peers of your own master.d files (a union); see\n"
    "# docs/add-remove-peer.rst.\n"
)


class MembershipError(ValueError):
    """Bad input or a configuration the commands cannot change; the message says why."""


def dropin_path(opts):
    """``<dir of conf_file>/<dir of default_include>/multimaster-peers.conf``."""
    return layout.master_dropin(opts, DROPIN_NAME)


def as_list(value):
    """A peers value as Salt's config holds it (list, comma string or None) -> list."""
    try:
        return validate.as_list("multimaster:peers", value)
    except validate.InvalidInput as exc:
        raise MembershipError(str(exc)) from None


def effective_peers(opts):
    """The peers Salt loaded (``opts["multimaster"]["peers"]``), drop-in included."""
    conf = opts.get("multimaster")
    if conf is None:
        return []
    if not isinstance(conf, dict):
        raise MembershipError(f"the multimaster option must be a mapping, not {conf!r}")
    return as_list(conf.get("peers"))


def read_dropin(path):
    """The peers listed in the drop-in (``[]`` when it does not exist)."""
    try:
        data = statefile.read(path, parse=statefile.parse_yaml)
    except statefile.Damaged as exc:
        raise MembershipError(f"{exc}: fix it, or remove it and add the peers again with "
                              "salt-run multimaster.add_peer") from None
    conf = (data or {}).get("multimaster") if isinstance(data, dict) or data is None else None
    if data and (not isinstance(conf, dict) or set(data) != {"multimaster"}
                 or set(conf) - {"peers"}):
        raise MembershipError(
            f"{path} holds more than multimaster:peers: it is owned by add_peer/remove_peer; "
            "move your own settings to another master.d file")
    return as_list((conf or {}).get("peers"))


def write_dropin(path, peers):
    """
    Write the drop-in listing ``peers`` (0600, temp file, fsync, rename), or
    remove it when ``peers`` is empty.  Returns the path.
    """
    if not peers:
        statefile.remove(path)
        return path
    fsutil.makedirs(os.path.dirname(path), mode=0o755)
    statefile.write(path, HEADER + salt.utils.yaml.safe_dump(
        {"multimaster": {"peers": list(peers)}}, default_flow_style=False), mode=DROPIN_MODE)
    return path


def shadowed(conf_file, dropin):
    """
    Why the drop-in cannot be used, or None: a ``multimaster`` block in the
    main config file, which Salt would replace with the drop-in's.
    """
    try:
        with open(conf_file, encoding="utf-8") as fh:
            data = salt.utils.yaml.safe_load(fh)
    except (OSError, salt.utils.yaml.YAMLError):
        return None
    if not isinstance(data, dict) or data.get("multimaster") is None:
        return None
    conf_dir = os.path.dirname(dropin)
    return (
        f"{conf_file} sets multimaster itself, and Salt replaces a top-level option of the "
        f"main config file with the one of any {conf_dir}/*.conf: a {DROPIN_NAME} there "
        f"would hide your whole multimaster block. Move that block to "
        f"{os.path.join(conf_dir, 'multimaster.conf')} (merged with {DROPIN_NAME}: the "
        "peers lists are joined), then run the command again")


def check_new_peer(peer, opts, configured, dropin_peers):
    """
    Refuse a peer ``add_peer`` must not add: an invalid id, the primary
    itself, a peer already configured, a minion whose key is not accepted
    here.  Raises :class:`MembershipError`.
    """
    if not manifest.valid_minion_id(peer) or "," in peer:
        raise MembershipError(f"invalid peer id {peer!r}: give the peer host's minion id")
    own = str(opts.get("id") or "")
    if peer in (own, own.removesuffix("_master")):
        raise MembershipError(
            f"{peer!r} is this primary master itself ({own}): a peer is another host")
    if peer in configured:
        where = ("the drop-in " + dropin_path(opts) + ", written by add_peer"
                 if peer in dropin_peers else "your multimaster:peers")
        raise MembershipError(
            f"{peer!r} is already a peer (in {where}): run salt-run multimaster.sync "
            f"peers={peer} or multimaster.status peers={peer}")
    state = next((state for state in manifest.KEY_STATES   # the key dir holding it, if any
                  if os.path.isfile(os.path.join(opts["pki_dir"], state, peer))), None)
    if state != "minions":
        raise MembershipError(
            f"{peer!r} is not an accepted minion of this master"
            + (f" (its key is in {state}): " if state else ": ")
            + ("accept it with salt-key -a " + peer if state == "minions_pre" else
               f"run a salt-minion with id {peer} on the new master's host, with this master "
               f"in its master list, and accept its key (salt-key -a {peer})"))


def check_host(peer, host, primary_id, primary_pub_sha):
    """
    What the peer host reported (``multimaster_peer.host_check``) -> the
    check step: ``{"result", "comment", "master": state}``.  ``state`` is
    ``stopped`` (its salt-master never started or is down, ports free),
    ``own_key`` (it runs with its own master key: restarted after the
    keys are placed), ``primary_key`` (it runs with the primary's key
    already) or ``busy`` (something else answers on its ports).
    """
    if not isinstance(host, dict) or "master_id" not in host:
        return {"result": False, "master": None,
                "comment": f"{peer}'s salt-minion gave no host check: {str(host)[:300]} (is "
                           "salt-multimaster installed there, and multimaster.master_config "
                           "set on its minion?)"}
    where = f"{host.get('master_config')}"
    how = host.get("master_restart")
    if isinstance(how, dict) and how.get("refused"):
        return {"result": False, "master": None,
                "comment": f"{peer}: nothing written, its salt-master cannot be (re)started "
                           f"by the command configured there: {how['refused']}"}
    if host["master_id"] == primary_id:
        return {"result": False, "master": None,
                "comment": f"{peer}'s master config {where} is this primary's own "
                           f"(id {primary_id}): a peer is another master"}
    listening = [p for p, busy in sorted((host.get("ports") or {}).items()) if busy]
    if host.get("master_pid"):
        own = host.get("pub_sha") != primary_pub_sha
        return {"result": True, "master": "own_key" if own else "primary_key",
                "comment": f"salt-master runs on {peer} (pid {host['master_pid']}, "
                           f"{where}) with " + ("its own master key: it restarts once the "
                                                "primary's keys are placed" if own else
                                                "the primary's master key")}
    if listening:
        return {"result": False, "master": "busy",
                "comment": f"ports {', '.join(map(str, listening))} on {peer} are taken by "
                           "something that is no running salt-master of "
                           f"{where}: free them (or fix interface/ports there) first"}
    return {"result": True, "master": "stopped",
            "comment": f"salt-master on {peer} is not running and its ports are free "
                       f"({where}): the keys are placed before its first start"}


def master_entry(host, address=None):
    """
    How minions name the peer's master in their ``master`` list: ``address``
    when given, else its ``interface`` (when it listens on one address), else
    the host's fqdn; ``:<ret_port>`` when not 4506.
    """
    if address:
        return str(address)
    interface = str(host.get("interface") or "")
    name = interface if interface not in ("", "0.0.0.0", "::") else host.get("fqdn") or ""
    if not name:
        raise MembershipError("cannot tell the peer's master address: pass address=<host>")
    port = int(host.get("ret_port") or masters.DEFAULT_MASTER_PORT)
    if port != masters.DEFAULT_MASTER_PORT:
        name = f"[{name}]:{port}" if ":" in name else f"{name}:{port}"
    return name


def lists(entries, entry, resolved):
    """Whether the master list ``entries`` names the master ``entry`` (any spelling)."""
    want = masters.parse_lenient(entry)[0]
    return any(masters.same(masters.parse_lenient(e)[0], want, resolved)
               for e in masters.entries(entries))


def minion_rows(entry, minions, current, pillars, adding):
    """
    Per minion, where it stands with the master ``entry``.

    minions
        The minion ids looked at.
    current
        ``{id: master list}`` as the minions' ``multimaster.audit`` reported
        their config files (a minion missing did not answer).
    pillars
        ``{id: multimaster:masters}`` from the minion data cache (missing:
        no cached pillar).
    adding
        True for add_peer, False for remove_peer.

    Returns ``{"<status>": [ids]}``.  add_peer: ``lists_it`` (already),
    ``will_get`` (pillar lists it: the next ``state.apply salt.multimaster``
    adds it), ``pillar_lacks`` (update the pillar), ``no_pillar`` (no cached
    pillar), ``no_answer``.  remove_peer: ``clean``, ``still_lists``
    (its config), ``pillar_lists`` (its pillar, the formula would put it
    back), ``no_answer``.
    """
    hosts = [masters.parse_lenient(entry)[0][0]]
    for value in list(current.values()) + list(pillars.values()):
        hosts.extend(masters.parse_lenient(e)[0][0] for e in masters.entries(value))
    resolved = masters.resolve_hosts(hosts)
    rows = {}
    for mid in sorted(minions):
        in_pillar = mid in pillars and lists(pillars[mid], entry, resolved)
        if adding:
            if mid in current and lists(current[mid], entry, resolved):
                status = "lists_it"
            elif mid not in pillars:
                status = "no_pillar"
            elif in_pillar:
                status = "will_get" if mid in current else "no_answer"
            else:
                status = "pillar_lacks"
        elif mid in current and lists(current[mid], entry, resolved):
            status = "still_lists"
        elif in_pillar:
            status = "pillar_lists"
        else:
            status = "clean" if mid in current else "no_answer"
        rows.setdefault(status, []).append(mid)
    return rows


def pillar_masters(pillars, minions):
    """``{id: multimaster:masters}`` of ``minions`` from their cached pillars (where set)."""
    ret = {}
    for mid, pillar in (pillars or {}).items():
        conf = pillar.get("multimaster") if isinstance(pillar, dict) else None
        value = conf.get("masters") if isinstance(conf, dict) else None
        if value is not None and mid in minions:
            ret[mid] = masters.entries(value)
    return ret


ADD_NEXT = {
    "will_get": "apply the formula: salt -L {ids} state.apply salt.multimaster",
    "pillar_lacks": "add {entry} to pillar multimaster:masters for {ids}, "
                    "salt -L {ids} saltutil.refresh_pillar, then apply salt.multimaster",
    "no_pillar": "no pillar cached for {ids}: salt -L {ids} saltutil.refresh_pillar, then run "
                 "this again with test=True",
    "no_answer": "{ids} did not answer: check them once they return (salt-run multimaster.audit)",
}
REMOVE_NEXT = {
    "still_lists": "{ids} still list {entry}: remove it from pillar multimaster:masters, then "
                   "salt -L {ids} state.apply salt.multimaster",
    "pillar_lists": "pillar multimaster:masters of {ids} still lists {entry}: the formula "
                    "would put it back; remove it there",
    "no_answer": "{ids} did not answer: their master list is unknown; audit them once they "
                 "return (salt-run multimaster.audit)",
}


def next_steps(rows, entry, adding):
    """One line per status that needs an operator's step."""
    texts = ADD_NEXT if adding else REMOVE_NEXT
    return [texts[status].format(ids=",".join(ids), entry=entry)
            for status, ids in sorted(rows.items()) if status in texts and ids]


def pub_sha(opts, topology):
    """The sha256 of the master public key this master serves for ``topology``, or None."""
    try:
        return manifest.sha256_file(layout.master_key_files(opts, topology)[1])
    except OSError:
        return None


def host_report(mopts, grains, topology, connect=None):
    """
    The peer host's side of the check (``multimaster_peer.host_check``):
    its master's id, config file, interface and ports, whether each port
    has a listener, the running master's pid (from its pidfile), and the
    sha256 of the public key it serves for ``topology``.  No secret.
    """
    connect = connect or (lambda host, port:
                          checks.tcp_connect(host, port, daemon.CONNECT_TIMEOUT) is None)
    host, ret_port = daemon.master_address(mopts)
    publish_port = int(mopts.get("publish_port") or 4505)
    ports = {port: connect(host, port) for port in (publish_port, ret_port)}
    running = daemon.master_process(mopts)
    return {"master_id": mopts.get("id"), "master_config": mopts.get("conf_file"),
            "interface": mopts.get("interface"), "ret_port": ret_port,
            "publish_port": publish_port, "ports": ports,
            "master_pid": running[0] if running else None, "pub_sha": pub_sha(mopts, topology),
            "fqdn": (grains or {}).get("fqdn")}


# The sync's error line of a restart nothing made (sync.verdict): the start
# step handles it, as it handles the peer's master not running (daemon.py).
_RESTART_LINE = ("{peer}'s salt-master must restart to load the new master keys or config "
                 "(no service manager restarted it): restart it")


def sync_kept(res, peer):
    """
    Whether a sync's return for one peer left it holding (test: would leave
    it holding) the primary's data: every category without errors,
    conflicts or unconfirmed items, and no error but its master not
    running or a restart required (the ``start`` step's business).
    """
    if not isinstance(res, dict):
        return False
    cats = [rep for rep in res.values() if isinstance(rep, dict) and "errors" in rep]
    if not cats or any(rep.get("errors") or rep.get("conflicts") or rep.get("unconfirmed")
                       or rep.get("peer_changed") for rep in cats):
        return False
    rest = str(res.get("error") or "").replace(_RESTART_LINE.format(peer=peer), "")
    head, tail = daemon.not_running_error(peer, "\0").split("\0")
    rest = re.sub(re.escape(head) + r"[^)]*" + re.escape(tail), "", rest)
    return not rest.strip("; ")


def master_step(check_state, sync_res, test):
    """
    The ``start`` step of add_peer from the host check's master state and
    the sync's return: ``{"result", "comment", "start": bool}`` (``start``:
    the runner starts the peer's salt-master now).
    """
    restart = (sync_res or {}).get("restart") if isinstance(sync_res, dict) else None
    if check_state == "stopped":
        return {"result": None if test else False, "start": not test,
                "comment": "salt-master " + ("would start" if test else "must start")
                           + " once the primary's master keys are placed (its first start)"}
    if check_state == "own_key":
        if test:
            return {"result": None, "start": False,
                    "comment": "salt-master would restart to load the primary's master keys"}
        if restart == "restarting":
            return {"result": True, "start": False,
                    "comment": "salt-master restarts in the background with the primary's keys"}
        return {"result": False, "start": False,
                "comment": "salt-master runs with its own master key: restart it now to load "
                           "the primary's (no service manager restarted it)"}
    return {"result": True, "start": False,
            "comment": "salt-master runs with the primary's master key"}


def report_rows(ret):
    """
    The compact report of add_peer/remove_peer for ``salt-run`` without
    ``--out`` (:func:`salt_multimaster.report.steps_rows`, titled ``peer``):
    one row per step with its status and comment (the sync's categories,
    the minions' groups), the next steps, then ``retcode``.
    """
    title = f"{ret.get('peer')} (minions list it as {ret.get('master_entry', '?')})"
    return report.steps_rows(ret, title, False, title_key="peer", peer=ret.get("peer"))
