"""
The three-way sync (issue 33 item 3): what a peer changed since it last
confirmed the primary's state is left in place and named, never reverted.
The plan (``outage.classify``), the peer's record (``confirmed``), and
whole syncs through the real rounds with the real peer over temp dirs
(``tests/unit/test_rounds.py``'s stand-in for Salt).
"""

import os

import pytest

from salt_multimaster import (confirmed, failback, manifest, outage, protocol, report, restore,
                              rounds, seal, sync)
from tests.support.cluster import gen_keypair
from tests.unit import test_rounds
from tests.unit.test_contract import CONFIG_KEYS, _assert_replica
from tests.unit.test_rounds import PEER, _sync

pair = test_rounds.pair
fake = test_rounds.fake

SHA = {name: manifest.key_sha(name.encode()) for name in ("a", "b", "c")}


# ---------------------------------------------------------------------------
# The plan: classify
# ---------------------------------------------------------------------------
def test_classify_keys_names_each_change_of_the_peer_and_leaves_it_out_of_the_plan():
    mine = {"minions": {"m1": SHA["a"], "m2": SHA["a"], "m3": SHA["a"], "m4": SHA["b"],
                        "m6": SHA["a"], "same": SHA["a"]}}
    theirs = {"minions": {"m1": SHA["a"], "new": SHA["c"], "m4": SHA["c"], "m6": SHA["a"],
                          "same": SHA["a"]},
              "minions_rejected": {"m2": SHA["a"]}}
    # m2 rejected on the peer, m3 deleted there, new accepted there; m4
    # changed on both sides; m6 untouched; "same" changed to the primary's
    record = {"changed": {"minions": {"m2": SHA["a"], "m3": SHA["a"], "new": None,
                                      "m4": SHA["a"], "same": SHA["b"]},
                          "minions_rejected": {"m2": None}}}
    left_mine, left_theirs, found = outage.classify("minion_keys", mine, theirs, record)
    assert left_mine == {"minions": {"m1": SHA["a"], "m6": SHA["a"]}}
    assert left_theirs == {"minions": {"m1": SHA["a"], "m6": SHA["a"]}}
    assert outage.converged(found) and [f["name"] for f in found if f["kind"] == "converged"] == [
        "same"]
    found = outage.left(found)
    assert [(f["name"], f["kind"], f["line"]) for f in found] == [
        ("m2", "peer_changed",
         "minions_rejected/m2: rejected (was minions/m2) on the peer since its last sync (kept)"),
        ("m3", "peer_changed", "minions/m3: deleted on the peer since its last sync (kept)"),
        ("m4", "conflict",
         "minions/m4: another key on the peer and changed on the primary since the peer's last "
         "sync (kept; multimaster.failback takes the peer's side, force=True the primary's)"),
        ("new", "peer_changed", "minions/new: accepted on the peer since its last sync (kept)"),
    ]
    m3 = found[1]
    assert (m3["peer"], m3["base"], m3["primary"]) == (None, {"minions": SHA["a"]},
                                                       {"minions": SHA["a"]})
    # force=True, or failback's keep of an item: planned as before
    assert outage.classify("minion_keys", mine, theirs, record, True) == (mine, theirs, [])
    _, left, found = outage.classify("minion_keys", mine, theirs, record, {"m2", "m3"})
    assert "m2" in left["minions_rejected"] and [
        f["name"] for f in outage.left(found)] == ["m4", "new"]
    # no record (a peer never confirmed): planned as before
    assert outage.classify("minion_keys", mine, theirs, None) == (mine, theirs, [])


def test_a_key_a_minion_left_by_signing_in_to_the_peer_is_planned_as_before():
    # web9 signed in to both masters; accepted on the primary since
    mine = {"minions": {"web9": SHA["a"]}}
    theirs = {"minions_pre": {"web9": SHA["a"]}, "minions_denied": {"web1": SHA["b"]}}
    record = {"changed": {"minions_pre": {"web9": None}, "minions_denied": {"web1": None}}}
    assert outage.classify("minion_keys", mine, theirs, record) == (mine, theirs, [])
    ops, rep = outage.plan_keys(mine, theirs, [], False)
    assert rep["added"] == ["minions/web9"] and "minions_pre/web9" in rep["removed"]
    # but a key the operator deleted there, back as pending: a change of the peer
    record = {"changed": {"minions": {"web9": SHA["a"]}, "minions_pre": {"web9": None}}}
    _, _, found = outage.classify("minion_keys", mine, theirs, record)
    assert [f["line"] for f in found] == [
        "minions_pre/web9: made pending (was minions/web9) on the peer since its last sync "
        "(kept)"]


