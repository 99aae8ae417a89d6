"""
Which master is the primary, and since when: the epoch that fences an old
primary off (issue 33 item 5).

Every master records, in ``<master cachedir>/multimaster/epoch.json``
(0600, flushed), the epoch of the primary it follows, that primary's id,
the masters retired from it, and what the primary said of its cluster
(its peers, how minions name it, its topology):

* a sync carries its primary's claim (:func:`claim`), sealed like the rest
  of the request; every master it reaches records a newer epoch or a
  changed cluster (a write only then: a no-op sync writes nothing);
* ``multimaster.promote`` on a peer records there the next epoch, with the
  peer's own master as the primary and the old one retired;
* a master whose recorded epoch is higher refuses a request from an older
  primary (:func:`fence`), and at the same epoch (past 0, that is after a
  promote) one from another primary: two masters promoted from the same
  epoch (split brain).

Before any promote every master is at epoch 0 and no primary is enforced:
the records only name it.  Plain Python: no Salt dunders.
"""

import json
import os

from salt_multimaster import layout, membership, statefile

NAME = "epoch.json"
FORMAT = 1


class Fenced(ValueError):
    """A request from a primary this master no longer follows; the message says what to do."""


def read(state_dir):
    """
    This master's record: ``{"epoch": int, "primary": id or None,
    "retired": [ids], "peers": [ids], "entry": str or None, "topology":
    str or None, "self": its host's minion id or None}``.
    """
    data = statefile.load(os.path.join(state_dir, NAME), "what it vouched for is read again")
    ret = {"epoch": 0, "primary": None, "retired": [], "peers": [], "entry": None,
           "topology": None, "self": None}
    if isinstance(data, dict) and data.get("format") == FORMAT:
        if _count(data.get("epoch")):
            ret["epoch"] = data["epoch"]
        for key in ("primary", "entry", "topology", "self"):
            if isinstance(data.get(key), str):
                ret[key] = data[key]
        for key in ("retired", "peers"):
            if isinstance(data.get(key), list):
                ret[key] = [str(v) for v in data[key]]
    return ret


def write(state_dir, record):
    """Write ``record`` (:func:`read`'s shape), flushed: it is no cache."""
    statefile.write(os.path.join(state_dir, NAME), json.dumps(dict(record, format=FORMAT)),
                    mode=0o600)


def _count(value):
    """Whether ``value`` is an epoch: a whole number, 0 or more."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def master_entry(opts):
    """How minions name this master (its interface, with a ret_port not 4506), or None."""
    try:  # no fqdn: a master listening on every address has no entry of its own
        return membership.master_entry({"interface": opts.get("interface"),
                                        "ret_port": opts.get("ret_port")})
    except membership.MembershipError:
        return None


def claim(opts, peers, topology):
    """
    What a sync from this primary carries: its epoch (its own record's),
    its id, its peers (every one configured), how minions name it and its
    topology.
    """
    return {"epoch": read(layout.state_dir(opts))["epoch"], "primary": opts["id"],
            "peers": list(peers), "entry": master_entry(opts), "topology": topology}


def fence(state_dir, value, self_id=None):
    """
    Check a request's claim against this master's record and record a newer
    epoch or changed cluster.  Raises :class:`Fenced` for a primary this
    master no longer follows.  ``self_id``: this host's minion id.
    """
    valid = isinstance(value, dict) and _count(value.get("epoch")) and isinstance(
        value.get("primary"), str)
    got = value if valid else {"epoch": 0, "primary": None}  # an older primary: epoch 0
    rec = read(state_dir)
    if got["epoch"] < rec["epoch"]:
        raise Fenced(f"this master was promoted away from {got['primary'] or 'an older primary'}"
                     f" at epoch {rec['epoch']}: run multimaster.failback on {rec['primary']} "
                     "instead")
    if got["epoch"] == rec["epoch"] > 0 and got["primary"] != rec["primary"]:
        raise Fenced(f"split brain: {got['primary']} and {rec['primary']} both claim to be the "
                     f"primary at epoch {rec['epoch']}: stop one of them, then run "
                     f"multimaster.failback on the other (docs/outage.rst)")
    if got["primary"] is None:
        return rec
    new = dict(rec, epoch=got["epoch"], primary=got["primary"])
    for key in ("peers", "entry", "topology"):
        if got.get(key) is not None:
            new[key] = got[key]
    if self_id:
        new["self"] = self_id
    if rec["primary"] and rec["primary"] != got["primary"] and got["epoch"] > rec["epoch"]:
        new["retired"] = sorted(set(rec["retired"]) | {rec["primary"]})
    if new != rec:
        write(state_dir, new)
    return new


def promoted(rec, master_id, peers=None):
    """
    The record of ``master_id`` made the primary by ``multimaster.promote``:
    the next epoch (the same when it is the primary already: a second run
    changes nothing), the old primary retired, its peers the ones given or
    the old primary's less this host (``self`` of ``rec``).
    """
    if rec["primary"] == master_id and rec["epoch"] > 0:
        return dict(rec, peers=list(peers) if peers is not None else rec["peers"])
    retired = set(rec["retired"])
    if rec["primary"] and rec["primary"] != master_id:
        retired.add(rec["primary"])
    if peers is None:
        peers = [p for p in rec["peers"] if p != rec["self"]]
    return dict(rec, epoch=rec["epoch"] + 1, primary=master_id, retired=sorted(retired),
                peers=list(peers))
