"""
Keep peer masters true replicas of the primary master.

Run on the primary master.  Peers are reached through their own salt-minion,
which is a minion of the primary (``multimaster:peers`` lists those minion
ids).  Configuration lives in the primary's master config:

.. code-block:: yaml

    multimaster:
      peers: [master02, master03]
      topology: shared            # shared | signed
      replicate: [master_keys, minion_keys, file_roots, pillar_roots, master_config]
      master_config_keys: [nodegroups, external_auth, publisher_acl, peer, peer_run]

Keyword arguments of each function override it.  The logic lives in the
``salt_multimaster`` package (:mod:`salt_multimaster.sync` plans and
merges, :mod:`salt_multimaster.protocol` is the wire format); this module
holds the Salt-facing parts: configuration, publishes, events, exit codes.
"""

import contextlib
import importlib
import logging
import math
import os
import sys
import threading
import time

import salt.client
import salt.loader
import salt.utils.event
import salt.utils.extmods
import salt.utils.jid
import salt.utils.master
import salt.utils.minions
import salt.utils.systemd
import salt.version
from salt.exceptions import SaltInvocationError

log = logging.getLogger(__name__)

__virtualname__ = "multimaster"

# the core modules this runner uses, imported once the core is importable
_CORE = {name: name for name in ("daemon", "finger", "fleet", "guard", "jobs", "layout",
                                 "lock", "manifest", "membership", "membership_steps",
                                 "memory", "outage", "protocol", "replicate", "report",
                                 "restart", "revocation", "rotation", "rotation_steps",
                                 "rounds", "seal", "transport", "validate")}
_CORE["sync_core"] = "sync"
_CORE["failback_core"] = "failback"
_CORE["promote_core"] = "promote"
_CORE["epochs"] = "epoch"

try:
    import salt_multimaster
    from salt_multimaster import (daemon, finger, fleet, guard, jobs, layout, lock,
                                  manifest, membership, membership_steps, memory, outage,
                                  protocol, replicate, report, restart, revocation, rotation,
                                  rotation_steps, rounds, seal, transport, validate)
    # the public functions failback() and promote() take the modules' names
    from salt_multimaster import epoch as epochs
    from salt_multimaster import failback as failback_core
    from salt_multimaster import promote as promote_core
    # the public function sync() takes the module's name
    from salt_multimaster import sync as sync_core

    HAS_CORE = True
except ImportError:
    HAS_CORE = False


def _load_core():
    """
    With the repository as a file_roots root, ``salt-run saltutil.sync_runners``
    brings this runner but not ``_utils``: sync the utils once, then import.
    """
    global HAS_CORE  # pylint: disable=global-statement
    if HAS_CORE:
        return True
    try:
        synced = salt.utils.extmods.sync(__opts__, "utils")
        log.info("multimaster: synced utils for the runner: %s", synced)
        importlib.invalidate_caches()
        utils_dir = os.path.join(__opts__["extension_modules"], "utils")
        if utils_dir not in sys.path:
            sys.path.append(utils_dir)
        globals()["salt_multimaster"] = importlib.import_module("salt_multimaster")
        for name, module in _CORE.items():
            globals()[name] = importlib.import_module(f"salt_multimaster.{module}")
        HAS_CORE = True
        for name, extra in _UNGUARDED.items():  # imported before the core was
            globals()[name] = _public(*extra)(globals()[name])
        _UNGUARDED.clear()
    except Exception as exc:  # pylint: disable=broad-except
        log.debug("multimaster: core not importable: %s", exc)
    return HAS_CORE


# The public functions imported before the core was (the file_roots
# install, its first load): wrapped by _load_core, before Salt collects them.
_UNGUARDED = {}


def _answer(fun, message, args, kwargs):  # pylint: disable=unused-argument
    """How a call with bad arguments, or one that failed, is answered (:func:`_public`)."""
    return _invalid(message)


def _public(*extra):
    """
    This runner's one wrapper of its public functions
    (:func:`salt_multimaster.guard.public`): ``extra`` names what a
    function's ``**kwargs`` accepts; any other keyword is answered with
    every accepted one and the closest match, nothing run; whatever it
    raises is answered as a named error (``result: False``, ``retcode``).
    """

    def decorate(func):
        if not HAS_CORE:
            _UNGUARDED[func.__name__] = extra
            return func
        return guard.public(__virtualname__, _answer, extra)(func)

    return decorate


def __virtual__():
    if _load_core():
        return __virtualname__
    return (
        False,
        "multimaster: the salt_multimaster core is missing; pip install "
        "salt-multimaster, or run 'salt-run saltutil.sync_all' with the "
        "repository in file_roots",
    )


@_public()
def version():
    """
    Return the version of salt-multimaster and where this runner was loaded from.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.version
    """
    return {"version": salt_multimaster.__version__, "runner": __file__}


# ---------------------------------------------------------------------------
# Replication (salt-run multimaster.sync / status / restore / pull)
# ---------------------------------------------------------------------------
_DEFAULT_TIMEOUT = 120
# A sync waits this long for another sync of this primary to end, then gives up.
LOCK_WAIT = 60
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

# Keyword arguments of sync and status besides their named parameters.
_CONF_KWARGS = ("rescan", "topology", "replicate", "master_config_keys", "timeout",
                "inline_limit", "pull_min_files", "backup_keep")