def test_classify_tree_compares_the_modes_a_sync_writes():
    mine = {"base": {"app/init.sls": [3, 0o644, "p"], "kept.sls": [1, 0o4755, "k"],
                     "gone.sls": [1, 0o644, "g"], "both.sls": [1, 0o644, "primary"]}}
    theirs = {"base": {"app/init.sls": [4, 0o644, "hotfix"], "kept.sls": [1, 0o755, "k"],
                       "new.sls": [1, 0o644, "n"], "both.sls": [1, 0o644, "peer"]}}
    record = {"changed": {"base": {"app/init.sls": [3, 0o644, "p"], "new.sls": None,
                                   "gone.sls": [1, 0o644, "g"], "kept.sls": [1, 0o755, "old"],
                                   "both.sls": [1, 0o644, "old"]}}}
    left_mine, left_theirs, found = outage.classify("file_roots", mine, theirs, record)
    assert left_mine == {} and left_theirs == {}
    assert [(f["name"], f["kind"]) for f in found if f["kind"] == "converged"] == [
        ("base:kept.sls", "converged")]
    found = outage.left(found)
    assert [(f["name"], f["kind"]) for f in found] == [
        ("base:app/init.sls", "peer_changed"), ("base:both.sls", "conflict"),
        ("base:gone.sls", "peer_changed"), ("base:new.sls", "peer_changed")]
    assert [f["line"].split(" since")[0] for f in found if f["kind"] == "peer_changed"] == [
        "base:app/init.sls: edited on the peer", "base:gone.sls: removed on the peer",
        "base:new.sls: added on the peer"]


def test_classify_config_keeps_the_peers_value_of_an_option_it_changed():
    mine = {"nodegroups": {"web": "L@a"}, "peer": {}, "publisher_acl": {"x": ["test.*"]}}
    theirs = {"nodegroups": {"web": "L@a,b"}, "peer": {}, "publisher_acl": {"y": []}}
    record = {"nodegroups": confirmed.value_sha("nodegroups", {"web": "L@a"}),
              "peer": confirmed.value_sha("peer", {}),
              "publisher_acl": confirmed.value_sha("publisher_acl", {})}
    values, found = outage.classify_config(mine, theirs, record)
    found = outage.left(found)
    assert values == {"nodegroups": {"web": "L@a,b"}, "peer": {}, "publisher_acl": {"y": []}}
    assert [(f["name"], f["kind"]) for f in found] == [("nodegroups", "peer_changed"),
                                                       ("publisher_acl", "conflict")]
    assert found[0]["line"] == ("nodegroups: changed on the peer (multimaster-sync.conf) since "
                                "its last sync (kept)")
    assert outage.classify_config(mine, theirs, {}) == (mine, [])
    assert outage.classify_config(mine, theirs, record, {"nodegroups"})[0]["nodegroups"] == {
        "web": "L@a"}


def test_plan_keys_forces_the_ids_kept_only():
    mine = {"minions": {"a": SHA["a"], "b": SHA["a"]}}
    theirs = {"minions": {"a": SHA["b"], "b": SHA["b"]}}
    ops, rep = outage.plan_keys(mine, theirs, [], {"minion_keys": {"a"}})
    assert [(op["op"], op["id"]) for op in ops] == [("write", "a")]
    assert rep["updated"] == ["minions/a"] and [c.split(":")[0] for c in rep["conflicts"]] == [
        "minions/b"]


# ---------------------------------------------------------------------------
# The peer's record
# ---------------------------------------------------------------------------
def _written(monkeypatch):
    """``[(category, bucket)]`` of the peer's record as it is written, bucket by bucket."""
    names = []
    real = confirmed.Record.save

    def spy(self):
        names.extend((self.cat, bucket) for bucket in sorted(self.changed))
        return real(self)

    monkeypatch.setattr(confirmed.Record, "save", spy)
    return names


