"""
What the primary remembers of each peer, without Salt's loader: what the
peer was last confirmed to hold (a meta entry of the primary's state
store, :mod:`salt_multimaster.store`), so that the common change sync is
one publish (:func:`expected_inventory`).  ``opts`` is the primary
master's configuration.
"""


from salt_multimaster import layout, outage, protocol, replicate
from salt_multimaster import store as state_store


def _valid_memory(held):
    """Whether a peer's memory has the shape :func:`remember` saves."""
    return isinstance(held, dict) and all(
        cat in replicate.CATEGORIES and isinstance(entry, dict)
        and (cat not in protocol.BUCKETED or isinstance(entry.get("digest"), dict))
        for cat, entry in held.items())


def _memory(opts, peer):
    """What ``peer`` was last confirmed to hold, as saved: a dict, maybe empty."""
    # none, or damaged: nothing known, the peer is asked (a second round)
    held = state_store.read(layout.state_dir(opts),
                            lambda found: found.meta(f"peer:{peer}"))
    return held if _valid_memory(held) else {}


def remembered(opts, peer, categories):
    """
    ``{category: inventory entry}`` the peer was last confirmed to hold, for
    every one of ``categories``; None when one is not known.
    """
    held = _memory(opts, peer)
    if not all(isinstance(held.get(c), dict) for c in categories):
        return None
    return {cat: held[cat] for cat in categories}


def remember(opts, peer, categories, primary, inv, ret):
    """
    After a sync of ``peer``: a category whose report is clean (nothing
    failed, left in conflict or unconfirmed, nothing damaged on the primary)
    is held by the peer as the primary holds it now; any other is forgotten.
    """
    held = _memory(opts, peer)
    for cat in categories:
        rep = ret.get(cat)
        entry = primary[cat]
        clean = (isinstance(rep, dict) and not rep.get("errors") and not rep.get("conflicts")
                 and not rep.get("unconfirmed") and not rep.get(outage.PEER_CHANGED)
                 and not entry.get("damaged"))
        if not clean:
            held.pop(cat, None)
        elif cat in protocol.BUCKETED:
            held[cat] = {"digest": entry["digest"]}
            envs = (inv.get(cat) or {}).get("envs")
            if envs is not None:
                held[cat]["envs"] = envs
        else:
            held[cat] = dict(entry["manifest"])
    # a stale or lost record costs a second round: the apply is conditional on it
    state_store.record(layout.state_dir(opts),
                       lambda found: found.set_meta(f"peer:{peer}", held),
                       f"what {peer} holds", durable=False)


def expected_inventory(held):
    """
    The inventory of a peer holding ``held`` (:func:`remembered`) as it
    answers the digests of ``held``: digests only, nothing detailed.  Plan
    with it (the buckets the primary changed since are taken from its
    previous state, checked by :func:`salt_multimaster.sync.unplannable`).
    """
    return {cat: dict(entry) for cat, entry in held.items()}
