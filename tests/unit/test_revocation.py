"""
Revocation reaches every master (issue 33, items 1 and 2), without daemons:

* a sync never moves to accepted a key the peer rejected or denied, unless
  ``force`` (:func:`replicate.plan_keys`, full and targeted plans alike);
* an apply that takes a key out of ``minions/`` asks the peer's master to
  rotate its AES key with Salt's own drop file, on this Salt line
  (:mod:`salt_multimaster.compat`), which Salt's own maintenance loop acts
  on; the reply and the report say so.

The real-daemon side: tests/integration/test_revocation.py.
"""

import getpass
import os
import pathlib
import stat
import time
import types
from unittest.mock import patch

import pytest
import salt.master
import salt.version

from salt_multimaster import compat, peer, replicate, report, revocation, sync
from tests.support.cluster import gen_keypair
from tests.unit import test_contract as contract
from tests.unit import test_rounds

pair = contract.pair  # the primary and peer over temp dirs (fixture)
fake = test_rounds.fake  # the same, synced through the real rounds (fixture)
_sync = test_rounds._sync  # pylint: disable=protected-access
_roundtrip = contract._roundtrip  # pylint: disable=protected-access

A, B = "a" * 64, "b" * 64
MAJOR = salt.version.__saltstack_version__.major


# ---------------------------------------------------------------------------
# The plan: a revocation on a peer is never undone without force
# ---------------------------------------------------------------------------
def test_a_key_rejected_on_the_peer_is_not_accepted_again():
    primary = {"minions": {"web1": A, "web2": A}}
    peer_keys = {"minions_rejected": {"web1": A}, "minions": {"web2": A}}
    ops, rep = replicate.plan_keys(primary, peer_keys, history=["web1", "web2"])
    assert ops == []
    assert rep == {"added": [], "updated": [], "removed": [], "errors": [], "conflicts": [
        "minions_rejected/web1: revoked on this peer master (rejected there) while the primary "
        "accepts it: left rejected; reject it on the primary too (salt-key -r web1 "
        "--include-accepted), or accept it again on this peer (salt-key -a web1 "
        "--include-rejected), or sync with force=True"]}
    # rejected there with another key, or accepted there as well: still revoked
    # (Salt refuses a rejected id whatever key it shows)
    for held in ({"minions_rejected": {"web1": B}},
                 {"minions_rejected": {"web1": A}, "minions": {"web1": A}}):
        ops, rep = replicate.plan_keys(primary, dict(held, minions={"web2": A, **held.get(
            "minions", {})}), history=["web1", "web2"])
        assert ops == [] and [c.split(":")[0] for c in rep["conflicts"]] == [
            "minions_rejected/web1"], rep
    # force=True accepts it again there
    ops, rep = replicate.plan_keys(primary, peer_keys, history=["web1"], force=True)
    assert [(op["op"], op["state"], op["id"]) for op in ops] == [
        ("write", "minions", "web1"), ("remove", "minions_rejected", "web1")]
    assert rep["conflicts"] == []
    # what accepts nothing still follows the primary: rejected on both, in
    # step; rejected on the primary, moved there too; pending on the primary
    for primary, peer_keys, expected in (
            ({"minions_rejected": {"x": A}}, {"minions_rejected": {"x": A}}, []),
            ({"minions_rejected": {"x": A}}, {"minions": {"x": A}},
             [("write", "minions_rejected"), ("remove", "minions")]),
            ({"minions_pre": {"x": A}}, {"minions_rejected": {"x": A}},
             [("write", "minions_pre"), ("remove", "minions_rejected")])):
        ops, rep = replicate.plan_keys(primary, peer_keys, history=["x"])
        assert [(op["op"], op["state"]) for op in ops] == expected
        assert rep["conflicts"] == []


def test_the_key_the_primary_accepts_denied_on_the_peer_is_not_accepted_there():
    primary = {"minions": {"web1": A}}
    ops, rep = replicate.plan_keys(primary, {"minions_denied": {"web1": A}}, history=["web1"])
    assert ops == [] and rep["conflicts"] == [
        "minions_denied/web1: revoked on this peer master (denied there) while the primary "
        "accepts it: left denied; reject it on the primary too (salt-key -r web1 "
        "--include-accepted), or accept it again on this peer (salt-key -a web1 "
        "--include-denied), or sync with force=True"]
    # another key denied beside the accepted one revokes nothing the primary
    # accepts: the conflict of another key for the id, as before
    ops, rep = replicate.plan_keys(primary, {"minions": {"web1": A}, "minions_denied": {"web1": B}},
                                   history=["web1"])
    assert ops == [] and rep["conflicts"] == [
        "minions_denied/web1: the peer holds a different key for this id (left alone; "
        "force=True replaces it)"]