def test_the_record_takes_a_bucket_whole_when_it_equals_the_primarys(tmp_path, monkeypatch):
    state = str(tmp_path)
    bucket = manifest.bucket_of("web1")
    held = {"minions": {"web1": SHA["a"]}}
    digest = {bucket: confirmed.part_digest(held)}
    confirmed.record_apply(state, "minion_keys", {}, digest, digest, {bucket: held})
    rec = confirmed.Record(state, "minion_keys")
    assert rec.part(bucket) == held and len(rec.digest) == manifest.BUCKETS
    # the same again (a no-op): nothing written
    written = _written(monkeypatch)
    confirmed.record_apply(state, "minion_keys", {}, digest, digest, {bucket: held})
    assert written == []
    # an apply that writes web2 in another bucket, in step after it
    other = manifest.bucket_of(next(f"w{i}" for i in range(99)
                                    if manifest.bucket_of(f"w{i}") != bucket))
    mid = next(f"w{i}" for i in range(99) if manifest.bucket_of(f"w{i}") == other)
    done = confirmed.applied("minion_keys", [{"op": "write", "state": "minions", "id": mid,
                                              "sha256": SHA["b"]}], set())
    after = dict(digest, **{other: confirmed.part_digest({"minions": {mid: SHA["b"]}})})
    confirmed.record_apply(state, "minion_keys", done, after, after,
                           {bucket: held, other: {"minions": {mid: SHA["b"]}}})
    assert written == [("minion_keys", other)]
    assert confirmed.Record(state, "minion_keys").part(other) == {"minions": {mid: SHA["b"]}}


def test_the_record_of_a_bucket_left_out_of_step_takes_the_items_written(tmp_path):
    state = str(tmp_path)
    bucket = manifest.bucket_of("web1")
    ids = [f"w{i}" for i in range(400) if manifest.bucket_of(f"w{i}") == bucket][:4]
    base = {"minions": {ids[0]: SHA["a"], ids[1]: SHA["a"], ids[3]: SHA["a"]}}
    rec = confirmed.Record(state, "minion_keys")
    rec.set(bucket, base)
    rec.save()
    # ids[0] rejected on the peer (kept); the primary accepted ids[2] (written) and
    # ids[3] anew, which Salt on the peer made pending again meanwhile: its every state
    now = {"minions": {ids[1]: SHA["a"], ids[2]: SHA["b"]},
           "minions_rejected": {ids[0]: SHA["a"]}, "minions_pre": {ids[3]: SHA["c"]}}
    primary = {"minions": {ids[0]: SHA["a"], ids[1]: SHA["a"], ids[2]: SHA["b"],
                           ids[3]: SHA["c"]}}
    done = confirmed.applied("minion_keys", [
        {"op": "write", "state": "minions", "id": mid, "sha256": sha}
        for mid, sha in ((ids[2], SHA["b"]), (ids[3], SHA["c"]))], set())
    confirmed.record_apply(state, "minion_keys", done, {bucket: confirmed.part_digest(primary)},
                           {bucket: confirmed.part_digest(now)}, {bucket: now})
    assert confirmed.Record(state, "minion_keys").part(bucket) == {
        "minions": {ids[0]: SHA["a"], ids[1]: SHA["a"], ids[2]: SHA["b"]},
        "minions_pre": {ids[3]: SHA["c"]}}
    # a failed write is not recorded; a bucket not recorded is not recorded by its items
    done = confirmed.applied("minion_keys", [{"op": "remove", "state": "minions", "id": ids[1]}],
                             {f"minions/{ids[1]}"})
    assert done == {}
    fresh = str(tmp_path / "fresh")
    confirmed.record_apply(fresh, "minion_keys", {bucket: [("minions", "x", None)]}, None, {}, {})
    assert confirmed.Record(fresh, "minion_keys").part(bucket) is None


def test_the_record_of_a_root_takes_each_written_file_in_its_saltenv_only(tmp_path):
    state = str(tmp_path)
    bucket = manifest.bucket_of("base/a.sls")
    rec = confirmed.Record(state, "file_roots")
    rec.set(bucket, {"base": {"a.sls": [1, 0o644, "x"]}, "dev": {"a.sls": [1, 0o644, "x"]}})
    rec.save()
    # the primary wrote base:a.sls; dev:a.sls changed on the peer: not the primary's
    now = {"base": {"a.sls": [2, 0o644, "y"]}, "dev": {"a.sls": [3, 0o644, "z"]}}
    done = confirmed.applied("file_roots", [{"op": "write", "env": "base", "rel": "a.sls",
                                             "size": 2, "mode": 0o644, "sha256": "y"}], set())
    confirmed.record_apply(state, "file_roots", done, {bucket: "other"},
                           {bucket: confirmed.part_digest(now)}, {bucket: now})
    assert confirmed.Record(state, "file_roots").part(bucket) == {
        "base": {"a.sls": [2, 0o644, "y"]}, "dev": {"a.sls": [1, 0o644, "x"]}}


