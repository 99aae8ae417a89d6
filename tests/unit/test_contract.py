"""
The runner-to-peer contract without Salt's loader: the real peer-side
inventory (over temp dirs) feeds the real planner, whose plan the real
applier applies, through the wire format (sealed contents, item names); the
peer's tree then equals the primary's.  Only the fileserver is stood in for
(the primary's file_roots read directly).
"""

import os
import socket
import sqlite3

import pytest
import salt.utils.yaml

from salt_multimaster import (applier, manifest, memory, peer, protocol, restart, restore,
                              seal, store, sync, transport, validate)
from tests.support.cluster import gen_keypair
from tests.support.history import received

CATS = ("master_keys", "minion_keys", "file_roots", "pillar_roots", "master_config")
CONFIG_KEYS = ["nodegroups", "publisher_acl"]


def _closed_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _master(root, name, port):
    for sub in ("pki/minions", "pki/minions_pre", "pki/minions_rejected", "srv", "pillar",
                "etc/master.d", "cache"):
        (root / name / sub).mkdir(parents=True)
    (root / name / "etc" / "master").write_text("")
    return {"id": f"{name}_master", "pki_dir": str(root / name / "pki"),
            "cachedir": str(root / name / "cache"),
            "conf_file": str(root / name / "etc" / "master"),
            "default_include": "master.d/*.conf", "interface": "127.0.0.1", "ret_port": port,
            "file_roots": {"base": [str(root / name / "srv")]},
            "pillar_roots": {"base": [str(root / name / "pillar")]},
            "hash_type": "sha256", "nodegroups": {}, "publisher_acl": {}}


@pytest.fixture
def pair(tmp_path):
    port = _closed_port()
    primary, replica = _master(tmp_path, "m1", port), _master(tmp_path, "m2", port)
    minion_priv, minion_pub = gen_keypair(2048)  # m2's salt-minion
    (tmp_path / "m1" / "pki" / "minions" / "m2").write_bytes(minion_pub)
    for opts in (primary, replica):
        priv, pub = gen_keypair(2048)
        (tmp_path / opts["id"][:2] / "pki" / "master.pem").write_bytes(priv)
        (tmp_path / opts["id"][:2] / "pki" / "master.pub").write_bytes(pub)
    return primary, replica, minion_priv, tmp_path


def _read_dropin(mopts):
    """What the peer module's salt.config.master_config() reads from master.d."""
    dropin = protocol.dropin_path(mopts)
    if os.path.exists(dropin):
        with open(dropin, encoding="utf-8") as fh:
            mopts.update(salt.utils.yaml.safe_load(fh))


def _roundtrip(primary_opts, mopts, minion_priv, tmp_path, sent=None, force=False,
               restart=None):
    """One sync of m2 as the runner and the peer module run it; returns the report."""
    primary = sync.read_primary(primary_opts, list(CATS), "shared", CONFIG_KEYS)
    digests = sent if sent is not None else sync.current_digests(primary, CATS)
    peer_state = str(tmp_path / "m2-minion-state")
    _read_dropin(mopts)
    inv = peer.inventory(mopts, peer_state, list(CATS), digests, "shared", CONFIG_KEYS)
    assert not sync.unplannable(CATS, primary, inv, digests)
    ops, report = sync.plan("shared", CATS, primary, inv, force)
    ops = {c: o for c, o in ops.items() if o}
    how = transport.transport(primary_opts, "m2", ops, transport.INLINE_LIMIT)
    assert how["mode"] == "inline" and how["error"] is None
    transport.attach_contents(primary_opts, "m2", ops, primary, how)

    def unseal(blob, purpose):
        return seal.unseal(minion_priv, blob, "m2", purpose)

    def fetch(file_ops):  # stands for the primary's fileserver
        return {id(op): manifest.locate(primary_opts["file_roots"][op["env"]], op["rel"])
                for op in file_ops}

    applied = applier.apply(mopts, peer_state, ops, "shared", 10, unseal, fetch,
                            restart or (lambda: "restart_required"),
                            keys_digest=primary["minion_keys"]["digest"])
    sync.merge(report, applied)
    return primary, ops, report, applied


def _tree(root):
    ret = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as fh:
                ret[os.path.relpath(path, root)] = fh.read()
    return ret


def _keys(opts):
    return {state: _tree(os.path.join(opts["pki_dir"], state)) for state in manifest.KEY_DIRS
            if os.path.isdir(os.path.join(opts["pki_dir"], state))}


