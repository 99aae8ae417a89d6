"""
The rounds of a sync (``salt_multimaster.rounds``) with Salt stood in for by
the real peer over temp dirs: which publishes go out, and that the peer ends
a replica.  The same runs on real daemons in tests/integration/test_sync.py.
"""

import os
import socket

import pytest

from salt_multimaster import (applier, backup, manifest, memory, peer, protocol, rounds, seal,
                              transport)
from tests.support.cluster import gen_keypair
from tests.support.history import received
from tests.unit import test_contract as contract
from tests.unit.test_contract import CATS, CONFIG_KEYS, _assert_replica, _read_dropin

pair = contract.pair  # the primary and peer over temp dirs (fixture)

PEER = "m2"


class FakeSalt:
    """
    Publishes run the peer module's logic at once on ``mopts`` (what
    ``multimaster_peer`` does around ``salt_multimaster.applier``), contents
    unsealed with the peer minion's key; the primary's fileserver is its
    file_roots read directly.
    """

    def __init__(self, primary_opts, mopts, minion_priv, state_dir):
        self.primary_opts, self.mopts = primary_opts, mopts
        self.minion_priv, self.state_dir = minion_priv, state_dir
        self.published = []
        self.lines = []

    def publish(self, peers, fun, request, timeout):
        assert peers == [PEER] and timeout > 0
        self.published.append(fun.split(".")[1])
        return _Job(self, fun, protocol.reply(self._run(fun, request)))

    def _run(self, fun, request):
        _read_dropin(self.mopts)
        if fun == "multimaster_peer.inventory":
            return peer.inventory(self.mopts, self.state_dir, request["categories"],
                                  request.get("digests") or {}, request["topology"],
                                  request.get("config_keys"), rescan=bool(request.get("rescan")))
        assert fun == "multimaster_peer.apply" and "pull_token" not in request
        return applier.apply(self.mopts, self.state_dir, request["ops"], request["topology"],
                             request["backup_keep"], self.unseal, self.fetch,
                             lambda *args: "restarting", keys_digest=request.get("keys_digest"),
                             expect=request.get("expect"), config_keys=request.get("config_keys"),
                             confirm=request.get("confirm"))

    def unseal(self, blob, purpose):
        return seal.unseal(self.minion_priv, blob, PEER, purpose)

    def fetch(self, file_ops):
        return {id(op): manifest.locate(self.primary_opts["file_roots"][op["env"]], op["rel"])
                for op in file_ops}

    def progress(self, message, **data):
        self.lines.append(message)

    @staticmethod
    def jid_dir(jid):
        raise AssertionError("no pull in these syncs")


class _Job:
    def __init__(self, salt, fun, ret):
        self.fun, self.ret = fun, ret

    def wait(self, on_wait=None):
        return {PEER: self.ret}

    def replies(self, on_wait=None):
        return {PEER: protocol.check_reply(PEER, self.fun, self.ret)}


def _conf():
    return {"peers": [PEER], "topology": "shared", "replicate": list(CATS),
            "master_config_keys": CONFIG_KEYS, "timeout": 30, "rescan": False,
            "inline_limit": transport.INLINE_LIMIT, "pull_min_files": transport.PULL_MIN_FILES,
            "backup_keep": backup.DEFAULT_KEEP}


@pytest.fixture
def fake(pair):
    primary_opts, mopts, minion_priv, tmp_path = pair
    pki = tmp_path / "m1" / "pki"
    for mid in ("web1", "web2"):
        (pki / "minions" / mid).write_bytes(gen_keypair(1024)[1])
    (tmp_path / "m1" / "srv" / "top.sls").write_text("base: {'*': [web]}\n")
    (tmp_path / "m1" / "pillar" / "secret.sls").write_text("password: hunter2\n")
    with socket.socket() as master:  # the peer's salt-master answers
        master.bind(("127.0.0.1", mopts["ret_port"]))
        master.listen()
        yield FakeSalt(primary_opts, mopts, minion_priv, str(tmp_path / "m2-minion-state"))


