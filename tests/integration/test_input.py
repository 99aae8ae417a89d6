"""
Strict input against real daemons (issue 13, items 5-7): each bad input to
``salt-run multimaster.*``, ``multimaster_peer.*``, the minion audit, the
states and the key reactor is a clear error naming it, a non-zero exit, and
nothing is published to a peer or written on it.
"""

import os
import pathlib
import stat

import pytest
import salt.utils.yaml

from tests.conftest import REPO
from tests.support.cluster import wait_until

pytestmark = pytest.mark.daemons


def _set_multimaster(master, value):
    dropin = pathlib.Path(master.config_file).parent / "master.d" / "multimaster.conf"
    dropin.parent.mkdir(exist_ok=True)
    dropin.write_text(salt.utils.yaml.safe_dump({"multimaster": value}))


@pytest.fixture(scope="module")
def cluster(cluster_factory):
    cluster = cluster_factory(
        "inp", peers=1, minions=1, share_master_keys=False, accept_on_peers=False,
        primary_overrides={"nodegroups": {"webs": "L@inp-minion1"},
                           "publisher_acl": {"ops": ["test.*"]}})
    _set_multimaster(cluster.primary, {"peers": [m.id for m in cluster.peer_minions]})
    yield from cluster.running()


def _snapshot(master):
    """Every file under a master's pki_dir, roots and config dir, with content and mode."""
    ret = {}
    dirs = [master.config["pki_dir"], str(pathlib.Path(master.config_file).parent)]
    for kind in ("file_roots", "pillar_roots"):
        for roots in master.config[kind].values():
            dirs.extend(roots)
    for top in dirs:
        for dirpath, _, files in os.walk(top):
            for name in files:
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                ret[path] = (st.st_mode, st.st_mtime_ns, os.readlink(path) if os.path.islink(path)
                             else pathlib.Path(path).read_bytes())
    return ret


PEER_FUNS = ("multimaster_peer.inventory", "multimaster_peer.apply")


def _peer_jobs(cluster):
    """The jids of every multimaster_peer job the primary published."""
    return {jid for fun in PEER_FUNS for jid, _, _ in cluster.job_records(cluster.primary, fun)}


def _refused(cluster, *args):
    """salt-run with bad input: non-zero exit, the message; nothing published or written."""
    peer = cluster.peers[0]
    before, jobs = _snapshot(peer), _peer_jobs(cluster)
    ret = cluster.salt_run(cluster.primary, *args, "--out=json")
    assert ret.returncode != 0, ret
    assert "Traceback" not in ret.stdout + ret.stderr, ret
    assert _snapshot(peer) == before
    assert _peer_jobs(cluster) == jobs, f"{args}: a peer job was published"
    return ret.data


def test_only_configured_peers(cluster):
    """peers= naming an accepted minion that is not a configured peer: nothing goes out."""
    minion = cluster.minions[0].id
    data = _refused(cluster, "multimaster.sync", f"peers={minion}", "only=master_keys")
    assert data["error"].startswith(f"peer(s) '{minion}' not in multimaster:peers"), data
    data = _refused(cluster, "multimaster.status", f"peers={cluster.peer_minions[0].id},{minion}")
    assert data["error"].startswith(f"peer(s) '{minion}' not in multimaster:peers"), data


@pytest.mark.parametrize("key", ["pki_dir", "interface", "id", "cachedir", "multimaster"])
def test_host_specific_master_config_refused(cluster, key):
    data = _refused(cluster, "multimaster.sync", "only=master_config",
                    f"master_config_keys=nodegroups,{key}")
    assert data["error"].startswith(f"master_config_keys: {key!r} not replicable"), data


