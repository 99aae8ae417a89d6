"""
Compact, readable reports of ``multimaster.sync`` and ``multimaster.status``
for ``salt-run`` without ``--out``, in the spirit of Salt's highstate
summary: one block per peer, a line per category that changed, the first few
names, then totals and the exit code.  ``--out=json``/``yaml`` keep the full
data.

Rows are ``{label: text}`` for Salt's ``txt`` outputter, which prints every
line of a text as ``label: line``; the last row is ``retcode`` (salt-run's
exit code).
"""

CATEGORIES = ("master_keys", "minion_keys", "file_roots", "pillar_roots", "master_config")
SHOW = 3
KINDS = ("added", "updated", "removed", "unconfirmed")
WOULD = {"added": "would add", "updated": "would update", "removed": "would remove",
         "unconfirmed": "not applied"}


def compact(opts, fun):
    """
    True when salt-run itself runs ``fun`` and the user chose no outputter
    (no ``--out``, no ``output`` in the config): print the compact report.
    Calls from the reactor, the scheduler or the API get the data.
    """
    return not opts.get("output") and opts.get("fun") == fun


def names(items, verbose=False, show=SHOW):
    """``a, b, c ... and N more`` (every name with ``verbose``)."""
    items = [str(i) for i in items]
    if verbose or len(items) <= show:
        return ", ".join(items)
    return f"{', '.join(items[:show])} ... and {len(items) - show} more"


def _label(rows, label):
    while label in rows:
        label += " "
    return label


def _category_lines(res, test, verbose):
    lines = []
    for cat in CATEGORIES:
        rep = res.get(cat)
        if not isinstance(rep, dict):
            continue
        parts = []
        for kind in KINDS:
            items = rep.get(kind) or []
            if items:
                word = WOULD[kind] if test else kind
                parts.append(f"{len(items)} {word}: {names(items, verbose)}")
        lines.append(f"  {cat:<14}" + ("; ".join(parts) if parts else
                                       "kept as the peer changed it" if rep.get("peer_changed")
                                       else "in sync"))
        for kind, label in (("peer_changed", "peer changed"), ("conflicts", "conflict"),
                            ("errors", "error"), ("warnings", "warning")):
            items = rep.get(kind) or []
            shown = items if verbose else items[:SHOW]
            lines.extend(f"    {label}: {item}" for item in shown)
            if len(items) > len(shown):
                lines.append(f"    ... and {len(items) - len(shown)} more {kind}")
    return lines


def replicas(ret):
    """
    Whether a sync's return (``{peer: result, "retcode": n}``) says every
    peer is a replica after it: a report per peer, none failed; a sync
    refused as a whole (``{"result": False, "error": ...}``) is not.
    """
    return isinstance(ret, dict) and bool(ret) and not ret.get("retcode") and all(
        isinstance(res, dict) and res.get("result") is not False for res in ret.values())


def sync_rows(ret, test=False, verbose=False):
    """The rows of a sync's return (``{peer: result, "retcode": n}``)."""
    rows = {}
    counts = {"peers": 0, "failed": 0, "changed": 0, "in_sync": 0}
    for peer, res in ret.items():
        if peer == "retcode" or not isinstance(res, dict):
            continue
        counts["peers"] += 1
        changed = any(isinstance(res.get(c), dict) and any(res[c].get(k) for k in KINDS)
                      for c in CATEGORIES)
        if res.get("result") is False:
            counts["failed"] += 1
            head = "FAILED" + (f": {res['error']}" if res.get("error") else "")
        elif changed:
            counts["changed"] += 1
            head = "would change" if test else "changed"
        else:
            counts["in_sync"] += 1
            head = "in sync"
        lines = [head] + _category_lines(res, test, verbose)
        for key in ("warnings", "primary_errors"):
            for item in res.get(key) or []:
                lines.append(f"  {key[:-1].replace('_', ' ')}: {item}")
        for key, where in (("rebuilt", "on the peer"), ("primary_rebuilt", "on the primary")):
            for item in res.get(key) or []:
                lines.append(f"  damaged {where}, rebuilt: {item}")
        if res.get("restart"):
            lines.append(f"  restart: {res['restart']}")
        if res.get("backup"):
            lines.append(f"  backup: {res['backup']}")
        if res.get("aes_rotation"):
            lines.append(f"  AES key rotation: {res['aes_rotation']}")
        rows[_label(rows, peer)] = "\n".join(lines)
    if "error" in ret and not counts["peers"]:
        rows["error"] = ret["error"]
    else:
        rows["summary"] = (
            f"{counts['peers']} peer(s): {counts['in_sync']} in sync, {counts['changed']} "
            f"{'would change' if test else 'changed'}, {counts['failed']} failed"
            + (" (test run, nothing changed)" if test else ""))
    rows["retcode"] = ret.get("retcode", 0)
    return rows


