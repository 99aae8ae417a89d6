"""
salt_multimaster.jobs.EventPoll: how long a runner waits between two reads of
a job's returns, on each Salt line.
"""

import salt.version

from salt_multimaster import jobs


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
