"""
The runner-to-peer protocol: what travels on Salt's publish channel.

Every minion of the primary receives (and decrypts) every publish, and a
minion at debug log level writes it to its log.  So a request to a peer's
minion carries nothing but routing in clear: its keyword arguments are one
JSON document sealed to that peer's minion key (:mod:`salt_multimaster.seal`),
published as ``sealed={peer id: blob}``; each peer opens its own blob.
Bulk contents never ride the publish: past ``inline_limit`` they are pulled
point-to-point through ``peer_run`` (``multimaster.pull``), and a sync that
cannot pull is refused with the configuration to add
(:func:`peer_run_snippet`).

Every peer reply carries ``protocol``: a peer running another version is a
named error, not a silent "did not return".
"""

import base64
import hashlib
import json
import re

import msgpack

from salt_multimaster import layout, seal

PROTOCOL = 1
PULL_FUNCTION = "multimaster.pull"
# The master.d drop-in a sync writes on a peer (master_config).
DROPIN_NAME = "multimaster-sync.conf"


class ProtocolError(ValueError):
    """A request this peer cannot open or does not speak."""


def _purpose(fun):
    return f"request/{fun}"


def sealed_kwarg(peer_pubs, fun, kwargs):
    """
    The publish's keyword arguments for ``fun`` sent to several peers:
    ``{"sealed": {peer: blob}}``, each blob carrying ``kwargs`` to its peer
    only; ``peer_pubs``: ``{peer: public key PEM}``.
    """
    body = json.dumps({"protocol": PROTOCOL, "fun": fun, "kwargs": kwargs},
                      separators=(",", ":"), sort_keys=True)
    return {"sealed": {peer: seal.seal(pub, body, peer, _purpose(fun))
                       for peer, pub in sorted(peer_pubs.items())}}


def open_request(private_pem, receiver, fun, sealed):
    """
    The keyword arguments sealed to ``receiver`` in ``sealed`` (the publish's
    ``{peer: blob}`` mapping, or one blob).  Raise :class:`ProtocolError` when
    there is none for this peer, it does not open, or speaks another version.
    """
    blob = sealed.get(receiver) if isinstance(sealed, dict) else sealed
    if not blob:
        raise ProtocolError(f"no request sealed to {receiver!r} in this publish")
    try:
        msg = json.loads(seal.unseal(private_pem, blob, receiver, _purpose(fun)))
    except seal.SealError as exc:
        raise ProtocolError(str(exc)) from None
    except ValueError:
        raise ProtocolError(f"sealed {fun} request is not a JSON document") from None
    if not isinstance(msg, dict) or msg.get("fun") != fun:
        raise ProtocolError(f"sealed request is not a {fun} request")
    if msg.get("protocol") != PROTOCOL:
        raise ProtocolError(
            f"the primary speaks protocol {msg.get('protocol')!r}, this peer {PROTOCOL}: "
            "install the same salt-multimaster on every master"
        )
    kwargs = msg.get("kwargs")
    if not isinstance(kwargs, dict):
        raise ProtocolError(f"sealed {fun} request carries no arguments")
    return kwargs


# ---------------------------------------------------------------------------
# Requests: the arguments each peer function accepts in its sealed request
# ---------------------------------------------------------------------------
REQUESTS = {
    "multimaster_peer.inventory": ("categories", "digests", "topology", "config_keys", "rescan",
                                   "epoch"),
    "multimaster_peer.apply": ("ops", "topology", "pull_token", "pull_chunks", "backup_keep",
                               "expect", "config_keys", "keys_digest", "confirm", "epoch"),
    "multimaster_peer.restore": ("backup_name", "test", "epoch"),
    "multimaster_peer.rotate_key": ("topology", "keypair", "restart_only", "restart_cmd", "test",
                                    "backup_keep"),
    "multimaster_peer.collect": ("items", "reply_to", "reply_pub", "epoch"),
}


def request(fun, **kwargs):
    """
    The keyword arguments of a request to the peer function ``fun``, without
    the ``None`` ones; an argument ``fun`` does not take raises
    :class:`ProtocolError` (a primary bug, never sent).
    """
    unknown = sorted(set(kwargs) - set(REQUESTS[fun]))
    if unknown:
        raise ProtocolError(f"{fun} takes no {', '.join(unknown)}")
    return {key: value for key, value in kwargs.items() if value is not None}


def request_args(fun, kwargs, given):
    """
    The arguments of a call of ``fun``: ``given`` (its defaults, or the
    command line's) updated with the opened request ``kwargs``; an argument
    it does not take raises :class:`ProtocolError`.
    """
    unknown = sorted(set(kwargs) - set(given))
    if unknown:
        raise ProtocolError(f"unknown arguments in the request: {', '.join(unknown)}")
    return dict(given, **kwargs)


