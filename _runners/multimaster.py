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

Keyword arguments of each function override it.
"""

import contextlib
import logging
import os
import time

from salt.exceptions import SaltInvocationError

log = logging.getLogger(__name__)

__virtualname__ = "multimaster"

try:
    import salt_multimaster

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
        import salt.utils.extmods  # pylint: disable=import-outside-toplevel

        synced = salt.utils.extmods.sync(__opts__, "utils")
        log.info("multimaster: synced utils for the runner: %s", synced)
        import importlib  # pylint: disable=import-outside-toplevel

        importlib.invalidate_caches()
        utils_dir = os.path.join(__opts__["extension_modules"], "utils")
        import sys  # pylint: disable=import-outside-toplevel

        if utils_dir not in sys.path:
            sys.path.append(utils_dir)
        importlib.import_module("salt_multimaster")
        HAS_CORE = True
    except Exception as exc:  # pylint: disable=broad-except
        log.debug("multimaster: core not importable: %s", exc)
    return HAS_CORE


def __virtual__():
    if _load_core():
        return __virtualname__
    return (
        False,
        "multimaster: the salt_multimaster core is missing; pip install "
        "salt-multimaster, or run 'salt-run saltutil.sync_all' with the "
        "repository in file_roots",
    )


def version():
    """
    Return the version of salt-multimaster and where this runner was loaded from.

    CLI Example:

    .. code-block:: bash

        salt-run multimaster.version
    """
    import salt_multimaster  # pylint: disable=import-outside-toplevel

    return {"version": salt_multimaster.__version__, "runner": __file__}


# ---------------------------------------------------------------------------
# Replication (salt-run multimaster.sync / multimaster.status)
# ---------------------------------------------------------------------------
_DEFAULT_TIMEOUT = 120
# Backups kept on each peer (the newest; each apply that replaced or removed
# anything makes one).
BACKUP_KEEP = 10


def _conf(kwargs):
    """The primary's ``multimaster`` config, overridden by runner kwargs."""
    from salt_multimaster import replicate  # pylint: disable=import-outside-toplevel

    conf = _valid(_checked_conf)
    configured = _as_list(conf.get("peers"))
    for key in ("peers", "topology", "replicate", "master_config_keys", "timeout", "inline_limit",
                "pull_min_files", "backup_keep"):
        if kwargs.get(key) is not None:
            conf[key] = kwargs[key]
    conf.setdefault("topology", "shared")
    conf.setdefault("replicate", list(replicate.CATEGORIES))
    conf.setdefault("master_config_keys", list(replicate.DEFAULT_CONFIG_KEYS))
    conf.setdefault("timeout", _DEFAULT_TIMEOUT)
    conf.setdefault("inline_limit", INLINE_LIMIT)
    conf.setdefault("pull_min_files", PULL_MIN_FILES)
    conf.setdefault("backup_keep", BACKUP_KEEP)
    conf["timeout"] = _valid(_checked_timeout, conf["timeout"])
    for key in ("inline_limit", "pull_min_files", "backup_keep"):
        try:
            conf[key] = int(conf[key])
        except (TypeError, ValueError):
            raise SaltInvocationError(f"{key} must be an integer, not {conf[key]!r}") from None
    for key in ("peers", "replicate", "master_config_keys"):
        conf[key] = _as_list(conf.get(key))
    _valid(_checked_targets, conf, configured)
    conf["rescan"] = _valid(_checked_bool, "rescan", kwargs.get("rescan"))
    return conf


# Keyword arguments of sync and status besides their named parameters.
_CONF_KWARGS = ("rescan", "topology", "replicate", "master_config_keys", "timeout",
                "inline_limit", "pull_min_files", "backup_keep")


def _valid(check, *args):
    """Run a ``salt_multimaster.validate`` check; bad input as SaltInvocationError."""
    from salt_multimaster import validate  # pylint: disable=import-outside-toplevel

    try:
        return check(validate, *args)
    except validate.InvalidInput as exc:
        raise SaltInvocationError(str(exc)) from None


def _checked_conf(validate):
    return validate.conf_mapping(__opts__.get("multimaster"))


def _checked_timeout(validate, value):
    import math  # pylint: disable=import-outside-toplevel

    return int(math.ceil(validate.timeout("timeout", value)))


def _checked_bool(validate, name, value):
    return validate.boolean(name, value)


def _checked_targets(validate, conf, configured):
    """Only configured peers receive secrets; only shared policy options travel."""
    validate.peers(conf["peers"], configured)
    validate.config_keys(conf["master_config_keys"])


def _checked_args(validate, fun, kwargs, minion_ids=None, only=None):
    validate.known_kwargs(kwargs, _CONF_KWARGS, fun)
    if only is not None and not _as_list(only):
        raise validate.InvalidInput(
            f"only is empty ({only!r}): name the categories to sync, or leave only out")
    if minion_ids is not None and not _as_list(minion_ids):
        raise validate.InvalidInput(
            f"minion_ids is empty ({minion_ids!r}): name the minions whose keys to sync, "
            "or leave minion_ids out for a full sync")


def _as_list(value):
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, (list, tuple, set)):
        return [str(v) for v in value]
    return [str(value)]


def _invalid(message):
    log.error("multimaster: %s", message)
    __context__["retcode"] = 1
    return {"result": False, "error": message, "retcode": 1}


def _validate(conf, only):
    """Return an error message for bad input, or None."""
    from salt_multimaster import layout, replicate  # pylint: disable=import-outside-toplevel

    if conf["topology"] not in layout.TOPOLOGIES:
        return f"unknown topology {conf['topology']!r} (known: {', '.join(layout.TOPOLOGIES)})"
    for cat in only + conf["replicate"]:
        if cat not in replicate.CATEGORIES:
            return f"unknown category {cat!r} (known: {', '.join(replicate.CATEGORIES)})"
    if not conf["peers"]:
        from salt_multimaster import protocol  # pylint: disable=import-outside-toplevel

        dropin = protocol.dropin_path(__opts__) if __opts__.get("conf_file") else None
        if dropin and os.path.isfile(dropin):
            return (f"this master is a peer: it holds {dropin}, written by a primary's "
                    "multimaster.sync; run salt-run multimaster.sync on the primary")
        return "no peers: set multimaster:peers in the master config or pass peers=..."
    return None


def _peer_errors(peers):
    """Per-peer input errors: invalid id, or not an accepted minion of the primary."""
    from salt_multimaster import manifest  # pylint: disable=import-outside-toplevel

    errors = {}
    for peer in peers:
        if not manifest.valid_minion_id(peer):
            errors[peer] = f"invalid peer id {peer!r}"
        elif not os.path.isfile(os.path.join(__opts__["pki_dir"], "minions", peer)):
            pending = os.path.isfile(os.path.join(__opts__["pki_dir"], "minions_pre", peer))
            errors[peer] = (
                f"peer {peer!r} is not an accepted minion of this master: "
                + (f"its key is pending, accept it: salt-key -a {peer}" if pending else
                   "start the peer host's salt-minion with this master in its master list, "
                   f"then accept its key: salt-key -a {peer}")
            )
    return errors


def _state_dir():
    from salt_multimaster import layout  # pylint: disable=import-outside-toplevel

    return layout.state_dir(__opts__)


def _saved_state(categories):
    """
    The keys snapshot's digests and the saved roots manifests, as the last
    sync read them: ``({category: digests}, {category: SavedManifest})``.
    No key or file is looked at.
    """
    from salt_multimaster import manifest  # pylint: disable=import-outside-toplevel

    digests, saved = {}, {}
    for cat in categories:
        if cat == "minion_keys":
            digest = manifest.KeysSnapshot.saved_digest(__opts__["pki_dir"], _state_dir())
        elif cat in ("file_roots", "pillar_roots"):
            saved[cat] = manifest.SavedManifest(_state_dir(), cat)
            digest = saved[cat].digest
        else:
            continue
        if digest is not None:
            digests[cat] = digest
    return digests, saved


