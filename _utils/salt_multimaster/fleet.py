"""
The fleet report behind ``salt-run multimaster.audit``: the minions'
``multimaster.audit`` returns gathered through one master, folded into one
report, and rendered as the rows of a compact table (:func:`audit`: the
runner's call, the publish passed in).
"""

import salt.version
from salt.exceptions import SaltInvocationError

from salt_multimaster import settings
from salt_multimaster.audit import CHECKS
from salt_multimaster.checks import SEVERITIES


def minion_entry(ret):
    """
    One minion's line in the report from its job return: the full return
    (``{"ret": ..., "retcode": ...}``), the bare audit dict, or whatever the
    minion sent instead (an error string when the module is missing).
    """
    data = payload(ret)
    if isinstance(data, dict) and isinstance(data.get("findings"), list):
        return {
            "ok": bool(data.get("result")),
            "findings": data["findings"],
            "masters": data.get("masters", []),
            "master_finger": data.get("master_finger", ""),
            "saltversion": data.get("saltversion", ""),
        }
    return {
        "ok": False,
        "findings": [
            {
                "check": "audit",
                "severity": "error",
                "message": f"multimaster.audit did not run: {data}",
                "remedy": "Install salt-multimaster on the minion (pip install "
                "salt-multimaster, or saltutil.sync_all with the repository in "
                "file_roots), then run the audit again.",
            }
        ],
        "masters": [],
        "master_finger": "",
        "saltversion": "",
    }


def payload(ret):
    """What the minion returned: ``ret["ret"]`` of a full return, else ``ret`` itself."""
    return ret.get("ret") if isinstance(ret, dict) and "ret" in ret else ret


def returned(ret):
    """False for the markers LocalClient uses for minions that did not return."""
    if ret is False or ret is None:
        return False
    if isinstance(ret, dict):
        # LocalClient: {"failed": True}, or {"out": "no_return", "ret": "Minion
        # did not return. [No response]...", "retcode": 1} (Salt 3008)
        if ret.get("out") == "no_return":
            return False
        if ret.get("failed") and "ret" not in ret:
            return False
    return True


def build_report(master, saltversion, tgt, tgt_type, expected, returns):
    """
    Fold the minions' returns into the fleet report.

    ``expected``: the minion ids the target matches on this master;
    ``returns``: ``{minion_id: job return}`` as LocalClient gives them.
    """
    minions = {}
    for minion_id in sorted(returns):
        if returned(returns[minion_id]):
            minions[minion_id] = minion_entry(returns[minion_id])
    missing = sorted(set(expected) - set(minions))
    totals = {}
    for entry in minions.values():
        seen = {}
        for item in entry["findings"]:
            if item["severity"] == "info":
                continue
            seen.setdefault(item["check"], set()).add(item["severity"])
        for check, severities in seen.items():
            for severity in severities:
                totals.setdefault(check, {}).setdefault(severity, 0)
                totals[check][severity] += 1
    order = {check: index for index, check in enumerate(CHECKS)}
    totals = dict(sorted(totals.items(), key=lambda kv: (order.get(kv[0], 99), kv[0])))
    failed = sorted(m for m, e in minions.items() if not e["ok"])
    if missing:
        totals["no_return"] = {"error": len(missing)}
    targeted = set(expected) | set(minions)
    if not targeted:
        totals["no_minions"] = {"error": 1}
    result = bool(targeted) and not failed and not missing
    return {
        "result": result,
        "master": master,
        "saltversion": saltversion,
        "tgt": tgt,
        "tgt_type": tgt_type,
        "counts": {
            "targeted": len(targeted),
            "returned": len(minions),
            "ok": len(minions) - len(failed),
            "failed": len(failed),
            "missing": len(missing),
        },
        "minions": minions,
        "missing": missing,
        "failed": failed,
        "totals": totals,
        "retcode": 0 if result else 1,
    }


def _flagged(findings):
    """``check(E)``/``check(W)`` labels, errors first, one per check and severity."""
    labels = []
    for severity in ("error", "warning"):
        for item in findings:
            label = "{}({})".format(item["check"], severity[0].upper())
            if item["severity"] == severity and label not in labels:
                labels.append(label)
    return labels


def render_rows(report):
    """
    The report as ordered ``{label: line}`` rows for Salt's ``txt`` outputter,
    which prints ``label: line``: one row per minion, then totals.  The last
    row is ``retcode`` (salt-run's exit code).
    """
    minion_ids = list(report["minions"]) + list(report["missing"])
    width = max([len(m) for m in minion_ids] + [len("master"), len("totals")])
    rows = {}

    def put(label, line):
        key = label.ljust(width)
        if key.strip() == "retcode":  # the exit code row is salt-run's
            key = key.rstrip() + " (minion)"
        while key in rows:
            key += " "
        rows[key] = line

    counts = report["counts"]
    put(
        "master",
        "{} (Salt {}), target {!r} ({}): {} targeted, {} ok, {} failed, {} did not "
        "return".format(
            report["master"], report["saltversion"], report["tgt"], report["tgt_type"],
            counts["targeted"], counts["ok"], counts["failed"], counts["missing"],
        ),
    )
    for minion_id, entry in report["minions"].items():
        labels = _flagged(entry["findings"])
        status = "ok  " if entry["ok"] else "FAIL"
        put(minion_id, "{} {}".format(status, " ".join(labels)).rstrip())
    for minion_id in report["missing"]:
        put(minion_id, "NO RETURN (targeted, did not return through this master)")
    if report["totals"]:
        put(
            "totals",
            ", ".join(
                "{} {}".format(
                    check,
                    "/".join(f"{n}{sev[0].upper()}" for sev, n in sorted(
                        by_sev.items(), key=lambda kv: SEVERITIES.index(kv[0])
                    )),
                )
                for check, by_sev in report["totals"].items()
            ),
        )
    else:
        put("totals", "no findings")
    rows["retcode"] = report["retcode"]
    return rows


def audit(opts, context, gather, tgt, tgt_type, timeout, masters, master_finger, topology,
          master_version):
    """
    ``salt-run multimaster.audit`` (its arguments) through this master:
    ``gather(tgt, tgt_type, fun, kwarg, timeout)`` publishes
    (:func:`salt_multimaster.jobs.full_returns`); the report, its compact
    table when no outputter was chosen, or bad input refused (``context``:
    the runner's ``__context__``, the exit code).
    """
    # bad input: a retcode in the return (a raised SaltInvocationError leaves
    # salt-run exiting 0 on 3008)
    if not tgt or not isinstance(tgt, (str, list)):
        return settings.invalid(context, f"multimaster.audit: invalid target {tgt!r}")
    try:
        timeout = settings.timeout(timeout if timeout is not None else opts.get("timeout", 5))
    except SaltInvocationError as exc:
        return settings.invalid(context, f"multimaster.audit: {exc}")
    kwarg = {"master_version": master_version or {opts["id"]: salt.version.__version__}}
    for key, value in (("masters", masters), ("master_finger", master_finger),
                       ("topology", topology)):
        if value is not None:
            kwarg[key] = value
    expected, returns = gather(tgt, tgt_type, "multimaster.audit", kwarg, timeout)
    report = build_report(opts["id"], salt.version.__version__, tgt, tgt_type, expected, returns)
    # no outputter chosen (no --out, no ``output`` in the master config): the compact table
    if not opts.get("output"):
        return {"outputter": "txt", "data": render_rows(report)}
    return report