def test_since_reports_the_items_changed_and_the_buckets_not_recorded(tmp_path):
    state = str(tmp_path)
    b1 = manifest.bucket_of("base/a.sls")
    rec = confirmed.Record(state, "file_roots")
    rec.set(b1, {"base": {"a.sls": [1, 0o644, "x"]}})
    rec.save()
    current = {"base": {"a.sls": [2, 0o644, "y"]}}
    got = confirmed.since(state, "file_roots", {b1: confirmed.part_digest(current)}, [b1, "99"],
                          lambda b: current if b == b1 else {})
    assert got["changed"] == {"base": {"a.sls": [1, 0o644, "x"]}}
    assert got["unknown"] == ["99"]
    assert b1 not in got["stale"] and len(got["stale"]) == manifest.BUCKETS - 1


# ---------------------------------------------------------------------------
# Whole syncs over temp dirs
# ---------------------------------------------------------------------------
def _write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb" if isinstance(data, bytes) else "w") as fh:
        fh.write(data)


def _outage(fake):
    """A peer in step, then what an operator does on it while the primary is down."""
    tmp = fake.state_dir.rsplit("/", 1)[0]
    pki, ppki = f"{tmp}/m1/pki", f"{tmp}/m2/pki"
    _write(f"{pki}/minions/gone1", gen_keypair(1024)[1])
    _write(f"{tmp}/m1/srv/app/init.sls", "app: v1\n")
    _write(f"{tmp}/m1/srv/old.sls", "old: 1\n")
    fake.primary_opts["nodegroups"] = {"webs": "L@web1"}
    res, _ = _sync(fake)
    assert res["result"] is True, res
    os.rename(f"{ppki}/minions/web1", f"{ppki}/minions_rejected/web1")
    _write(f"{ppki}/minions/newbie", gen_keypair(1024)[1])
    os.unlink(f"{ppki}/minions/gone1")
    _write(f"{tmp}/m2/srv/app/init.sls", "app: hotfix\n")
    _write(f"{tmp}/m2/srv/added.sls", "added: 1\n")
    os.unlink(f"{tmp}/m2/srv/old.sls")
    fake.mopts["nodegroups"] = {"webs": "L@web1,newbie"}
    _write(f"{tmp}/m2/etc/master.d/multimaster-sync.conf", "nodegroups: {webs: 'L@web1,newbie'}\n")
    return tmp


EXPECTED = {
    "minion_keys": [
        "minions/gone1: deleted on the peer since its last sync (kept)",
        "minions/newbie: accepted on the peer since its last sync (kept)",
        "minions_rejected/web1: rejected (was minions/web1) on the peer since its last sync "
        "(kept)"],
    "file_roots": [
        "base:added.sls: added on the peer since its last sync (kept)",
        "base:app/init.sls: edited on the peer since its last sync (kept)",
        "base:old.sls: removed on the peer since its last sync (kept)"],
    "master_config": [
        "nodegroups: changed on the peer (multimaster-sync.conf) since its last sync (kept)"],
}


def test_an_outage_on_the_peer_is_named_and_never_reverted(fake):
    tmp = _outage(fake)
    before = {p: open(p, "rb").read() for p in _files(tmp + "/m2")}
    res, published = _sync(fake)
    assert res["result"] is False
    for cat, lines in EXPECTED.items():
        assert sorted(res[cat].get("peer_changed", [])) == lines, (cat, res[cat])
        assert res[cat]["added"] == res[cat]["updated"] == res[cat]["removed"] == [], res[cat]
    assert "3 item(s)" not in res["error"] and res["error"].startswith(
        f"7 item(s) changed on {PEER} since its last sync, left there (see peer_changed): "
        f"salt-run multimaster.failback peer={PEER} carries them to the primary, force=True "
        "puts the primary's back")
    assert {p: open(p, "rb").read() for p in _files(tmp + "/m2")} == before
    # the same on every sync (the record is not moved by a sync that leaves them)
    res, _ = _sync(fake)
    assert sorted(res["file_roots"]["peer_changed"]) == EXPECTED["file_roots"]
    assert sync.drift(res, ["file_roots"])["file_roots"]["peer_changed"] == 3
    # a change of the primary meanwhile still reaches the peer
    _write(f"{tmp}/m1/srv/other.sls", "other: 1\n")
    res, _ = _sync(fake)
    assert res["file_roots"]["added"] == ["base:other.sls"]
    assert sorted(res["file_roots"]["peer_changed"]) == EXPECTED["file_roots"]
    # force=True puts the primary's back, and the peer is in step again
    res, _ = _sync(fake, force=True)
    assert res["result"] is True, res
    fake.mopts.pop("nodegroups")
    test_rounds._read_dropin(fake.mopts)  # pylint: disable=protected-access
    _assert_replica(fake.primary_opts, fake.mopts)
    res, published = _sync(fake)
    assert res["result"] is True and published == ["inventory"], res