def _primary_state(conf, categories, saved=None):
    """
    The primary's manifests, and the contents they describe, on demand.
    ``saved``: the roots manifests of the last read (:func:`_saved_state`),
    kept as each category's ``previous`` and replaced by this read.
    """
    from salt_multimaster import manifest, replicate  # pylint: disable=import-outside-toplevel

    cache_dir = _state_dir()
    saved = saved or {}
    errors, state = [], {}
    started = time.monotonic()
    roots, roots_errors = manifest.read_roots(__opts__, categories, cache_dir,
                                              rescan=conf["rescan"])
    if conf["rescan"] and "file_roots" in categories:
        # Salt's fileserver trusts unchanged mtimes too: else a peer fetching
        # a file rewritten behind them is told the old hash and keeps its copy
        manifest.forget_fileserver_hashes(__opts__["cachedir"])
    log.debug("multimaster: roots read in %.3f s", time.monotonic() - started)
    for cat in categories:
        started = time.monotonic()
        if cat == "minion_keys":
            # no per-key work while no key dir changed
            snap = manifest.KeysSnapshot(__opts__["pki_dir"], cache_dir, rescan=conf["rescan"])
            errors.extend(snap.errors)
            state[cat] = {"snapshot": snap, "digest": snap.digest, "counts": snap.counts,
                          "previous": snap.previous_parts(), "damaged": snap.damaged}
        elif cat in roots:
            man = roots[cat]
            errors.extend(roots_errors[cat])
            parts = manifest.split(cat, man)
            # digests and the saved manifest describe a peer in step: modes
            # less the bits a sync never writes (the plan warns of those)
            digest = manifest.bucket_digests(replicate.safe_parts(parts))
            last = saved.get(cat) or manifest.SavedManifest(cache_dir, cat)
            state[cat] = {"manifest": man, "parts": parts, "digest": digest,
                          "previous": (last.digest, last.parts) if last.digest else None,
                          "damaged": manifest.damaged_sources(roots_errors[cat])}
            last.save(replicate.safe_tree(man), digest)
        elif cat == "master_keys":
            pem, pub = _primary_master_key_files(conf["topology"])
            state[cat] = {
                "files": {"pem": pem, "pub": pub},
                "manifest": {"pem": _sha(pem), "pub": _sha(pub)},
            }
        elif cat == "master_config":
            state[cat] = {"manifest": {k: __opts__.get(k) for k in conf["master_config_keys"]}}
        log.debug("multimaster: %s read in %.3f s", cat, time.monotonic() - started)
    state["errors"] = [str(e) for e in errors]
    state["damaged"] = _damaged_messages(state, categories)
    return state


def _damaged_messages(state, categories):
    """
    One line per key or roots file that exists on the primary but cannot be
    read or used: the peer's copy is kept, and the sync fails for it.
    """
    lines = []
    for cat in categories:
        for where, names in sorted(((state.get(cat) or {}).get("damaged") or {}).items()):
            for name in sorted(names):
                sep = "/" if cat == "minion_keys" else ":"
                lines.append(f"{cat} {where}{sep}{name}: damaged or unreadable on the primary")
    return lines


def _sha(path):
    from salt_multimaster import manifest  # pylint: disable=import-outside-toplevel

    try:
        return manifest.sha256_file(path)
    except OSError:
        return None


def _primary_master_key_files(topology):
    from salt_multimaster import layout  # pylint: disable=import-outside-toplevel

    return layout.master_key_files(__opts__, topology)


def _client():
    import salt.client  # pylint: disable=import-outside-toplevel

    return salt.client.LocalClient(mopts=__opts__)


def _publish(peers, fun, kwarg, timeout):
    """Call ``fun`` on the peers' minions; return ``{peer: ret}`` for those that returned."""
    return _Job(peers, fun, kwarg, timeout).wait()


def _progress(message, **data):
    """
    Fire ``salt/multimaster/sync/progress`` on the master event bus (not the
    runner's own tag, which ``salt-run`` would print into its output).
    """
    import salt.utils.event  # pylint: disable=import-outside-toplevel

    data["message"] = message
    try:
        with salt.utils.event.get_master_event(
            __opts__, __opts__["sock_dir"], listen=False
        ) as event:
            event.fire_event(data, "salt/multimaster/sync/progress")
    except Exception as exc:  # pylint: disable=broad-except
        log.debug("multimaster: progress event not fired: %s", exc)


def _inventories(conf, categories, peers, test):
    """
    The primary's state and every peer's inventory.  The inventory publish
    carries the digests of the primary's last read and goes out first; the
    primary reads its state while the peers answer.  A peer in step answers
    with digests only; for a bucket the primary changed since, the peer's
    content is the primary's previous one (:func:`_plan`).  A peer that
    cannot be planned so (no previous state) is asked again with the current
    digests.  Returns ``(primary, {peer: inventory return})``.
    """
    digests, saved = _saved_state(categories)
    kwarg = {"categories": categories, "digests": digests, "topology": conf["topology"],
             "config_keys": conf["master_config_keys"], "test": test}
    if conf["rescan"]:
        kwarg["rescan"] = True
    if set(digests) != set(categories) & {"minion_keys", "file_roots", "pillar_roots"}:
        # nothing saved yet (first sync): a peer in step would detail everything
        primary = _primary_state(conf, categories, saved)
        kwarg["digests"] = {c: primary[c]["digest"] for c in categories if "digest" in primary[c]}
        return primary, _publish(peers, "multimaster_peer.inventory", kwarg, conf["timeout"])
    job = _Job(peers, "multimaster_peer.inventory", kwarg, conf["timeout"])
    try:
        primary = _primary_state(conf, categories, saved)
    finally:
        invs = job.wait()
    current = {c: primary[c]["digest"] for c in categories if "digest" in primary[c]}
    again = [peer for peer in peers
             if _unplannable(categories, primary, (invs.get(peer) or {}).get("ret"), digests)]
    if again:
        log.info("multimaster: asking %s again with the current digests", ", ".join(again))
        for peer in again:
            invs.pop(peer, None)
        invs.update(_Job(again, "multimaster_peer.inventory",
                         dict(kwarg, digests=current), conf["timeout"]).wait())
    return primary, invs


def _stale(cat, primary, theirs):
    """
    The buckets where the peer differs from the primary now, and among them
    those the peer did not detail: it holds them as the digests sent to it.
    """
    from salt_multimaster import manifest  # pylint: disable=import-outside-toplevel

    need = manifest.differing(primary[cat]["digest"], theirs.get("digest") or {})
    detailed = set(theirs.get("buckets") or [])
    return need, [b for b in need if b not in detailed]


def _unplannable(categories, primary, inv, sent):
    """
    Whether the peer holds, as ``sent``, buckets the primary changed since
    and whose previous content it lost (or holds otherwise: each bucket is
    checked against the digest sent).
    """
    from salt_multimaster import manifest  # pylint: disable=import-outside-toplevel

    if not isinstance(inv, dict):
        return False
    for cat in categories:
        theirs = inv.get(cat)
        if cat not in ("minion_keys", "file_roots", "pillar_roots") or not isinstance(theirs, dict):
            continue
        _, stale = _stale(cat, primary, theirs)
        if not stale:
            continue
        previous = primary[cat].get("previous")
        if previous is None:
            return True
        parts = previous[1]()
        held = manifest.bucket_digests({b: parts[b] for b in stale if b in parts})
        if any(held.get(b) != (sent.get(cat) or {}).get(b) for b in stale):
            return True
    return False


# How a peer's job is tracked: after JOB_POLL seconds without a return, Salt's
# find_job asks the peer every GATHER_TIMEOUT seconds whether it still runs it.
JOB_POLL = 2
GATHER_TIMEOUT = 3


class _Job:
    """
    A publish to the peers whose returns are read later: the caller works
    meanwhile.  The keyword arguments are sealed to each peer
    (:mod:`salt_multimaster.protocol`): the publish reaches every minion.
    """

    def __init__(self, peers, fun, kwarg, timeout):
        from salt_multimaster import protocol  # pylint: disable=import-outside-toplevel

        self.peers = list(peers)
        self.timeout = timeout
        sealed = protocol.sealed_kwarg({peer: _peer_pub(peer) for peer in self.peers}, fun, kwarg)
        self.client = _client()
        self.was_listening = self.client.event.cpub
        try:
            self.pub = self.client.run_job(self.peers, fun, kwarg=sealed, tgt_type="list",
                                           timeout=timeout, listen=True)
        except BaseException:
            self.close()
            raise

    def wait(self):
        """
        ``{peer: full return}`` of the peers that returned.  The peers' job is
        tracked with ``saltutil.find_job`` as Salt's own CLI does, every
        :data:`GATHER_TIMEOUT` seconds: a peer that is not connected, or whose
        minion dies while it works, is given up within seconds, whatever the
        size of the sync; one still running is waited for up to the timeout.
        """
        try:
            ret = {}
            if self.pub:
                deadline = time.monotonic() + self.timeout
                # expect_minions=False: the caller reports missing peers
                # itself; Salt would otherwise list every accepted key after
                # the returns (~2 s at 20,000 keys, bench/bench_sync.py)
                for fn_ret in self.client.get_iter_returns(
                        self.pub["jid"], set(self.pub["minions"]), timeout=JOB_POLL,
                        tgt=self.peers, tgt_type="list", expect_minions=False, block=False,
                        gather_job_timeout=GATHER_TIMEOUT):
                    if fn_ret:
                        for mid, data in fn_ret.items():
                            ret[mid] = data
                    elif time.monotonic() > deadline:
                        break
                    else:
                        time.sleep(0.02)
            return ret
        finally:
            self.close()

    def close(self):
        if not self.was_listening:
            self.client.event.close_pub()
        self.client.destroy()