def _conf(kwargs):
    """The primary's ``multimaster`` config, overridden by runner kwargs."""
    conf = _valid(validate.conf_mapping, __opts__.get("multimaster"))
    configured = _as_list(conf.get("peers"), "multimaster:peers")
    for key in ("peers",) + _CONF_KWARGS[1:]:
        if kwargs.get(key) is not None:
            conf[key] = kwargs[key]
    conf.setdefault("topology", "shared")
    conf.setdefault("replicate", list(replicate.CATEGORIES))
    conf.setdefault("master_config_keys", list(replicate.DEFAULT_CONFIG_KEYS))
    conf.setdefault("timeout", _DEFAULT_TIMEOUT)
    conf.setdefault("inline_limit", transport.INLINE_LIMIT)
    conf.setdefault("pull_min_files", transport.PULL_MIN_FILES)
    conf.setdefault("backup_keep", sync_core.BACKUP_KEEP)
    conf.setdefault("verify_interval", sync_core.VERIFY_INTERVAL)
    conf["timeout"] = _timeout(conf["timeout"])
    for key in ("inline_limit", "pull_min_files", "backup_keep", "verify_interval"):
        try:
            conf[key] = int(conf[key])
        except (TypeError, ValueError):
            raise SaltInvocationError(f"{key} must be an integer, not {conf[key]!r}") from None
    if conf["verify_interval"] < 0:
        raise SaltInvocationError("multimaster:verify_interval must be seconds >= 0 (0: never), "
                                  f"not {conf['verify_interval']!r}")
    for key in ("peers", "replicate", "master_config_keys"):
        conf[key] = _as_list(conf.get(key), key)
    # only configured peers receive secrets; only shared policy options travel
    _valid(validate.peers, conf["peers"], configured)
    _valid(validate.config_keys, conf["master_config_keys"])
    conf["rescan"] = _flag("rescan", kwargs.get("rescan"))
    # every peer configured: what this primary's epoch claim names (epoch.claim)
    conf["configured_peers"] = configured
    return conf


def _valid(check, *args):
    """Run a ``salt_multimaster.validate`` check; bad input as SaltInvocationError."""
    try:
        return check(*args)
    except validate.InvalidInput as exc:
        raise SaltInvocationError(str(exc)) from None


def _timeout(value):
    """A timeout in whole seconds; bad input as SaltInvocationError."""
    return int(math.ceil(_valid(validate.timeout, "timeout", value)))


def _checked_args(minion_ids=None, only=None):
    """``only`` and ``minion_ids`` not empty when given (the keywords: :func:`_public`)."""
    if only is not None and not _as_list(only, "only"):
        raise validate.InvalidInput(
            f"only is empty ({only!r}): name the categories to sync, or leave only out")
    if minion_ids is not None and not _as_list(minion_ids, "minion_ids"):
        raise validate.InvalidInput(
            f"minion_ids is empty ({minion_ids!r}): name the minions whose keys to sync, "
            "or leave minion_ids out for a full sync")


def _as_list(value, name):
    """``value`` as a list (:func:`validate.as_list`); bad input as SaltInvocationError."""
    return _valid(validate.as_list, name, value)


def _flag(name, value):
    """``value`` as a bool (:func:`validate.boolean`); bad input as SaltInvocationError."""
    return _valid(validate.boolean, name, value)


def _invalid(message):
    log.error("multimaster: %s", message)
    __context__["retcode"] = 1
    return {"result": False, "error": message, "retcode": 1}


def _validate(conf, only):
    """Return an error message for bad input, or None."""
    if conf["topology"] not in layout.TOPOLOGIES:
        return f"unknown topology {conf['topology']!r} (known: {', '.join(layout.TOPOLOGIES)})"
    for cat in only + conf["replicate"]:
        if cat not in replicate.CATEGORIES:
            return f"unknown category {cat!r} (known: {', '.join(replicate.CATEGORIES)})"
    if not conf["peers"]:
        dropin = protocol.dropin_path(__opts__) if __opts__.get("conf_file") else None
        if dropin and os.path.isfile(dropin):
            return (f"this master is a peer: it holds {dropin}, written by a primary's "
                    "multimaster.sync; run salt-run multimaster.sync on the primary")
        return "no peers: set multimaster:peers in the master config or pass peers=..."
    return None


#: seconds between two progress lines of one peer's job still running
PROGRESS_EVERY = 5


def _client():
    """A LocalClient of this master (the caller destroys it), as Salt's manage runner makes one."""
    return salt.client.get_local_client(mopts=__opts__)


def _gather_timeout():
    """The master's ``gather_job_timeout`` (:data:`GATHER_TIMEOUT` when unset or not a number)."""
    try:
        return max(1, int(__opts__.get("gather_job_timeout") or GATHER_TIMEOUT))
    except (TypeError, ValueError):
        return GATHER_TIMEOUT


def _returns(client, pub, tgt, tgt_type, timeout, on_wait=None):
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
    poll = jobs.EventPoll()
    for got in client.get_iter_returns(pub["jid"], set(pub["minions"]), timeout=JOB_POLL,
                                       tgt=tgt, tgt_type=tgt_type, expect_minions=False,
                                       block=False, gather_job_timeout=_gather_timeout()):
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


class _Job:
    """
    A publish to the peers whose returns are read later: the caller works
    meanwhile.  The keyword arguments are sealed to each peer
    (:mod:`salt_multimaster.protocol`): the publish reaches every minion.
    """

    def __init__(self, peers, fun, kwarg, timeout):
        self.peers = list(peers)
        self.fun = fun
        self.timeout = timeout
        sealed = protocol.sealed_kwarg(
            {peer: transport.peer_pub(__opts__, peer) for peer in self.peers}, fun, kwarg)
        self.client = _client()
        self.was_listening = self.client.event.cpub
        try:
            self.pub = self.client.run_job(self.peers, fun, kwarg=sealed, tgt_type="list",
                                           timeout=timeout, listen=True)
        except BaseException:
            self.close()
            raise

    def wait(self, on_wait=None):
        """``{peer: return}`` of the peers that returned (:func:`_returns`)."""
        try:
            return _returns(self.client, self.pub, self.peers, "list", self.timeout, on_wait)
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


