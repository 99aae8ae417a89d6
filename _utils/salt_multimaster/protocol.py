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

import json
import os
import re

from salt_multimaster import seal

PROTOCOL = 1
PULL_FUNCTION = "multimaster.pull"
# The master.d drop-in a sync writes on a peer (master_config).
DROPIN_NAME = "multimaster-sync.conf"


class ProtocolError(ValueError):
    """A request this peer cannot open or does not speak."""


def _purpose(fun):
    return f"request/{fun}"


def seal_request(peer_pub, peer, fun, kwargs):
    """The blob carrying ``kwargs`` of ``fun`` to ``peer`` only."""
    body = json.dumps({"protocol": PROTOCOL, "fun": fun, "kwargs": kwargs},
                      separators=(",", ":"), sort_keys=True)
    return seal.seal(peer_pub, body, peer, _purpose(fun))


def sealed_kwarg(peer_pubs, fun, kwargs):
    """
    The publish's keyword arguments for ``fun`` sent to several peers:
    ``{"sealed": {peer: blob}}``; ``peer_pubs``: ``{peer: public key PEM}``.
    """
    return {"sealed": {peer: seal_request(pub, peer, fun, kwargs)
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


def reply_error(ret):
    """
    A message when a peer's reply is from another protocol version, else None.
    """
    if isinstance(ret, dict) and ret.get("protocol", PROTOCOL) != PROTOCOL:
        return (f"peer runs protocol {ret.get('protocol')!r}, primary {PROTOCOL}: install "
                "the same salt-multimaster on every master")
    return None


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
    include = mopts.get("default_include") or "master.d/*.conf"
    conf_dir = os.path.dirname(mopts["conf_file"])
    return os.path.join(conf_dir, os.path.dirname(include), DROPIN_NAME)