def _parts(entry):
    """The bucket parts of a category of :func:`_primary_state`."""
    return entry["snapshot"].parts if "snapshot" in entry else entry["parts"]


def _peer_buckets(cat, primary, theirs):
    """
    The buckets where the peer differs from the primary now, with the peer's
    manifest and key history there: as the peer detailed them where it
    differs from the digests sent to it, else the primary's previous state
    (which it holds: checked by :func:`_unplannable`).
    """
    from salt_multimaster import manifest  # pylint: disable=import-outside-toplevel

    need, stale = _stale(cat, primary, theirs)
    peer_man = manifest.restrict(cat, theirs.get("manifest") or {}, need)
    history = list(theirs.get("history") or [])
    if stale:
        old = manifest.merge(primary[cat]["previous"][1](), stale)
        for outer, entries in old.items():
            peer_man.setdefault(outer, {}).update(entries)
        if cat == "minion_keys":
            # a peer in step with the primary received every id it holds from it
            history.extend(mid for entries in old.values() for mid in entries)
    return need, peer_man, history


def _plan(conf, categories, primary, inv, force):
    """Operations and report for one peer from its inventory."""
    from salt_multimaster import replicate  # pylint: disable=import-outside-toplevel

    ops, report = {}, {}
    for cat in categories:
        theirs = inv.get(cat) or {}
        if cat in ("minion_keys", "file_roots", "pillar_roots"):
            # only the buckets where the peer differs are compared
            from salt_multimaster import manifest  # pylint: disable=import-outside-toplevel

            need, peer_man, history = _peer_buckets(cat, primary, theirs)
            mine = manifest.merge(_parts(primary[cat]), need) if need else {}
            damaged = primary[cat].get("damaged")
            if cat == "minion_keys":
                cat_ops, rep = replicate.plan_keys(mine, peer_man, history, force, damaged=damaged)
            else:
                cat_ops, rep = replicate.plan_tree(
                    mine, peer_man, theirs.get("envs"), primary_envs=primary[cat]["manifest"],
                    damaged=damaged)
        elif cat == "master_keys":
            cat_ops, rep = replicate.plan_master_keys(
                primary[cat]["manifest"], theirs, conf["topology"])
        else:
            cat_ops, rep = replicate.plan_master_config(primary[cat]["manifest"], theirs)
        rep["errors"].extend(theirs.get("errors") or [])
        ops[cat], report[cat] = cat_ops, rep
    return ops, report


# Contents up to this size ride in the apply publish (sealed where secret);
# larger ones are pulled by the peer over the request channel (peer_run).
INLINE_LIMIT = 64 * 1024
# Past this many file_roots files (or bytes), the peer pulls them in bulk
# instead of fetching each from the fileserver.
PULL_MIN_FILES = 100
PULL_MIN_BYTES = 4 * 1024 * 1024
PULL_TTL = 600
# A sealed master key pair in an apply request (a 4096-bit PEM, base64).
MASTER_KEY_WEIGHT = 4096


def _pull_allowed(peer):
    """True when this master's peer_run lets ``peer`` call multimaster.pull."""
    from salt_multimaster import protocol  # pylint: disable=import-outside-toplevel

    return protocol.pull_allowed(__opts__.get("peer_run"), peer)


def _peer_pub(peer):
    """The peer minion's public key, as accepted on this master."""
    with open(os.path.join(__opts__["pki_dir"], "minions", peer), encoding="utf-8") as fh:
        return fh.read()


def _content_path(cat, op):
    from salt_multimaster import manifest  # pylint: disable=import-outside-toplevel

    if cat == "minion_keys":
        return os.path.join(__opts__["pki_dir"], op["state"], op["id"])
    return manifest.locate(__opts__[cat][op["env"]], op["rel"])


def _transport(peer, ops, inline_limit, pull_min_files=None):
    """
    How the apply of ``ops`` reaches ``peer``, decided the same way in test
    mode: ``{"mode": "inline"|"pull"|None, "pull_files": bool, "size": bytes,
    "error": message or None}``.

    The operations and the contents of minion keys, pillar files and master
    keys ride the apply publish, sealed to the peer, only up to
    ``inline_limit`` bytes.  Past it, or past ``pull_min_files`` file_roots
    files (or 4 MiB of them), the peer pulls them point-to-point through
    ``peer_run`` (``multimaster.pull``).  A peer that may not pull is refused
    (``error``, with the ``peer_run`` snippet to add): bulk never rides the
    publish, which every minion receives.  Otherwise file_roots files come
    from this master's fileserver, point-to-point too.
    """
    from salt_multimaster import protocol  # pylint: disable=import-outside-toplevel

    pullable = _pull_allowed(peer)
    files = [op for op in ops.get("file_roots", []) if op["op"] == "write"]
    pull_files = pullable and (
        len(files) > (PULL_MIN_FILES if pull_min_files is None else pull_min_files)
        or sum(op.get("size", 0) for op in files) > PULL_MIN_BYTES)
    size = protocol.payload_size(ops)
    for cat in ("master_keys", "minion_keys", "pillar_roots"):
        for op in ops.get(cat, []):
            if size > inline_limit and pullable:
                break  # enough to decide (a stat per key of an initial sync: 0.16 s)
            if op["op"] != "write":
                continue
            if cat == "master_keys":
                size += MASTER_KEY_WEIGHT
                continue
            try:
                # sealed contents travel base64-encoded
                size += 4 * (op["size"] if "size" in op
                             else os.path.getsize(_content_path(cat, op))) // 3
            except (OSError, TypeError, KeyError):
                pass
    if size <= inline_limit and not pull_files:
        return {"mode": "inline", "pull_files": False, "size": size, "error": None}
    if pullable:
        return {"mode": "pull", "pull_files": pull_files, "size": size, "error": None}
    return {"mode": None, "pull_files": False, "size": size,
            "error": protocol.refusal(peer, size, inline_limit)}


def _attach_contents(peer, ops, primary, how):
    """
    Fill write operations with their contents, as :func:`_transport`
    decided (``how``).  Private keys and pillar files are sealed to the
    peer's minion key (inside the sealed request as well); pulled contents
    are cut in chunks.  Return the chunks the peer pulls, or None.
    """
    from salt_multimaster import replicate, seal  # pylint: disable=import-outside-toplevel

    peer_pub = _peer_pub(peer)
    chunks = None
    if how["mode"] == "pull":
        bulk_cats = ("minion_keys", "pillar_roots") + (("file_roots",) if how["pull_files"] else ())
        chunks = replicate.assign_chunks(
            [(cat, op) for cat in bulk_cats for op in ops.get(cat, []) if op["op"] == "write"])
    for cat, cat_ops in ops.items():
        for op in cat_ops:
            if op["op"] != "write" or "pull" in op or cat == "file_roots":
                continue
            if cat in ("minion_keys", "pillar_roots"):
                with open(_content_path(cat, op), "rb") as fh:
                    data = fh.read()
                if cat == "minion_keys":
                    op["data"] = data.decode()
                else:
                    op["sealed"] = seal.seal(peer_pub, data, peer, replicate.item_name(cat, op))
            elif cat == "master_keys":
                with open(primary[cat]["files"][op["kind"]], "rb") as fh:
                    data = fh.read()
                if op["kind"] == "pem":
                    op["sealed"] = seal.seal(peer_pub, data, peer, f"master_keys/{op['name']}")
                else:
                    op["data"] = data.decode()
    return chunks


def _grant(peer, ops, chunks):
    """
    Let ``peer`` pull, for ten minutes, the operations of its sync and the
    contents cut in ``chunks``; return the token naming the grant.
    """
    import json  # pylint: disable=import-outside-toplevel
    import secrets  # pylint: disable=import-outside-toplevel
    import time  # pylint: disable=import-outside-toplevel

    from salt_multimaster import fsutil  # pylint: disable=import-outside-toplevel

    token = secrets.token_hex(16)
    pull_dir = os.path.join(__opts__["cachedir"], "multimaster", "pull")
    fsutil.makedirs(pull_dir, mode=0o700)
    grant = {"peer": peer, "expires": time.time() + PULL_TTL, "ops": ops, "chunks": chunks}
    fsutil.atomic_write(os.path.join(pull_dir, token), json.dumps(grant), mode=0o600)
    return token