class _Salt:
    """
    What the rounds of a sync (:class:`salt_multimaster.rounds.Rounds`)
    ask of Salt: publishing to the peers, progress lines, the job cache.
    ``event``: the job's own event connection (:func:`_own_job`), or None:
    then the progress events go out on a connection of this call's own,
    closed by :meth:`close`.
    """

    publish = _Job

    def __init__(self, event=None):
        self.event = event
        self.bus = None if event is None else event.event
        self.own_bus = event is None
        self.lock = threading.Lock()  # the rounds report from their threads
        self.cli = None

    def close(self):
        if self.own_bus and self.bus is not None:
            self.bus.destroy()
        self.bus = None

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
            on = self.event is not None and _compact("multimaster.sync")
            if on and "multimaster_progress" not in salt.loader.outputters(__opts__):
                try:
                    salt.utils.extmods.sync(__opts__, "output")
                except Exception as exc:  # pylint: disable=broad-except
                    log.debug("multimaster: outputter not synced: %s", exc)
                on = "multimaster_progress" in salt.loader.outputters(__opts__)
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
                        __opts__, __opts__["sock_dir"], listen=False)
                self.bus.fire_event(data, "salt/multimaster/sync/progress")
            except Exception as exc:  # pylint: disable=broad-except
                log.debug("multimaster: progress event not fired: %s", exc)
            if self.cli_progress():
                try:
                    self.event.fire_event(
                        {"message": message, "outputter": "multimaster_progress"}, "progress")
                except Exception as exc:  # pylint: disable=broad-except
                    log.debug("multimaster: progress not printed: %s", exc)

    @staticmethod
    def jid_dir(jid):
        return salt.utils.jid.jid_dir(jid, os.path.join(__opts__["cachedir"], "jobs"),
                                      __opts__["hash_type"])


def _sync(job, peers, only, test, force, minion_ids, **kwargs):
    try:
        _valid(_checked_args, minion_ids, only)
        force = _flag("force", force)
        conf = _conf(dict(kwargs, peers=peers))
    except SaltInvocationError as exc:
        return _invalid(str(exc))
    only = _as_list(only, "only")
    ids = sorted(set(_as_list(minion_ids, "minion_ids")))
    error = _validate(conf, only)
    if not error and ids:
        other = [c for c in only if c != "minion_keys"]
        bad_ids = [mid for mid in ids if not manifest.valid_minion_id(mid)]
        if other:
            error = f"minion_ids syncs minion_keys only, not {', '.join(other)}"
        elif bad_ids:
            error = f"invalid minion id(s) in minion_ids: {', '.join(map(repr, bad_ids))}"
        only = ["minion_keys"]
        if len(ids) > memory.MAX_TARGETED_IDS:
            ids = []
    if error:
        return _invalid(error)
    # a full sync (every configured category) reads everything again once
    # per verify_interval: what stat and the change journal cannot see
    full = not test and not ids and set(only or conf["replicate"]) >= set(conf["replicate"])
    if full and not conf["rescan"] and sync_core.verify_due(__opts__, conf["verify_interval"]):
        log.info("multimaster: periodic full verify (verify_interval %s s): every file and "
                 "key is read again", conf["verify_interval"])
        conf["rescan"] = True
    ret = _run_rounds(job, conf, only or conf["replicate"], test, force, ids)
    if not all(r["result"] for r in ret.values()):
        __context__["retcode"] = 1
        ret["retcode"] = 1
    elif full and conf["rescan"]:
        sync_core.verified(__opts__)
    return ret


def _run_rounds(job, conf, categories, test=False, force=False, ids=None):
    """``{peer: report}`` of a sync of every peer of ``conf`` (checked input)."""
    bad = sync_core.peer_errors(__opts__, conf["peers"])
    ret = {peer: {"result": False, "error": message} for peer, message in bad.items()}
    peers = [p for p in conf["peers"] if p not in bad]
    if peers:
        ret.update(rounds.Rounds(__opts__, conf, job, test, force).run(peers, categories, ids))
    return ret


def _own_job(fun):
    """
    ``(jid, event)`` of this call: the ``__jid__`` Salt set for the runner
    job (None outside one) and, when ``salt-run`` itself runs ``fun``, the
    job's connection to the master event bus (``__jid_event__``), which
    prints its progress lines; else None (the reactor, the scheduler, a
    ``peer_run`` call).  Salt stores the job's record as for any runner job.
    """
    event = globals().get("__jid_event__") if __opts__.get("fun") == fun else None
    return globals().get("__jid__"), event


def _compact(fun):
    """
    True when salt-run itself runs ``fun`` and the user chose no outputter
    (no ``--out``, no ``output`` in the config): print the compact report.
    Calls from the reactor, the scheduler or the API get the data.
    """
    return not __opts__.get("output") and __opts__.get("fun") == fun


@_public(*_CONF_KWARGS, "lock_wait")
def sync(peers=None, only=None, test=False, force=False, minion_ids=None, verbose=False,
         **kwargs):
    """
    Make each peer master mirror this (primary) master.

    peers
        Peer minion ids (default: ``multimaster:peers`` from the master
        config); only ids listed there are accepted: anything else is
        refused before anything is sent.
    only
        Categories to sync, among master_keys, minion_keys, file_roots,
        pillar_roots, master_config (default: ``multimaster:replicate``).
    test
        Change nothing; report exactly what a real run would change.
    force
        Replace conflicting minion keys and remove keys found only on a peer.
    minion_ids
        Sync the keys of these minions only (implies ``only=minion_keys``), no
        listing of every key: one publish per peer (the apply) when the
        primary knows what the peer holds of them since its last sync, else
        an inventory of those ids and an apply.  The ``salt/key`` reactor
        passes the ids of its events.  Past 200 ids, a full ``minion_keys``
        sync runs instead.
    rescan
        Read and hash every minion key and every file_roots/pillar_roots
        file on the primary and the peers, ignoring the change journal and
        the state store's stats (like ``rsync -c``): finds what changed
        behind them.  It also drops the primary fileserver's own hash cache
        (``cachedir/roots/hash``), which trusts mtimes the same way.  It
        reads every byte of the roots on every master, where a plain sync
        only stats them: use it after a suspected edit behind the cache,
        not on every run.
    lock_wait
        Seconds to wait for another sync of this primary to end (default
        ``multimaster:lock_wait``, 60).  One sync runs at a time per
        primary (a lock in ``cachedir/multimaster/sync.lock``): a second
        one waits, then does only what is left; past ``lock_wait`` it
        changes nothing, returns ``a sync is already running, jid ...``
        and ``salt-run`` exits non-zero.  ``test=True`` takes no lock.

    verbose
        In the compact report (``salt-run`` without ``--out``), list every
        name instead of the first three.

    Returns, per peer, ``{"result": bool, "<category>": {"added": [...],
    "updated": [...], "removed": [...], "conflicts": [...], "errors": [...]}}``
    (``unconfirmed``: planned, not confirmed by the peer).  Without ``--out``
    salt-run prints a compact summary per peer; ``--out=json`` or ``yaml``
    give this data.  A peer that is not a replica in service afterwards
    (failed, unreachable, conflicts left, restart required, master down)
    gets ``result: False`` and one ``error`` line, and ``salt-run`` exits
    non-zero; the other peers are still synced.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.sync
        salt-run multimaster.sync peers=master02 only=minion_keys,file_roots test=True
        salt-run multimaster.sync minion_ids=web01,web02
        salt-run multimaster.sync rescan=True
        salt-run multimaster.sync --out=json
    """
    try:
        test, verbose = _flag("test", test), _flag("verbose", verbose)
    except SaltInvocationError as exc:
        return _invalid(str(exc))
    jid, event = _own_job("multimaster.sync")
    job = _Salt(event)
    try:
        ret = _locked_sync(job, jid, peers, only, test, force, minion_ids, **kwargs)
    finally:
        job.close()
    if _compact("multimaster.sync"):
        return {"outputter": "txt",
                "data": report.sync_rows(ret, test, verbose)}
    return ret


