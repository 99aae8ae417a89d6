"""
salt_multimaster.jobs.record: a runner job saves its own record, naming its
one target, only when it is the job running and the job cache would look
for it.
"""

import os

import pytest
import salt.payload
import salt.version

from salt_multimaster import jobs


@pytest.fixture
def opts(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "pki" / "minions").mkdir(parents=True)
    (tmp_path / "pki" / "minions" / "peer1").write_text("pub")
    return {"cachedir": str(tmp_path), "pki_dir": str(tmp_path / "pki"), "job_cache": True,
            "master_job_cache": "local_cache"}


def _running(opts, jid, fun, user="root", fun_args=(), pid=None):
    """The proc file Salt 3008 writes for a runner job (of this process by default)."""
    with open(os.path.join(opts["cachedir"], "proc", jid), "wb") as fh:
        salt.payload.dump({"fun": fun, "jid": jid, "user": user, "fun_args": list(fun_args),
                           "pid": os.getpid() if pid is None else pid}, fh)


class _Returners(dict):
    def __init__(self, fail=False):
        super().__init__()
        self.calls = []

        def save_load(jid, load, minions=None):
            if fail:
                raise OSError("disk full")
            self.calls.append((jid, load, minions))

        self["local_cache.save_load"] = save_load


def test_the_running_job_records_its_one_target(opts):
    _running(opts, "1", "runner.multimaster.pull", user="salt")
    rets = _Returners()
    assert jobs.record(opts, "1", "multimaster.pull", "peer1", ["request=x"], rets) is True
    assert rets.calls == [("1", {
        "jid": "1", "id": "peer1", "tgt": "peer1", "tgt_type": "glob",
        "fun": "runner.multimaster.pull", "arg": ["request=x"], "user": "salt",
    }, ["peer1"])]


def test_a_target_without_an_accepted_key_matches_no_minion(opts):
    _running(opts, "2", "runner.multimaster.sync")
    rets = _Returners()
    assert jobs.record(opts, "2", "multimaster.sync", "m1_master", [], rets) is True
    assert rets.calls[0][2] == []


@pytest.mark.parametrize("case", ["nested", "no proc file", "other job cache", "no job cache",
                                  "ext_job_cache", "glob target", "no jid"])
def test_left_to_salt(opts, case):
    jid, tgt = "3", "peer1"
    if case != "no proc file":
        # the reactor's key_event calls sync under its own jid
        _running(opts, jid, "runner.multimaster_reactor.key_event" if case == "nested"
                 else "runner.multimaster.sync")
    if case == "other job cache":
        opts["master_job_cache"] = "redis"
    elif case == "no job cache":
        opts["job_cache"] = False
    elif case == "ext_job_cache":
        opts["ext_job_cache"] = "redis"
    elif case == "glob target":
        tgt = "peer*"
    elif case == "no jid":
        jid = None
    rets = _Returners()
    assert jobs.record(opts, jid, "multimaster.sync", tgt, [], rets) is False
    assert rets.calls == []


def test_reactor_threads_each_record_their_own_job(opts):
    # Salt 3008's reactor runs key_event jobs in threads of one process that
    # share the module's __jid__: the hint can name the other thread's job
    fun = "multimaster_reactor.key_event"
    _running(opts, "10", f"runner.{fun}", fun_args=[{"act": "accepted", "minion_id": "a"}])
    _running(opts, "11", f"runner.{fun}", fun_args=[{"act": "accepted", "minion_id": "b"}])
    # a job of another process running the same function with the same args
    _running(opts, "12", f"runner.{fun}", fun_args=[{"act": "accepted", "minion_id": "a"}],
             pid=os.getpid() + 1)
    rets = _Returners()
    assert jobs.record(opts, "11", fun, "peer1", ["act=accepted", "minion_id=a"], rets,
                       kwargs={"act": "accepted", "minion_id": "a"}) is True
    assert jobs.record(opts, "11", fun, "peer1", ["act=accepted", "minion_id=b"], rets,
                       kwargs={"act": "accepted", "minion_id": "b"}) is True
    assert [(jid, load["arg"]) for jid, load, _ in rets.calls] == [
        ("10", ["act=accepted", "minion_id=a"]), ("11", ["act=accepted", "minion_id=b"])]


def test_own_job(opts):
    fun = "multimaster.sync"
    # one job of this process runs the function: that one, whatever the hint
    # and however its arguments were given (by name or by position)
    _running(opts, "20", f"runner.{fun}", fun_args=["master02", {"test": True, "__pub_x": 1}])
    assert jobs.own_job(opts, "99", fun, {"peers": "master02", "test": True, "__pub_user": "u",
                                          "only": None})[0] == "20"
    # other arguments: not this call's job
    assert jobs.own_job(opts, "20", fun, {"peers": "master03"}) == (None, None)
    # two alike: the hint, when it is one of them; else nobody
    _running(opts, "21", f"runner.{fun}", fun_args=["master02", {"test": True}])
    assert jobs.own_job(opts, "21", fun, {"peers": "master02"})[0] == "21"
    assert jobs.own_job(opts, "22", fun, {"peers": "master02"}) == (None, None)
    # no hint: nothing
    assert jobs.own_job(opts, None, fun, {}) == (None, None)


