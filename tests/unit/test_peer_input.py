"""
``multimaster_peer`` refuses malformed input with a named error, ``result:
False`` and a non-zero retcode, before anything is written; the replicated
master config drop-in is 0600.
"""

import importlib.util
import os
import stat

import pytest

from tests.conftest import REPO

SHA = "a" * 64


def _tree(root):
    return sorted(
        (os.path.relpath(os.path.join(d, f), root), os.stat(os.path.join(d, f)).st_mode)
        for d, _, files in os.walk(root) for f in files
    )


@pytest.fixture
def peer(tmp_path):
    spec = importlib.util.spec_from_file_location("mm_peer_input", REPO / "_modules" / "multimaster_peer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    conf_dir = tmp_path / "etc"
    (conf_dir / "master.d").mkdir(parents=True)
    (conf_dir / "master").write_text("")
    mopts = {"id": "m2_master", "conf_file": str(conf_dir / "master"),
             "default_include": "master.d/*.conf", "pki_dir": str(tmp_path / "pki"),
             "cachedir": str(tmp_path / "mcache"),
             "file_roots": {"base": [str(tmp_path / "srv")]},
             "pillar_roots": {"base": [str(tmp_path / "pillar")]}}
    for path in (tmp_path / "pki" / "minions", tmp_path / "srv", tmp_path / "pillar"):
        path.mkdir(parents=True)
    (tmp_path / "pki" / "minions" / "web1").write_text("key")
    mod.__opts__ = {"id": "m2", "cachedir": str(tmp_path / "cache"), "pki_dir": str(tmp_path / "mpki")}
    mod.__context__ = {}
    mod.__salt__ = {}
    mod._master_opts = lambda: mopts
    mod._restart_master = lambda cmd=None: lambda: "restart_required"
    mod.tmp = tmp_path
    return mod


@pytest.mark.parametrize("ops,error", [
    ("minion_keys", "ops must be a mapping of category to operations, not 'minion_keys'"),
    ({"minion_keys": "minions/web2"},
     "ops['minion_keys'] must be a list of operations, not 'minions/web2'"),
    ({"keys": []}, "ops: unknown category 'keys' (known: master_keys, minion_keys, file_roots, "
                   "pillar_roots, master_config)"),
    ({"minion_keys": [{"op": "write", "state": "minions", "id": "web2", "sha256": SHA,
                       "data": "k"}, "web3"]},
     "ops['minion_keys'][1] must be a mapping, not 'web3'"),
    ({"file_roots": [{"op": "write", "env": "base", "mode": 420, "sha256": SHA}]},
     "ops['file_roots'][0]: missing field 'rel'"),
    ({"master_config": [{"op": "write", "values": {"pki_dir": "/tmp"}}]},
     "master_config_keys: 'pki_dir' not replicable: only cluster-wide policy options are ("),
])
def test_apply_refuses_malformed_ops(peer, ops, error):
    before = _tree(peer.tmp)
    ret = peer.apply(ops=ops)
    assert set(ret) == {"result", "error", "protocol"} and ret["result"] is False
    assert ret["error"].startswith(f"multimaster_peer.apply: {error}")
    assert peer.__context__["retcode"] == 1
    assert _tree(peer.tmp) == before


def test_apply_refuses_unknown_topology(peer):
    assert peer.apply(ops={}, topology="mesh") == {
        "result": False, "protocol": 1,
        "error": "multimaster_peer.apply: unknown topology 'mesh'"}


@pytest.mark.parametrize("kwargs,error", [
    ({"categories": "minion_keys"}, "categories must be a list of categories, not 'minion_keys'"),
    ({"categories": ["minion_keys", "keys"]}, "categories: unknown category 'keys' (known: "
     "master_keys, minion_keys, file_roots, pillar_roots, master_config)"),
    ({"digests": "x"}, "digests must be a mapping, not 'x'"),
    ({"config_keys": "peer"}, "config_keys must be a list, not 'peer'"),
])
def test_inventory_refuses(peer, kwargs, error):
    assert peer.inventory(**kwargs) == {"result": False, "protocol": 1,
                                        "error": f"multimaster_peer.inventory: {error}"}
    assert peer.__context__["retcode"] == 1


def test_inventory_refuses_host_specific_config_keys(peer):
    ret = peer.inventory(categories=["master_config"], config_keys=["nodegroups", "pki_dir"])
    assert ret["result"] is False
    assert ret["error"].startswith("multimaster_peer.inventory: master_config_keys: 'pki_dir' "
                                   "not replicable")


def test_master_config_dropin_is_0600(peer):
    ret = peer.apply(ops={"master_config": [
        {"op": "write", "values": {"external_auth": {"pam": {"ops": [".*"]}}}}]})
    assert ret["master_config"] == {"errors": [], "failed": []}, ret
    dropin = peer.tmp / "etc" / "master.d" / "multimaster-sync.conf"
    assert stat.S_IMODE(dropin.stat().st_mode) == 0o600
    assert "external_auth" in dropin.read_text()