@pytest.mark.parametrize("arg,error", [
    ("timeout=0", "timeout must be more than 0 seconds, not 0"),
    ("timeout=-5", "timeout must be more than 0 seconds, not -5"),
    ("timeout=nan", "timeout must be a finite number of seconds, not 'nan'"),
    ("timeout=.inf", "timeout must be a finite number of seconds, not inf"),
    ("timeout=999999999", "timeout must be at most 86400 seconds, not 999999999"),
    ("force=maybe", "force must be a boolean (True/False, yes/no, 1/0), not 'maybe'"),
    ("test=sure", "test must be a boolean (True/False, yes/no, 1/0), not 'sure'"),
    ("rescan=always", "rescan must be a boolean (True/False, yes/no, 1/0), not 'always'"),
    ("tset=True", "multimaster.sync: unknown argument tset: did you mean test? (accepted: "
                  "backup_keep, force, inline_limit, lock_wait, master_config_keys, minion_ids, "
                  "only, peers, pull_min_files, replicate, rescan, test, timeout, topology, "
                  "verbose)"),
    ("peer=inp-peer1", "multimaster.sync: unknown argument peer: did you mean peers? (accepted: "
                       "backup_keep, force, inline_limit, lock_wait, master_config_keys, "
                       "minion_ids, only, peers, pull_min_files, replicate, rescan, test, "
                       "timeout, topology, verbose)"),
    ("minion_ids=", "minion_ids is empty (''): name the minions whose keys to sync, or leave "
                    "minion_ids out for a full sync"),
    ("only=", "only is empty (''): name the categories to sync, or leave only out"),
])
def test_sync_bad_input(cluster, arg, error):
    assert _refused(cluster, "multimaster.sync", arg) == {
        "result": False, "error": error, "retcode": 1}


@pytest.mark.parametrize("value", ["inp-peer1", ["inp-peer1"]])
def test_multimaster_config_not_a_mapping(cluster, value):
    good = {"peers": [m.id for m in cluster.peer_minions]}
    _set_multimaster(cluster.primary, value)
    try:
        for fun in ("multimaster.sync", "multimaster.status"):
            data = _refused(cluster, fun)
            assert data["error"].startswith(
                "the master config option multimaster must be a mapping"), data
    finally:
        _set_multimaster(cluster.primary, good)


@pytest.mark.parametrize("arg,error", [
    ("timeout=-1", "multimaster.audit: timeout must be more than 0 seconds, not -1"),
    ("timeout=soon", "multimaster.audit: timeout must be a number of seconds, not 'soon'"),
])
def test_runner_audit_bad_input_exits_non_zero(cluster, arg, error):
    assert _refused(cluster, "multimaster.audit", arg) == {
        "result": False, "error": error, "retcode": 1}


@pytest.mark.parametrize("arg", ["timeout=-1", "timeout=0", "timeout=nan", "timeout=.inf"])
def test_minion_audit_bad_timeout(cluster, arg):
    minion = cluster.minions[0]
    ret = cluster.salt(cluster.primary, "multimaster.audit", arg, minion_tgt=minion.id)
    assert ret.returncode != 0, ret
    assert "multimaster.audit: timeout must be" in ret.stdout, ret
    assert "Traceback" not in ret.stdout, ret


def test_states_validate_before_writing(cluster):
    minion = cluster.minions[0]
    dropin = pathlib.Path(minion.config_file).parent / "minion.d" / "mm-input.conf"
    cached = pathlib.Path(minion.config["pki_dir"]) / "minion_master.pub"
    trusted = cached.read_bytes()
    other = (pathlib.Path(cluster.primary.config["pki_dir"]) / "minions"
             / cluster.peer_minions[0].id).read_text()
    for args in (
        ("multimaster.minion_config", "mm-input.conf",
         f"masters=[{cluster.primary.config['interface']}]", "restart_delay=soon"),
        ("multimaster.master_key", "minion_master.pub", f"contents={other!r}",
         "restart_delay=-1"),
    ):
        ret = cluster.salt(cluster.primary, "state.single", *args, "--out=json",
                           minion_tgt=minion.id)
        assert ret.returncode != 0, ret
        assert "Invalid argument, nothing written: restart_delay must be" in ret.stdout, ret
    assert not dropin.exists()
    assert cached.read_bytes() == trusted


@pytest.mark.parametrize("fun,arg,error", [
    ("multimaster_peer.apply", 'ops={"minion_keys": "minions/x"}',
     "ops['minion_keys'] must be a list of operations"),
    ("multimaster_peer.apply", 'ops={"minion_keys": [{"op": "write", "state": "minions"}]}',
     "ops['minion_keys'][0]: missing field 'id'"),
    ("multimaster_peer.apply", 'ops={"keys": []}', "ops: unknown category 'keys'"),
    ("multimaster_peer.apply", "ops=[1]", "ops must be a mapping"),
    ("multimaster_peer.inventory", "minion_ids=web1", "unknown argument minion_ids"),
    ("multimaster_peer.inventory", "categories=minion_keys",
     "categories must be a list of categories"),
    ("multimaster_peer.inventory", "categories=[keys]", "categories: unknown category 'keys'"),
])
def test_peer_functions_refuse_malformed_input(cluster, fun, arg, error):
    peer, pm = cluster.peers[0], cluster.peer_minions[0]
    before = _snapshot(peer)
    ret = cluster.salt(cluster.primary, fun, arg, "--out=json", minion_tgt=pm.id)
    assert ret.returncode != 0, ret
    data = ret.data
    assert data["result"] is False and data["error"].startswith(f"{fun}: {error}"), data
    assert "Traceback" not in ret.stdout, ret
    assert _snapshot(peer) == before