def test_a_targeted_plan_leaves_a_revocation_too(pair):
    primary_opts, mopts, _, tmp_path = pair
    key = gen_keypair(1024)[1]
    (tmp_path / "m1" / "pki" / "minions" / "web1").write_bytes(key)
    (tmp_path / "m2" / "pki" / "minions_rejected" / "web1").write_bytes(key)
    primary = sync.read_primary(primary_opts, ["minion_keys"], "shared", [])
    inv = peer.inventory(mopts, str(tmp_path / "m2-minion-state"), ["minion_keys"],
                         sync.current_digests(primary, ["minion_keys"]), "shared", [])
    ops, rep = sync.plan("shared", ["minion_keys"], primary, inv, False, ids=["web1"])
    assert ops == {"minion_keys": []}
    assert rep["minion_keys"]["conflicts"][0].startswith(
        "minions_rejected/web1: revoked on this peer master"), rep


def test_a_sync_leaves_a_key_rejected_on_the_peer_and_fails(fake):
    """
    Full and targeted syncs through the rounds: named, left rejected, result
    False (rejected on the peer since its last sync: a change of the peer).
    """
    tmp_path = fake.state_dir.rsplit("/", 1)[0]
    res, _ = _sync(fake)
    assert res["result"] is True, res
    os.rename(f"{tmp_path}/m2/pki/minions/web1", f"{tmp_path}/m2/pki/minions_rejected/web1")
    for ids in (None, ["web1"]):
        res, _ = _sync(fake, ["minion_keys"], ids=ids)
        assert res["result"] is False, res
        assert "1 item(s) changed on m2 since its last sync" in res["error"], res
        assert [c.split(":")[0] for c in res["minion_keys"]["peer_changed"]] == [
            "minions_rejected/web1"], res
        assert os.path.exists(f"{tmp_path}/m2/pki/minions_rejected/web1")
        assert not os.path.exists(f"{tmp_path}/m2/pki/minions/web1")


# ---------------------------------------------------------------------------
# Salt's drop file, on this Salt line
# ---------------------------------------------------------------------------
def _mopts(tmp_path, **extra):
    cachedir = tmp_path / "cache"
    cachedir.mkdir(exist_ok=True)
    return dict({"cachedir": str(cachedir), "id": "peer1_master", "user": getpass.getuser()},
                **extra)


def _salt_rotates(mopts):
    """
    Whether Salt's own maintenance loop (``Maintenance.handle_key_rotate``
    of this Salt line) rotates the AES key for what is in the cachedir.
    """
    rotated = []
    maint = types.SimpleNamespace(opts=dict(mopts, publish_session=0), event=None, rotate=0,
                                  ipc_publisher=None)
    with patch.object(salt.master.SMaster, "rotate_secrets",
                      lambda *args, **kwargs: rotated.append(True)):
        salt.master.Maintenance.handle_key_rotate(maint, time.time())
    return bool(rotated)


def test_the_drop_file_takes_the_master_s_id_from_3007_on():
    assert compat.dropfile_names_master() is (MAJOR >= 3007)


def test_a_rotation_request_is_the_drop_file_salt_key_writes(tmp_path):
    mopts = _mopts(tmp_path)
    assert revocation.request_rotation(mopts) == revocation.REQUESTED
    dfn = tmp_path / "cache" / ".dfn"
    assert stat.S_IMODE(dfn.stat().st_mode) == 0o400
    # Salt 3006 writes it empty; 3007 and 3008 name the master (.dfn-next renamed)
    assert dfn.read_text() == ("peer1_master" if MAJOR >= 3007 else "")
    assert not (tmp_path / "cache" / ".dfn-next").exists()
    assert compat.dropfile_ignored(mopts["cachedir"], mopts["id"]) is None
    # Salt's maintenance loop rotates for it, and takes it
    assert _salt_rotates(mopts) is True
    assert not dfn.exists()
    # once taken, the request is still confirmed
    assert compat.dropfile_ignored(mopts["cachedir"], mopts["id"]) is None