def _assert_replica(primary_opts, mopts):
    for cat in ("file_roots", "pillar_roots"):
        assert _tree(mopts[cat]["base"][0]) == _tree(primary_opts[cat]["base"][0])
    mine, theirs = _keys(primary_opts), _keys(mopts)
    mine["minions"].pop("m2")  # the peer minion's own key: on the primary only here
    theirs["minions"].pop("m2", None)
    assert theirs == {s: k for s, k in mine.items() if k or s in theirs}
    for name in ("master.pem", "master.pub"):
        with open(os.path.join(primary_opts["pki_dir"], name), "rb") as a, \
                open(os.path.join(mopts["pki_dir"], name), "rb") as b:
            assert a.read() == b.read()


def _records(state_dir):
    """The peer's records in its state store: the key history and what it confirmed."""
    path = state_dir / store.NAME
    if not path.exists():
        return None
    with sqlite3.connect(path) as db:
        return [db.execute(f"SELECT * FROM {table} ORDER BY 1, 2").fetchall()
                for table in ("history", "confirmed")]


def test_the_real_inventory_planned_and_applied_makes_a_replica(pair):
    primary_opts, mopts, minion_priv, tmp_path = pair
    pki, srv = tmp_path / "m1" / "pki", tmp_path / "m1" / "srv"
    for mid in ("web1", "web2"):
        (pki / "minions" / mid).write_bytes(gen_keypair(1024)[1])
    (pki / "minions_pre" / "new1").write_bytes(gen_keypair(1024)[1])
    (srv / "top.sls").write_text("base: {'*': [web]}\n")
    (srv / "web").mkdir()
    (srv / "web" / "init.sls").write_text("nginx: pkg.installed\n")
    (tmp_path / "m1" / "pillar" / "secret.sls").write_text("password: hunter2\n")
    primary_opts["nodegroups"] = {"webs": "L@web1,web2"}
    # a key the peer holds and the primary never had: a conflict, kept
    (tmp_path / "m2" / "pki" / "minions" / "local").write_bytes(gen_keypair(1024)[1])
    records = _records(tmp_path / "m2-minion-state")

    _, ops, report, applied = _roundtrip(primary_opts, mopts, minion_priv, tmp_path)
    assert sorted(ops) == list(sorted(CATS))
    # small enough: the files ride sealed in the request, no fetch
    assert all("sealed" in op for op in ops["file_roots"]) and b"nginx" not in str(ops).encode()
    assert sorted(report["minion_keys"]["added"]) == [
        "minions/m2", "minions/web1", "minions/web2", "minions_pre/new1"]
    assert report["minion_keys"]["conflicts"] == [
        "minions/local: only on the peer, never on the primary (kept; force=True removes it)"]
    assert applied["restart"] == "restart_required"
    assert all(not report[c]["errors"] for c in CATS), report
    (tmp_path / "m2" / "pki" / "minions" / "local").unlink()
    _assert_replica(primary_opts, mopts)
    dropin = tmp_path / "m2" / "etc" / "master.d" / "multimaster-sync.conf"
    assert "webs: L@web1,web2" in dropin.read_text()
    assert received(str(tmp_path / "m2-minion-state")) == [
        "m2", "new1", "web1", "web2"]

    # the primary changes: accepted, deleted, edited; the peer is asked with
    # the digests of the primary's previous state, as the one-publish sync
    # sends what the peer last confirmed
    sent = sync.current_digests(
        sync.read_primary(primary_opts, CATS, "shared", CONFIG_KEYS), CATS)
    os.rename(pki / "minions_pre" / "new1", pki / "minions" / "new1")
    (pki / "minions" / "web2").unlink()
    (srv / "web" / "init.sls").write_text("nginx: pkg.latest\n")
    (srv / "top.sls").unlink()
    records = _records(tmp_path / "m2-minion-state")
    peer.inventory(mopts, str(tmp_path / "m2-minion-state"), list(CATS), sent, "shared",
                   CONFIG_KEYS)
    assert _records(tmp_path / "m2-minion-state") == records  # the inventory changes nothing
    _, ops, report, _ = _roundtrip(primary_opts, mopts, minion_priv, tmp_path, sent=sent)
    assert report["minion_keys"]["added"] == ["minions/new1"]
    assert sorted(report["minion_keys"]["removed"]) == ["minions/web2", "minions_pre/new1"]
    assert report["file_roots"]["updated"] == ["base:web/init.sls"]
    assert report["file_roots"]["removed"] == ["base:top.sls"]
    assert "master_keys" not in ops and "master_config" not in ops
    _assert_replica(primary_opts, mopts)

    # in step: nothing planned
    _, ops, _, _ = _roundtrip(primary_opts, mopts, minion_priv, tmp_path)
    assert ops == {}


