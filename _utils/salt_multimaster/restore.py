"""
What a peer gives back, without Salt's loader: the restore of one of its
backups (:mod:`salt_multimaster.backup`), and the collect of what it
changed for the primary's failback (:mod:`salt_multimaster.failback`).
"""

import hashlib
import logging
import os

from salt_multimaster import backup, fsutil, layout, manifest, protocol, seal
from salt_multimaster.applier import DAEMON_CATEGORIES, Applier
from salt_multimaster.peer import PeerError

log = logging.getLogger(__name__)


def restore_target(mopts, rel):
    """Where the backed-up item ``rel`` (``category/...``) goes back, and its mode."""
    try:
        cat, fields = protocol.parse_item(rel)
    except protocol.ProtocolError:
        raise backup.BackupError(f"{rel}: unknown category") from None
    if cat == "minion_keys":
        if fields["state"] not in manifest.KEY_DIRS or not manifest.valid_minion_id(fields["id"]):
            raise backup.BackupError(f"{rel}: not a minion key")
        return fsutil.safe_join(mopts["pki_dir"], f"{fields['state']}/{fields['id']}"), 0o644
    if cat in ("file_roots", "pillar_roots"):
        roots = (mopts.get(cat) or {}).get(fields["env"])
        if not roots:
            raise backup.BackupError(f"{rel}: saltenv {fields['env']!r} is not configured here")
        return (manifest.locate_confined(roots, fields["rel"])
                or fsutil.safe_join(roots[0], fields["rel"])), None
    if cat == "master_keys":
        topology = "signed" if fields["name"].startswith("master_sign.") else "shared"
        pem, pub = layout.master_key_files(mopts, topology)
        if fields["name"].endswith(".pem"):
            return pem, fsutil.PRIVATE_KEY_MODE
        return pub, 0o644
    return protocol.dropin_path(mopts), 0o600


def restore(mopts, state_dir, backup_name, test, restart):
    """
    Put back every file of the backup ``backup_name`` (default: the newest),
    what is there now backed up first; with ``test``, only list.
    """
    base = os.path.join(mopts["cachedir"], "multimaster", "backup")
    try:
        source = backup.choose(base, backup_name)
    except backup.BackupError as exc:
        return {"result": False, "error": str(exc), "restored": [], "errors": []}
    ret = {"result": True, "backup_restored": os.path.basename(source), "restored": [],
           "errors": []}
    app = None if test else Applier(mopts, None)
    refused = restart.why_refused()
    for rel in backup.items(source):
        try:
            target, mode = restore_target(mopts, rel)
            if refused and rel.split("/", 1)[0] in DAEMON_CATEGORIES:
                raise PeerError(refused)
            if app is not None:
                with open(os.path.join(source, rel), "rb") as fh:
                    data = fh.read()
                if mode is None:
                    mode = os.stat(os.path.join(source, rel)).st_mode & 0o7777
                if rel.startswith("master_keys/"):
                    fsutil.makedirs(os.path.dirname(target), mode=fsutil.KEY_DIR_MODE)
                app.write(target, data, mode, rel, None)
            ret["restored"].append(rel)
        except (backup.BackupError, fsutil.PathError, PeerError, OSError) as exc:
            ret["errors"].append(f"{rel}: {exc}")
    daemon_files = any(r.split("/", 1)[0] in DAEMON_CATEGORIES for r in ret["restored"])
    if app is not None:
        app.commit()
        ret["backup"] = app.backup_root if app.backed_up else None
        ret["restart"] = restart() if daemon_files else None
    elif daemon_files:
        ret["restart"] = restart.predict()
    ret["result"] = not ret["errors"]
    return ret


# ---------------------------------------------------------------------------
# Failback: the contents of what this peer changed, for the primary
# ---------------------------------------------------------------------------
#: what one collect returns at most: the primary asks in batches below it.
#: A return is an event on the primary's bus, trimmed past its
#: ``max_event_size`` (1 MiB by default), and sealed content travels base64.
COLLECT_MAX_BYTES = 512 * 1024


def collect(mopts, items, receiver, reply_pub):
    """
    The contents of ``items`` (:func:`protocol.item_name`: minion keys and
    roots files), each sealed to ``reply_pub`` (the primary's master public
    key) for ``receiver`` (its id): what ``multimaster.failback`` carries
    from this peer to the primary.  Returns ``{"items": {item: {"sha256",
    "size", "mode", "sealed"}}, "errors": [...]}``; an item it cannot read
    or that lies outside its pki_dir or roots is an error, never read.
    Changes nothing.
    """
    ret = {"items": {}, "errors": []}
    total = 0
    for item in items:
        try:
            cat = protocol.parse_item(item)[0]
            if cat not in ("minion_keys", "file_roots", "pillar_roots"):
                raise PeerError("only minion keys and roots files are collected")
            path = restore_target(mopts, item)[0]  # confined to its pki_dir or roots
            if not os.path.isfile(path):
                raise PeerError("not found")
            if os.path.getsize(path) > COLLECT_MAX_BYTES:
                raise PeerError(f"larger than {COLLECT_MAX_BYTES // 1024} KiB, more than a "
                                "return carries: copy it to the primary by hand, or keep it")
            with open(path, "rb") as fh:
                data = fh.read()
            total += len(data)
            if total > COLLECT_MAX_BYTES:
                raise PeerError(f"past {COLLECT_MAX_BYTES // 1024} KiB in one collect: ask "
                                "again")
            st = os.stat(path)
            sha = manifest.key_sha(data) if cat == "minion_keys" else \
                hashlib.sha256(data).hexdigest()
            ret["items"][item] = {"sha256": sha, "size": len(data),
                                  "mode": fsutil.safe_mode(st.st_mode & 0o7777),
                                  "sealed": seal.seal(reply_pub, data, receiver,
                                                      f"failback/{item}")}
        except backup.BackupError as exc:
            ret["errors"].append(str(exc))  # it names the item
        except (PeerError, OSError, fsutil.PathError, protocol.ProtocolError,
                seal.SealError, ValueError) as exc:
            ret["errors"].append(f"{item}: {exc}")
    return ret
