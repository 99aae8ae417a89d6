"""
The runner's jobs: how it publishes to the peers and the minions through
this master's ``LocalClient`` and reads their returns off the master event
bus (:class:`EventPoll`, :func:`returns`), a publish to the peers sealed to
each (:class:`Job`), what the rounds of a sync ask of Salt (:class:`Salt`:
publishes, progress events, the job cache), and the calls the steps of
add_peer, remove_peer, promote and rotate_key make through their
``SaltOps``.  Plain Python: the runner passes its ``__opts__``.
"""

import logging
import os
import threading
import time

import salt.client
import salt.loader
import salt.utils.event
import salt.utils.extmods
import salt.utils.jid
import salt.utils.master
import salt.utils.minions

from salt_multimaster import compat, fleet, protocol, report, transport

log = logging.getLogger(__name__)

# How a peer's job is tracked: after JOB_POLL seconds without a return, Salt's
# find_job asks the peer whether it still runs it, and waits for the answer
# the master's gather_job_timeout, as Salt's CLI does (GATHER_TIMEOUT when
# unset: Salt's default).  3 s was too short for a busy master: a peer
# still working was reported gone.  JOB_POLL is the first wait of Salt's
# CLI (its default ``timeout``, 5 s): a minion's job writes the record
# find_job looks for only once it has loaded its modules, seconds on a busy
# host; a job not found there yet is taken for one that ended.
JOB_POLL = 5
GATHER_TIMEOUT = 10
#: seconds between two progress lines of one peer's job still running
PROGRESS_EVERY = 5


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


def client(opts):
    """A LocalClient of this master (the caller destroys it), as Salt's manage runner makes one."""
    return salt.client.get_local_client(mopts=opts)


def gather_timeout(opts):
    """The master's ``gather_job_timeout`` (:data:`GATHER_TIMEOUT` when unset or not a number)."""
    try:
        return max(1, int(opts.get("gather_job_timeout") or GATHER_TIMEOUT))
    except (TypeError, ValueError):
        return GATHER_TIMEOUT


def returns(opts, client, pub, tgt, tgt_type, timeout, on_wait=None):
    """
    ``{minion id: return}`` of the job ``pub`` (``ret`` of Salt's full
    return) from the minions that returned within ``timeout`` seconds.  The
    job is tracked with ``saltutil.find_job`` as Salt's own CLI does, each
    answer awaited ``gather_job_timeout`` seconds (the master's option,
    :data:`GATHER_TIMEOUT` by default): a minion that is not connected, or dies
    (or loses its return across a master restart) while it works, is given
    up within seconds; one still running is waited for up to the timeout.
    ``on_wait(seconds)`` is called every :data:`PROGRESS_EVERY` seconds
    meanwhile.
    """
    ret = {}
    if not pub or not pub.get("minions"):
        return ret
    start = told = time.monotonic()
    deadline = start + timeout
    # expect_minions=False: the caller reports missing minions itself; Salt
    # would otherwise list every accepted key after the returns (~2 s at
    # 20,000 keys, bench/bench_sync.py)
    poll = EventPoll()
    for got in client.get_iter_returns(pub["jid"], set(pub["minions"]), timeout=JOB_POLL,
                                       tgt=tgt, tgt_type=tgt_type, expect_minions=False,
                                       block=False, gather_job_timeout=gather_timeout(opts)):
        for mid, data in (got or {}).items():
            if isinstance(data, dict) and "ret" in data:
                ret[mid] = data["ret"]
        if set(ret) >= set(pub["minions"]) or time.monotonic() > deadline:
            break
        if not got and on_wait and time.monotonic() - told >= PROGRESS_EVERY:
            told = time.monotonic()
            on_wait(told - start)
        time.sleep(poll.nap(got))
    return ret


class Job:
    """
    A publish to the peers whose returns are read later: the caller works
    meanwhile.  The keyword arguments are sealed to each peer
    (:mod:`salt_multimaster.protocol`): the publish reaches every minion.
    """

    def __init__(self, opts, peers, fun, kwarg, timeout):
        self.opts = opts
        self.peers = list(peers)
        self.fun = fun
        self.timeout = timeout
        sealed = protocol.sealed_kwarg(
            {peer: transport.peer_pub(opts, peer) for peer in self.peers}, fun, kwarg)
        self.client = client(opts)
        self.was_listening = self.client.event.cpub
        try:
            self.pub = self.client.run_job(self.peers, fun, kwarg=sealed, tgt_type="list",
                                           timeout=timeout, listen=True)
        except BaseException:
            self.close()
            raise

    def wait(self, on_wait=None):
        """``{peer: return}`` of the peers that returned (:func:`returns`)."""
        try:
            return returns(self.opts, self.client, self.pub, self.peers, "list", self.timeout,
                           on_wait)
        finally:
            self.close()

    def replies(self, on_wait=None):
        """
        ``{peer: (reply, error)}`` (:func:`protocol.check_reply`) of every peer
        asked; ``on_wait(seconds)`` is called every :data:`PROGRESS_EVERY`
        seconds while they work.
        """
        rets = self.wait(on_wait)
        return {peer: protocol.check_reply(peer, self.fun, rets.get(peer)) for peer in self.peers}

    def close(self):
        if not self.was_listening:
            self.client.event.close_pub()
        self.client.destroy()