def _revoke(token):
    """
    End a pull grant, and drop from the job cache (local_cache) the sealed
    chunks its pulls stored there: tens of MiB each, kept ``keep_jobs``
    hours otherwise.
    """
    import shutil  # pylint: disable=import-outside-toplevel

    import salt.utils.jid  # pylint: disable=import-outside-toplevel

    base = os.path.join(__opts__["cachedir"], "multimaster", "pull", token)
    try:
        with open(f"{base}.jids", encoding="utf-8") as fh:
            jids = [line.strip() for line in fh if line.strip().isdigit()]
    except OSError:
        jids = []
    if __opts__.get("master_job_cache", "local_cache") == "local_cache":
        jobs = os.path.join(__opts__["cachedir"], "jobs")
        for jid in jids:
            shutil.rmtree(salt.utils.jid.jid_dir(jid, jobs, __opts__["hash_type"]),
                          ignore_errors=True)
    for path in (base, f"{base}.jids"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


@contextlib.contextmanager
def _job_record(fun, tgt, arg):
    """
    Save this job's record naming its one target (``salt_multimaster.jobs``)
    in a thread while the job runs; saved before the job returns, so before
    Salt stores the job.
    """
    from salt_multimaster import jobs  # pylint: disable=import-outside-toplevel

    thread = jobs.record_in_thread(__opts__, globals().get("__jid__"), fun, tgt, arg)
    try:
        yield
    finally:
        thread.join()


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
    with _job_record("multimaster.pull", caller, [f"request={request}"]):
        return _pull(request, caller, globals().get("__jid__"))


def _pull(request, caller, jid):
    import base64  # pylint: disable=import-outside-toplevel
    import json  # pylint: disable=import-outside-toplevel
    import time  # pylint: disable=import-outside-toplevel

    import msgpack  # pylint: disable=import-outside-toplevel

    from salt_multimaster import seal  # pylint: disable=import-outside-toplevel

    try:
        req = json.loads(base64.urlsafe_b64decode(request + "=" * (-len(request) % 4)))
        token, index = str(req["token"]), int(req["chunk"])
        if not token.isalnum() or index < 0:
            raise ValueError("bad token or chunk")
        with open(os.path.join(__opts__["cachedir"], "multimaster", "pull", token), encoding="utf-8") as fh:
            grant = json.load(fh)
        items = grant["chunks"][index]
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return {"error": "unknown or malformed pull request"}
    if grant["peer"] != caller or grant["expires"] < time.time():
        log.warning("multimaster: pull refused for %s", caller)
        return {"error": f"no pull grant for {caller}"}
    contents, missing = {}, []
    for item in items:
        cat, rest = item.split("/", 1)
        op = ({"state": rest.split("/", 1)[0], "id": rest.split("/", 1)[1]} if cat == "minion_keys"
              else {"env": rest.split("/", 1)[0], "rel": rest.split("/", 1)[1]})
        try:
            with open(_content_path(cat, op), "rb") as fh:
                contents[item] = fh.read()
        except (OSError, TypeError, KeyError):
            missing.append(item)
    reply = {"contents": contents, "missing": missing}
    if index == 0:
        reply["ops"] = grant["ops"]
    if jid:
        # the sync drops this job's stored return (the sealed chunk) from the
        # job cache once the peer has applied it
        with open(os.path.join(__opts__["cachedir"], "multimaster", "pull", f"{token}.jids"),
                  "a", encoding="utf-8") as fh:
            fh.write(f"{jid}\n")
    peer_pub = _peer_pub(caller)
    # msgpack itself, not salt.payload: Salt's loads turns UTF-8 bytes into str
    sealed = seal.seal(peer_pub, msgpack.packb(reply, use_bin_type=True), caller,
                       f"pull/{token}", binary=True)
    # the master prints each runner return it serves with the outputter the
    # return names; no_return (built in, like nested) prints "sealed:" and
    # skips the value, where nested would decode tens of MiB of ciphertext
    return {"outputter": "no_return", "data": {"sealed": sealed}}


def _merge(report, applied):
    """Take out of the planned lists the items the peer reports as failed."""
    for cat, rep in applied.items():
        if cat not in report or not isinstance(rep, dict):
            continue
        errors, failed = rep.get("errors"), rep.get("failed")
        if isinstance(errors, list):
            report[cat]["errors"].extend(errors)
        elif errors:
            report[cat]["errors"].append(f"peer errors not readable: {str(errors)[:200]}")
        if not isinstance(failed, list):
            if failed:
                report[cat]["errors"].append("the peer's list of failed items was trimmed")
            continue
        failed = set(failed)
        for kind in ("added", "updated", "removed"):
            report[cat][kind] = [
                item for item in report[cat][kind] if _applied_name(cat, item) not in failed
            ]


def _applied_name(cat, item):
    from salt_multimaster import protocol  # pylint: disable=import-outside-toplevel

    return item if cat != "master_config" else protocol.DROPIN_NAME


def _no_reply(peer, what, got):
    """Why ``peer`` gave no usable reply to ``what``, and what to do."""
    if got is None:
        return (f"{peer}'s salt-minion did not answer {what} (it is not connected to this "
                f"master, or it stopped while working): start it, or check `salt-run "
                f"manage.status`")
    return (f"{peer} returned no {what}: {str(got)[:300]} (is salt-multimaster installed "
            f"there, and multimaster.master_config set on its minion?)")


def _unconfirmed(ret, categories):
    """
    A peer that did not apply: move what was planned out of the lists of
    changes (which name only what the peer confirmed) into ``unconfirmed``.
    """
    for cat in categories:
        rep = ret.get(cat)
        if not isinstance(rep, dict):
            continue
        items = [item for kind in ("added", "updated", "removed") for item in rep[kind]]
        for kind in ("added", "updated", "removed"):
            rep[kind] = []
        if items:
            rep["unconfirmed"] = items


def _sync_one(peer, conf, categories, primary, inv, test, force):
    from salt_multimaster import protocol  # pylint: disable=import-outside-toplevel

    ops, report = _plan(conf, categories, primary, inv, force)
    ops = {c: o for c, o in ops.items() if o}
    ret = {"result": True}
    ret.update(report)
    how = _transport(peer, ops, conf["inline_limit"], conf["pull_min_files"]) if ops else None
    if how and how["error"]:
        ret["result"] = False
        ret["error"] = how["error"]
        if not test:
            _unconfirmed(ret, categories)
        return ret
    if ops and not test:
        chunks = _attach_contents(peer, ops, primary, how)
        kwarg = {"ops": ops, "topology": conf["topology"], "backup_keep": conf["backup_keep"]}
        token = None
        if chunks is not None:
            # the operations travel with the first chunk, pulled point-to-point
            token = _grant(peer, ops, chunks)
            kwarg.update(ops=None, pull_token=token, pull_chunks=len(chunks))
        # a large apply (an initial sync) takes longer than an inventory:
        # allow for 10 operations a second on top of the timeout
        wait = conf["timeout"] + sum(len(o) for o in ops.values()) // 10
        try:
            rets = _publish([peer], "multimaster_peer.apply", kwarg, wait)
        finally:
            if token:
                _revoke(token)
        applied = rets.get(peer)
        applied = applied.get("ret") if isinstance(applied, dict) else None
        mismatch = protocol.reply_error(applied)
        if mismatch or not isinstance(applied, dict) or "backup" not in applied:
            ret["result"] = False
            ret["error"] = mismatch or _no_reply(peer, "the apply", applied)
            _unconfirmed(ret, categories)
            return ret
        _merge(report, applied)
        for key in ("restart", "backup"):
            if applied.get(key):
                ret[key] = applied[key]
    if inv.get("restart_pending") and not ret.get("restart"):
        # keys or config written by an earlier sync, and the master not restarted since
        ret["restart"] = "restart_required"
    if inv.get("master_running") is False:
        # synced, yet no replica in service: say so, and fail the run
        from salt_multimaster import daemon  # pylint: disable=import-outside-toplevel

        ret["error"] = daemon.not_running_error(peer, inv.get("master_address"))
    return _verdict(peer, ret, categories)


def _verdict(peer, ret, categories):
    """
    ``result`` False, and one ``error`` line saying why, whenever the peer is
    not a replica in service after the run: errors, conflicts left, a
    restart still required, its master down.
    """
    reasons = [ret["error"]] if ret.get("error") else []
    errors = sum(len(ret[c]["errors"]) for c in categories if isinstance(ret.get(c), dict))
    conflicts = sum(len(ret[c]["conflicts"]) for c in categories if isinstance(ret.get(c), dict))
    if errors and not reasons:
        reasons.append(f"{errors} item(s) failed (see errors)")
    if conflicts:
        reasons.append(f"{conflicts} conflict(s) left on {peer} (see conflicts; force=True "
                       "replaces or removes them)")
    if ret.get("restart") == "restart_required":
        reasons.append(f"{peer}'s salt-master must restart to load the new master keys or "
                       "config (no service manager restarted it): restart it")
    if reasons:
        ret["result"] = False
        ret["error"] = "; ".join(reasons)
    return ret


# Past this many ids a targeted key sync is a full minion_keys sync.
MAX_TARGETED_IDS = 200


def _sync_ids(conf, peers, ids, test, force):
    """
    Mirror the keys of ``ids`` only: one publish to every peer carrying the
    primary's keys of these ids; each peer plans and applies them itself.
    """
    from salt_multimaster import manifest, protocol  # pylint: disable=import-outside-toplevel

    errors = []
    state = manifest.keys_state(__opts__["pki_dir"], ids, errors=errors)
    keys = {mid: {} for mid in ids}
    for key_state, entries in state.items():
        for mid in entries:
            path = os.path.join(__opts__["pki_dir"], key_state, mid)
            try:
                with open(path, encoding="utf-8") as fh:
                    data = fh.read()
            except (OSError, UnicodeDecodeError) as exc:
                errors.append(manifest.Damaged(f"{key_state}/{mid}: unreadable: {exc}", mid,
                                               key_state))
                continue
            keys[mid][key_state] = {"sha256": manifest.key_sha(data.encode()), "data": data}
    # a key that exists here but cannot be read is not a deletion: its id is
    # left out, and the peer keeps what it holds
    damaged = sorted({mid for names in manifest.damaged_sources(errors).values() for mid in names})
    for mid in damaged:
        keys.pop(mid, None)
    errors = [str(e) for e in errors]
    if not keys:
        # every id asked is damaged here: nothing to send, each peer keeps its copy
        from salt_multimaster import replicate  # pylint: disable=import-outside-toplevel

        return {peer: {"result": False, "minion_keys": replicate.empty_report(),
                       "primary_errors": errors,
                       "error": "damaged or unreadable on the primary, the peer's copy kept: "
                                + ", ".join(damaged)}
                for peer in peers}
    if protocol.payload_size(keys) > conf["inline_limit"]:
        return None  # too large to publish, even sealed: a full minion_keys sync
    rets = _publish(peers, "multimaster_peer.mirror_keys",
                    {"keys": keys, "force": force, "test": test}, conf["timeout"])
    ret = {}
    for peer in peers:
        got = rets.get(peer)
        rep = got.get("ret") if isinstance(got, dict) else None
        mismatch = protocol.reply_error(rep)
        if mismatch:
            ret[peer] = {"result": False, "error": mismatch}
            continue
        if not isinstance(rep, dict) or "conflicts" not in rep:
            ret[peer] = {"result": False, "error": _no_reply(peer, "the key sync", rep)}
            continue
        backup = rep.pop("backup", None)
        rep.pop("protocol", None)
        ret[peer] = {"result": True, "minion_keys": rep}
        if backup:
            ret[peer]["backup"] = backup
        if errors:
            ret[peer]["primary_errors"] = errors
        if damaged:
            ret[peer]["error"] = ("damaged or unreadable on the primary, the peer's copy kept: "
                                  + ", ".join(damaged))
        _verdict(peer, ret[peer], ["minion_keys"])
    return ret


def _compact(fun):
    """
    True when salt-run itself runs ``fun`` and the user chose no outputter
    (no ``--out``, no ``output`` in the config): print the compact report.
    Calls from the reactor, the scheduler or the API get the data.
    """
    return not __opts__.get("output") and __opts__.get("fun") == fun


def _truthy(value):
    return bool(value) and str(value).lower() not in ("false", "0", "no")


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
        Sync the keys of these minions only (implies ``only=minion_keys``): one
        publish instead of an inventory and an apply, and no listing of every
        key.  The ``salt/key`` reactor passes the ids of its events.  Past
        200 ids, a full ``minion_keys`` sync runs instead.
    rescan
        List and stat every key dir on the primary and the peers, even those
        unchanged since the last sync (which a sync otherwise takes from its
        saved snapshot), and read and hash every file_roots/pillar_roots
        file on both sides, ignoring the hash caches (like ``rsync -c``):
        finds a key or a file rewritten in place with the same size, inode
        and mtime.  It also drops the primary fileserver's own hash cache
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
    from salt_multimaster import jobs  # pylint: disable=import-outside-toplevel

    with _job_record("multimaster.sync", __opts__.get("id"),
                     jobs.args(peers=peers, only=only, test=test or None, force=force or None,
                               minion_ids=minion_ids, **kwargs)):
        ret = _locked_sync(peers, only, test, force, minion_ids, **kwargs)
    if _compact("multimaster.sync"):
        from salt_multimaster import report  # pylint: disable=import-outside-toplevel

        return {"outputter": "txt",
                "data": report.sync_rows(ret, _truthy(test), _truthy(verbose))}
    return ret


def _locked_sync(peers, only, test, force, minion_ids, **kwargs):
    """:func:`_sync` under this primary's sync lock (no lock in test mode)."""
    if str(test).lower() in ("true", "1", "yes"):
        return _sync(peers, only, test, force, minion_ids, **kwargs)
    with _sync_lock(kwargs.pop("lock_wait", None)) as busy:
        if busy:
            # per peer too: a caller checking each peer's result (the
            # reactor's key_event retries a failed sync) sees the failure
            conf = __opts__.get("multimaster")
            for peer in _as_list(peers) or _as_list(
                    conf.get("peers") if isinstance(conf, dict) else None):
                busy.setdefault(peer, {"result": False, "error": busy["error"]})
            return busy
        _sweep_grants()
        return _sync(peers, only, test, force, minion_ids, **kwargs)


# A sync waits this long for another sync of this primary to end, then gives up.
LOCK_WAIT = 60


@contextlib.contextmanager
def _sync_lock(wait=None):
    """
    Hold this primary's sync lock (``salt_multimaster.lock``) for the block;
    yield None, or the failed return naming the running sync's jid when it
    did not end within ``wait`` seconds (``lock_wait=``, else
    ``multimaster:lock_wait``, default 60).
    """
    from salt_multimaster import lock  # pylint: disable=import-outside-toplevel

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
    held = lock.SyncLock(os.path.join(_state_dir(), lock.LOCK_NAME),
                         globals().get("__jid__"), wait=wait)
    try:
        held.acquire()
    except lock.Busy as exc:
        yield _invalid(str(exc))
        return
    try:
        yield None
    finally:
        held.release()


def _sweep_grants():
    """Revoke the expired pull grants of syncs that never revoked them (killed)."""
    from salt_multimaster import grants  # pylint: disable=import-outside-toplevel

    pull_dir = os.path.join(__opts__["cachedir"], "multimaster", "pull")
    for token in grants.expired(pull_dir, ttl=PULL_TTL):
        log.info("multimaster: revoking the expired pull grant %s", token)
        try:
            _revoke(token)
        except OSError as exc:
            log.warning("multimaster: expired pull grant %s not revoked: %s", token, exc)


def _sync(peers, only, test, force, minion_ids, **kwargs):
    from salt_multimaster import manifest, protocol  # pylint: disable=import-outside-toplevel

    try:
        _valid(_checked_args, "multimaster.sync", kwargs, minion_ids, only)
        test = _valid(_checked_bool, "test", test)
        force = _valid(_checked_bool, "force", force)
        conf = _conf(dict(kwargs, peers=peers))
    except SaltInvocationError as exc:
        return _invalid(str(exc))
    only = _as_list(only)
    ids = sorted(set(_as_list(minion_ids)))
    error = _validate(conf, only)
    if not error and ids:
        other = [c for c in only if c != "minion_keys"]
        bad_ids = [mid for mid in ids if not manifest.valid_minion_id(mid)]
        if other:
            error = f"minion_ids syncs minion_keys only, not {', '.join(other)}"
        elif bad_ids:
            error = f"invalid minion id(s) in minion_ids: {', '.join(map(repr, bad_ids))}"
        only = ["minion_keys"]
        if len(ids) > MAX_TARGETED_IDS:
            ids = []
    if error:
        return _invalid(error)
    categories = only or conf["replicate"]

    ret = {}
    bad = _peer_errors(conf["peers"])
    for peer, message in bad.items():
        ret[peer] = {"result": False, "error": message}
    peers = [p for p in conf["peers"] if p not in bad]
    targeted = _sync_ids(conf, peers, ids, test, force) if peers and ids else None
    if targeted is not None:
        ret.update(targeted)
    elif peers:
        _progress(f"multimaster: reading the primary's state for {', '.join(categories)}")
        primary, invs = _inventories(conf, categories, peers, test)
        import concurrent.futures  # pylint: disable=import-outside-toplevel

        def one(peer):
            inv = invs.get(peer)
            mismatch = protocol.reply_error(inv.get("ret") if isinstance(inv, dict) else None)
            if mismatch:
                return {"result": False, "error": mismatch}
            if not inv or not isinstance(inv.get("ret"), dict) or "master_id" not in inv["ret"]:
                return {"result": False, "error": _no_reply(
                    peer, "the inventory", inv.get("ret") if isinstance(inv, dict) else None)}
            try:
                return _sync_one(peer, conf, categories, primary, inv["ret"], test, force)
            except Exception as exc:  # pylint: disable=broad-except
                log.exception("multimaster: sync of %s failed", peer)
                return {"result": False, "error": f"{exc.__class__.__name__}: {exc}"}

        with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(peers))) as pool:
            for peer, res in zip(peers, pool.map(one, peers)):
                ret[peer] = res
                if primary["errors"]:
                    res.setdefault("primary_errors", primary["errors"])
                if primary.get("damaged"):
                    # the peer is no replica of what cannot be read here
                    res["result"] = False
                    msg = (f"{len(primary['damaged'])} damaged or unreadable source(s) on the "
                           "primary, their copies on the peer kept: "
                           + "; ".join(primary["damaged"][:5]))
                    res["error"] = f"{msg}; {res['error']}" if res.get("error") else msg
                _progress(f"multimaster: {peer}: {'ok' if res['result'] else 'FAILED'}")
    if not all(r["result"] for r in ret.values()):
        __context__["retcode"] = 1
        ret["retcode"] = 1
    return ret

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
    from salt_multimaster import protocol  # pylint: disable=import-outside-toplevel

    try:
        _valid(_checked_args, "multimaster.restore", {k: v for k, v in kwargs.items()
                                                      if k != "timeout"})
        test = _valid(_checked_bool, "test", test)
        if len(_as_list(peer)) != 1:
            raise SaltInvocationError("restore takes one peer: peer=<id of multimaster:peers>")
        conf = _conf(dict(kwargs, peers=peer))
    except SaltInvocationError as exc:
        return _invalid(str(exc))
    peer = conf["peers"][0]
    bad = _peer_errors([peer])
    if bad:
        return _invalid(bad[peer])
    rets = _publish([peer], "multimaster_peer.restore",
                    {"backup_name": backup, "test": test}, conf["timeout"])
    got = rets.get(peer)
    got = got.get("ret") if isinstance(got, dict) else None
    mismatch = protocol.reply_error(got)
    if mismatch or not isinstance(got, dict) or "restored" not in got:
        return _invalid(mismatch or _no_reply(peer, "the restore", got))
    got.pop("protocol", None)
    ret = {peer: got}
    if not got.get("result"):
        __context__["retcode"] = 1
        ret["retcode"] = 1
    if _compact("multimaster.restore"):
        from salt_multimaster import report  # pylint: disable=import-outside-toplevel

        return {"outputter": "txt", "data": report.restore_rows(ret, test)}
    return ret


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
    from salt_multimaster import jobs  # pylint: disable=import-outside-toplevel

    with _job_record("multimaster.status", __opts__.get("id"), jobs.args(peers=peers, **kwargs)):
        ret = _status(peers, **kwargs)
    if _compact("multimaster.status"):
        from salt_multimaster import report  # pylint: disable=import-outside-toplevel

        return {"outputter": "txt", "data": report.status_rows(ret, _truthy(verbose))}
    return ret


