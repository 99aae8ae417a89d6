"""
The salt/key reactor SLS (rendered with Salt's Jinja renderer, as the
master's reactor does) and the coalescing runner behind it.
"""

import importlib.util
import threading
import time
from unittest.mock import patch

import pytest
import salt.config
import salt.utils.templates
import salt.utils.yaml

from tests.conftest import REPO

REACTOR = REPO / "salt" / "multimaster" / "reactor" / "key.sls"
STATE_ID = "multimaster-reactor-runner-multimaster_reactor-key_event"


def render(data, opts=None):
    import tempfile  # pylint: disable=import-outside-toplevel

    extra = opts if opts is not None else {"multimaster": {"peers": ["m02", "m03"]}}
    opts = dict(salt.config.DEFAULT_MASTER_OPTS)
    opts.pop("multimaster", None)
    opts.update(extra, cachedir=tempfile.gettempdir(), file_client="local")
    ret = salt.utils.templates.JINJA(
        str(REACTOR), to_str=True, opts=opts, saltenv="base", tag="salt/key",
        data=data, salt={}, grains={}, pillar={},
    )
    assert ret["result"], ret
    return salt.utils.yaml.safe_load(ret["data"]) or {}


@pytest.mark.parametrize(
    "act", ["accept", "reject", "delete", "accepted", "rejected", "pending", "denied"]
)
def test_reacts_to_3007_and_3008_acts(act):
    assert render({"act": act, "id": "web01", "result": True}) == {
        STATE_ID: {
            "runner.multimaster_reactor.key_event": [
                {"args": [{"act": act}, {"minion_id": "web01"}]}
            ]
        }
    }


@pytest.mark.parametrize(
    "data,opts",
    [
        ({"act": "accepted", "id": "web01", "result": False}, None),  # failed action
        ({"act": "list", "id": "web01", "result": True}, None),  # not a key change
        ({"act": "accepted", "id": "m02", "result": True}, None),  # a peer's own minion
        ({"act": "accepted", "id": "web01", "result": True}, {}),  # not the primary
        ({"act": "accepted", "id": "web01", "result": True}, {"multimaster": {}}),
    ],
)
def test_ignored_events(data, opts):
    assert render(data, opts) == {}


def test_peers_as_comma_string():
    out = render({"act": "delete", "id": "x", "result": True},
                 {"multimaster": {"peers": "m02,m03"}})
    assert STATE_ID in out
    assert render({"act": "delete", "id": "m03", "result": True},
                  {"multimaster": {"peers": "m02,m03"}}) == {}