class Salt:
    """
    What the rounds of a sync (:class:`salt_multimaster.rounds.Rounds`)
    ask of Salt: publishing to the peers, progress lines, the job cache.
    ``event``: the job's own event connection (the runner's
    ``__jid_event__``), or None: then the progress events go out on a
    connection of this call's own, closed by :meth:`close` (or at the end
    of a ``with`` block).
    """

    def __init__(self, opts, event=None):
        self.opts = opts
        self.event = event
        self.bus = None if event is None else event.event
        self.own_bus = event is None
        self.lock = threading.Lock()  # the rounds report from their threads
        self.cli = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self.own_bus and self.bus is not None:
            self.bus.destroy()
        self.bus = None

    def publish(self, peers, fun, kwarg, timeout):
        """A :class:`Job` of ``fun`` on ``peers``, its returns read later."""
        return Job(self.opts, peers, fun, kwarg, timeout)

    def cli_progress(self):
        """
        Whether ``salt-run`` prints this sync's progress: it runs
        ``multimaster.sync`` with the compact report (no ``--out``, so
        ``--out=json``/``yaml`` stay the data alone), the job's own event
        connection is known, and the ``multimaster_progress`` outputter is
        found (with the repository as a file_roots root it is synced once,
        as the core is).
        """
        if self.cli is None:
            on = self.event is not None and report.compact(self.opts, "multimaster.sync")
            if on and "multimaster_progress" not in salt.loader.outputters(self.opts):
                try:
                    salt.utils.extmods.sync(self.opts, "output")
                except Exception as exc:  # pylint: disable=broad-except
                    log.debug("multimaster: outputter not synced: %s", exc)
                on = "multimaster_progress" in salt.loader.outputters(self.opts)
            self.cli = on
        return self.cli

    def progress(self, message, **data):
        """
        Fire ``salt/multimaster/sync/progress`` on the master event bus, and
        when ``salt-run`` prints the compact report, a progress event of this
        job that it prints as one line (the ``multimaster_progress``
        outputter).
        """
        data["message"] = message
        with self.lock:
            try:
                if self.bus is None:
                    self.bus = salt.utils.event.get_master_event(
                        self.opts, self.opts["sock_dir"], listen=False)
                self.bus.fire_event(data, "salt/multimaster/sync/progress")
            except Exception as exc:  # pylint: disable=broad-except
                log.debug("multimaster: progress event not fired: %s", exc)
            if self.cli_progress():
                try:
                    self.event.fire_event(
                        {"message": message, "outputter": "multimaster_progress"}, "progress")
                except Exception as exc:  # pylint: disable=broad-except
                    log.debug("multimaster: progress not printed: %s", exc)

    def jid_dir(self, jid):
        """A job's directory in this master's job cache."""
        return salt.utils.jid.jid_dir(jid, os.path.join(self.opts["cachedir"], "jobs"),
                                      self.opts["hash_type"])


def minions(opts, tgt, tgt_type):
    """The accepted minion ids ``tgt`` matches."""
    return salt.utils.minions.CkMinions(opts).check_minions(tgt, tgt_type).get("minions", [])


def full_returns(opts, tgt, tgt_type, fun, kwarg, timeout):
    """
    ``(expected ids, {id: Salt's full return})`` of ``fun`` on the accepted
    minions ``tgt`` matches, within ``timeout`` seconds (none: no publish).
    """
    expected = minions(opts, tgt, tgt_type)
    rets = {}
    if expected:
        local = client(opts)
        try:
            rets = local.cmd(tgt, fun, kwarg=kwarg, tgt_type=tgt_type, timeout=timeout,
                             full_return=True) or {}
        finally:
            local.destroy()
    return expected, rets


def cmd(opts, tgt, fun, arg=None, kwarg=None, tgt_type="glob", timeout=30):
    """``{minion id: return}`` of the minions that returned ``fun``."""
    local = client(opts)
    try:
        rets = local.cmd(tgt, fun, arg=arg or [], kwarg=kwarg, tgt_type=tgt_type,
                         timeout=timeout, full_return=True) or {}
    finally:
        local.destroy()
    return {mid: fleet.payload(ret) for mid, ret in rets.items() if fleet.returned(ret)}


def cached_pillars(opts, ids):
    """``{id: pillar}`` of the minions ``ids`` from this master's minion data cache."""
    return salt.utils.master.MasterPillarUtil(
        ids, "list", use_cached_grains=True, grains_fallback=False,
        use_cached_pillar=True, pillar_fallback=False, opts=opts).get_minion_pillar()


def call_peer(opts, peer, fun, kwarg, timeout):
    """One peer's reply to ``fun``, its arguments sealed to it (``rotation_steps.SaltOps``)."""
    got = Job(opts, [peer], fun, protocol.request(fun, **kwarg), timeout).wait().get(peer)
    if got is None:
        return None
    reply, error = protocol.check_reply(peer, fun, got)
    return {"result": False, "error": error} if error else reply


def minion_returns(opts, tgt, tgt_type, fun, kwarg, timeout):
    """
    ``(expected ids, {id: return})`` of ``fun`` on the targeted minions,
    within ``timeout`` seconds whatever happens: a minion that lost its
    return (reconnecting to a restarted master) is not waited for beyond it.
    """
    expected = minions(opts, tgt, tgt_type)
    if not expected:
        return expected, {}
    local = client(opts)
    try:
        pub = local.run_job(tgt, fun, kwarg=kwarg, tgt_type=tgt_type, timeout=timeout,
                            listen=True)
        return expected, returns(opts, local, pub, tgt, tgt_type, timeout)
    finally:
        local.destroy()
