"""
salt_multimaster.trigger: the change journal as a trigger (continuous
replication), against a journal and a clock of the test's own.
"""

import os
import threading
import time

import pytest

from salt_multimaster import journal, trigger, watch

ROOT, PILLAR, PKI = "/srv/salt", "/srv/pillar", "/etc/salt/pki/master"
OPTS = {"file_roots": {"base": [ROOT]}, "pillar_roots": {"base": [PILLAR]}, "pki_dir": PKI,
        "multimaster": {"peers": ["m2"]}}


class Journal:
    """A journal the test writes to: ``change(tree, rel)``, ``reset()``."""

    def __init__(self):
        self.session, self.seq, self.log = "s1", 0, []

    def change(self, tree, rel=""):
        self.seq += 1
        self.log.append((self.seq, tree, rel))

    def reset(self):
        self.session, self.seq, self.log = self.session + "x", 0, []

    def __call__(self, since):
        reply = {"session": self.session, "seq": self.seq, "changed": None}
        if since is not None and since["session"] == self.session:
            changed = {}
            for seq, tree, rel in self.log:
                if seq > since["seq"]:
                    changed.setdefault(tree, []).append(rel)
            reply["changed"] = changed
        return reply


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _trigger(results=None, **kwargs):
    journal, clock, synced = Journal(), Clock(), []
    results = [True] + list(results or [])  # the first one: the start's sync

    def sync(categories):
        synced.append(categories)
        return results.pop(0) if results else True

    of = trigger.categories_of(OPTS)
    trig = trigger.Trigger(journal, of, trigger.replicated(OPTS), sync, clock=clock, **kwargs)
    # the first look: what changed before the engine watched is not known
    trig.tick()
    clock.now += trigger.QUIET
    trig.tick()
    _settle(trig)
    assert synced == [sorted(trigger.WATCHED)]
    del synced[:]
    assert trig.tick() is None
    return trig, journal, clock, synced


def _settle(trig):
    if trig.thread is not None:
        trig.thread.join(5)


def test_a_change_syncs_its_category_once_quiet():
    trig, journal, clock, synced = _trigger()
    journal.change(ROOT, "web")
    assert trig.tick() == pytest.approx(trigger.QUIET)  # not yet: changes may follow
    clock.now += 0.5
    journal.change(PILLAR, "")
    assert trig.tick() == pytest.approx(trigger.QUIET)  # the quiet time starts again
    clock.now += trigger.QUIET
    assert trig.tick() == trigger.QUIET  # started; looked at again soon
    _settle(trig)
    assert synced == [["file_roots", "pillar_roots"]]
    assert trig.tick() is None and synced == [["file_roots", "pillar_roots"]]


def test_keys_and_master_keys_by_directory_of_the_pki_dir():
    of = trigger.categories_of(OPTS)
    assert of(PKI, "") == {"master_keys"}
    assert of(PKI, "minions_pre") == of(PKI, "minions_autosign") == {"minion_keys"}
    assert of(PKI, "elsewhere") == set()
    assert of(ROOT, "a/b") == {"file_roots"} and of("/other", "") == set()


def test_a_steady_stream_of_changes_waits_at_most_max_wait():
    trig, journal, clock, synced = _trigger(max_wait=3.0)
    for _ in range(5):
        journal.change(ROOT, "a")
        trig.tick()
        clock.now += 0.9
    _settle(trig)
    assert synced == [["file_roots"]]  # after 3 s of changes every 0.9 s


def test_changes_while_a_sync_runs_start_the_next_one():
    trig, journal, clock, synced = _trigger()
    journal.change(PKI, "minions")
    trig.tick()
    clock.now += trigger.QUIET
    trig.tick()
    journal.change(ROOT, "x")  # meanwhile
    _settle(trig)
    trig.tick()
    clock.now += trigger.QUIET
    trig.tick()
    _settle(trig)
    assert synced == [["minion_keys"], ["file_roots"]]


