"""
The salt/key reactor SLS (rendered with Salt's Jinja renderer, as the
master's reactor does) and the coalescing runner behind it.
"""

import importlib.util
import os
import threading
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
#: the return of a sync after which the one peer is a replica
REPLICA = {"m02": {"result": True}}


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
    ret = mod.key_event(act="delete", window=0, retries=2, retry_delay=0, quiet=0)
    assert ret["result"] is False and ret["syncs"] == 3 and len(calls) == 3


def test_key_event_retries_a_transient_failure(tmp_path):
    answers = iter([{"m02": {"result": False, "error": "no return"}, "retcode": 1},
                    {"m02": {"result": True}}])
    calls = []
    mod = _runner(tmp_path, lambda only, minion_ids: calls.append(minion_ids) or next(answers))
    ret = mod.key_event(act="accepted", minion_id="a", window=0, retry_delay=0, quiet=0)
    assert ret == {"queued": False, "syncs": 2, "result": True,
                   "last": {"m02": {"result": True}}}
    assert calls == [["a"], ["a"]]  # the retry covers the same key


def test_key_event_retries_a_sync_failed_as_a_whole(tmp_path):
    """
    A sync that failed as a whole (what it raised, answered by the runner's
    guard: no report per peer) leaves no peer confirmed: tried again.
    """
    failed = {"result": False, "error": "multimaster.sync: OSError: [Errno 5] Input/output error",
              "retcode": 1}
    answers = iter([failed, REPLICA])
    calls = []
    mod = _runner(tmp_path, lambda only, minion_ids: calls.append(minion_ids) or next(answers))
    ret = mod.key_event(act="accepted", minion_id="a", window=0, retry_delay=0, quiet=0)
    assert ret == {"queued": False, "syncs": 2, "result": True, "last": REPLICA}
    assert calls == [["a"], ["a"]]


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
        target=lambda: results.append(mod.key_event(act="accepted", minion_id="a", window=0,
                                                    quiet=0))
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
        return REPLICA

    mod.__salt__["multimaster.sync"] = sync
    ret = mod.key_event(act="accepted", minion_id="a", window=0, quiet=0)
    assert ret["syncs"] == 2 and calls == [["a"], ["b"]]


class _Clock:
    """
    A fake ``time`` for the runner: ``sleep`` advances ``now`` and delivers
    the key events scheduled until then through the real ``key_event`` (they
    are queued: the sync running holds the lock), stamping the queue file
    with the fake time of their arrival, as the real clock would.
    """

    def __init__(self, mod, tmp_path, events=()):
        self.mod = mod
        self.queue = tmp_path / "multimaster" / "key-sync.pending"
        self.now = 1000.0
        self.events = sorted(events)  # [(at, minion_id)]
        self.delivered = []

    def time(self):
        return self.now

    def sleep(self, seconds):
        assert seconds >= 0
        self.now += seconds
        while self.events and self.events[0][0] <= self.now:
            at, mid = self.events.pop(0)
            assert self.mod.key_event(act="accepted", minion_id=mid)["queued"] is True
            os.utime(self.queue, (at, at))
            self.delivered.append(mid)


SYNC_SECONDS = 1.0


def _clocked_runner(tmp_path, events, opts=None):
    """
    The runner on a fake clock; each sync takes ``SYNC_SECONDS`` (events
    arrive meanwhile) and is recorded as ``(fake start time, ids)``.
    """
    syncs = []

    def sync(only, minion_ids):
        syncs.append((clock.now, minion_ids))
        clock.sleep(SYNC_SECONDS)
        return REPLICA

    mod = _runner(tmp_path, sync)
    mod.__opts__.update(opts or {})
    clock = _Clock(mod, tmp_path, events)
    return mod, clock, syncs


def test_key_event_window_delays_the_sync_to_cover_the_burst(tmp_path):
    """With a window, the events arriving within it ride the same sync."""
    mod, clock, syncs = _clocked_runner(tmp_path, [(1000.2, "b"), (1000.4, "c"), (1000.9, "d")])
    with patch.object(mod, "time", clock):
        ret = mod.key_event(act="accepted", minion_id="a", window=0.5)
    assert ret == {"queued": False, "syncs": 2, "result": True, "last": REPLICA}
    # a, b and c in the first sync, after the window; d, which came during
    # that sync, in a second one
    assert syncs == [(1000.5, ["a", "b", "c"]), (syncs[1][0], ["d"])]
    assert clock.delivered == ["b", "c", "d"]