def _sync(fake, categories=CATS, ids=None, test=False, force=False):
    fake.published.clear()
    ret = rounds.Rounds(fake.primary_opts, _conf(), fake, test=test, force=force,
                        ids=ids).run([PEER], list(categories))
    return ret[PEER], list(fake.published)


def test_a_first_sync_asks_then_applies_and_a_change_sync_is_one_publish(fake):
    tmp_path = fake.state_dir.rsplit("/", 1)[0]
    res, published = _sync(fake, test=True)
    assert published == ["inventory"] and res["result"] is True, res.get("error")
    assert sorted(res["minion_keys"]["added"]) == ["minions/m2", "minions/web1", "minions/web2"]

    res, published = _sync(fake)
    assert published == ["inventory", "apply"] and res["result"] is True, res
    _assert_replica(fake.primary_opts, fake.mopts)
    assert fake.lines[0].startswith("multimaster: reading the primary's state")
    assert fake.lines[-1] == f"multimaster: {PEER}: ok"

    # a new key and a changed file: one conditional apply
    with open(f"{tmp_path}/m1/pki/minions/web3", "wb") as fh:
        fh.write(gen_keypair(1024)[1])
    with open(f"{tmp_path}/m1/srv/top.sls", "w", encoding="utf-8") as fh:
        fh.write("base: {'*': [web, db]}\n")
    res, published = _sync(fake)
    assert published == ["apply"], res
    assert res["minion_keys"]["added"] == ["minions/web3"]
    assert res["file_roots"]["updated"] == ["base:top.sls"]
    _assert_replica(fake.primary_opts, fake.mopts)

    # nothing changed: one inventory checks it
    res, published = _sync(fake)
    assert published == ["inventory"] and res["result"] is True, res.get("error")
    assert not any(res[c][k] for c in ("minion_keys", "file_roots")
                   for k in ("added", "updated", "removed"))


def test_a_peer_changed_behind_the_primarys_back_keeps_its_change_in_a_second_round(fake):
    tmp_path = fake.state_dir.rsplit("/", 1)[0]
    _sync(fake)
    # someone edits the peer's file_roots; then the primary changes a pillar
    with open(f"{tmp_path}/m2/srv/top.sls", "w", encoding="utf-8") as fh:
        fh.write("edited on the peer\n")
    with open(f"{tmp_path}/m1/pillar/secret.sls", "w", encoding="utf-8") as fh:
        fh.write("password: changed\n")
    res, published = _sync(fake)
    # the conditional apply is refused with the peer's inventory, then planned
    # from it: the peer's edit since its last sync is left there and named
    assert published == ["apply", "apply"], res
    assert res["file_roots"]["updated"] == []
    assert res["file_roots"]["peer_changed"] == [
        "base:top.sls: edited on the peer since its last sync (kept)"]
    assert res["pillar_roots"]["updated"] == ["base:secret.sls"]
    assert res["result"] is False
    with open(f"{tmp_path}/m2/srv/top.sls", encoding="utf-8") as fh:
        assert fh.read() == "edited on the peer\n"
    # force=True puts the primary's back
    res, published = _sync(fake, force=True)
    assert res["file_roots"]["updated"] == ["base:top.sls"] and res["result"] is True, res
    _assert_replica(fake.primary_opts, fake.mopts)
    res, published = _sync(fake)
    assert published == ["inventory"] and res["result"] is True, res


