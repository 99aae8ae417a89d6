"""
How the contents of a sync travel from the primary to a peer, without
Salt's loader: attached to the apply publish (sealed where secret) up to
:data:`INLINE_LIMIT`, else pulled by the peer over the request channel
(``peer_run`` ``multimaster.pull``) with a grant for that peer only
(grant, serve, revoke).  ``opts`` is the primary master's configuration.
"""

import json
import logging
import os
import secrets
import shutil
import time

from salt_multimaster import (fsutil, grants, layout, manifest, protocol, replicate, seal,
                              statefile)

log = logging.getLogger(__name__)

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


def peer_pub(opts, peer):
    """The peer minion's public key, as accepted on this master."""
    with open(os.path.join(opts["pki_dir"], "minions", peer), encoding="utf-8") as fh:
        return fh.read()


def content_path(opts, cat, fields):
    """Where the primary holds the content of an item (:func:`protocol.parse_item` fields)."""
    if cat == "minion_keys":
        return os.path.join(opts["pki_dir"], fields["state"], fields["id"])
    return manifest.locate(opts[cat][fields["env"]], fields["rel"])


def transport(opts, peer, ops, inline_limit, pull_min_files=None):
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
    from this master's fileserver, point-to-point too, unless they fit in
    ``inline_limit`` with the rest (``inline_files``: sealed in the request,
    one round trip less).
    """
    pullable = protocol.pull_allowed(opts.get("peer_run"), peer)
    files = [op for op in ops.get("file_roots", []) if op["op"] == replicate.WRITE]
    pull_files = pullable and (
        len(files) > (PULL_MIN_FILES if pull_min_files is None else pull_min_files)
        or sum(op.get("size", 0) for op in files) > PULL_MIN_BYTES)
    size = protocol.payload_size(ops)
    for cat in ("master_keys", "minion_keys", "pillar_roots"):
        for op in ops.get(cat, []):
            if size > inline_limit and pullable:
                break  # enough to decide (a stat per key of an initial sync: 0.16 s)
            if op["op"] != replicate.WRITE:
                continue
            if cat == "master_keys":
                size += MASTER_KEY_WEIGHT
                continue
            try:
                # sealed contents travel base64-encoded
                size += 4 * (op["size"] if "size" in op
                             else os.path.getsize(content_path(opts, cat, op))) // 3
            except (OSError, TypeError, KeyError):
                pass
    if size <= inline_limit and not pull_files:
        files_size = sum(4 * op.get("size", inline_limit) // 3 for op in files)
        return {"mode": "inline", "pull_files": False, "size": size, "error": None,
                "inline_files": bool(files) and size + files_size <= inline_limit}
    if pullable:
        return {"mode": "pull", "pull_files": pull_files, "size": size, "error": None}
    return {"mode": None, "pull_files": False, "size": size,
            "error": protocol.refusal(peer, size, inline_limit)}


def attach_contents(opts, peer, ops, primary, how):
    """
    Fill write operations with their contents, as :func:`transport`
    decided (``how``).  Private keys and pillar files are sealed to the
    peer's minion key (inside the sealed request as well); pulled contents
    are cut in chunks.  Return the chunks the peer pulls, or None.
    """
    pub = peer_pub(opts, peer)
    chunks = None
    if how["mode"] == "pull":
        bulk = ("minion_keys", "pillar_roots") + (("file_roots",) if how["pull_files"] else ())
        chunks = replicate.assign_chunks(
            [(cat, op) for cat in bulk for op in ops.get(cat, []) if op["op"] == replicate.WRITE])
    for cat, cat_ops in ops.items():
        for op in cat_ops:
            if op["op"] != replicate.WRITE or "pull" in op:
                continue
            if cat == "master_keys":
                path = primary[cat]["files"][op["kind"]]
            elif cat in ("minion_keys", "pillar_roots") or (
                    cat == "file_roots" and how.get("inline_files")):
                path = content_path(opts, cat, op)
            else:
                continue  # fetched by the peer from this master's fileserver
            with open(path, "rb") as fh:
                data = fh.read()
            if cat == "minion_keys" or op.get("kind") == "pub":
                op["data"] = data.decode()
            else:
                op["sealed"] = seal.seal(pub, data, peer, protocol.item_name(cat, op))
    return chunks


def pull_dir(opts):
    return os.path.join(opts["cachedir"], "multimaster", "pull")


def grant(opts, peer, ops, chunks):
    """
    Let ``peer`` pull, for ten minutes, the operations of its sync and the
    contents cut in ``chunks``; return the token naming the grant.
    """
    token = secrets.token_hex(16)
    body = {"peer": peer, "expires": time.time() + PULL_TTL, "ops": ops, "chunks": chunks}
    statefile.write(os.path.join(pull_dir(opts), token), json.dumps(body),
                    root=layout.state_dir(opts))
    return token


def _valid_grant(body):
    return isinstance(body, dict) and isinstance(body.get("peer"), str) and isinstance(
        body.get("expires"), (int, float)) and isinstance(body.get("chunks"), list)


def revoke(opts, token, jid_dir):
    """
    End a pull grant, and drop from the job cache (local_cache) the sealed
    chunks its pulls stored there: tens of MiB each, kept ``keep_jobs``
    hours otherwise.  ``jid_dir(jid)``: a job's directory in the job cache.
    """
    if opts.get("master_job_cache", "local_cache") == "local_cache":
        for jid in grants.jids(pull_dir(opts), token):
            shutil.rmtree(jid_dir(jid), ignore_errors=True)
    base = os.path.join(pull_dir(opts), token)
    for path in (base, f"{base}{grants.JIDS_SUFFIX}"):
        fsutil.remove(path)


def sweep_grants(opts, jid_dir):
    """Revoke the expired pull grants of syncs that never revoked them (killed)."""
    for token in grants.expired(pull_dir(opts), ttl=PULL_TTL):
        log.info("multimaster: revoking the expired pull grant %s", token)
        try:
            revoke(opts, token, jid_dir)
        except OSError as exc:
            log.warning("multimaster: expired pull grant %s not revoked: %s", token, exc)


def pulled(opts, token, chunks):
    """``(chunks served, items in them)`` of the grant ``token`` so far."""
    served = min(len(grants.jids(pull_dir(opts), token)), len(chunks))
    return served, sum(len(chunk) for chunk in chunks[:served])


def serve_pull(opts, request, caller, jid):
    """
    The reply to a peer's ``multimaster.pull``: the chunk it asks of its
    grant, sealed to its minion key, or ``{"error": ...}``.
    """
    try:
        token, index = protocol.open_pull_request(request)
        body = statefile.read(os.path.join(pull_dir(opts), token), _valid_grant)
        items = body["chunks"][index]
    except (statefile.Damaged, ValueError, KeyError, TypeError, IndexError):
        return {"error": "unknown or malformed pull request"}
    if body["peer"] != caller or body["expires"] < time.time():
        log.warning("multimaster: pull refused for %s", caller)
        return {"error": f"no pull grant for {caller}"}
    contents, missing = {}, []
    for item in items:
        try:
            cat, fields = protocol.parse_item(item)
            with open(content_path(opts, cat, fields), "rb") as fh:
                contents[item] = fh.read()
        except (OSError, TypeError, KeyError, protocol.ProtocolError):
            missing.append(item)
    if jid:
        # the sync drops this job's stored return (the sealed chunk) from the
        # job cache once the peer has applied it
        with open(os.path.join(pull_dir(opts), f"{token}{grants.JIDS_SUFFIX}"), "a",
                  encoding="utf-8") as fh:
            fh.write(f"{jid}\n")
    return protocol.seal_pull_reply(peer_pub(opts, caller), caller, token, contents, missing,
                                    ops=body["ops"] if index == 0 else None)
