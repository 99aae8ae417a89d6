"""
The primary's epoch (issue 33 item 5): what every master records, the
fence that refuses a sync from a primary it was promoted away from, and
the steps of ``multimaster.promote`` with Salt stood in for.
"""

import os

import pytest

from salt_multimaster import epoch, membership, membership_steps, promote, protocol, rounds
from tests.unit import test_rounds

pair = test_rounds.pair
fake = test_rounds.fake


def _claim(n, primary, peers=("b", "c")):
    return {"epoch": n, "primary": primary, "peers": list(peers), "entry": f"{primary}.example",
            "topology": "shared"}


def test_a_sync_records_its_primary_once_and_an_older_one_is_refused(tmp_path, monkeypatch):
    state = str(tmp_path)
    rec = epoch.fence(state, _claim(0, "a_master"), "b")
    assert rec == {"epoch": 0, "primary": "a_master", "retired": [], "peers": ["b", "c"],
                   "entry": "a_master.example", "topology": "shared", "self": "b"}
    assert epoch.read(state) == rec
    # the same claim again: nothing written (a no-op sync writes nothing)
    writes = []
    monkeypatch.setattr(epoch, "write", lambda *a: writes.append(a))
    epoch.fence(state, _claim(0, "a_master"), "b")
    assert writes == []
    monkeypatch.undo()
    # the new primary's sync: recorded, the old one retired
    rec = epoch.fence(state, _claim(1, "b_master", ["c"]), "c")
    assert (rec["epoch"], rec["primary"], rec["retired"], rec["peers"]) == (
        1, "b_master", ["a_master"], ["c"])
    # the old primary comes back: refused, named, nothing recorded
    with pytest.raises(epoch.Fenced) as exc:
        epoch.fence(state, _claim(0, "a_master"), "c")
    assert str(exc.value) == ("this master was promoted away from a_master at epoch 1: run "
                              "multimaster.failback on b_master instead")
    # an older primary's request without a claim (protocol 1 before epochs)
    with pytest.raises(epoch.Fenced, match="promoted away from an older primary at epoch 1"):
        epoch.fence(state, None)
    # two primaries at one epoch: split brain
    with pytest.raises(epoch.Fenced, match="split brain: c_master and b_master both claim"):
        epoch.fence(state, _claim(1, "c_master"))
    assert epoch.read(state)["primary"] == "b_master"


def test_before_any_promote_no_primary_is_enforced(tmp_path):
    state = str(tmp_path)
    epoch.fence(state, _claim(0, "a_master"))
    assert epoch.fence(state, _claim(0, "other_master"))["primary"] == "other_master"


def test_promoted_takes_the_next_epoch_once(tmp_path):
    rec = dict(epoch.read(str(tmp_path)), primary="a_master", peers=["b", "c"], self="b")
    new = epoch.promoted(rec, "b_master")
    assert (new["epoch"], new["primary"], new["retired"], new["peers"]) == (
        1, "b_master", ["a_master"], ["c"])
    assert epoch.promoted(new, "b_master") == new
    assert epoch.promoted(rec, "b_master", peers=["d"])["peers"] == ["d"]


def test_a_damaged_record_reads_as_epoch_0(tmp_path):
    (tmp_path / epoch.NAME).write_text('{"format": 1, "epoch": "1"')
    assert epoch.read(str(tmp_path))["epoch"] == 0
    (tmp_path / epoch.NAME).write_text('{"format": 1, "epoch": -3, "primary": 7}')
    assert epoch.read(str(tmp_path)) == epoch.read(str(tmp_path / "none"))


def test_every_request_of_a_sync_carries_the_primarys_claim(fake):
    sent = []
    publish = fake.publish

    def spying(peers, fun, request, timeout):
        sent.append((fun, request.get("epoch")))
        return publish(peers, fun, request, timeout)

    fake.publish = spying
    test_rounds._sync(fake)  # pylint: disable=protected-access
    opts = fake.primary_opts
    want = {"epoch": 0, "primary": opts["id"], "peers": [test_rounds.PEER],
            "entry": f"127.0.0.1:{opts['ret_port']}", "topology": "shared"}
    assert sent == [("multimaster_peer.inventory", want), ("multimaster_peer.apply", want)]
    epoch.write(os.path.join(opts["cachedir"], "multimaster"),
                dict(epoch.read("/nonexistent"), epoch=3, primary=opts["id"]))
    assert rounds.Rounds(opts, test_rounds._conf(), fake).claim["epoch"] == 3  # noqa