def _locked_sync(job, jid, peers, only, test, force, minion_ids, **kwargs):
    """
    :func:`_sync` under this primary's sync lock (no lock in test mode:
    ``test`` a bool); ``job``: the :class:`_Salt` of this call, ``jid``: its
    own jid or None.
    """
    if test:
        return _sync(job, peers, only, test, force, minion_ids, **kwargs)
    with _sync_lock(kwargs.pop("lock_wait", None), jid) as busy:
        if busy:
            # per peer too: a caller checking each peer's result (the
            # reactor's key_event retries a failed sync) sees the failure
            conf = __opts__.get("multimaster")
            for peer in _as_list(peers, "peers") or _as_list(
                    conf.get("peers") if isinstance(conf, dict) else None, "multimaster:peers"):
                busy.setdefault(peer, {"result": False, "error": busy["error"]})
            return busy
        transport.sweep_grants(__opts__, _Salt.jid_dir)
        return _sync(job, peers, only, test, force, minion_ids, **kwargs)


@contextlib.contextmanager
def _sync_lock(wait=None, jid=None):
    """
    Hold this primary's sync lock (``salt_multimaster.lock``) for the block,
    naming ``jid`` as the holder (else the job this sync runs in);
    yield None, or the failed return naming the running sync's jid when it
    did not end within ``wait`` seconds (``lock_wait=``, else
    ``multimaster:lock_wait``, default 60).
    """
    if wait is None:
        conf = __opts__.get("multimaster")
        wait = conf.get("lock_wait", LOCK_WAIT) if isinstance(conf, dict) else LOCK_WAIT
    try:
        wait = float(wait)
        if not 0 <= wait <= 86400:
            raise ValueError(wait)
    except (TypeError, ValueError):
        yield _invalid(f"lock_wait must be a number of seconds (0 to 86400), not {wait!r}")
        return
    held = lock.SyncLock(os.path.join(layout.state_dir(__opts__), lock.LOCK_NAME),
                         jid or globals().get("__jid__"), wait=wait)
    try:
        held.acquire()
    except lock.Busy as exc:
        yield _invalid(str(exc))
        return
    try:
        yield None
    finally:
        held.release()


@_public()
def pull(request):
    """
    Serve a peer what it pulls during a sync: the operations of its sync and
    the contents of minion keys, pillar and file_roots files, in chunks.

    Not for operators: a peer's minion calls it through ``peer_run`` while
    ``multimaster.sync`` runs.  The request names a grant the sync created
    for that peer only (a random token, valid ten minutes) and a chunk of
    it; the reply is sealed to the calling peer's minion key, so job cache
    and events hold ciphertext only.  Allow it on the primary with:

    .. code-block:: yaml

        peer_run:
          master0[2-9]:
            - multimaster.pull

    CLI Example:

    .. code-block:: bash

        salt master02 publish.runner multimaster.pull
    """
    caller = __opts__.get("id")
    served = transport.serve_pull(__opts__, request, caller, _own_job("multimaster.pull")[0])
    if "error" in served:
        return served
    # the master prints each runner return it serves with the outputter the
    # return names; no_return (built in, like nested) prints "sealed:" and
    # skips the value, where nested would decode tens of MiB of ciphertext
    return {"outputter": "no_return", "data": served}


@_public("timeout")
def restore(peer=None, backup=None, test=False, **kwargs):
    """
    Roll a peer back: put back every file a sync replaced or removed there,
    from one of the peer's backups (``<peer master cachedir>/multimaster/
    backup/<timestamp>``, the newest ``multimaster:backup_keep`` kept,
    default 10).  What the peer holds now is backed up first, so a restore is
    undone the same way; files a sync added stay.  Run ``test=True`` first:
    it lists what would be put back.  A peer master must restart when master
    keys or config were restored (done in the background where systemd runs
    it).  A later ``multimaster.sync`` makes the peer mirror the primary
    again: fix the primary first.

    peer
        One peer of ``multimaster:peers``.
    backup
        The backup's timestamp, as a sync reported it (``backup``); default:
        the newest.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.restore peer=master02 test=True
        salt-run multimaster.restore peer=master02 backup=20261123T221500.123456Z
    """
    try:
        test = _flag("test", test)
        if len(_as_list(peer, "peer")) != 1:
            raise SaltInvocationError("restore takes one peer: peer=<id of multimaster:peers>")
        conf = _conf(dict(kwargs, peers=peer))
    except SaltInvocationError as exc:
        return _invalid(str(exc))
    peer = conf["peers"][0]
    bad = sync_core.peer_errors(__opts__, [peer])
    if bad:
        return _invalid(bad[peer])
    request = protocol.request("multimaster_peer.restore", backup_name=backup, test=test)
    got, error = _Job([peer], "multimaster_peer.restore", request,
                      conf["timeout"]).replies()[peer]
    if error:
        return _invalid(error)
    ret = {peer: got}
    if not got.get("result"):
        __context__["retcode"] = 1
        ret["retcode"] = 1
    if _compact("multimaster.restore"):
        return {"outputter": "txt", "data": report.restore_rows(ret, test)}
    return ret


