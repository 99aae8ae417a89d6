"""
``multimaster.sync``/``multimaster.status`` refuse bad input before anything
is read or sent: a named error and a ``retcode`` in the return (what makes
``salt-run`` exit non-zero on 3008).
"""

import importlib.util

import pytest
import salt.client

from salt_multimaster import settings, sync
from tests.conftest import REPO
from tests.support.cluster import gen_keypair


def _load():
    spec = importlib.util.spec_from_file_location("mm_runner_input",
                                                  REPO / "_runners" / "multimaster.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def runner(tmp_path, monkeypatch):
    mod = _load()
    (tmp_path / "pki" / "minions").mkdir(parents=True)
    (tmp_path / "pki" / "minions" / "web01").write_text("key")
    for mid in ("m2", "m3"):  # the peers' minion keys: requests are sealed to them
        (tmp_path / "pki" / "minions" / mid).write_bytes(gen_keypair(1024)[1])
    mod.__opts__ = {"id": "m1", "pki_dir": str(tmp_path / "pki"), "cachedir": str(tmp_path / "c"),
                    "multimaster": {"peers": ["m2", "m3"]}}
    mod.__context__ = {}

    def nothing_sent(*args, **kwargs):
        raise AssertionError(f"published with bad input: {args} {kwargs}")

    # Salt's client, the one way anything reaches a peer
    monkeypatch.setattr(salt.client, "LocalClient", nothing_sent)
    return mod


def _refused(error):
    return {"result": False, "error": error, "retcode": 1}


@pytest.mark.parametrize("kwargs,error", [
    ({"peers": "m2,web01", "only": "master_keys"},
     "peer(s) 'web01' not in multimaster:peers of the master config (configured: m2, m3); "
     "only configured peers are synced"),
    ({"timeout": 0}, "timeout must be more than 0 seconds, not 0"),
    ({"timeout": -3}, "timeout must be more than 0 seconds, not -3"),
    ({"timeout": "nan"}, "timeout must be a finite number of seconds, not 'nan'"),
    ({"timeout": float("inf")}, "timeout must be a finite number of seconds, not inf"),
    ({"timeout": 10 ** 12}, "timeout must be at most 86400 seconds, not 1000000000000"),
    ({"force": "maybe"}, "force must be a boolean (True/False, yes/no, 1/0), not 'maybe'"),
    ({"test": "sure"}, "test must be a boolean (True/False, yes/no, 1/0), not 'sure'"),
    ({"rescan": "always"}, "rescan must be a boolean (True/False, yes/no, 1/0), not 'always'"),
    ({"minion_ids": ""}, "minion_ids is empty (''): name the minions whose keys to sync, or "
                         "leave minion_ids out for a full sync"),
    ({"minion_ids": []}, "minion_ids is empty ([]): name the minions whose keys to sync, or "
                         "leave minion_ids out for a full sync"),
    ({"only": ""}, "only is empty (''): name the categories to sync, or leave only out"),
    ({"backup_keep": 0}, "backup_keep must be a whole number of at least 1, not 0"),
    ({"backup_keep": "many"}, "backup_keep must be a whole number of at least 1, not 'many'"),
])
def test_sync_refuses(runner, kwargs, error):
    assert runner.sync(**kwargs) == _refused(error)
    assert runner.__context__["retcode"] == 1


@pytest.mark.parametrize("key", ["pki_dir", "interface", "id", "cachedir", "multimaster"])
def test_sync_refuses_host_specific_master_config_keys(runner, key):
    from salt_multimaster import validate  # pylint: disable=import-outside-toplevel

    assert runner.sync(master_config_keys=f"nodegroups,{key}") == _refused(
        f"master_config_keys: {key!r} not replicable: only cluster-wide policy options are "
        f"({', '.join(validate.SHARED_CONFIG_KEYS)}); host-specific options such as id, "
        "interface, pki_dir, cachedir or multimaster stay on each host")
    runner.__opts__["multimaster"]["master_config_keys"] = [key]
    assert runner.sync()["error"].startswith(f"master_config_keys: {key!r} not replicable")


SYNC_ACCEPTED = ("backup_keep, force, inline_limit, lock_wait, master_config_keys, minion_ids, "
                 "only, peers, pull_min_files, replicate, rescan, test, timeout, topology, "
                 "verbose")


def test_the_sync_keywords_are_rescan_and_the_options_a_call_overrides(runner):
    """The runner names them for its decorators; settings.conf overrides the same ones."""
    assert set(runner._CONF_KWARGS) == {"rescan"} | (set(settings.OVERRIDES) - {"peers"})


def test_unknown_kwarg_message_lists_the_accepted_ones(runner):
    assert runner.sync(tset=True) == _refused(
        f"multimaster.sync: unknown argument tset: did you mean test? (accepted: {SYNC_ACCEPTED})")
    assert runner.sync(peer="m2") == _refused(
        f"multimaster.sync: unknown argument peer: did you mean peers? (accepted: {SYNC_ACCEPTED})")


@pytest.mark.parametrize("conf", ["m2,m3", ["m2", "m3"]])
def test_multimaster_config_not_a_mapping(runner, conf):
    runner.__opts__["multimaster"] = conf
    assert runner.sync() == _refused(
        "the master config option multimaster must be a mapping (peers:, topology:, ...), "
        f"not a {type(conf).__name__}: {conf!r}")
    assert runner.status() == _refused(
        "the master config option multimaster must be a mapping (peers:, topology:, ...), "
        f"not a {type(conf).__name__}: {conf!r}")


def test_status_refuses(runner):
    assert runner.status(peers="web01") == _refused(
        "peer(s) 'web01' not in multimaster:peers of the master config (configured: m2, m3); "
        "only configured peers are synced")
    assert runner.status(tset=1)["error"].startswith("multimaster.status: unknown argument tset")
    assert runner.status(master_config_keys="id")["error"].startswith(
        "master_config_keys: 'id' not replicable")


def test_salt_pub_kwargs_pass(runner, tmp_path):
    """Salt's __pub_* keys are not unknown arguments: the sync goes on (and publishes)."""
    # a real key: a damaged one is never published
    (tmp_path / "pki" / "minions" / "web01").write_bytes(gen_keypair(1024)[1])
    ret = runner.sync(minion_ids="web01", __pub_user="root", __pub_jid="1", test="yes")
    assert "published with bad input" in ret["error"], ret


def test_a_peer_not_accepted_names_the_command(tmp_path):
    (tmp_path / "pki" / "minions").mkdir(parents=True)
    (tmp_path / "pki" / "minions_pre").mkdir()
    (tmp_path / "pki" / "minions_pre" / "m3").write_text("key")
    errors = sync.peer_errors({"pki_dir": str(tmp_path / "pki")}, ["m3", "m4"])
    assert errors == {
        "m3": "peer 'm3' is not an accepted minion of this master: its key is pending, "
              "accept it: salt-key -a m3",
        "m4": "peer 'm4' is not an accepted minion of this master: start the peer host's "
              "salt-minion with this master in its master list, then accept its key: "
              "salt-key -a m4",
    }


def test_sync_on_a_peer_says_run_it_on_the_primary(runner, tmp_path):
    (tmp_path / "etc" / "master.d").mkdir(parents=True)
    (tmp_path / "etc" / "master").write_text("")
    (tmp_path / "etc" / "master.d" / "multimaster-sync.conf").write_text("nodegroups: {}\n")
    runner.__opts__.update(conf_file=str(tmp_path / "etc" / "master"), multimaster={})
    assert runner.sync() == _refused(
        f"this master is a peer: it holds {tmp_path}/etc/master.d/multimaster-sync.conf, written "
        "by a primary's multimaster.sync; run salt-run multimaster.sync on the primary")


class _Client:
    """The runner's LocalClient for one publish: records how its returns are waited for."""

    waits = []

    def __init__(self, *args, **kwargs):
        self.event = type("Event", (), {"cpub": True, "close_pub": lambda self: None})()

    def run_job(self, tgt, fun, **kwargs):
        return {"jid": "20261124000000000001", "minions": list(tgt)}

    def get_iter_returns(self, jid, minions, **kwargs):
        self.waits.append(kwargs["gather_job_timeout"])
        yield {}

    def destroy(self):
        pass


@pytest.mark.parametrize("configured,used", [(None, 10), (25, 25), ("soon", 10)])
def test_a_peer_job_is_tracked_for_the_masters_gather_job_timeout(runner, monkeypatch,
                                                                  configured, used):
    """A busy peer answers find_job late: it is waited for as long as Salt's CLI would."""
    if configured is not None:
        runner.__opts__["gather_job_timeout"] = configured
    monkeypatch.setattr(salt.client, "LocalClient", _Client)
    _Client.waits = []
    ret = runner.sync(peers="m2", only="master_config", timeout=5)
    assert ret["m2"]["result"] is False  # nothing returned: reported, not hidden
    assert _Client.waits == [used]