def test_a_change_on_both_sides_is_a_conflict(fake):
    tmp = _outage(fake)
    _write(f"{tmp}/m1/srv/app/init.sls", "app: v2\n")
    res, _ = _sync(fake, ["file_roots"])
    assert res["file_roots"]["conflicts"] == [
        "base:app/init.sls: edited on the peer and changed on the primary since the peer's "
        "last sync (kept; multimaster.failback takes the peer's side, force=True the "
        "primary's)"]
    assert open(f"{tmp}/m2/srv/app/init.sls").read() == "app: hotfix\n"


def test_a_targeted_key_sync_keeps_a_rejection_of_the_peer(fake):
    tmp = _outage(fake)
    res, _ = _sync(fake, ["minion_keys"], ids=["web1", "gone1"])
    assert sorted(res["minion_keys"]["peer_changed"]) == [
        EXPECTED["minion_keys"][0], EXPECTED["minion_keys"][2]], res
    assert os.path.exists(f"{tmp}/m2/pki/minions_rejected/web1")
    assert not os.path.exists(f"{tmp}/m2/pki/minions/gone1")


def test_a_noop_sync_writes_no_record_and_a_change_sync_only_its_buckets(fake, monkeypatch):
    tmp = fake.state_dir.rsplit("/", 1)[0]
    _sync(fake)
    res, published = _sync(fake)
    assert res["result"] is True and published == ["inventory"]
    written = _written(monkeypatch)
    res, published = _sync(fake)
    assert published == ["inventory"]
    assert written == []
    _write(f"{tmp}/m1/srv/one.sls", "one: 1\n")
    res, published = _sync(fake)
    assert published == ["apply"] and res["file_roots"]["added"] == ["base:one.sls"]
    bucket = manifest.bucket_of("base/one.sls")
    assert written == [("file_roots", bucket)]
    del written[:]
    res, published = _sync(fake)
    assert published == ["inventory"] and written == []


def _files(root):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
                  if "/cache/" not in os.path.join(d, f))


@pytest.mark.parametrize("cat", ["minion_keys", "file_roots"])
def test_a_peer_never_confirmed_is_planned_as_before(fake, cat):
    tmp = fake.state_dir.rsplit("/", 1)[0]
    _write(f"{tmp}/m2/pki/minions/local", gen_keypair(1024)[1])
    _write(f"{tmp}/m2/srv/local.sls", "local\n")
    res, _ = _sync(fake, [cat])
    if cat == "minion_keys":
        assert [c.split(":")[0] for c in res[cat]["conflicts"]] == ["minions/local"]
    else:
        assert res[cat]["removed"] == ["base:local.sls"]
    assert "peer_changed" not in res[cat]
    assert sync.drift(res, [cat])[cat].get("peer_changed") is None


# ---------------------------------------------------------------------------
# Failback (issue 33 item 4), over temp dirs
# ---------------------------------------------------------------------------
class FailbackSalt(test_rounds.FakeSalt):
    """The stand-in for Salt, answering the peer's collect too."""

    def _run(self, fun, request):
        if fun == "multimaster_peer.collect":
            return restore.collect(self.mopts, request["items"], request["reply_to"],
                                   request["reply_pub"])
        return super()._run(fun, request)