def test_a_targeted_key_sync_after_a_full_sync_is_one_publish(fake):
    tmp_path = fake.state_dir.rsplit("/", 1)[0]
    _sync(fake)
    with open(f"{tmp_path}/m1/pki/minions_pre/new1", "wb") as fh:
        fh.write(gen_keypair(1024)[1])
    # a test run reads through the state store and changes nothing in it
    res, published = _sync(fake, ["minion_keys"], ids=["new1"], test=True)
    assert published == ["inventory"] and res["minion_keys"]["added"] == ["minions_pre/new1"]
    res, published = _sync(fake, ["minion_keys"], ids=["new1"])
    assert published == ["apply"], res
    assert res["minion_keys"]["added"] == ["minions_pre/new1"]
    _assert_replica(fake.primary_opts, fake.mopts)
    # nothing to apply: the conditional apply confirms the keys of the id
    res, published = _sync(fake, ["minion_keys"], ids=["new1"])
    assert published == ["apply"] and res["result"] is True, res
    assert not any(res["minion_keys"].values()), res


def test_a_targeted_key_sync_leaves_the_other_ids_and_what_the_peer_holds_is_forgotten(fake):
    """
    A targeted sync plans the keys of its ids only; when keys of other ids
    differ too, the peer is no replica of the primary's keys: what it holds
    is forgotten, and the next sync asks it (two publishes).
    """
    tmp_path = fake.state_dir.rsplit("/", 1)[0]
    _sync(fake)
    for mid in ("new1", "other1"):
        with open(f"{tmp_path}/m1/pki/minions_pre/{mid}", "wb") as fh:
            fh.write(gen_keypair(1024)[1])
    res, published = _sync(fake, ["minion_keys"], ids=["new1"])
    assert published == ["apply"], res
    assert res["result"] is True and res["minion_keys"]["added"] == ["minions_pre/new1"], res
    assert os.path.exists(f"{tmp_path}/m2/pki/minions_pre/new1")
    assert not os.path.exists(f"{tmp_path}/m2/pki/minions_pre/other1")
    assert memory.remembered(fake.primary_opts, PEER, ["minion_keys"]) is None
    res, published = _sync(fake, ["minion_keys"], ids=["other1"])
    assert published == ["inventory", "apply"], res
    assert res["minion_keys"]["added"] == ["minions_pre/other1"], res
    _assert_replica(fake.primary_opts, fake.mopts)
    # a replica again: remembered, one publish
    assert memory.remembered(fake.primary_opts, PEER, ["minion_keys"]) is not None


def test_a_peer_refusing_the_condition_is_asked_and_synced_as_before(fake):
    """
    A peer older than the conditional apply refuses it as invalid (nothing
    applied): the primary asks for its inventory and applies as a full sync
    does; a targeted key sync too.
    """
    tmp_path = fake.state_dir.rsplit("/", 1)[0]
    _sync(fake)
    run = fake._run

    def older(fun, request):
        if fun == "multimaster_peer.apply" and request.get("expect") is not None:
            return {"result": False, "error": "multimaster_peer.apply: unknown argument expect"}
        return run(fun, request)

    fake._run = older
    with open(f"{tmp_path}/m1/pki/minions/web3", "wb") as fh:
        fh.write(gen_keypair(1024)[1])
    with open(f"{tmp_path}/m1/srv/top.sls", "w", encoding="utf-8") as fh:
        fh.write("base: {'*': [web, db]}\n")
    res, published = _sync(fake)
    assert published == ["apply", "inventory", "apply"], res
    assert res["result"] is True, res.get("error")
    assert res["minion_keys"]["added"] == ["minions/web3"]
    assert res["file_roots"]["updated"] == ["base:top.sls"]
    _assert_replica(fake.primary_opts, fake.mopts)

    with open(f"{tmp_path}/m1/pki/minions_pre/new1", "wb") as fh:
        fh.write(gen_keypair(1024)[1])
    res, published = _sync(fake, ["minion_keys"], ids=["new1"])
    assert published == ["apply", "inventory", "apply"], res
    assert res["result"] is True, res.get("error")
    assert res["minion_keys"]["added"] == ["minions_pre/new1"]
    _assert_replica(fake.primary_opts, fake.mopts)