# ---------------------------------------------------------------------------
# Replies: every peer reply carries ``protocol``; the key naming each kind
# ---------------------------------------------------------------------------
REPLIES = {
    "multimaster_peer.inventory": ("the inventory", "master_id"),
    "multimaster_peer.apply": ("the apply", "backup"),
    "multimaster_peer.restore": ("the restore", "restored"),
    "multimaster_peer.rotate_key": ("the key rotation", "restart"),
    "multimaster_peer.collect": ("the collect", "items"),
}


def reply(ret):
    """``ret`` as a peer sends it back: with this side's protocol version."""
    ret["protocol"] = PROTOCOL
    return ret


def refused(ret):
    """
    Whether ``ret`` is a peer's refusal of a request as invalid (its reply
    ``{"result": False, "error": ...}`` in this protocol): it changed nothing.
    """
    return (isinstance(ret, dict) and ret.get("protocol", 0) == PROTOCOL
            and ret.get("result") is False and bool(ret.get("error")))


def check_reply(peer, fun, ret):
    """
    ``(reply, None)`` for a valid reply of ``peer`` to ``fun`` (``ret``: its
    Salt return, ``None`` when it did not answer), its ``protocol`` taken
    out; else ``(None, error)``: the peer did not answer, runs another
    protocol version (a reply without ``protocol``: a peer older than
    protocol 1), or refused (its error); the error says what to do.
    """
    what, key = REPLIES[fun]
    if isinstance(ret, dict) and ret.get("protocol", 0) != PROTOCOL:
        return None, (f"peer runs protocol {ret.get('protocol', 0)}, primary {PROTOCOL}: "
                      f"upgrade salt-multimaster on {peer}")
    if isinstance(ret, dict) and key in ret:
        ret = dict(ret)
        ret.pop("protocol")
        return ret, None
    if refused(ret):
        return None, str(ret["error"])
    if ret is None:
        return None, (f"{peer}'s salt-minion did not answer {what} (it is not connected to "
                      f"this master, or it stopped while working): start it, or check "
                      f"`salt-run manage.status`")
    return None, (f"{peer} gave no usable reply to {what}: {str(ret)[:300]} (is "
                  f"salt-multimaster installed there, and multimaster.master_config set on "
                  f"its minion?)")


# ---------------------------------------------------------------------------
# A conditional apply: what the primary expects the peer to hold
# ---------------------------------------------------------------------------
#: the categories replicated by bucket (their digests are per bucket)
BUCKETED = ("minion_keys", "file_roots", "pillar_roots")