# ---------------------------------------------------------------------------
# multimaster_reactor.key_event
# ---------------------------------------------------------------------------
def _runner(tmp_path, sync):
    spec = importlib.util.spec_from_file_location(
        "mm_test_runner_reactor", str(REPO / "_runners" / "multimaster_reactor.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.__opts__ = {"cachedir": str(tmp_path)}
    mod.__salt__ = {"multimaster.sync": sync}
    return mod


def test_key_event_runs_one_sync(tmp_path):
    calls = []
    mod = _runner(tmp_path, lambda only, minion_ids: calls.append((only, minion_ids))
                  or {"m02": {"result": True}})
    assert mod.key_event(act="accepted", minion_id="a", window=0) == {
        "queued": False, "syncs": 1, "result": True, "last": {"m02": {"result": True}},
    }
    assert calls == [("minion_keys", ["a"])]
    assert mod.key_event(act="bogus") == {"ignored": "act 'bogus'"}
    assert mod.key_event(act="delete", window=0)["syncs"] == 1
    # an event without a minion id syncs every key
    assert calls == [("minion_keys", ["a"]), ("minion_keys", None)]


def test_key_event_reports_failed_sync(tmp_path):
    calls = []
    mod = _runner(tmp_path, lambda only, minion_ids: calls.append(only) or {"m02": {"result": False},
                                                                 "retcode": 1})
    ret = mod.key_event(act="delete", window=0, retries=2, retry_delay=0)
    assert ret["result"] is False and ret["syncs"] == 3 and len(calls) == 3


def test_key_event_retries_a_transient_failure(tmp_path):
    answers = iter([{"m02": {"result": False, "error": "no return"}, "retcode": 1},
                    {"m02": {"result": True}}])
    calls = []
    mod = _runner(tmp_path, lambda only, minion_ids: calls.append(minion_ids) or next(answers))
    ret = mod.key_event(act="accepted", minion_id="a", window=0, retry_delay=0)
    assert ret == {"queued": False, "syncs": 2, "result": True,
                   "last": {"m02": {"result": True}}}
    assert calls == [["a"], ["a"]]  # the retry covers the same key


def test_key_event_burst_is_coalesced(tmp_path):
    """20 events while a sync runs: queued, and covered by one more sync."""
    started, release = threading.Event(), threading.Event()
    calls = []

    def sync(only, minion_ids):
        calls.append(minion_ids)
        if len(calls) == 1:
            started.set()
            release.wait(10)
        return {"m02": {"result": True}}

    mod = _runner(tmp_path, sync)
    results = []
    first = threading.Thread(
        target=lambda: results.append(mod.key_event(act="accepted", minion_id="a", window=0))
    )
    first.start()
    assert started.wait(10)
    burst = [mod.key_event(act="accepted", minion_id=f"m{i}", window=0) for i in range(20)]
    assert all(r["queued"] for r in burst)
    release.set()
    first.join(10)
    assert results[0]["syncs"] == 2
    # the second sync covers the whole burst, in one targeted run
    assert calls == [["a"], [f"m{i}" for i in sorted(range(20), key=str)]]


def test_key_event_event_after_release_is_not_lost(tmp_path):
    """An event whose lock attempt fails just before release is picked up."""
    mod = _runner(tmp_path, lambda only, minion_ids: {"m02": {"result": True}})
    calls = []

    def sync(only, minion_ids):
        calls.append(minion_ids)
        if len(calls) == 1:
            # an event arrives during this sync: it marks dirty, lock is busy
            assert mod.key_event(act="accepted", minion_id="b", window=0)["queued"] is True
        return {}

    mod.__salt__["multimaster.sync"] = sync
    ret = mod.key_event(act="accepted", minion_id="a", window=0)
    assert ret["syncs"] == 2 and calls == [["a"], ["b"]]


def test_key_event_window_absorbs_burst(tmp_path):
    calls = []
    mod = _runner(tmp_path, lambda only, minion_ids: calls.append(time.time()) or {})
    slept = []
    with patch.object(mod.time, "sleep", slept.append):
        assert mod.key_event(act="accepted")["syncs"] == 1
        assert mod.key_event(act="accepted", window=0.5)["syncs"] == 1
    assert slept == [0.5]


@pytest.mark.parametrize("mid", ["x\n*", "*", "web?", "a b", "[ab]", "a/b", ""])
def test_key_event_drops_invalid_ids(tmp_path, mid):
    """A pending key named ``x\\n*`` must not queue ``*`` (every key): logged and dropped."""
    calls = []
    mod = _runner(tmp_path, lambda only, minion_ids: calls.append(minion_ids) or {})
    assert mod.key_event(act="pending", minion_id=mid, window=0) == {
        "ignored": f"invalid minion id {mid!r}", "result": False, "retcode": 1}
    assert calls == []
    assert not (tmp_path / "multimaster" / "key-sync.pending").exists()
    # a valid id after it syncs that id only
    assert mod.key_event(act="pending", minion_id="web01", window=0)["syncs"] == 1
    assert calls == [["web01"]]


def test_key_event_numeric_id(tmp_path):
    calls = []
    mod = _runner(tmp_path, lambda only, minion_ids: calls.append(minion_ids) or {})
    assert mod.key_event(act="accepted", minion_id=1234, window=0)["syncs"] == 1
    assert calls == [["1234"]]