def _failback_ops(fake, rotated=None, sync_all=None):
    opts = fake.primary_opts
    conf = test_rounds._conf()  # pylint: disable=protected-access
    salt = FailbackSalt(opts, fake.mopts, fake.minion_priv, fake.state_dir)
    salt.published = fake.published

    def collect(peer_id, items, timeout):
        with open(f"{opts['pki_dir']}/master.pub", encoding="utf-8") as fh:
            request = protocol.request("multimaster_peer.collect", items=items,
                                       reply_to=opts["id"], reply_pub=fh.read())
        return salt.publish([peer_id], "multimaster_peer.collect", request, timeout).replies()[
            peer_id]

    def unseal(blob, purpose):
        with open(f"{opts['pki_dir']}/master.pem", "rb") as fh:
            return seal.unseal(fh.read(), blob, opts["id"], purpose)

    def everyone():
        return rounds.Rounds(opts, conf, salt).run([PEER], list(test_rounds.CATS))

    return failback.SaltOps(opts, conf, salt, collect, unseal,
                            rotate_aes=lambda: rotated.append(True) or "requested"
                            if rotated is not None else "requested",
                            sync_all=sync_all or everyone)


def _tree_of(root):
    return {os.path.relpath(p, root): open(p, "rb").read() for p in _files(root)}


def test_failback_test_shows_the_outage_and_changes_nothing(fake):
    tmp = _outage(fake)
    before = (_tree_of(f"{tmp}/m1"), _tree_of(f"{tmp}/m2"))
    fake.published.clear()
    ret = failback.failback(_failback_ops(fake), PEER, test=True)
    assert (_tree_of(f"{tmp}/m1"), _tree_of(f"{tmp}/m2")) == before
    plan = ret["steps"]["plan"]
    assert plan["result"] is None and sorted(plan["carry"]) == [
        "base:added.sls: added (peer changed)", "base:app/init.sls: edited (peer changed)",
        "base:old.sls: removed (peer changed)", "minions/gone1: deleted (peer changed)",
        "minions/newbie: accepted (peer changed)",
        "minions_rejected/web1: rejected (was minions/web1) (peer changed)"]
    assert plan["config"] == ["nodegroups: changed (peer changed)"]
    assert ret["steps"]["config"]["remedy"][0].startswith(
        f"nodegroups: changed on {PEER} (multimaster-sync.conf), not carried")
    assert ret["result"] is False and ret["retcode"] == 1
    assert fake.published == ["inventory"]


def test_failback_carries_the_outage_to_the_primary_and_the_masters_agree(fake):
    tmp = _outage(fake)
    pki = f"{tmp}/m1/pki"
    rotated = []
    ret = failback.failback(_failback_ops(fake, rotated), PEER)
    primary = ret["steps"]["primary"]
    assert primary["result"] is True, primary
    assert primary["changes"]["minion_keys"] == {
        "added": [], "updated": ["minions/newbie", "minions_rejected/web1"],
        "removed": ["minions/gone1", "minions/web1"], "errors": []}
    assert primary["changes"]["file_roots"]["updated"] == ["base:added.sls", "base:app/init.sls"]
    assert primary["changes"]["file_roots"]["removed"] == ["base:old.sls"]
    assert rotated == [True] and primary["aes_rotation"] == "requested"
    assert os.path.exists(f"{primary['backup']}/minion_keys/minions/web1")
    assert os.path.exists(f"{pki}/minions_rejected/web1") and not os.path.exists(
        f"{pki}/minions/web1")
    assert open(f"{tmp}/m1/srv/app/init.sls").read() == "app: hotfix\n"
    assert not os.path.exists(f"{tmp}/m1/srv/old.sls")
    # the option is named, not carried: the sync still says so
    assert ret["steps"]["config"]["result"] is False
    assert ret["steps"]["sync"]["result"] is False and ret["retcode"] == 1
    # keep it: the primary's value goes back to the peer, and every master agrees
    ret = failback.failback(_failback_ops(fake), PEER, keep="nodegroups")
    assert ret["result"] is True, ret
    assert ret["steps"]["plan"]["keep"] == ["nodegroups: changed (peer changed)"]
    assert "primary" not in ret["steps"] and ret["steps"]["peer"]["result"] is True
    fake.mopts.pop("nodegroups")
    test_rounds._read_dropin(fake.mopts)  # pylint: disable=protected-access
    assert fake.mopts["nodegroups"] == {"webs": "L@web1"}
    _assert_replica(fake.primary_opts, fake.mopts)
    # a second failback has nothing to carry; a plain sync is clean
    ret = failback.failback(_failback_ops(fake), PEER)
    assert ret["result"] is True and ret["steps"]["plan"]["comment"] == (
        f"nothing changed on {PEER} since its last sync")
    res, published = _sync(fake)
    assert res["result"] is True and published == ["inventory"], res