def test_a_targeted_plan_keeps_the_keys_of_those_ids_only(pair):
    primary_opts, mopts, minion_priv, tmp_path = pair
    pki = tmp_path / "m1" / "pki"
    key = gen_keypair(1024)[1]
    (pki / "minions" / "web1").write_bytes(key)
    (pki / "minions" / "other").write_bytes(gen_keypair(1024)[1])
    state = str(tmp_path / "m2-minion-state")

    def targeted():
        primary = sync.read_primary(primary_opts, ["minion_keys"], "shared", CONFIG_KEYS)
        inv = peer.inventory(mopts, state, ["minion_keys"],
                             sync.current_digests(primary, ["minion_keys"]), "shared",
                             CONFIG_KEYS)
        ops, report = sync.plan("shared", ["minion_keys"], primary, inv, False, ids=["web1"])
        return primary, inv, ops, report

    primary, _, ops, report = targeted()
    assert report["minion_keys"]["added"] == ["minions/web1"]
    how = transport.transport(primary_opts, "m2", ops, transport.INLINE_LIMIT)
    transport.attach_contents(primary_opts, "m2", ops, primary, how)
    applier.apply(mopts, state, ops, "shared", 10, None, lambda ops: {}, lambda: None)
    assert (tmp_path / "m2" / "pki" / "minions" / "web1").read_bytes() == key
    assert not (tmp_path / "m2" / "pki" / "minions" / "other").exists()
    # deleted on the primary: the peer received it from the primary, so it goes
    (pki / "minions" / "web1").unlink()
    _, inv, ops, report = targeted()
    assert "web1" in inv["minion_keys"]["history"]
    assert report["minion_keys"]["removed"] == ["minions/web1"]
    assert report["minion_keys"]["added"] == []
    applier.apply(mopts, state, ops, "shared", 10, None, lambda ops: {}, lambda: None)
    assert not (tmp_path / "m2" / "pki" / "minions" / "web1").exists()
    assert not (tmp_path / "m2" / "pki" / "minions" / "other").exists()


def test_a_change_sync_planned_from_what_the_peer_was_last_confirmed_to_hold(pair):
    """#17 item 7: the apply goes out with the digests the peer should hold."""
    primary_opts, mopts, minion_priv, tmp_path = pair
    pki, srv = tmp_path / "m1" / "pki", tmp_path / "m1" / "srv"
    (pki / "minions" / "web1").write_bytes(gen_keypair(1024)[1])
    (srv / "a.sls").write_text("a: 1\n")
    primary, _, report, _ = _roundtrip(primary_opts, mopts, minion_priv, tmp_path)
    inv = {cat: {"envs": ["base"]} for cat in ("file_roots", "pillar_roots")}
    memory.remember(primary_opts, "m2", CATS, primary, inv, report)
    held = memory.remembered(primary_opts, "m2", CATS)
    assert sorted(held) == sorted(CATS)
    assert "pem" in held["master_keys"] and held["master_config"]["nodegroups"] == {}

    # one new key, one changed file
    (pki / "minions" / "web2").write_bytes(gen_keypair(1024)[1])
    (srv / "a.sls").write_text("a: 2\n")
    primary = sync.read_primary(primary_opts, list(CATS), "shared", CONFIG_KEYS)
    expected = memory.expected_inventory(held)
    expect = protocol.expectation(held)
    assert not sync.unplannable(CATS, primary, expected, protocol.expected_digests(expect))
    ops, report = sync.plan("shared", CATS, primary, expected, False)
    assert report["minion_keys"]["added"] == ["minions/web2"]
    assert report["file_roots"]["updated"] == ["base:a.sls"]
    ops = {c: o for c, o in ops.items() if o}
    transport.attach_contents(primary_opts, "m2", ops, primary, {"mode": "inline"})
    state = str(tmp_path / "m2-minion-state")

    def unseal(blob, purpose):
        return seal.unseal(minion_priv, blob, "m2", purpose)

    def fetch(file_ops):
        return {id(op): manifest.locate(primary_opts["file_roots"][op["env"]], op["rel"])
                for op in file_ops}

    # the peer changed behind the primary's back: nothing applied, its inventory instead
    (tmp_path / "m2" / "srv" / "local.sls").write_text("mine\n")
    _read_dropin(mopts)
    got = applier.apply(mopts, state, ops, "shared", 10, unseal, fetch, lambda: None,
                        expect=expect, config_keys=CONFIG_KEYS)
    assert set(got) == {"backup", "inventory"} and got["backup"] is None
    assert got["inventory"]["file_roots"]["buckets"]
    assert not (tmp_path / "m2" / "pki" / "minions" / "web2").exists()
    # the usual second round converges
    plan_ops, report = sync.plan("shared", CATS, primary, got["inventory"], False)
    assert report["file_roots"]["removed"] == ["base:local.sls"]
    (tmp_path / "m2" / "srv" / "local.sls").unlink()
    # as expected: applied in the one round trip, the master's state with it
    got = applier.apply(mopts, state, ops, "shared", 10, unseal, fetch, lambda: None,
                        expect=expect, config_keys=CONFIG_KEYS)
    assert got["master_running"] is False and got["restart"] is None
    assert got["minion_keys"] == {"errors": [], "failed": []}
    _assert_replica(primary_opts, mopts)
    with pytest.raises(validate.InvalidInput, match="expect must be a mapping"):
        applier.apply(mopts, state, {}, "shared", 10, unseal, fetch, lambda: None, expect=[1])