@_public(*_CONF_KWARGS)
def status(peers=None, verbose=False, **kwargs):
    """
    Report, per peer, how far it is from the primary; change nothing.

    Returns per peer: ``reachable``, the master key fingerprints of the
    primary and the peer (``master_finger``), minion key counts per state on
    both sides, and per category the drift a sync would repair
    (``{"added": n, "updated": n, "removed": n, "conflicts": n}``), whether
    the peer may pull bulk (``pull_allowed``, with the ``peer_run`` snippet
    when not), whether its salt-master runs (``master_running``) and whether
    it runs older keys or config than a sync wrote (``restart_pending``).
    Without ``--out`` salt-run prints a compact summary per peer.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.status
        salt-run multimaster.status peers=master02 --out=json
    """
    try:
        verbose = _flag("verbose", verbose)
    except SaltInvocationError as exc:
        return _invalid(str(exc))
    job = _Salt(_own_job("multimaster.status")[1])
    try:
        ret = _status(job, peers, **kwargs)
    finally:
        job.close()
    if _compact("multimaster.status"):
        return {"outputter": "txt", "data": report.status_rows(ret, verbose)}
    return ret


def _status(job, peers, **kwargs):
    try:
        conf = _conf(dict(kwargs, peers=peers))
    except SaltInvocationError as exc:
        return _invalid(str(exc))
    error = _validate(conf, [])
    if error:
        return _invalid(error)
    categories = conf["replicate"]
    bad = sync_core.peer_errors(__opts__, conf["peers"])
    ret = {peer: {"reachable": False, "in_sync": False, "error": message}
           for peer, message in bad.items()}
    peers = [p for p in conf["peers"] if p not in bad]
    if not peers:
        ret["retcode"] = 1
        return ret
    primary, invs = rounds.Rounds(__opts__, conf, job, test=True).inventories(
        sync_core.status_categories(categories), peers)
    pub = primary["master_keys"]["files"]["pub"]
    primary_finger = finger.file_finger(pub, __opts__.get("hash_type", "sha256")) or None
    for peer in peers:
        inv, error = invs[peer]
        pullable = protocol.pull_allowed(__opts__.get("peer_run"), peer)
        ret[peer] = ({"reachable": False, "in_sync": False, "pull_allowed": pullable,
                      "error": error} if error else
                     sync_core.peer_status(peer, inv, primary, categories, conf["topology"],
                                           primary_finger, pullable))
    if not all(r.get("reachable") and r.get("master_running") is not False
               for r in ret.values()):
        __context__["retcode"] = 1
        ret["retcode"] = 1
    return ret


# ---------------------------------------------------------------------------
# Fleet audit (salt-run multimaster.audit).  Everything below this line
# belongs to the audit; sync/status live above it.
# ---------------------------------------------------------------------------


def _audit_default_output():
    """
    True when the user did not choose an outputter (no --out, no ``output``
    in the master config): the audit then prints its compact table.
    """
    return not __opts__.get("output")


@_public()
def audit(
    tgt="*",
    tgt_type="glob",
    timeout=None,
    masters=None,
    master_finger=None,
    topology=None,
    master_version=None,
):
    """
    Fleet report: run ``multimaster.audit`` on the targeted minions through
    the master this runs on, and list every targeted minion that did not
    return.  Run it on the primary and on each peer to see which minions are
    connected to which master.

    The master passes its own Salt version (``master_version``) so every
    minion checks version_skew.  ``masters``, ``master_finger`` and
    ``topology`` are passed on to the minions when given (else the minions
    use their pillar).

    Returns ``{"result", "master", "saltversion", "tgt", "tgt_type",
    "counts", "minions": {id: {"ok", "findings", "masters", "master_finger",
    "saltversion"}}, "missing", "failed", "totals": {check: {severity: n}},
    "retcode"}``.  Without ``--out`` a compact table is printed (one row per
    minion, then totals per check); ``--out=json`` (or yaml, nested...) gives
    the data.  salt-run exits non-zero when a minion fails the audit or a
    targeted minion does not return.

    tgt
        Target, default ``*``.

    tgt_type
        Target type (glob, list, compound, nodegroup, ...), default ``glob``.

    timeout
        Seconds to wait for the minions (default: the master's ``timeout``).

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.audit
        salt-run multimaster.audit tgt='web*' --out=json
        salt-run multimaster.audit tgt=G@os:Debian tgt_type=compound
    """
    # bad input: a retcode in the return (a raised SaltInvocationError leaves
    # salt-run exiting 0 on 3008)
    if not tgt or not isinstance(tgt, (str, list)):
        return _invalid(f"multimaster.audit: invalid target {tgt!r}")
    try:
        timeout = _timeout(timeout if timeout is not None else __opts__.get("timeout", 5))
    except SaltInvocationError as exc:
        return _invalid(f"multimaster.audit: {exc}")
    kwarg = {"master_version": master_version or {__opts__["id"]: salt.version.__version__}}
    for key, value in (("masters", masters), ("master_finger", master_finger),
                       ("topology", topology)):
        if value is not None:
            kwarg[key] = value
    expected = salt.utils.minions.CkMinions(__opts__).check_minions(tgt, tgt_type)
    expected = expected.get("minions", []) if isinstance(expected, dict) else []
    returns = {}
    if expected:
        client = _client()
        try:
            returns = client.cmd(
                tgt,
                "multimaster.audit",
                kwarg=kwarg,
                tgt_type=tgt_type,
                timeout=timeout,
                full_return=True,
            ) or {}
        finally:
            client.destroy()
    report = fleet.build_report(
        __opts__["id"], salt.version.__version__, tgt, tgt_type, expected, returns
    )
    if _audit_default_output():
        return {"outputter": "txt", "data": fleet.render_rows(report)}
    return report