def test_job_event_is_the_jobs_own_connection_only():
    import weakref  # pylint: disable=import-outside-toplevel

    import salt.utils.event  # pylint: disable=import-outside-toplevel

    class Bus:
        def fire_event(self, data, tag):
            pass

    mine = salt.utils.event.NamespacedEvent(Bus(), "salt/run/20")
    assert jobs.job_event(mine, "20") is mine
    # another job's connection, a job not told, no event
    assert jobs.job_event(mine, "2") is None
    assert jobs.job_event(mine, None) is None
    assert jobs.job_event(None, "20") is None
    # Salt hands the job a weak proxy: once its job ended, no connection
    other = salt.utils.event.NamespacedEvent(Bus(), "salt/run/21")
    proxy = weakref.proxy(other)
    assert jobs.job_event(proxy, "21") is proxy
    del other
    assert jobs.job_event(proxy, "21") is None


def test_without_a_proc_file_the_started_function_records(opts):
    # Salt 3007 writes no proc file: the function salt-run or peer_run
    # started is in the opts
    rets = _Returners()
    assert jobs.record(dict(opts, fun="multimaster.sync"), "5", "multimaster.sync", "peer1",
                       [], rets) is True
    assert rets.calls[0][1]["fun"] == "runner.multimaster.sync"
    # an orchestration calling sync: left to Salt
    assert jobs.record(dict(opts, fun="state.orch"), "6", "multimaster.sync", "peer1",
                       [], rets) is False


def test_a_failing_save_is_left_to_salt(opts):
    _running(opts, "4", "runner.multimaster.sync")
    assert jobs.record(opts, "4", "multimaster.sync", "peer1", [], _Returners(fail=True)) is False


def test_record_in_thread_saves_through_the_job_cache(opts):
    import salt.config  # pylint: disable=import-outside-toplevel
    import salt.utils.jid  # pylint: disable=import-outside-toplevel

    _running(opts, "7", "runner.multimaster.sync")
    master = salt.config.master_config("/dev/null")
    master.update(opts, hash_type="sha256")
    thread = jobs.record_in_thread(master, "7", "multimaster.sync", "peer1", ["a=1"])
    thread.join()
    # the real local_cache saved the record where Salt's store_job looks for it
    jid_dir = salt.utils.jid.jid_dir("7", os.path.join(opts["cachedir"], "jobs"), "sha256")
    with open(os.path.join(jid_dir, ".load.p"), "rb") as fh:
        assert salt.payload.load(fh)["arg"] == ["a=1"]
    with open(os.path.join(jid_dir, ".minions.p"), "rb") as fh:
        assert salt.payload.load(fh) == ["peer1"]


def test_args_lists_what_was_given():
    assert jobs.args(peers="a,b", only=None, test=True, __pub_user="x") == ["peers=a,b", "test=True"]


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _reads(poll, clock, reads):
    """Each read: (seconds it took, what it brought); the naps asked for."""
    naps = []
    for took, got in reads:
        clock.now += took
        naps.append(poll.nap(got))
        clock.now += naps[-1]
    return naps


def test_event_poll_on_3008_reads_again_at_once_when_salt_waited_or_an_event_came():
    clock = _Clock()
    poll = jobs.EventPoll(waits=True, clock=clock)
    # an empty read waits 10 ms itself; a 30 KiB event comes in 4 KiB reads
    # that return at once, then the return
    reads = [(0.010, None)] * 3 + [(0.0002, None)] * 8 + [(0.0002, {"p": {"ret": 1}})]
    assert _reads(poll, clock, reads) == [0, 0, 0] + [poll.NAP] * 8 + [0]


def test_event_poll_on_3008_polls_when_reads_keep_returning_at_once():
    clock = _Clock()
    poll = jobs.EventPoll(waits=True, clock=clock)
    # a client whose reads return at once with nothing (its connection lost)
    naps = _reads(poll, clock, [(0.0001, None)] * (poll.SPIN + 3))
    assert naps == [poll.NAP] * poll.SPIN + [poll.POLL] * 3
    # an event brings it back to reading at once
    assert _reads(poll, clock, [(0.0001, {"p": {}}), (0.0001, None)]) == [0, poll.NAP]


def test_event_poll_on_3006_and_3007_sleeps_after_every_empty_read():
    clock = _Clock()
    poll = jobs.EventPoll(waits=False, clock=clock)
    # reads return at once, a whole event or none; one slowed down by a busy
    # CPU is no sign that Salt waited
    reads = [(0.0001, None), (0.030, None), (0.0001, {"p": {}}), (0.0001, None)]
    assert _reads(poll, clock, reads) == [poll.POLL, poll.POLL, 0, poll.POLL]


def test_event_poll_knows_its_salt():
    assert jobs.EventPoll().waits is (salt.version.__saltstack_version__.major >= 3008)