def test_an_apply_leaves_its_key_history_record_to_after_its_return(fake):
    """
    The listing of the key dirs an apply changed, for its history record,
    runs once the job has returned (``after``), under the peer's lock; until
    it has, the inventory says the history is not recorded.
    """
    tmp_path = fake.state_dir.rsplit("/", 1)[0]
    _sync(fake)
    left = []
    run = fake._run

    def apply_leaving_the_record(fun, request):
        if fun != "multimaster_peer.apply":
            return run(fun, request)
        _read_dropin(fake.mopts)
        return applier.apply(fake.mopts, fake.state_dir, request["ops"], request["topology"],
                             request["backup_keep"], fake.unseal, fake.fetch,
                             lambda *args: "restarting", keys_digest=request.get("keys_digest"),
                             expect=request.get("expect"), config_keys=request.get("config_keys"),
                             after=left.append, confirm=request.get("confirm"))

    fake._run = apply_leaving_the_record
    with open(f"{tmp_path}/m1/pki/minions/web4", "wb") as fh:
        fh.write(gen_keypair(1024)[1])
    res, published = _sync(fake)
    assert published == ["apply"] and res["minion_keys"]["added"] == ["minions/web4"], res
    assert len(left) == 1
    assert "web4" in received(fake.state_dir)  # the ids it wrote: at once
    assert peer.keys_inventory(fake.mopts, fake.state_dir, {})["history_recorded"] is False

    slept = []

    def sleep(seconds):
        slept.append(seconds)

    def work():
        # under the lock: another job waits
        with pytest.raises(peer.PeerError, match="another multimaster job still holds"):
            with peer.locked(fake.state_dir, wait=0):
                pass
        left[0]()

    # meanwhile the peer's Salt 3008 made web4 pending again (a sign-in in
    # flight: its key cache deletes the accepted key to store a pending one)
    pki = fake.mopts["pki_dir"]
    os.rename(f"{pki}/minions/web4", f"{pki}/minions_pre/web4")
    peer.record_after_return(fake.state_dir, work, sleep=sleep)
    assert slept == [peer.RECORD_DELAY]
    assert os.path.exists(f"{pki}/minions/web4") and not os.path.exists(f"{pki}/minions_pre/web4")
    assert peer.keys_inventory(fake.mopts, fake.state_dir, {})["history_recorded"] is True
    _assert_replica(fake.primary_opts, fake.mopts)


def test_a_history_record_that_fails_is_logged(tmp_path, caplog):
    def work():
        raise OSError(28, "No space left on device")

    with caplog.at_level("ERROR"):
        peer.record_after_return(str(tmp_path / "state"), work, sleep=lambda s: None)
    assert [r.getMessage() for r in caplog.records] == [
        "multimaster: the key history of the last apply was not recorded; "
        "the next sync records it"]
    # the lock was let go
    with peer.locked(str(tmp_path / "state"), wait=0):
        pass


def test_keep_accepted_puts_back_only_the_key_the_apply_wrote(tmp_path):
    pki = tmp_path / "pki"
    for d in ("minions", "minions_pre"):
        (pki / d).mkdir(parents=True)
    mine, other = gen_keypair(1024)[1], gen_keypair(1024)[1]
    (pki / "minions_pre" / "web1").write_bytes(mine)   # demoted, same key
    (pki / "minions_pre" / "web2").write_bytes(other)  # another key for that id
    (pki / "minions" / "web3").write_bytes(mine)       # still accepted
    (pki / "minions_pre" / "web3").write_bytes(mine)
    ops = [{"op": "write", "state": "minions", "id": mid, "sha256": manifest.key_sha(mine)}
           for mid in ("web1", "web2", "web3", "web4")]
    ops.append({"op": "write", "state": "minions_pre", "id": "web5",
                "sha256": manifest.key_sha(mine)})
    assert applier.keep_accepted({"pki_dir": str(pki)}, ops) == ["web1"]
    assert sorted(os.listdir(pki / "minions")) == ["web1", "web3"]
    assert sorted(os.listdir(pki / "minions_pre")) == ["web2", "web3"]