def config_digest(values):
    """The digest of replicated master options (``{option: value}``)."""
    text = json.dumps(values, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def expectation(held):
    """
    What an apply expects the peer to hold, from what the primary last
    confirmed it held (``held``: ``{category: inventory entry}``):
    digests only, nothing secret (the request is sealed all the same).
    """
    # held keeps digests (and saltenvs) already, but the values of master_config
    return {cat: {"config": config_digest(entry)} if cat == "master_config" else dict(entry)
            for cat, entry in held.items()}


def expected_digests(expect):
    """The bucket digests an inventory checking ``expect`` compares with."""
    return {cat: e["digest"] for cat, e in expect.items() if cat in BUCKETED}


def holds(expect, inv):
    """Whether the peer whose inventory is ``inv`` holds what ``expect`` says."""
    for cat, want in expect.items():
        have = inv.get(cat) or {}
        if cat in BUCKETED:
            if have.get("buckets") or have.get("digest") != want["digest"]:
                return False
            if "envs" in want and have.get("envs") != want["envs"]:
                return False
        elif cat == "master_keys":
            if (have.get("pem"), have.get("pub")) != (want["pem"], want["pub"]):
                return False
        elif config_digest(have) != want["config"]:
            return False
    return True


# ---------------------------------------------------------------------------
# Items: how the pull grant, the seals and the backups name what is synced
# ---------------------------------------------------------------------------
def item_name(cat, op):
    """An operation's item as the pull grant and the seals name it."""
    if cat == "minion_keys":
        return f"{cat}/{op['state']}/{op['id']}"
    if cat == "master_keys":
        return f"{cat}/{op['name']}"
    if cat == "master_config":
        return f"{cat}/{DROPIN_NAME}"
    return f"{cat}/{op['env']}/{op['rel']}"


def parse_item(item):
    """
    ``(category, fields)`` of an item named by :func:`item_name`: fields
    ``state``/``id`` (minion keys), ``env``/``rel`` (roots), ``name``.
    Raise :class:`ProtocolError` for a name it does not make.
    """
    cat, _, rest = str(item).partition("/")
    first, _, second = rest.partition("/")
    if cat == "minion_keys" and first and second:
        return cat, {"state": first, "id": second}
    if cat in ("file_roots", "pillar_roots") and first and second:
        return cat, {"env": first, "rel": second}
    if cat in ("master_keys", "master_config") and rest:
        return cat, {"name": rest}
    raise ProtocolError(f"not an item name: {item!r}")


# ---------------------------------------------------------------------------
# The pull channel (peer_run multimaster.pull)
# ---------------------------------------------------------------------------
def pull_request(token, index):
    """The ``request`` argument of a pull of chunk ``index`` of grant ``token``."""
    return base64.urlsafe_b64encode(
        json.dumps({"token": token, "chunk": index}).encode()).decode().rstrip("=")


def open_pull_request(text):
    """``(token, chunk index)`` of a pull request; :class:`ProtocolError` when malformed."""
    try:
        req = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
        token, index = str(req["token"]), int(req["chunk"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ProtocolError(f"malformed pull request: {exc}") from None
    if not token.isalnum() or index < 0:
        raise ProtocolError("malformed pull request: bad token or chunk")
    return token, index


def seal_pull_reply(peer_pub, peer, token, contents, missing, ops=None):
    """
    A chunk as the primary serves it, sealed to ``peer``: ``{"sealed": blob}``
    (the first chunk also carries the operations).
    """
    body = {"contents": contents, "missing": missing}
    if ops is not None:
        body["ops"] = ops
    # msgpack itself, not salt.payload: Salt's loads turns UTF-8 bytes into str
    return {"sealed": seal.seal(peer_pub, msgpack.packb(body, use_bin_type=True), peer,
                                f"pull/{token}", binary=True)}


def open_pull_reply(unseal, token, reply_):
    """
    The chunk ``{"contents", "missing"[, "ops"]}`` of a pull reply;
    ``unseal(blob, purpose)`` opens what was sealed to this peer.
    """
    if isinstance(reply_, dict) and set(reply_) == {"outputter", "data"}:
        reply_ = reply_["data"]
    if not isinstance(reply_, dict) or "sealed" not in reply_:
        why = reply_.get("error") if isinstance(reply_, dict) and reply_ else "check its peer_run"
        raise ProtocolError(f"the primary refused multimaster.pull ({why})")
    try:
        return msgpack.unpackb(unseal(reply_["sealed"], f"pull/{token}"), raw=False)
    except seal.SealError as exc:
        raise ProtocolError(str(exc)) from None


def payload_size(ops):
    """Bytes the operations of an apply take in its (sealed) request."""
    return len(json.dumps(ops, separators=(",", ":"), default=str))


def peer_run_pattern(peer):
    """The ``peer_run`` key matching exactly ``peer`` (Salt matches it as a regex)."""
    return f"{re.escape(peer)}$"


def pull_allowed(peer_run, peer):
    """
    Whether a master's ``peer_run`` lets ``peer`` call ``multimaster.pull``:
    the match Salt itself makes (salt/daemons/masterapi.py, minion_runner).
    """
    if not isinstance(peer_run, dict):
        return False
    for match, funs in peer_run.items():
        try:
            if re.match(str(match), peer) and isinstance(funs, list):
                if any(re.match(str(fun), PULL_FUNCTION) for fun in funs):
                    return True
        except re.error:
            continue
    return False


def peer_run_config(peers):
    """The ``peer_run`` option granting each of ``peers`` the pull channel."""
    return {peer_run_pattern(peer): [PULL_FUNCTION] for peer in sorted(peers)}


def peer_run_snippet(peers):
    """The master config to add, as YAML text an operator can paste."""
    lines = ["peer_run:"]
    for pattern, funs in peer_run_config(peers).items():
        lines.append(f"  '{pattern}':")
        lines.extend(f"    - {fun}" for fun in funs)
    return "\n".join(lines)


def refusal(peer, size, inline_limit):
    """The error of a sync too large to publish for a peer that cannot pull."""
    return (
        f"{size // 1024} KiB to send to {peer} exceeds inline_limit "
        f"({inline_limit // 1024} KiB) and {peer} may not pull it: bulk never rides the "
        f"publish (every minion receives it). Let it pull point-to-point; add to this "
        f"master's config (e.g. master.d/multimaster-pull.conf, or apply the "
        f"salt.multimaster.master state) and restart the master:\n"
        f"{peer_run_snippet([peer])}"
    )


def dropin_path(mopts):
    """Where a peer's master reads the replicated master options."""
    return layout.master_dropin(mopts, DROPIN_NAME)