def test_key_event_first_sync_at_once_then_waits_for_quiet(tmp_path):
    """
    Without a window the first event syncs at once; the events arriving
    meanwhile and after it are taken together once none came for
    ``key_event_quiet`` seconds (from the master config).
    """
    events = [(1000.0, "b"), (1000.5, "c"), (1001.5, "d"), (1002.3, "e")]
    mod, clock, syncs = _clocked_runner(
        tmp_path, events, {"multimaster": {"key_event_quiet": 2, "key_event_max_wait": 60}})
    with patch.object(mod, "time", clock):
        assert mod.key_event(act="accepted", minion_id="a")["syncs"] == 2
    assert syncs[0] == (1000.0, ["a"])
    at, ids = syncs[1]
    assert ids == ["b", "c", "d", "e"]
    # not before the events had stopped for 2 s (e came at 1002.3), and
    # without waiting for the max_wait bound
    assert 1004.3 <= at < 1004.6


def test_key_event_max_wait_bounds_a_never_ending_burst(tmp_path):
    """
    Events every 0.5 s for 10 s never leave ``quiet`` seconds: each later sync
    still starts ``max_wait`` seconds after the previous one ended, with what
    was queued so far, and the last one once the events stopped for
    ``quiet`` seconds.  Every key is synced once, in order.
    """
    events = [(1000.0 + 0.5 * i, f"m{i:02d}") for i in range(21)]  # 1000.0 .. 1010.0
    mod, clock, syncs = _clocked_runner(tmp_path, events)
    with patch.object(mod, "time", clock):
        ret = mod.key_event(act="accepted", minion_id="a", quiet=1, max_wait=3)
    assert ret["result"] is True and ret["syncs"] == len(syncs) == 4, syncs
    starts = [at for at, _ in syncs]
    assert starts[0] == 1000.0
    waits = [b - (a + SYNC_SECONDS) for a, b in zip(starts, starts[1:])]
    # the burst is still running: max_wait (3 s) ends the second and third wait
    assert all(3.0 <= w < 3.25 for w in waits[:2]), waits
    # the events stopped at 1010.0: the last sync waits for quiet (1 s) only
    assert 1011.0 <= starts[3] < 1011.25, starts
    assert [mid for _, ids in syncs[1:] for mid in ids] == [mid for _, mid in events]


@pytest.mark.parametrize("mid", ["x\n*", "*", "web?", "a b", "[ab]", "a/b", ""])
def test_key_event_drops_invalid_ids(tmp_path, mid):
    """A pending key named ``x\\n*`` must not queue ``*`` (every key): logged and dropped."""
    calls = []
    mod = _runner(tmp_path, lambda only, minion_ids: calls.append(minion_ids) or REPLICA)
    assert mod.key_event(act="pending", minion_id=mid, window=0) == {
        "ignored": f"invalid minion id {mid!r}", "result": False, "retcode": 1}
    assert calls == []
    assert not (tmp_path / "multimaster" / "key-sync.pending").exists()
    # a valid id after it syncs that id only
    assert mod.key_event(act="pending", minion_id="web01", window=0)["syncs"] == 1
    assert calls == [["web01"]]


def test_key_event_numeric_id(tmp_path):
    calls = []
    mod = _runner(tmp_path, lambda only, minion_ids: calls.append(minion_ids) or REPLICA)
    assert mod.key_event(act="accepted", minion_id=1234, window=0)["syncs"] == 1
    assert calls == [["1234"]]


def test_key_event_retries_back_off_then_give_up(tmp_path):
    """A failing sync is tried again after 2, 4 and 8 s, then left to the next full sync."""
    syncs = []

    def sync(only, minion_ids):
        syncs.append((clock.now, minion_ids))
        return {"m02": {"result": False, "error": "no return"}, "retcode": 1}

    mod = _runner(tmp_path, sync)
    clock = _Clock(mod, tmp_path)
    with patch.object(mod, "time", clock):
        # max_wait=0: no settling for a quiet queue between the tries (covered above)
        ret = mod.key_event(act="accepted", minion_id="a", window=0, max_wait=0)
    assert ret["result"] is False and ret["syncs"] == 4
    assert syncs == [(1000.0, ["a"]), (1002.0, ["a"]), (1006.0, ["a"]), (1014.0, ["a"])]


def test_key_event_leaves_keys_to_the_watch_engine(tmp_path):
    calls = []
    mod = _runner(tmp_path, lambda **kwargs: calls.append(kwargs))
    with patch("salt_multimaster.trigger.replicates_keys", return_value=True) as asked:
        assert mod.key_event(act="accepted", minion_id="a") == {
            "ignored": "the multimaster_watch engine replicates key changes on this master"}
    assert asked.call_args[0][0] is mod.__opts__ and calls == []
    assert not os.path.exists(tmp_path / "multimaster" / "key-sync.pending")