def test_reactor_drops_invalid_event_id(cluster):
    """A key event for ``x\\n*`` is dropped: no sync of every key runs."""
    syncs = cluster.job_records(cluster.primary, "runner.multimaster.sync")
    ret = cluster.salt_run(cluster.primary, "multimaster_reactor.key_event", "act=pending",
                           'minion_id="x\\n*"', "--out=json")
    assert ret.returncode != 0, ret
    assert ret.data == {"ignored": "invalid minion id 'x\\n*'", "result": False, "retcode": 1}
    pending = pathlib.Path(cluster.primary.config["cachedir"]) / "multimaster" / "key-sync.pending"
    assert not pending.exists()
    assert cluster.job_records(cluster.primary, "runner.multimaster.sync") == syncs


def test_master_config_dropin_is_0600(cluster):
    """The positive control: a valid sync publishes, and the drop-in it writes is 0600."""
    jobs = _peer_jobs(cluster)
    ret = cluster.salt_run(cluster.primary, "multimaster.sync", "only=master_config",
                           "master_config_keys=nodegroups,publisher_acl", "--out=json")
    assert _peer_jobs(cluster) != jobs
    peer = cluster.peers[0]
    dropin = pathlib.Path(peer.config_file).parent / "master.d" / "multimaster-sync.conf"
    # applied; the peer's master must restart to read it (no systemd here)
    res = ret.data[cluster.peer_minions[0].id]
    assert res["result"] is False and res["restart"] == "restart_required", ret
    assert ret.data[cluster.peer_minions[0].id]["master_config"]["added"] == [
        "nodegroups", "publisher_acl"], ret
    assert stat.S_IMODE(dropin.stat().st_mode) == 0o600
    assert salt.utils.yaml.safe_load(dropin.read_text())["nodegroups"] == {
        "webs": "L@inp-minion1"}


# An old peer: the peer module as it answered before replies carried their
# protocol version (0), installed on the peer's minion over the pip one.
OLD_PEER = """

def _protocol_zero(ret):
    ret.pop("protocol", None)
    return ret
"""


def test_a_peer_of_another_protocol_version_is_named(cluster):
    pm = cluster.peer_minions[0]
    ext = cluster.salt(cluster.primary, "config.get", "extension_modules", "--out=json",
                       minion_tgt=pm.id).data
    modules = pathlib.Path(ext) / "modules"
    modules.mkdir(parents=True, exist_ok=True)
    source = (REPO / "_modules" / "multimaster_peer.py").read_text()
    assert "return protocol.reply(" in source
    old = modules / "multimaster_peer.py"
    old.write_text(source.replace("return protocol.reply(", "return _protocol_zero(") + OLD_PEER)

    def answers_unversioned():
        cluster.salt(cluster.primary, "saltutil.refresh_modules", minion_tgt=pm.id)
        ret = cluster.salt(cluster.primary, "multimaster_peer.inventory",
                           "categories=[master_config]", "--out=json", minion_tgt=pm.id)
        return isinstance(ret.data, dict) and "master_id" in ret.data \
            and "protocol" not in ret.data

    try:
        assert wait_until(answers_unversioned, deadline=60), cluster.salt(
            cluster.primary, "multimaster_peer.inventory", "categories=[master_config]",
            "--out=json", minion_tgt=pm.id)
        before = _snapshot(cluster.peers[0])
        ret = cluster.salt_run(cluster.primary, "multimaster.sync", "--out=json")
        assert ret.returncode != 0, ret
        assert ret.data[pm.id] == {
            "result": False,
            "error": f"peer runs protocol 0, primary 1: upgrade salt-multimaster on {pm.id}"}, ret
        assert _snapshot(cluster.peers[0]) == before
    finally:
        old.unlink()
        cluster.salt(cluster.primary, "saltutil.refresh_modules", minion_tgt=pm.id)
    assert wait_until(lambda: "protocol" in (cluster.salt(
        cluster.primary, "multimaster_peer.inventory", "categories=[master_config]",
        "--out=json", minion_tgt=pm.id).data or {}), deadline=60)
