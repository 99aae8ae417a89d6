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

from salt_multimaster import layout, statefile

NAME = "epoch.json"
FORMAT = 1


class Fenced(ValueError):
    """A request from a primary this master no longer follows; the message says what to do."""


def path(state_dir):
    return os.path.join(state_dir, NAME)


def read(state_dir):
    """
    This master's record: ``{"epoch": int, "primary": id or None,
    "retired": [ids], "peers": [ids], "entry": str or None, "topology":
    str or None, "self": its host's minion id or None}``.
    """
    data = statefile.load(path(state_dir), "what it vouched for is read again")
    ret = {"epoch": 0, "primary": None, "retired": [], "peers": [], "entry": None,
           "topology": None, "self": None}
    if isinstance(data, dict) and data.get("format") == FORMAT:
        if isinstance(data.get("epoch"), int) and not isinstance(data["epoch"], bool) \
                and data["epoch"] >= 0:
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
    statefile.write(path(state_dir), json.dumps(dict(record, format=FORMAT)), mode=0o600)


def master_entry(opts):
    """How minions name this master (its interface, with a ret_port not 4506), or None."""
    interface = str(opts.get("interface") or "")
    if interface in ("", "0.0.0.0", "::"):
        return None
    port = opts.get("ret_port") or 4506
    if str(port) != "4506":
        return f"[{interface}]:{port}" if ":" in interface else f"{interface}:{port}"
    return interface


def claim(opts, peers, topology=None):
    """
    What a sync from this primary carries: its epoch (its own record's),
    its id, its peers (every one configured), how minions name it and its
    topology.
    """
    return {"epoch": read(layout.state_dir(opts))["epoch"], "primary": opts["id"],
            "peers": list(peers), "entry": master_entry(opts), "topology": topology}


def refusal(old, epoch, new):
    """The named error of a request from ``old``, fenced off by the promote of ``new``."""
    return (f"this master was promoted away from {old} at epoch {epoch}: run "
            f"multimaster.failback on {new} instead")


def valid_claim(value):
    """A claim as a request carries it, or None (an older primary: epoch 0)."""
    if not isinstance(value, dict):
        return None
    epoch = value.get("epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0 or not isinstance(
            value.get("primary"), str):
        return None
    return value


def fence(state_dir, value, self_id=None):
    """
    Check a request's claim against this master's record and record a newer
    epoch or changed cluster.  Raises :class:`Fenced` for a primary this
    master no longer follows.  ``self_id``: this host's minion id.
    """
    got = valid_claim(value) or {"epoch": 0, "primary": None}
    rec = read(state_dir)
    if got["epoch"] < rec["epoch"]:
        raise Fenced(refusal(got["primary"] or "an older primary", rec["epoch"], rec["primary"]))
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


def promoted(rec, master_id, self_id, peers=None):
    """
    The record of ``master_id`` made the primary by ``multimaster.promote``:
    the next epoch (the same when it is the primary already: a second run
    changes nothing), the old primary retired, its peers the ones given or
    the old primary's less this host.
    """
    if rec["primary"] == master_id and rec["epoch"] > 0:
        return dict(rec, peers=list(peers) if peers is not None else rec["peers"])
    retired = set(rec["retired"])
    if rec["primary"] and rec["primary"] != master_id:
        retired.add(rec["primary"])
    if peers is None:
        peers = [p for p in rec["peers"] if p != self_id]
    return dict(rec, epoch=rec["epoch"] + 1, primary=master_id, retired=sorted(retired),
                peers=list(peers))