def test_a_restart_command_that_cannot_run_holds_back_what_needs_it(pair):
    """
    The peer host's multimaster.master_restart_cmd names a program not
    installed: master keys and options are not written (errors naming the
    command, no restart marked); the other categories are applied.
    test=True predicted exactly that from the inventory.
    """
    primary_opts, mopts, minion_priv, tmp_path = pair
    (tmp_path / "m1" / "srv" / "top.sls").write_text("base: {}\n")
    primary_opts["nodegroups"] = {"webs": "L@web1"}
    marks, scripts = [], []
    refused = restart.MasterRestart(
        {"cachedir": str(tmp_path / "m2-minion"),
         restart.MASTER_CMD_OPTION: "nosuch-init salt-master restart"},
        lambda: marks.append(1), lambda script: scripts.append(script) or 1, lambda: True)
    before = {n: (tmp_path / "m2" / "pki" / n).read_bytes() for n in ("master.pem", "master.pub")}

    # test mode: the inventory says how the master would restart
    primary = sync.read_primary(primary_opts, list(CATS), "shared", CONFIG_KEYS)
    inv = peer.inventory(mopts, str(tmp_path / "m2-minion-state"), list(CATS),
                         sync.current_digests(primary, CATS), "shared", CONFIG_KEYS)
    inv["master_restart"] = refused.describe()
    inv["master_running"] = True
    _, plan_report = sync.plan("shared", CATS, primary, inv, False)
    predicted = sync.finish("m2", dict(plan_report, result=True), inv, CATS, test=True)

    _, _, report, applied = _roundtrip(primary_opts, mopts, minion_priv, tmp_path,
                                       restart=refused)
    why = refused.why_refused()
    assert sorted(report["master_keys"]["errors"]) == [f"master.pem: {why}",
                                                       f"master.pub: {why}"]
    assert report["master_config"]["errors"] == [f"{protocol.DROPIN_NAME}: {why}"]
    assert applied["restart"] is None and marks == [] and scripts == []
    assert {n: (tmp_path / "m2" / "pki" / n).read_bytes() for n in before} == before
    assert not os.path.exists(protocol.dropin_path(mopts))
    assert (tmp_path / "m2" / "srv" / "top.sls").read_text() == "base: {}\n"
    ret = sync.finish("m2", dict(report, result=True), inv, CATS)  # the real run
    assert ret["result"] is False and ret["error"] == "3 item(s) failed (see errors)"
    assert sorted(predicted["master_keys"]["errors"]) == sorted(report["master_keys"]["errors"])
    assert predicted["master_config"]["errors"] == [f"nodegroups: {why}"]  # per option
    for cat in ("master_keys", "master_config"):
        assert predicted[cat]["added"] == predicted[cat]["updated"] == []
    assert predicted["result"] is False and "restart" not in predicted

    # a restart that can run: written, restarting; a restore of the old keys
    # (their backup) needs the restart too: refused the same way, test=True too
    _, _, report, applied = _roundtrip(primary_opts, mopts, minion_priv, tmp_path,
                                       restart=lambda: "restarting")
    assert applied["restart"] == "restarting" and not report["master_keys"]["errors"]
    written = {n: (tmp_path / "m2" / "pki" / n).read_bytes() for n in before}
    state = str(tmp_path / "m2-minion-state")
    for test in (True, False):
        ret = restore.restore(mopts, state, None, test, refused)
        assert ret["result"] is False and ret["restored"] == [], ret
        assert sorted(ret["errors"]) == [f"master_keys/master.pem: {why}",
                                         f"master_keys/master.pub: {why}"]
    assert {n: (tmp_path / "m2" / "pki" / n).read_bytes() for n in before} == written
    assert marks == [] and scripts == []
