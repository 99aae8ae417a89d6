"""
Revocation on a peer master.  ``salt-key -r/-d`` on one master asks it to
rotate its AES session key (Salt's drop file, ``<cachedir>/.dfn``), so that
a minion whose key it rejected or deleted stops decrypting its publishes at
its next maintenance loop.  A sync that takes keys out of ``minions/`` on a
peer does the same there (:func:`after_apply`), unless that master's own
config sets ``rotate_aes_key: False``.  Plain functions, no Salt loader;
the Salt line's drop file is :func:`salt_multimaster.compat.dropfile`.
"""

import logging

from salt_multimaster import compat

log = logging.getLogger(__name__)

#: ``aes_rotation`` of an apply's reply: the drop file is there as the
#: master acts on it (or already taken), or the master's config turns it off
REQUESTED = "requested"
DISABLED = "disabled (rotate_aes_key: False in this master's config)"


class RevocationError(Exception):
    """The master was not asked to rotate its AES key; the message says why."""


def request_rotation(mopts):
    """
    Ask the master whose config is ``mopts`` to rotate its AES session key
    at its next maintenance loop, as ``salt-key`` does: :data:`REQUESTED`
    once its drop file is checked, :data:`DISABLED` when ``rotate_aes_key``
    is off there (Salt's ``salt-key`` writes nothing then either).  Raise
    :class:`RevocationError` when the master will not rotate.
    """
    if not mopts.get("rotate_aes_key", True):
        return DISABLED
    cachedir = mopts["cachedir"]
    try:
        compat.dropfile(cachedir, mopts.get("user"), mopts["id"])
    except OSError as exc:
        raise RevocationError(f"no drop file written in {cachedir}: {exc}") from None
    why = compat.dropfile_ignored(cachedir, mopts["id"])
    if why:
        raise RevocationError(f"{why}: the master ignores it (remove it)")
    return REQUESTED


def after_apply(mopts, report):
    """
    After an apply whose ``minion_keys`` report is ``report``: when it took
    keys out of ``minions/``, ask the master to rotate its AES key and
    return ``{"aes_rotation": ...}`` for the reply; else ``{}``.  A master
    not asked is an error of ``report`` (the keys stay removed).
    """
    ids = sorted(item.split("/", 1)[1] for item in report["removed"]
                 if item.startswith("minions/"))
    if not ids:
        return {}
    try:
        done = request_rotation(mopts)
    except RevocationError as exc:
        log.error("multimaster: AES key rotation not requested after revoking %s: %s",
                  ", ".join(ids), exc)
        report["errors"].append(
            f"{', '.join('minions/' + mid for mid in ids)}: removed, but this master's AES "
            f"session key is not rotated ({exc}): until it is (restart its salt-master), "
            "the revoked minion(s) still decrypt its publishes")
        return {}
    log.info("multimaster: revoked %s: AES key rotation %s", ", ".join(ids), done)
    return {"aes_rotation": done}
