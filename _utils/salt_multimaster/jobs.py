"""
How a runner reads a job's returns off the master event bus.
"""

import time

from salt_multimaster import compat


class EventPoll:
    """
    How long to wait before the next non-blocking read of a job's returns
    off the master event bus (``LocalClient.get_iter_returns(block=False)``
    yields None when a read brought no whole event).

    Salt 3006 and 3007 return at once with a whole event or none: a 20 ms
    sleep after a read that brought nothing.  Salt 3008 waits 10 ms itself
    when nothing came, and reads at most 4 KiB of an event per read
    (:func:`compat.event_read_waits`): a fixed sleep between reads made the
    30 KiB publish event of an apply (Salt fires the whole publish on the
    bus) take 0.25 s to read before the peer's return behind it
    (bench/README.rst).  So on 3008: no sleep after a read that waited or
    brought an event; a 1 ms nap after one that returned at once (a part of
    an event); after :data:`SPIN` of those in a row (a client that lost its
    connection) a 20 ms one.
    """

    WAITED = 0.005
    NAP = 0.001
    SPIN = 100
    POLL = 0.02

    def __init__(self, waits=None, clock=time.monotonic):
        self.waits = compat.event_read_waits() if waits is None else waits
        self.clock = clock
        self.idle = 0
        self.last = clock()

    def nap(self, got):
        """Seconds to sleep after a read that brought ``got``."""
        now = self.clock()
        if got:
            self.idle, secs = 0, 0
        elif not self.waits:
            secs = self.POLL
        elif now - self.last >= self.WAITED:
            self.idle, secs = 0, 0
        else:
            self.idle += 1
            secs = self.POLL if self.idle > self.SPIN else self.NAP
        self.last = now + secs  # when the next read starts
        return secs