def status_rows(ret):
    """The rows of a status return (``{peer: status, "retcode": n}``)."""
    rows = {}
    for peer, res in ret.items():
        if peer == "retcode" or not isinstance(res, dict):
            continue
        if not res.get("reachable"):
            rows[_label(rows, peer)] = f"UNREACHABLE: {res.get('error', '')}".rstrip(": ")
            continue
        drift = res.get("drift") or {}
        lines = ["in sync" if res.get("in_sync") else "DRIFT"]
        for cat, counts in drift.items():
            nonzero = {k: n for k, n in counts.items() if n}
            lines.append(f"  {cat:<14}" + (", ".join(f"{n} {k}" for k, n in nonzero.items())
                                           if nonzero else "in sync"))
        finger = res.get("master_finger") or {}
        same = finger.get("primary") == finger.get("peer")
        lines.append(f"  master key     {'same as the primary' if same else 'DIFFERS'} "
                     f"({finger.get('peer')})")
        keys = res.get("minion_keys") or {}
        if keys:
            def counts(side):
                held = {s: n for s, n in sorted((keys.get(side) or {}).items()) if n}
                return ", ".join(f"{s} {n}" for s, n in held.items()) or "none"

            lines.append(f"  minion keys    primary {counts('primary')}; peer {counts('peer')}")
        if res.get("master_running") is False or res.get("error"):
            lines.append(f"  error: {res.get('error')}")
        if res.get("restart_pending"):
            lines.append("  restart pending: the peer's salt-master runs older keys or config")
        if not res.get("pull_allowed"):
            lines.append("  pull channel NOT allowed (bulk syncs are refused); add:")
            lines.extend(f"    {line}" for line in (res.get("pull_config") or "").splitlines())
        rows[_label(rows, peer)] = "\n".join(lines)
    if "error" in ret and not rows:
        rows["error"] = ret["error"]
    rows["retcode"] = ret.get("retcode", 0)
    return rows


def restore_rows(ret, test=False):
    """The rows of a restore's return (``{peer: result, "retcode": n}``)."""
    rows = {}
    for peer, res in ret.items():
        if peer == "retcode" or not isinstance(res, dict):
            continue
        head = ("FAILED: " + res["error"]) if res.get("error") else (
            f"{'would restore' if test else 'restored'} {len(res.get('restored') or [])} "
            f"file(s) from backup {res.get('backup_restored')}")
        lines = [head] + [f"  {item}" for item in res.get("restored") or []]
        lines += [f"  error: {err}" for err in res.get("errors") or []]
        if res.get("backup"):
            lines.append(f"  what was there is in backup: {res['backup']}")
        if res.get("restart"):
            lines.append(f"  restart: {res['restart']}")
        rows[_label(rows, peer)] = "\n".join(lines)
    if "error" in ret and not rows:
        rows["error"] = ret["error"]
    rows["retcode"] = ret.get("retcode", 0)
    return rows


STEP_STATUS = {True: "ok", False: "FAILED", None: "would do"}


def steps_done(ret):
    """
    A command reported in steps: ``result`` from its steps (one that failed
    fails it), ``retcode`` 1 then.
    """
    ret["result"] = all(step["result"] is not False for step in ret["steps"].values())
    if not ret["result"]:
        ret["retcode"] = 1
    return ret


def failback_rows(ret, verbose=False):
    """The rows of ``multimaster.failback``'s return (:func:`steps_rows`)."""
    return steps_rows(ret, ret.get("peer", ""), verbose)


def steps_rows(ret, title, verbose=False, title_key="title", peer=None):
    """
    The rows of a command reported in steps (``multimaster.failback``,
    ``multimaster.promote``, ``multimaster.add_peer``/``remove_peer``):
    ``title`` (row ``title_key``), then one row per step with its status,
    comment and items (a sync's per peer; with ``peer``, the ``sync`` step's
    changes are that one peer's, shown as its categories), the next steps,
    then ``result`` and ``retcode``.
    """
    if "steps" not in ret:
        return {"error": ret.get("error"), "retcode": ret.get("retcode", 0)}
    rows = {title_key: title + (": test run, nothing changed" if ret.get("test") else "")}
    for name, step in ret["steps"].items():
        lines = [f"{STEP_STATUS[step['result']]}: {step.get('comment', '')}"]
        for key, label in (("carry", "carry"), ("keep", "keep"), ("config", "option"),
                           ("remedy", "to do"), ("errors", "error")):
            items = step.get(key) or []
            shown = items if verbose else items[:10]
            lines.extend(f"  {label}: {item}" for item in shown)
            if len(items) > len(shown):
                lines.append(f"  ... and {len(items) - len(shown)} more")
        for status, ids in sorted((step.get("minions") or {}).items()):
            lines.append(f"  {status:<13}{names(ids, verbose)}")
        if name == "primary":
            for cat, rep in sorted((step.get("changes") or {}).items()):
                for kind in ("updated", "removed"):
                    if rep.get(kind):
                        lines.append(f"  {cat:<14}{'written' if kind == 'updated' else kind}: "
                                     f"{names(rep[kind], verbose)}")
            if step.get("backup"):
                lines.append(f"  backup: {step['backup']}")
        elif name == "sync" and peer is not None:
            if isinstance(step.get("changes"), dict):
                detail = sync_rows({peer: step["changes"]}, ret.get("test"), verbose)
                lines.extend(str(detail.get(peer, "")).splitlines()[1:])
        elif name in ("peer", "sync") and step.get("changes"):
            changes = step["changes"]
            if name == "peer":
                changes = {title: changes}
            detail = sync_rows(changes, False, verbose)
            for peer, text in detail.items():
                if peer in ("summary", "retcode", "error"):
                    continue
                lines.append(f"  {peer}: {text.splitlines()[0]}")
                lines.extend(f"  {line}" for line in text.splitlines()[1:])
        rows[_label(rows, name)] = "\n".join(lines)
    if ret.get("next_steps"):
        rows["next"] = "\n".join(f"- {line}" for line in ret["next_steps"])
    rows["result"] = ("NOT done" if not ret.get("result") else
                      "planned (test run)" if ret.get("test") else "done")
    rows["retcode"] = ret.get("retcode", 0)
    return rows