def test_a_failed_sync_is_tried_again_later_with_what_came_since():
    trig, journal, clock, synced = _trigger(results=[False, True])
    journal.change(ROOT, "a")
    trig.tick()
    clock.now += trigger.QUIET
    trig.tick()
    _settle(trig)
    journal.change(PKI, "")
    assert trig.tick() == pytest.approx(trigger.RETRY)
    clock.now += trigger.RETRY
    trig.tick()
    _settle(trig)
    assert synced == [["file_roots"], ["file_roots", "master_keys"]]


def test_a_new_session_of_the_journal_syncs_every_watched_category():
    trig, journal, clock, synced = _trigger()
    journal.reset()  # events lost: what changed is not known
    trig.tick()
    clock.now += trigger.QUIET
    trig.tick()
    _settle(trig)
    assert synced == [sorted(trigger.WATCHED)]


@pytest.mark.parametrize("conf,expected", [
    ({"peers": ["m2"]}, list(trigger.WATCHED)),
    ({"peers": "m2,m3", "replicate": ["file_roots", "master_config"]}, ["file_roots"]),
    ({"peers": []}, []),
    ({}, []),
    (None, []),
])
def test_only_a_primary_replicates_what_it_is_configured_to(conf, expected):
    opts = dict(OPTS, multimaster=conf)
    assert trigger.replicated(opts) == expected


@pytest.mark.parametrize("value", [-1, "1", True, None, 3601])
def test_bad_seconds_are_named(value):
    with pytest.raises(ValueError, match="quiet must be seconds"):
        trigger.check_seconds("quiet", value)


def test_roots_are_matched_by_their_real_path(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    opts = dict(OPTS, file_roots={"base": [str(tmp_path / "link")]})
    of = trigger.categories_of(opts)
    assert of(os.path.realpath(real), "") == {"file_roots"}


def test_not_watching_triggers_nothing():
    synced = []
    trig = trigger.Trigger(lambda since: {"session": None, "seq": 0, "changed": None},
                           trigger.categories_of(OPTS), trigger.replicated(OPTS),
                           synced.append, clock=Clock())
    assert trig.tick() is None and trig.tick() is None and synced == []


@pytest.fixture
def served(tmp_path):
    """``served(*trees)``: a started watcher answering at tmp_path/state's socket."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    stop, threads = threading.Event(), []

    def serve(*trees):
        watcher = watch.Watcher(trees)
        watcher.start()
        sock = journal.socket_path(str(state_dir))
        thread = threading.Thread(target=journal.serve, args=(watcher, sock),
                                  kwargs={"stop": stop, "poll": 0.02}, daemon=True)
        thread.start()
        threads.append((thread, watcher))
        deadline = time.monotonic() + 5
        while journal.query(sock, None) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)

    yield str(state_dir), serve
    stop.set()
    for thread, watcher in threads:
        thread.join(5)
        watcher.close()


@pytest.mark.parametrize("engines,replicate,expected", [
    ([{"multimaster_watch": {"poll": 0.5}}], None, True),
    (["multimaster_watch"], None, True),
    ([{"multimaster_watch": None}], None, True),
    ([{"multimaster_watch": {"replicate": False}}], None, False),
    ([{"other_engine": {}}], None, False),
    (None, None, False),
    ([{"multimaster_watch": {}}], ["file_roots"], False),
])
def test_the_reactor_leaves_keys_to_an_engine_that_replicates_them(
        served, tmp_path, engines, replicate, expected):
    state_dir, serve = served
    pki = tmp_path / "pki"
    pki.mkdir()
    conf = {"peers": ["m2"], "replicate": replicate} if replicate else {"peers": ["m2"]}
    opts = dict(OPTS, pki_dir=str(pki), engines=engines, multimaster=conf)
    assert trigger.replicates_keys(opts, state_dir) is False  # no engine answers
    serve(str(pki))
    assert trigger.replicates_keys(opts, state_dir) is expected


def test_the_reactor_keeps_keys_a_journal_does_not_watch(served, tmp_path):
    state_dir, serve = served
    pki, other = tmp_path / "pki", tmp_path / "other"
    other.mkdir()
    opts = dict(OPTS, pki_dir=str(pki), engines=["multimaster_watch"])
    serve(str(other), str(pki))  # the pki_dir does not exist: unwatched
    assert trigger.replicates_keys(opts, state_dir) is False