# ---------------------------------------------------------------------------
# Membership (salt-run multimaster.add_peer / multimaster.remove_peer).
# Everything below this line belongs to adding and removing peers; it calls
# the public sync() only.  The steps are salt_multimaster.membership's.
# ---------------------------------------------------------------------------
_MEMBERSHIP_KWARGS = ("timeout",)


def _member_cmd(tgt, fun, arg=None, kwarg=None, tgt_type="glob", timeout=30):
    """``{minion id: return}`` of the minions that returned ``fun``."""
    client = _client()
    try:
        rets = client.cmd(tgt, fun, arg=arg or [], kwarg=kwarg, tgt_type=tgt_type,
                          timeout=timeout, full_return=True) or {}
    finally:
        client.destroy()
    return {mid: ret.get("ret") if isinstance(ret, dict) and "ret" in ret else ret
            for mid, ret in rets.items() if fleet.returned(ret)}


def _member_minions(tgt, tgt_type):
    """The accepted minion ids ``tgt`` matches."""
    found = salt.utils.minions.CkMinions(__opts__).check_minions(tgt, tgt_type)
    return found.get("minions", []) if isinstance(found, dict) else []


def _member_pillars(minions):
    """``{id: pillar}`` of ``minions`` from this master's minion data cache."""
    return salt.utils.master.MasterPillarUtil(
        minions, "list", use_cached_grains=True, grains_fallback=False,
        use_cached_pillar=True, pillar_fallback=False, opts=__opts__).get_minion_pillar()


def _member_run(fun, steps, peer, kwargs, **args):
    """
    ``steps`` (membership_steps.add_peer/remove_peer) of ``peer`` run with this
    master's Salt, bad input refused before anything is sent; without
    ``--out``, salt-run running ``fun`` prints the compact report.
    """
    try:
        for flag in ("test", "force"):
            if flag in args:
                args[flag] = _flag(flag, args[flag])
        args["timeout"] = _timeout(kwargs.get("timeout") or 30)
        salt_ops = membership_steps.SaltOps(__opts__, cmd=_member_cmd, minions=_member_minions,
                                            cached_pillars=_member_pillars, sync=sync)
        ret = steps(salt_ops, peer, **args)
    except (SaltInvocationError, membership.MembershipError) as exc:
        ret = _invalid(str(exc))
    if ret.get("retcode"):
        __context__["retcode"] = ret["retcode"]
    if __opts__.get("output") or __opts__.get("fun") != fun:
        return ret
    return {"outputter": "txt", "data": membership.report_rows(ret)}


@_public(*_MEMBERSHIP_KWARGS)
def add_peer(peer=None, address=None, test=False, tgt="*", tgt_type="glob", **kwargs):
    """
    Make ``peer``, the new master host's accepted salt-minion, a peer master
    of this primary: ``check`` its host, list it in the drop-in ``config``,
    ``sync`` everything to it (the master keys before its salt-master's
    first start; the drop-in put back when the sync fails), ``start`` its
    salt-master, and report the ``minions`` that get it at their next
    ``state.apply salt.multimaster``.  ``address`` overrides how minions
    name the new master.

    Arguments, steps and report: docs/add-remove-peer.rst.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.add_peer master03 test=True
        salt-run multimaster.add_peer master03
        salt-run multimaster.add_peer master03 address=master03.example.com
    """
    return _member_run("multimaster.add_peer", membership_steps.add_peer, peer, kwargs,
                       address=address, test=test, tgt=tgt, tgt_type=tgt_type)


@_public(*_MEMBERSHIP_KWARGS)
def remove_peer(peer=None, address=None, test=False, force=False, tgt="*", tgt_type="glob",
                **kwargs):
    """
    Take ``peer``, added by add_peer, out of this primary's peers once no
    minion lists its master: the ``minions`` whose config or pillar still
    do are named and nothing changes (``force=True`` goes on anyway); then
    the ``config`` drop-in stops listing it.  Its salt-master is left
    running: stop it afterwards.

    Arguments, steps and report: docs/add-remove-peer.rst.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.remove_peer master03 test=True
        salt-run multimaster.remove_peer master03
    """
    return _member_run("multimaster.remove_peer", membership_steps.remove_peer, peer, kwargs,
                       address=address, test=test, force=force, tgt=tgt, tgt_type=tgt_type)


# ---------------------------------------------------------------------------
# Master key rotation (salt-run multimaster.rotate_key): the input, the lock and
# the Salt side (rotation_steps.SaltOps) of the steps in salt_multimaster.rotation_steps.
# ---------------------------------------------------------------------------
def _rot_invalid(message):
    """Bad input or a refused rotation: nothing changed, a non-zero exit."""
    return dict(rotation_steps.refused(message), retcode=1)


def _rot_call_peer(peer, fun, kwarg, timeout):
    """One peer's reply to ``fun``, its arguments sealed to it (``SaltOps.call_peer``)."""
    got = _Job([peer], fun, protocol.request(fun, **kwarg), timeout).wait().get(peer)
    if got is None:
        return None
    reply, error = protocol.check_reply(peer, fun, got)
    return {"result": False, "error": error} if error else reply


def _rot_minions(tgt, tgt_type, fun, kwarg, timeout):
    """
    ``(expected ids, {id: return})`` of ``fun`` on the targeted minions,
    within ``timeout`` seconds whatever happens: a minion that lost its
    return (reconnecting to a restarted master) is not waited for beyond it.
    """
    expected = salt.utils.minions.CkMinions(__opts__).check_minions(tgt, tgt_type)
    expected = expected.get("minions", []) if isinstance(expected, dict) else []
    if not expected:
        return expected, {}
    client = _client()
    try:
        pub = client.run_job(tgt, fun, kwarg=kwarg, tgt_type=tgt_type, timeout=timeout,
                             listen=True)
        return expected, _returns(client, pub, tgt, tgt_type, timeout)
    finally:
        client.destroy()


def _rot_reconnect_events():
    """
    This master restarted under the running salt-run: its job's connection
    to the master event bus is gone (Salt 3006 dies firing the job's return
    on it, StreamClosedError).  Drop it: the next event connects again.
    """
    try:
        globals().get("__jid_event__").event.close_pull()
    except Exception as exc:  # pylint: disable=broad-except
        log.debug("multimaster: event connection not reset: %s", exc)