def test_failback_keep_primary_puts_the_primarys_side_back(fake):
    tmp = _outage(fake)
    before = _tree_of(f"{tmp}/m1")
    ret = failback.failback(_failback_ops(fake), PEER, keep="primary")
    assert ret["result"] is True, ret
    assert "primary" not in ret["steps"]
    assert {k: v for k, v in _tree_of(f"{tmp}/m1").items() if "/multimaster/" not in k
            and not k.startswith("cache/")} == {
        k: v for k, v in before.items() if "/multimaster/" not in k and not k.startswith("cache/")}
    fake.mopts.pop("nodegroups")
    test_rounds._read_dropin(fake.mopts)  # pylint: disable=protected-access
    _assert_replica(fake.primary_opts, fake.mopts)


def test_failback_keep_names_items_and_refuses_an_unknown_one(fake):
    tmp = _outage(fake)
    with pytest.raises(outage.FailbackError, match="keep: no item changed on the peer is named "
                                                   "'nosuch'"):
        failback.failback(_failback_ops(fake), PEER, keep="web1,nosuch")
    ret = failback.failback(_failback_ops(fake), PEER,
                            keep=["web1", "base:app/init.sls", "master_config"])
    assert ret["result"] is True, ret
    assert sorted(ret["steps"]["plan"]["keep"]) == [
        "base:app/init.sls: edited (peer changed)", "minions_rejected/web1: rejected (was "
        "minions/web1) (peer changed)", "nodegroups: changed (peer changed)"]
    assert open(f"{tmp}/m2/srv/app/init.sls").read() == "app: v1\n"
    assert os.path.exists(f"{tmp}/m2/pki/minions/web1")
    assert open(f"{tmp}/m1/srv/added.sls").read() == "added: 1\n"


def test_an_interrupted_failback_converges_when_run_again(fake):
    tmp = _outage(fake)

    def crash():
        raise RuntimeError("salt-run killed")

    with pytest.raises(RuntimeError):
        failback.failback(_failback_ops(fake, sync_all=crash), PEER, keep="master_config")
    # the primary holds the peer's changes; the peer was not synced
    assert os.path.exists(f"{tmp}/m1/pki/minions_rejected/web1")
    ret = failback.failback(_failback_ops(fake), PEER, keep="master_config")
    assert ret["result"] is True, ret
    assert "primary" not in ret["steps"]
    fake.mopts.pop("nodegroups")
    test_rounds._read_dropin(fake.mopts)  # pylint: disable=protected-access
    _assert_replica(fake.primary_opts, fake.mopts)


def test_a_collect_reads_only_inside_the_pki_dir_and_roots(fake, tmp_path):
    tmp = _outage(fake)
    with open(f"{fake.primary_opts['pki_dir']}/master.pub", encoding="utf-8") as fh:
        pub = fh.read()
    got = restore.collect(fake.mopts, ["minion_keys/minions/newbie", "file_roots/base/../etc/x",
                                       "minion_keys/minions/../../etc", "master_keys/master.pem",
                                       "file_roots/nosuchenv/a.sls",
                                       "file_roots/base/app/init.sls"],
                          "m1_master", pub)
    assert sorted(got["items"]) == ["file_roots/base/app/init.sls", "minion_keys/minions/newbie"]
    assert len(got["errors"]) == 4
    item = got["items"]["file_roots/base/app/init.sls"]
    assert b"hotfix" not in str(item).encode()
    with open(f"{fake.primary_opts['pki_dir']}/master.pem", "rb") as fh:
        assert seal.unseal(fh.read(), item["sealed"], "m1_master",
                           "failback/file_roots/base/app/init.sls") == b"app: hotfix\n"
    assert os.path.exists(f"{tmp}/m2/srv/app/init.sls")


def test_the_compact_report_of_a_failback_names_each_step_and_item(fake):
    _outage(fake)
    ret = failback.failback(_failback_ops(fake), PEER)
    rows = report.failback_rows(ret)
    assert list(rows) == ["title", "plan", "primary", "config", "sync", "result", "retcode"]
    assert rows["title"] == PEER
    assert rows["plan"].splitlines()[0] == (
        f"ok: 7 item(s) changed on {PEER} since its last sync: 6 to carry to the primary, 0 "
        "to put back as the primary holds them, 1 option(s) not carried")
    assert "  carry: base:app/init.sls: edited (peer changed)" in rows["plan"]
    assert rows["primary"].splitlines()[0] == (
        "ok: 7 change(s) of m2 written on the primary; gone1, web1 no longer accepted: AES key "
        "rotation requested")
    assert "  minion_keys   written: minions/newbie, minions_rejected/web1" in rows["primary"]
    assert rows["config"].startswith("FAILED: 1 option(s) changed on m2, not carried\n  to do: ")
    assert rows["sync"].splitlines()[1].startswith(f"  {PEER}: FAILED: 1 item(s) changed on")
    assert (rows["result"], rows["retcode"]) == ("NOT done", 1)