# ---------------------------------------------------------------------------
# promote, with Salt stood in for
# ---------------------------------------------------------------------------
class FakeOps(membership_steps.SaltOps):
    def __init__(self, opts):
        super().__init__(opts, cmd=self._cmd, minions=lambda tgt, tgt_type: ["web1", "web2"],
                         cached_pillars=self._pillars, sync=self._sync)
        self.synced = []

    @staticmethod
    def _cmd(tgt, fun, **kwargs):
        assert fun == "multimaster.audit"
        return {"web1": {"findings": [], "masters": ["10.0.0.1", "10.0.0.2"]},
                "web2": {"findings": [], "masters": ["10.0.0.2"]}}

    @staticmethod
    def _pillars(minions):
        return {"web1": {"multimaster": {"masters": ["10.0.0.1", "10.0.0.2"]}},
                "web2": {"multimaster": {"masters": ["10.0.0.2"]}}}

    def _sync(self, **kwargs):
        self.synced.append(kwargs)
        return {p: {"result": True} for p in kwargs["peers"].split(",")}


@pytest.fixture
def peer_b(pair):
    _primary_opts, mopts, _priv, _tmp = pair
    mopts["id"] = "b_master"
    mopts["interface"], mopts["ret_port"] = "10.0.0.2", 4506
    state = os.path.join(mopts["cachedir"], "multimaster")
    os.makedirs(state)
    epoch.fence(state, {"epoch": 0, "primary": "a_master", "peers": ["b", "c"],
                        "entry": "10.0.0.1", "topology": "shared"}, "b")
    with open(protocol.dropin_path(mopts), "w", encoding="utf-8") as fh:
        fh.write("nodegroups: {}\n")
    return mopts


def test_promote_test_changes_nothing(peer_b):
    state = os.path.join(peer_b["cachedir"], "multimaster")
    before = epoch.read(state)
    ops = FakeOps(peer_b)
    ret = promote.promote(ops, test=True)
    assert epoch.read(state) == before and ops.synced == []
    assert not os.path.exists(membership.dropin_path(peer_b))
    assert ret["result"] is True and ret["epoch"] == 1
    assert ret["steps"]["epoch"]["comment"] == ("epoch 1: b_master would be the primary, "
                                                "a_master retired")


def test_promote_makes_the_peer_the_primary(peer_b, monkeypatch):
    state = os.path.join(peer_b["cachedir"], "multimaster")
    ops = FakeOps(peer_b)
    monkeypatch.setattr(ops, "reload_peers", lambda: membership.read_dropin(
        membership.dropin_path(peer_b)))
    ret = promote.promote(ops)
    assert ret["result"] is True, ret
    rec = epoch.read(state)
    assert (rec["epoch"], rec["primary"], rec["retired"], rec["peers"]) == (
        1, "b_master", ["a_master"], ["c"])
    assert membership.read_dropin(membership.dropin_path(peer_b)) == ["c"]
    assert ops.synced == [{"peers": "c", "test": False, "topology": "shared"}]
    assert ret["steps"]["minions"]["minions"] == {"still_lists": ["web1"], "clean": ["web2"]}
    assert ret["next_steps"][0].startswith("web1 still list 10.0.0.1")
    assert ret["next_steps"][1].startswith(
        "pillar multimaster:masters: list 10.0.0.2 first and remove 10.0.0.1")
    # a second run: the same epoch, the peers synced again
    ret = promote.promote(ops)
    assert ret["result"] is True and epoch.read(state)["epoch"] == 1
    assert "epoch" not in ret["steps"] and len(ops.synced) == 2


def test_promote_refuses_a_master_no_primary_reached(pair):
    _primary_opts, mopts, _priv, _tmp = pair
    with pytest.raises(promote.PromoteError, match="is no peer master"):
        promote.promote(FakeOps(mopts))
