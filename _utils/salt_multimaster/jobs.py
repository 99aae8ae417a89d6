"""
The job record of a runner job, saved by the job itself.

When a runner job ends, Salt's ``store_job`` saves the job's record in the
job cache unless it is already there, and to save it works out the job's
targets with ``CkMinions.check_minions``, which lists every minion key:
about two seconds on a master with 20,000 keys, paid by every ``salt-run``,
every reactor runner and every ``peer_run`` call.  A runner job of this
extension targets one id it knows (the master it runs on, or the peer that
called it), so it saves that record itself, through the job cache's own
``save_load``, naming that one target; Salt then only adds the return.
"""

import logging
import os
import threading
import time

import salt.loader
import salt.payload
import salt.utils.user

from salt_multimaster import compat

log = logging.getLogger(__name__)

GLOB_CHARS = "*?["


def record(opts, jid, fun, tgt, arg, returners=None, kwargs=None, running=None):
    """
    Save the record of runner job ``jid`` running ``fun`` (``"module.func"``)
    as ``tgt`` with the arguments ``arg`` (a list).  Return True when saved.

    Nothing is saved (Salt saves the record as usual) unless the job cache
    is the master's ``local_cache`` (the only one whose ``store_job`` looks
    for a saved record), the job running ``fun`` itself can be told
    (:func:`own_job`; ``jid`` is the ``__jid__`` read, ``kwargs`` the call's
    keyword arguments; ``running``: its proc data when the caller found the
    job already), and ``tgt`` is one plain id.  ``returners``: a loader of
    returners (default: ``salt.loader.returners(opts, {})``).
    """
    if (not tgt or any(c in str(tgt) for c in GLOB_CHARS)
            or not opts.get("job_cache", True) or opts.get("ext_job_cache")
            or opts.get("master_job_cache", "local_cache") != "local_cache"):
        return False
    if running is None:
        jid, running = own_job(opts, jid, fun, kwargs)
    if jid is None:
        return False
    # a glob of one id matches that id when its key is accepted, as Salt's
    # own check_minions would find
    accepted = os.path.isfile(os.path.join(opts["pki_dir"], "minions", str(tgt)))
    load = {"jid": jid, "id": tgt, "tgt": tgt, "tgt_type": "glob", "fun": f"runner.{fun}",
            "arg": list(arg), "user": running.get("user") or salt.utils.user.get_specific_user()}
    try:
        if returners is None:
            returners = salt.loader.returners(opts, {})
        returners["local_cache.save_load"](jid, load, minions=[tgt] if accepted else [])
    except Exception as exc:  # pylint: disable=broad-except
        log.debug("multimaster: job %s record left to Salt: %s", jid, exc)
        return False
    return True


def own_job(opts, hint, fun, kwargs=None):
    """
    ``(jid, proc data)`` of the runner job that runs ``fun`` (``"module.func"``)
    in this call, or ``(None, None)`` when it cannot be told.

    ``hint`` is the ``__jid__`` the runner module read.  Salt sets that
    global at each call, in the module's globals, and Salt 3008's reactor
    runs its runner jobs in threads of one process sharing one loader: a
    ``__jid__`` read a moment later can be another event's job.  So the job
    is found from Salt 3008's proc files (``cachedir/proc/<jid>``, with the
    function, its arguments and the pid): the job of this process running
    ``fun`` whose arguments are ``kwargs`` (the ones not None), the hint
    when several are alike.

    A function called by another runner (the reactor's key_event calling
    sync, an orchestration) runs under that runner's jid: no job of its own.
    Salt 3006 and 3007 write no proc file for runner jobs; there only the
    job salt-run or peer_run started (``opts["fun"]``) is recognised, by the
    hint.
    """
    if not hint:
        return None, None
    hint, want, kwargs = str(hint), f"runner.{fun}", kwargs or {}
    proc = os.path.join(opts["cachedir"], "proc")
    mine, hinted = {}, False
    try:
        names = os.listdir(proc)
    except OSError:
        names = []
    for name in names:
        try:
            with open(os.path.join(proc, name), "rb") as fh:
                data = salt.payload.load(fh)
        except Exception:  # pylint: disable=broad-except
            # gone meanwhile (the job ended), or not a proc file
            continue
        hinted = hinted or name == hint
        if (isinstance(data, dict) and data.get("fun") == want and data.get("pid") == os.getpid()
                and _same_args(data.get("fun_args"), kwargs)):
            mine[name] = data
    if len(mine) == 1:
        return next(iter(mine.items()))
    if hint in mine:
        return hint, mine[hint]
    if not mine and not hinted and opts.get("fun") == fun:
        return hint, {"fun": want}
    if mine:
        log.debug("multimaster: %s jobs %s alike: record left to Salt", fun, sorted(mine))
    return None, None


def job_event(event, jid):
    """
    ``event`` (a runner's ``__jid_event__``) when it is job ``jid``'s own
    connection to the event bus (its tag ends in the jid), else None.
    """
    try:
        if jid is not None and event is not None and str(event.base).endswith(f"/{jid}"):
            return event
    except (AttributeError, ReferenceError):
        # not an event of a runner job, or its job ended (a dead weakref)
        pass
    return None


def _same_args(fun_args, kwargs):
    """Whether a proc file's ``fun_args`` carry ``kwargs`` (by name, or by value)."""
    named, values = {}, []
    for arg in fun_args if isinstance(fun_args, list) else []:
        if isinstance(arg, dict):
            named.update({str(k): v for k, v in arg.items() if not str(k).startswith("__")})
        else:
            values.append(str(arg))
    for key, value in kwargs.items():
        if value is None or str(key).startswith("__"):
            continue
        if key in named:
            if str(named[key]) != str(value):
                return False
        elif str(value) not in values:
            return False
    return True


def record_in_thread(opts, jid, fun, tgt, arg, running=None):
    """
    :func:`record` in a thread started here, so that the job goes on
    meanwhile (loading the job cache takes a few tenths of a second); the
    thread runs in a copy of this context (Salt's loader dunders are context
    variables).  Join it before the job returns.
    """
    thread = threading.Thread(target=compat.copy_context().run,
                              args=(record, opts, jid, fun, tgt, arg, None, None, running),
                              name="multimaster-job-record", daemon=True)
    thread.start()
    return thread


def args(**kwargs):
    """A runner job's arguments as its record lists them (``key=value``)."""
    return [f"{k}={v}" for k, v in kwargs.items() if v is not None and not k.startswith("__")]


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