def _status(peers, **kwargs):
    from salt_multimaster import finger as _finger  # pylint: disable=import-outside-toplevel

    from salt_multimaster import protocol  # pylint: disable=import-outside-toplevel

    try:
        _valid(_checked_args, "multimaster.status", kwargs)
        conf = _conf(dict(kwargs, peers=peers))
    except SaltInvocationError as exc:
        return _invalid(str(exc))
    error = _validate(conf, [])
    if error:
        return _invalid(error)
    categories = conf["replicate"]
    ret = {}
    bad = _peer_errors(conf["peers"])
    for peer, message in bad.items():
        ret[peer] = {"reachable": False, "in_sync": False, "error": message}
    peers = [p for p in conf["peers"] if p not in bad]
    if not peers:
        ret["retcode"] = 1
        return ret
    all_cats = sorted(set(categories) | {"master_keys", "minion_keys"})
    primary, invs = _inventories(conf, all_cats, peers, test=True)
    pub = primary["master_keys"]["files"]["pub"]
    primary_finger = _finger.file_finger(pub, __opts__.get("hash_type", "sha256")) or None
    primary_counts = primary["minion_keys"]["counts"]
    for peer in peers:
        inv = (invs.get(peer) or {}).get("ret")
        mismatch = protocol.reply_error(inv)
        if mismatch or not isinstance(inv, dict) or "master_id" not in inv:
            ret[peer] = {"reachable": False, "in_sync": False,
                         "pull_allowed": _pull_allowed(peer),
                         "error": mismatch or _no_reply(peer, "the inventory", inv)}
            continue
        _, report = _plan(conf, all_cats, primary, inv, False)
        drift = {
            cat: {k: len(report[cat][k]) for k in ("added", "updated", "removed", "conflicts")}
            for cat in categories
        }
        ret[peer] = {
            "reachable": True,
            "master_finger": {"primary": primary_finger,
                              "peer": inv["master_keys"].get("fingerprint")},
            "minion_keys": {"primary": primary_counts,
                            "peer": inv["minion_keys"].get("counts", {})},
            "drift": drift,
            "in_sync": not any(sum(d.values()) for d in drift.values()),
            # whether bulk (an initial sync) can reach this peer at all
            "pull_allowed": _pull_allowed(peer),
            "master_running": inv.get("master_running"),
            "restart_pending": inv.get("restart_pending"),
        }
        if inv.get("restart_pending"):
            ret[peer]["in_sync"] = False
        if inv.get("master_running") is False:
            from salt_multimaster import daemon  # pylint: disable=import-outside-toplevel

            ret[peer]["in_sync"] = False
            ret[peer]["error"] = daemon.not_running_error(peer, inv.get("master_address"))
        if not ret[peer]["pull_allowed"]:
            ret[peer]["pull_config"] = protocol.peer_run_snippet([peer])
        errors = [e for cat in categories for e in report[cat]["errors"]]
        if errors:
            ret[peer]["errors"] = errors
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
    from salt_multimaster import jobs  # pylint: disable=import-outside-toplevel

    with _job_record("multimaster.audit", __opts__.get("id"),
                     jobs.args(tgt=tgt, tgt_type=tgt_type, timeout=timeout, masters=masters,
                               master_finger=master_finger, topology=topology,
                               master_version=master_version)):
        return _audit(tgt, tgt_type, timeout, masters, master_finger, topology, master_version)