def test_a_collect_fits_in_a_return(fake):
    tmp = _outage(fake)
    with open(f"{fake.primary_opts['pki_dir']}/master.pub", encoding="utf-8") as fh:
        pub = fh.read()
    _write(f"{tmp}/m2/srv/big.bin", b"x" * (restore.COLLECT_MAX_BYTES + 1))
    _write(f"{tmp}/m2/srv/half1", b"y" * (restore.COLLECT_MAX_BYTES // 2 + 1))
    _write(f"{tmp}/m2/srv/half2", b"y" * (restore.COLLECT_MAX_BYTES // 2 + 1))
    got = restore.collect(fake.mopts, ["file_roots/base/big.bin", "file_roots/base/half1",
                                       "file_roots/base/half2"], "m1_master", pub)
    assert list(got["items"]) == ["file_roots/base/half1"]
    assert [e.split(":")[0] for e in got["errors"]] == ["file_roots/base/big.bin",
                                                        "file_roots/base/half2"]
    assert "copy it to the primary by hand, or keep it" in got["errors"][0]
    # the primary asks in batches that fit
    sizes = {"a": 300 * 1024, "b": 300 * 1024, "c": 10}
    assert outage.batches(sizes, restore.COLLECT_MAX_BYTES) == [["a"], ["b", "c"]]


def test_the_record_of_a_key_forced_holds_what_the_peer_holds_of_it(fake):
    """
    A targeted apply records every key of the ids it wrote as the peer holds
    them (its operations alone do not say that the peer deleted another
    state of the id itself): a later removal on the primary is a removal.
    """
    tmp = fake.state_dir.rsplit("/", 1)[0]
    pki, ppki = f"{tmp}/m1/pki", f"{tmp}/m2/pki"
    _write(f"{pki}/minions_rejected/tgt1", gen_keypair(1024)[1])
    res, _ = _sync(fake)
    assert res["result"] is True and os.path.exists(f"{ppki}/minions_rejected/tgt1")
    os.unlink(f"{ppki}/minions_rejected/tgt1")
    os.rename(f"{pki}/minions_rejected/tgt1", f"{pki}/minions/tgt1")
    res, _ = _sync(fake, ["minion_keys"], ids=["tgt1"])
    assert [c.split(":")[0] for c in res["minion_keys"]["conflicts"]] == [
        "minions_rejected/tgt1"], res
    res, _ = _sync(fake, ["minion_keys"], ids=["tgt1"], force=True)
    assert res["result"] is True and res["minion_keys"]["added"] == ["minions/tgt1"], res
    os.unlink(f"{pki}/minions/tgt1")
    res, _ = _sync(fake, ["minion_keys"])
    assert res["result"] is True and res["minion_keys"]["removed"] == ["minions/tgt1"], res


def test_a_peer_that_reached_the_primarys_state_by_itself_records_it(fake):
    """
    A restore on the peer, then the primary fixed to the same: in step,
    nothing to apply, and the record written again; the peer's next edit
    is its own change, not a conflict.
    """
    tmp = fake.state_dir.rsplit("/", 1)[0]
    _write(f"{tmp}/m1/srv/motd.sls", "v1\n")
    _sync(fake)
    _write(f"{tmp}/m1/srv/motd.sls", "v2 (a mistake)\n")
    _sync(fake)
    _write(f"{tmp}/m2/srv/motd.sls", "v1\n")  # as multimaster.restore puts it back
    _write(f"{tmp}/m1/srv/motd.sls", "v1\n")  # the primary fixed
    res, published = _sync(fake, ["file_roots"])
    assert res["result"] is True and "peer_changed" not in res["file_roots"], res
    assert published == ["apply", "apply"]  # refused, then the apply recording it
    _write(f"{tmp}/m2/srv/motd.sls", "v3 hot-fixed on the peer\n")
    res, _ = _sync(fake, ["file_roots"])
    assert res["file_roots"]["peer_changed"] == [
        "base:motd.sls: edited on the peer since its last sync (kept)"], res