def _rot_salt():
    """What the rotation asks of Salt on this master (``rotation_steps.SaltOps``)."""
    state_dir = layout.state_dir(__opts__)
    started = []
    return rotation_steps.SaltOps(
        __opts__, call_peer=_rot_call_peer, minions=_rot_minions,
        status=lambda peers, topology: status(peers=",".join(peers), topology=topology,
                                              replicate="master_keys"),
        restart_primary=lambda cmd: rotation.restart_primary(
            __opts__, cmd, not cmd and salt.utils.systemd.booted({}), started.append),
        restart_failed=lambda: rotation.command_failure(started[-1] if started else None),
        primary_serving=lambda: rotation.serving(
            __opts__, os.path.join(state_dir, daemon.RESTART_MARKER)),
        reconnect_events=_rot_reconnect_events)


@_public()
def rotate_key(peers=None, topology=None, test=False, fresh=False, tgt="*", tgt_type="glob",
               restart_cmd=None, restart_wait=120, verify_wait=60, timeout=15):
    """
    Give every master a new master key without losing a minion, one master
    at a time: the peers (``multimaster:peers``), then this primary.  Each
    master's old keypair is kept in its protected backup
    (``<cachedir>/multimaster/backup/<timestamp>/master_keys``, 0400 in 0700
    dirs).  A master is rotated only once the previous one serves its new
    key, so at every moment the other masters answer.

    - topology ``signed``: each master generates its new key itself (the
      private key never leaves its host) and signs it with the shared
      master_sign key; minions with ``verify_master_pubkey_sign`` accept it.
    - topology ``shared``: the new shared keypair is generated here, reaches
      each peer sealed to its minion key, then every minion is told the new
      public key, then this master switches.

    Afterwards every targeted minion is audited (``multimaster.audit``) for
    the new key; those that do not confirm are listed by id with the exact
    remedy, and ``salt-run`` exits non-zero.  An unfinished rotation (a
    master that did not restart, a stopped minion) is resumed by running
    the same command again (its record: ``<cachedir>/multimaster/rotation.json``).

    peers
        Default ``multimaster:peers``.
    topology
        Default ``multimaster:topology``, else ``shared``.
    test
        Change nothing: the checks and the plan.
    fresh
        Forget an unfinished rotation and start a new one.
    tgt, tgt_type
        The minions to tell (shared) and audit; default every minion.
    restart_cmd
        How a master restarts (run on its host); default
        ``multimaster:master_restart_cmd``, else on a peer host its minion
        option ``multimaster.master_restart_cmd``, else the service manager
        (systemd on this primary), else the run stops with
        ``restart_required`` and the remedy.  A command whose program is
        not installed is refused before that master's key is written.
    restart_wait
        Seconds to wait for a restarted master to serve its new key (the
        primary's restart command exiting non-zero ends the wait at once).
    verify_wait
        Seconds to wait for minions to reconnect before they are listed.
    timeout
        Seconds for each call to the peers and minions.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.rotate_key test=True
        salt-run multimaster.rotate_key
        salt-run multimaster.rotate_key topology=signed --out=json
    """
    conf = __opts__.get("multimaster") if isinstance(__opts__.get("multimaster"), dict) else {}
    topology = topology or conf.get("topology") or "shared"
    restart_cmd = restart_cmd or conf.get("master_restart_cmd") or None
    try:
        configured = validate.as_list("multimaster:peers", conf.get("peers"))
        conf_peers = validate.as_list("peers", peers) or configured
        test = validate.boolean("test", test)
        fresh = validate.boolean("fresh", fresh)
        validate.peers(conf_peers, configured)
        waits = {k: validate.timeout(k, v, maximum=3600) for k, v in
                 (("restart_wait", restart_wait), ("verify_wait", verify_wait),
                  ("timeout", timeout))}
    except validate.InvalidInput as exc:
        return _rot_invalid(f"multimaster.rotate_key: {exc}")
    reason = rotation.unsupported(__opts__, topology)
    if reason:
        return _rot_invalid(f"multimaster.rotate_key: {__opts__['id']}: {reason}")
    if restart_cmd is not None and not isinstance(restart_cmd, str):
        return _rot_invalid(f"multimaster.rotate_key: restart_cmd must be a command, "
                            f"not {restart_cmd!r}")
    # the same command restarts this primary last: refused before any master is touched
    why = restart.impossible(restart_cmd, "salt-master", runs="salt-master") \
        if restart_cmd else None
    if why:
        return _rot_invalid(f"multimaster.rotate_key: {__opts__['id']}: {why}")
    if not conf_peers:
        return _rot_invalid("multimaster.rotate_key: no peers: set multimaster:peers or pass "
                            "peers=")
    rot = rotation_steps.Rotation(_rot_salt(), topology, conf_peers, restart_cmd, tgt, tgt_type,
                                  **waits)
    ret = rot.check(fresh, test)
    if ret["result"] and not test:
        try:
            with lock.SyncLock(os.path.join(rot.state_dir, lock.LOCK_NAME),
                               globals().get("__jid__"), wait=0):
                ret = rot.run(ret)
        except lock.Busy as exc:
            return _rot_invalid(f"multimaster.rotate_key: {exc}")
    if not ret["result"]:
        ret["retcode"] = 1
    return ret


# ---------------------------------------------------------------------------
# The outage (salt-run multimaster.failback): the Salt side of the steps in
# salt_multimaster.failback.
# ---------------------------------------------------------------------------
def _out_collect(peer, items, timeout):
    """``(reply, error)`` of ``multimaster_peer.collect``: contents sealed to this master's key."""
    with open(layout.master_key_files(__opts__, "shared")[1], encoding="utf-8") as fh:
        reply_pub = fh.read()
    conf = _conf({})
    request = protocol.request("multimaster_peer.collect", items=items,
                               reply_to=__opts__["id"], reply_pub=reply_pub,
                               epoch=epochs.claim(__opts__, conf["peers"], conf["topology"]))
    return _Job([peer], "multimaster_peer.collect", request, timeout).replies()[peer]