def _audit(tgt, tgt_type, timeout, masters, master_finger, topology, master_version):
    # pylint: disable=import-outside-toplevel
    import salt.client
    import salt.utils.minions
    import salt.version
    import salt_multimaster.fleet

    # bad input: a retcode in the return (a raised SaltInvocationError leaves
    # salt-run exiting 0 on 3008)
    if not tgt or not isinstance(tgt, (str, list)):
        return _invalid(f"multimaster.audit: invalid target {tgt!r}")
    try:
        timeout = _valid(_checked_timeout, timeout if timeout is not None
                         else __opts__.get("timeout", 5))
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
        client = salt.client.LocalClient(mopts=__opts__)
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
    report = salt_multimaster.fleet.build_report(
        __opts__["id"], salt.version.__version__, tgt, tgt_type, expected, returns
    )
    if _audit_default_output():
        return {"outputter": "txt", "data": salt_multimaster.fleet.render_rows(report)}
    return report

# ---------------------------------------------------------------------------
# Master key rotation (salt-run multimaster.rotate_key).  Everything below
# this line belongs to the rotation: it calls the public status() above and
# salt_multimaster.rotation, nothing else of this runner.
# ---------------------------------------------------------------------------
ROTATE_POLL = 2


def _rot_invalid(message):
    """Bad input or a refused rotation: nothing changed, a non-zero exit."""
    log.error("multimaster: %s", message)
    return {"result": False, "error": message, "retcode": 1}