@pytest.mark.parametrize("name,mode,content", [
    ("another master's", 0o400, "other_master"),
    ("writable", 0o600, "peer1_master"),
])
def test_a_drop_file_salt_ignores_is_never_confirmed(tmp_path, name, mode, content):
    mopts = _mopts(tmp_path)
    dfn = tmp_path / "cache" / ".dfn"
    dfn.write_text(content)
    os.chmod(dfn, mode)
    ignored = compat.dropfile_ignored(mopts["cachedir"], mopts["id"])
    if MAJOR < 3007 and mode == 0o400:
        # Salt 3006 rotates for any 0400 drop file
        assert ignored is None, name
    else:
        assert ignored, name
        # Salt's drop file is not written over it: the request fails, named
        with pytest.raises(revocation.RevocationError, match=r"\.dfn"):
            revocation.request_rotation(mopts)
    assert _salt_rotates(mopts) is (ignored is None)


def test_rotate_aes_key_false_on_the_peer_writes_nothing(tmp_path):
    mopts = _mopts(tmp_path, rotate_aes_key=False)
    assert revocation.request_rotation(mopts) == revocation.DISABLED
    assert not (tmp_path / "cache" / ".dfn").exists()


# ---------------------------------------------------------------------------
# The apply asks for it, the reply and the report say so
# ---------------------------------------------------------------------------
def test_an_apply_that_takes_keys_out_of_minions_requests_a_rotation(pair):
    primary_opts, mopts, minion_priv, tmp_path = pair
    pki = tmp_path / "m1" / "pki"
    for mid in ("web1", "web2", "new1"):
        (pki / ("minions_pre" if mid == "new1" else "minions") / mid).write_bytes(
            gen_keypair(1024)[1])
    dfn = tmp_path / "m2" / "cache" / ".dfn"
    _, _, rep, applied = _roundtrip(primary_opts, mopts, minion_priv, tmp_path)
    assert "aes_rotation" not in applied and not dfn.exists()  # nothing revoked
    # a pending key deleted: nothing revoked either
    (pki / "minions_pre" / "new1").unlink()
    _, _, rep, applied = _roundtrip(primary_opts, mopts, minion_priv, tmp_path)
    assert rep["minion_keys"]["removed"] == ["minions_pre/new1"]
    assert "aes_rotation" not in applied and not dfn.exists()
    # rejected and deleted on the primary: this master rotates its AES key
    os.rename(pki / "minions" / "web1", pki / "minions_rejected" / "web1")
    (pki / "minions" / "web2").unlink()
    _, _, rep, applied = _roundtrip(primary_opts, mopts, minion_priv, tmp_path)
    assert sorted(rep["minion_keys"]["removed"]) == ["minions/web1", "minions/web2"]
    assert applied["aes_rotation"] == "requested"
    assert rep["minion_keys"]["errors"] == []
    assert dfn.read_text() == ("m2_master" if MAJOR >= 3007 else "")


def test_a_rotation_that_cannot_be_requested_fails_the_sync(pair):
    primary_opts, mopts, minion_priv, tmp_path = pair
    (tmp_path / "m1" / "pki" / "minions" / "web1").write_bytes(gen_keypair(1024)[1])
    _roundtrip(primary_opts, mopts, minion_priv, tmp_path)
    # a drop file this master ignores is in the way
    dfn = tmp_path / "m2" / "cache" / ".dfn"
    dfn.write_text("m2_master")
    os.chmod(dfn, 0o644)
    (tmp_path / "m1" / "pki" / "minions" / "web1").unlink()
    _, _, rep, applied = _roundtrip(primary_opts, mopts, minion_priv, tmp_path)
    assert "aes_rotation" not in applied
    assert rep["minion_keys"]["removed"] == ["minions/web1"]  # the revocation stands
    assert len(rep["minion_keys"]["errors"]) == 1
    assert rep["minion_keys"]["errors"][0].startswith(
        "minions/web1: removed, but this master's AES session key is not rotated ("), rep
    assert sync.verdict("m2", {"result": True, **rep}, ["minion_keys"])["result"] is False


def test_the_runner_s_report_says_a_rotation_was_requested(fake):
    tmp_path = fake.state_dir.rsplit("/", 1)[0]
    res, _ = _sync(fake)
    assert "aes_rotation" not in res
    os.unlink(f"{tmp_path}/m1/pki/minions/web1")
    for ids in (None, ["web2"]):
        if ids:
            os.rename(f"{tmp_path}/m1/pki/minions/web2", f"{tmp_path}/m1/pki/minions_rejected/web2")
        pathlib.Path(f"{tmp_path}/m2/cache/.dfn").unlink(missing_ok=True)
        res, _ = _sync(fake, ["minion_keys"], ids=ids)
        assert res["result"] is True, res
        assert res["aes_rotation"] == "requested", res
        assert os.path.exists(f"{tmp_path}/m2/cache/.dfn")
    rows = report.sync_rows({"m2": res, "retcode": 0})
    assert rows["m2"].endswith("\n  AES key rotation: requested"), rows