def _out_unseal(blob, purpose):
    """Open what a peer sealed to this master's own key."""
    with open(layout.master_key_files(__opts__, "shared")[0], "rb") as fh:
        return seal.unseal(fh.read(), blob, __opts__["id"], purpose)


@_public("lock_wait")
def failback(peer=None, test=False, keep=None, verbose=False, **kwargs):
    """
    Carry to this primary what was changed on ``peer`` since its last sync
    (the primary down: keys accepted, rejected or deleted there, files of
    its roots edited, added or removed), then sync every peer, so that all
    masters agree and a plain ``multimaster.sync`` is clean again.

    The changes come from the peer sealed to this master's key and are
    written here as a sync writes a peer: validated, each checked against
    its sha256, confined to this master's pki_dir and roots, staged, what
    they replace or remove backed up in ``<cachedir>/multimaster/backup``.
    A key that leaves ``minions/`` makes this master rotate its AES session
    key, as ``salt-key -r/-d`` does.  Options the peer changed in its
    ``multimaster-sync.conf`` are named, not carried: set them in this
    master's config, or ``keep`` them.  Every step is reported; a second
    run finds nothing left to carry; an interrupted run converges when run
    again.

    peer
        One peer of ``multimaster:peers``.
    test
        Show what the peer changed and what would be carried; change nothing.
    keep
        ``primary`` to keep this master's side of every item (as a sync with
        ``force=True`` of that peer), or the items to keep it for, named as
        ``test=True`` shows them: a minion id, ``<saltenv>:<path>``, an
        option, or a category (``minion_keys``, ``file_roots``,
        ``pillar_roots``, ``master_config``).
    lock_wait
        Seconds to wait for a running sync (default 60).
    verbose
        In the compact report, list every name.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.failback peer=master02 test=True
        salt-run multimaster.failback peer=master02
        salt-run multimaster.failback peer=master02 keep=web09,base:app/init.sls
    """
    try:
        verbose = _flag("verbose", verbose)
    except SaltInvocationError as exc:
        return _invalid(f"multimaster.failback: {exc}")
    jid, event = _own_job("multimaster.failback")
    job = _Salt(event)
    try:
        ret = _failback(job, jid, peer, test, keep, **kwargs)
    finally:
        job.close()
    if ret.get("retcode"):
        __context__["retcode"] = ret["retcode"]
    if _compact("multimaster.failback"):
        return {"outputter": "txt", "data": report.failback_rows(ret, verbose)}
    return ret


def _failback(job, jid, peer, test, keep, **kwargs):
    lock_wait = kwargs.pop("lock_wait", None)
    try:
        test = _flag("test", test)
        if len(_as_list(peer, "peer")) != 1:
            raise SaltInvocationError("failback takes one peer: peer=<id of multimaster:peers>")
        conf = _conf(kwargs)
        _valid(validate.peers, _as_list(peer, "peer"), conf["peers"])
        membership.as_list(keep)
    except (SaltInvocationError, membership.MembershipError) as exc:
        return _invalid(f"multimaster.failback: {exc}")
    peer = _as_list(peer, "peer")[0]
    error = _validate(conf, [])
    bad = sync_core.peer_errors(__opts__, [peer])
    if error or bad:
        return _invalid(error or bad[peer])
    salt_ops = failback_core.SaltOps(
        __opts__, conf, job, collect=_out_collect, unseal=_out_unseal,
        rotate_aes=lambda: revocation.request_rotation(__opts__),
        sync_all=lambda: _run_rounds(job, conf, conf["replicate"]))
    try:
        if test:
            return failback_core.failback(salt_ops, peer, True, keep)
        with _sync_lock(lock_wait, jid) as busy:
            if busy:
                return busy
            transport.sweep_grants(__opts__, _Salt.jid_dir)
            return failback_core.failback(salt_ops, peer, False, keep)
    except outage.FailbackError as exc:
        return _invalid(f"multimaster.failback: {exc}")


@_public()
def promote(peers=None, test=False, address=None, tgt="*", tgt_type="glob", verbose=False,
            **kwargs):
    """
    Make this peer master the primary, when the primary is gone for good:
    its epoch record takes the next epoch with this master as the primary
    and the old one retired; the old primary's other peers become this
    master's ``multimaster:peers`` (``master.d/multimaster-peers.conf``) and
    are synced, so they record the new epoch.  From then on every master
    that knows it refuses a sync from the old primary: ``this master was
    promoted away from <old> at epoch N: run multimaster.failback on <new>
    instead``.  The minions whose config or cached pillar still list the
    old primary are named, with the pillar and top file changes for the
    formula (``multimaster:masters``, the new primary first).  A second
    run changes nothing and syncs the peers again.

    Run it on the peer to promote, with the old primary stopped for good.

    peers
        This master's peers (default: the old primary's, less this host).
    test
        Show the plan; change nothing.
    address
        How minions name the old primary (default: as its syncs said).
    tgt, tgt_type
        The minions whose master list is checked (default every minion).
    CLI Example:

    .. code-block:: bash

        salt-run multimaster.promote test=True
        salt-run multimaster.promote
    """
    try:
        verbose = _flag("verbose", verbose)
    except SaltInvocationError as exc:
        return _invalid(f"multimaster.promote: {exc}")
    try:
        test = _flag("test", test)
        salt_ops = membership_steps.SaltOps(__opts__, cmd=_member_cmd, minions=_member_minions,
                                            cached_pillars=_member_pillars, sync=sync)
        ret = promote_core.promote(
            salt_ops, test, None if peers is None else _as_list(peers, "peers"), address, tgt,
            tgt_type)
    except (SaltInvocationError, promote_core.PromoteError, membership.MembershipError) as exc:
        ret = _invalid(f"multimaster.promote: {exc}")
    if ret.get("retcode"):
        __context__["retcode"] = ret["retcode"]
    if _compact("multimaster.promote"):
        return {"outputter": "txt",
                "data": report.steps_rows(ret, f"{__opts__['id']} (epoch {ret.get('epoch')})",
                                          verbose)}
    return ret