def _rot_job(tgt, tgt_type, fun, kwarg, timeout):
    """
    ``{id: return}`` of ``fun`` on the targeted minions, within ``timeout``
    seconds whatever happens: a minion that lost its return (reconnecting to
    a restarted master) is not waited for beyond it.
    """
    import salt.client  # pylint: disable=import-outside-toplevel

    client = salt.client.LocalClient(mopts=__opts__)
    ret = {}
    try:
        pub = client.run_job(tgt, fun, kwarg=kwarg, tgt_type=tgt_type, timeout=timeout,
                             listen=True)
        if not pub or not pub.get("minions"):
            return ret
        deadline = time.monotonic() + timeout
        for got in client.get_iter_returns(pub["jid"], set(pub["minions"]), timeout=2,
                                           tgt=tgt, tgt_type=tgt_type, expect_minions=False,
                                           block=False, gather_job_timeout=3):
            for mid, data in (got or {}).items():
                if isinstance(data, dict) and "ret" in data:
                    ret[mid] = data["ret"]
            if set(ret) >= set(pub["minions"]) or time.monotonic() > deadline:
                break
            if not got:
                time.sleep(0.05)
    finally:
        client.destroy()
    return ret


def _rot_call(peer, fun, kwarg, timeout):
    """One peer's return of ``fun`` (its arguments sealed to it), or None."""
    from salt_multimaster import protocol  # pylint: disable=import-outside-toplevel

    with open(os.path.join(__opts__["pki_dir"], "minions", peer), encoding="utf-8") as fh:
        sealed = protocol.sealed_kwarg({peer: fh.read()}, fun, kwarg)
    got = _rot_job([peer], "list", fun, sealed, timeout).get(peer)
    if protocol.reply_error(got):
        return {"result": False, "error": protocol.reply_error(got)}
    return got


def _rot_minions(tgt, tgt_type, fun, kwarg, timeout, only=None):
    """``(expected ids, {id: return})`` of ``fun`` on the targeted minions."""
    import salt.utils.minions  # pylint: disable=import-outside-toplevel

    if only is not None:
        tgt, tgt_type, expected = list(only), "list", list(only)
    else:
        expected = salt.utils.minions.CkMinions(__opts__).check_minions(tgt, tgt_type)
        expected = expected.get("minions", []) if isinstance(expected, dict) else []
    return expected, (_rot_job(tgt, tgt_type, fun, kwarg, timeout) if expected else {})


def _rot_peer(peer, step, ctx):
    """Rotate one peer: new key, restart, wait until it serves it.  Error or None."""
    from salt_multimaster import rotation, seal  # pylint: disable=import-outside-toplevel

    restart = None
    if step["state"] == rotation.PENDING:
        kwarg = {"topology": ctx["topology"], "restart_cmd": ctx["restart_cmd"]}
        if ctx["topology"] == "shared":
            with open(os.path.join(__opts__["pki_dir"], "minions", peer), encoding="utf-8") as fh:
                kwarg["keypair"] = {"pub": ctx["pub"].decode(), "sealed": seal.seal(
                    fh.read(), ctx["priv"], peer, "rotate_key/master.pem")}
        got = _rot_call(peer, "multimaster_peer.rotate_key", kwarg, ctx["timeout"])
        if not isinstance(got, dict) or not got.get("result"):
            return (f"{peer}: no new key: "
                    + (got.get("error", str(got)) if isinstance(got, dict)
                       else "its salt-minion did not answer (start it, check salt-run "
                            "manage.status), then run salt-run multimaster.rotate_key again"))
        step.update(state=rotation.WRITTEN, old=got["old"], new=got["new"], backup=got["backup"])
        ctx["save"]()
        restart = got["restart"]
    return _rot_wait(peer, step, ctx, restart)


def _rot_peer_serving(peer, step, ctx):
    """``(serving, detail)`` of a peer after its key write."""
    got = _rot_call(peer, "multimaster_peer.inventory",
                    {"categories": ["master_keys"], "topology": "shared", "test": True},
                    ctx["timeout"])
    if not isinstance(got, dict) or "master_keys" not in got:
        return False, "its salt-minion did not answer"
    if got["master_keys"].get("fingerprint") != step["new"]:
        return False, (f"its key on disk is {got['master_keys'].get('fingerprint')}, not the "
                       f"new {step['new']} (restored or replaced since?)")
    if not got.get("master_running"):
        return False, f"its salt-master does not answer on {got.get('master_address')}"
    if got.get("restart_pending") is not False:
        return False, "its salt-master still runs with the old key (not restarted since)"
    return True, None


def _rot_wait(name, step, ctx, restart):
    """
    Wait until master ``name`` serves its new key (asking for a restart when
    none was asked in this run); mark the step serving.  Error or None.
    """
    from salt_multimaster import rotation  # pylint: disable=import-outside-toplevel

    is_primary = name == ctx["primary"]
    check = ((lambda: _rot_primary_serving(step)) if is_primary
             else (lambda: _rot_peer_serving(name, step, ctx)))
    if restart is None:
        ok, detail = check()
        if ok:
            step["state"] = rotation.SERVING
            ctx["save"]()
            return None
        if is_primary:
            restart = _rot_restart_primary(ctx)
        else:
            got = _rot_call(name, "multimaster_peer.rotate_key",
                            {"topology": ctx["topology"], "restart_only": True,
                             "restart_cmd": ctx["restart_cmd"]}, ctx["timeout"])
            restart = got.get("restart") if isinstance(got, dict) else None
            if not restart:
                return f"{name}: {detail}; its salt-minion did not answer the restart"
    step["restart"] = restart
    if restart == "restart_required":
        return rotation.restart_remedy(name, restart)
    deadline = time.monotonic() + ctx["restart_wait"]
    detail = None
    while time.monotonic() < deadline:
        time.sleep(ROTATE_POLL)
        try:
            ok, detail = check()
        except Exception as exc:  # pylint: disable=broad-except
            # the primary's own restart: its sockets go away for a while
            ok, detail = False, f"{exc.__class__.__name__}: {exc}"
        if ok:
            step["state"] = rotation.SERVING
            step.pop("restart", None)
            ctx["save"]()
            if is_primary:
                _rot_reconnect_events()
            return None
    return rotation.restart_remedy(name, f"after {ctx['restart_wait']} s: {detail}")


def _rot_reconnect_events():
    """
    This master restarted under the running salt-run: its job's connection
    to the master event bus is gone (Salt 3006 dies firing the job's return
    on it, StreamClosedError).  Drop it: the next event connects again.
    """
    jid_event = globals().get("__jid_event__")
    try:
        jid_event.event.close_pull()
    except Exception as exc:  # pylint: disable=broad-except
        log.debug("multimaster: event connection not reset: %s", exc)


def _rot_primary_serving(step):
    from salt_multimaster import daemon, layout, rotation  # pylint: disable=import-outside-toplevel

    if rotation.current_finger(__opts__) != step["new"]:
        return False, f"its key on disk is not the new {step['new']} (restored or replaced since?)"
    return rotation.serving(__opts__, os.path.join(layout.state_dir(__opts__),
                                                   daemon.RESTART_MARKER))


def _rot_restart_primary(ctx):
    import salt.utils.systemd  # pylint: disable=import-outside-toplevel
    from salt_multimaster import layout, rotation  # pylint: disable=import-outside-toplevel

    booted = not ctx["restart_cmd"] and salt.utils.systemd.booted({})
    return rotation.restart_primary(layout.state_dir(__opts__), ctx["restart_cmd"], booted)


def _rot_primary(step, ctx):
    """Rotate the primary itself (last): new key, restart, wait.  Error or None."""
    from salt_multimaster import layout, rotation  # pylint: disable=import-outside-toplevel

    restart = None
    if step["state"] == rotation.PENDING:
        try:
            if ctx["topology"] == "shared":
                priv, pub = ctx["priv"], ctx["pub"]
            else:
                priv, pub = rotation.gen_keypair(__opts__.get("keysize") or rotation.DEFAULT_KEYSIZE)
            done = rotation.install(__opts__, priv, pub, rotation.backup_root(__opts__))
        except (rotation.RotationError, OSError, ValueError) as exc:
            return f"{ctx['primary']}: no new key: {exc}"
        step.update(state=rotation.WRITTEN, old=done["old"], new=done["new"],
                    backup=done["backup"])
        ctx["save"]()
        if ctx["topology"] == "shared":
            rotation.drop_stage(layout.state_dir(__opts__))
        restart = _rot_restart_primary(ctx)
    return _rot_wait(ctx["primary"], step, ctx, restart)


def _rot_tell_minions(step, ctx):
    """topology shared: every targeted minion now trusts the new public key."""
    from salt_multimaster import rotation  # pylint: disable=import-outside-toplevel

    expected, got = _rot_minions(
        ctx["tgt"], ctx["tgt_type"], "multimaster.master_key_apply",
        {"contents": ctx["pub"].decode(), "master_finger": ctx["new_finger"],
         "topology": "shared"}, ctx["timeout"])
    told = sorted(m for m, r in got.items() if isinstance(r, dict) and r.get("expected"))
    step.update(state=rotation.SERVING, told=len(told),
                not_told=sorted(set(expected) - set(told)))
    ctx["save"]()


def _rot_verify(ctx, record):
    """``{id: {"reason", "remedy"}}`` of the targeted minions not trusting the new key."""
    from salt_multimaster import rotation  # pylint: disable=import-outside-toplevel

    kwarg = {"master_finger": ctx["expect_finger"], "topology": ctx["topology"]}
    expected, got = _rot_minions(ctx["tgt"], ctx["tgt_type"], "multimaster.audit", kwarg,
                                 ctx["timeout"])
    verdicts = {mid: rotation.minion_verdict(got.get(mid)) for mid in expected}
    deadline = time.monotonic() + ctx["verify_wait"]
    while any(verdicts.values()) and time.monotonic() < deadline:
        # minions reconnect to a restarted master after a while: ask again
        time.sleep(ROTATE_POLL)
        again = sorted(m for m, v in verdicts.items() if v)
        _, more = _rot_minions(None, None, "multimaster.audit", kwarg, ctx["timeout"], only=again)
        for mid in again:
            verdicts[mid] = rotation.minion_verdict(more.get(mid))
    unconfirmed = {mid: {"reason": reason,
                         "remedy": rotation.remedy(mid, ctx["topology"], ctx["new_finger"])}
                   for mid, reason in sorted(verdicts.items()) if reason}
    record["unconfirmed"] = sorted(unconfirmed)
    return sorted(m for m, v in verdicts.items() if not v), unconfirmed


def _rot_checks(conf_peers, topology, fresh_start):
    """Errors that stop a rotation before it changes anything: peers down, keys not in step."""
    for _ in range(3):
        errors = _rot_status_errors(conf_peers, topology, fresh_start)
        if not errors:
            break
        # a peer's minion reconnecting to a master restarted a moment ago
        time.sleep(5)
    return errors


def _rot_status_errors(conf_peers, topology, fresh_start):
    st = status(peers=",".join(conf_peers), topology=topology, replicate="master_keys")
    if not isinstance(st, dict):
        return [f"multimaster.status failed: {st}"]
    if "error" in st and "result" in st:
        return [st["error"]]
    errors = []
    for peer in conf_peers:
        res = st.get(peer) or {}
        if not res.get("reachable") or res.get("master_running") is False:
            errors.append(f"{peer}: {res.get('error') or 'not reachable'}")
        elif (topology == "signed" or fresh_start) and any(
                (res.get("drift") or {}).get("master_keys", {}).values()):
            errors.append(f"{peer}: its {'master_sign' if topology == 'signed' else 'master'} "
                          "keypair differs from the primary's: run salt-run multimaster.sync "
                          f"only=master_keys topology={topology} first")
    return errors


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
        ``multimaster:master_restart_cmd``, else systemd where it runs the
        master, else the run stops with ``restart_required`` and the remedy.
    restart_wait
        Seconds to wait for a restarted master to serve its new key.
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
    # pylint: disable=import-outside-toplevel
    from salt_multimaster import layout, lock, rotation, validate

    conf = __opts__.get("multimaster") if isinstance(__opts__.get("multimaster"), dict) else {}
    topology = topology or conf.get("topology") or "shared"
    conf_peers = rotation.as_list(peers) or rotation.as_list(conf.get("peers"))
    restart_cmd = restart_cmd or conf.get("master_restart_cmd") or None
    try:
        test = validate.boolean("test", test)
        fresh = validate.boolean("fresh", fresh)
        validate.peers(conf_peers, rotation.as_list(conf.get("peers")))
        waits = {k: validate.timeout(k, v, maximum=3600) for k, v in
                 (("restart_wait", restart_wait), ("verify_wait", verify_wait),
                  ("timeout", timeout))}
    except validate.InvalidInput as exc:
        return _rot_invalid(f"multimaster.rotate_key: {exc}")
    reason = rotation.unsupported(__opts__, topology)
    if reason:
        return _rot_invalid(f"multimaster.rotate_key: {__opts__['id']}: {reason}")
    if restart_cmd is not None and not isinstance(restart_cmd, str):
        return _rot_invalid(f"multimaster.rotate_key: restart_cmd must be a command, not {restart_cmd!r}")
    if not conf_peers:
        return _rot_invalid("multimaster.rotate_key: no peers: set multimaster:peers or pass peers=")
    state_dir = layout.state_dir(__opts__)
    primary = __opts__["id"]
    record = None if fresh else rotation.load_record(state_dir)
    if record:
        reason = rotation.resumable(record, topology, conf_peers, primary)
        if reason:
            return _rot_invalid(f"multimaster.rotate_key: {reason}")
    errors = _rot_checks(conf_peers, topology, record is None)
    resumed = record is not None
    record = record or rotation.new_record(topology, conf_peers, primary)
    ret = {"result": not errors, "topology": topology, "test": test, "resumed": resumed,
           "started": record["started"], "plan": rotation.plan(record)}
    if errors or test:
        if errors:
            ret["error"] = "; ".join(errors)
            ret["retcode"] = 1
        return ret
    try:
        held = lock.SyncLock(os.path.join(state_dir, lock.LOCK_NAME),
                             globals().get("__jid__"), wait=0)
        held.acquire()
    except lock.Busy as exc:
        return _rot_invalid(f"multimaster.rotate_key: {exc}")
    try:
        if fresh:
            rotation.drop_stage(state_dir)  # a new rotation, a new key
        return _rot_run(ret, record, dict(
            waits, topology=topology, primary=primary, restart_cmd=restart_cmd, tgt=tgt,
            tgt_type=tgt_type, save=lambda: rotation.save_record(state_dir, record)),
            state_dir)
    finally:
        held.release()


def _rot_run(ret, record, ctx, state_dir):
    from salt_multimaster import finger, layout, rotation  # pylint: disable=import-outside-toplevel

    ctx["save"]()
    if ctx["topology"] == "shared":
        if record["state"][ctx["primary"]]["state"] == rotation.PENDING:
            ctx["priv"], ctx["pub"] = rotation.stage_keypair(
                state_dir, __opts__.get("keysize") or rotation.DEFAULT_KEYSIZE)
        else:
            # installed here: the staged copy is gone, the key files hold it
            with open(rotation.own_key_files(__opts__)[1], "rb") as fh:
                ctx["priv"], ctx["pub"] = None, fh.read()
        ctx["new_finger"] = finger.master_finger(ctx["pub"].decode(),
                                                 __opts__.get("hash_type", "sha256"))
        ctx["expect_finger"] = ctx["new_finger"]
    else:
        ctx["new_finger"] = None
        ctx["expect_finger"] = rotation.key_finger(
            layout.master_key_files(__opts__, "signed")[1], __opts__)
    error = None
    for name in record["steps"]:
        step = record["state"][name]
        if step["state"] == rotation.SERVING:
            continue
        log.info("multimaster: rotate_key: %s", name)
        if name == rotation.MINIONS_STEP:
            _rot_tell_minions(step, ctx)
        elif name == ctx["primary"]:
            error = _rot_primary(step, ctx)
        else:
            error = _rot_peer(name, step, ctx)
        if error:
            break
    ret["steps"] = {("minions" if n == rotation.MINIONS_STEP else n): dict(record["state"][n])
                    for n in record["steps"]}
    if error:
        ctx["save"]()
        ret.update(result=False, error=error, retcode=1)
        return ret
    confirmed, unconfirmed = _rot_verify(ctx, record)
    ret["minions"] = {"confirmed": confirmed, "unconfirmed": unconfirmed}
    ret["fingerprints"] = {n: record["state"][n].get("new") for n in record["steps"]
                           if n != rotation.MINIONS_STEP}
    if unconfirmed:
        ctx["save"]()
        ret.update(result=False, retcode=1,
                   error=f"{len(unconfirmed)} minion(s) did not confirm the new key: "
                         + ", ".join(sorted(unconfirmed)) + " (see minions:unconfirmed)")
    else:
        record["done"] = True
        ctx["save"]()
    if ctx["topology"] == "shared":
        ret["next"] = (f"set pillar multimaster:master_finger to {ctx['new_finger']} (and "
                       "multimaster:master_pub, if used, to the new master.pub) before the "
                       "next state.apply of salt.multimaster, which would otherwise put the "
                       "old key back")
    ret["plan"] = rotation.plan(record)
    return ret
