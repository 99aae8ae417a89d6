"""
Audit a minion's multi-master configuration.

The audit reads the minion's own configuration and cached master key and
changes nothing.  Expected values come from keyword arguments, else from the
pillar keys ``multimaster:masters`` and ``multimaster:master_finger``.
"""

import logging

log = logging.getLogger(__name__)

__virtualname__ = "multimaster"

try:
    import salt_multimaster

    HAS_CORE = True
except ImportError:
    HAS_CORE = False


def __virtual__():
    if HAS_CORE:
        return __virtualname__
    return (
        False,
        "multimaster: the salt_multimaster core is missing; pip install "
        "salt-multimaster, or run 'saltutil.sync_all' with the repository in file_roots",
    )


def version():
    """
    Return the version of salt-multimaster and where this module was loaded from.

    CLI Example:

    .. code-block:: bash

        salt '*' multimaster.version
    """
    return {"version": salt_multimaster.__version__, "module": __file__}


# ---------------------------------------------------------------------------
# Minion configuration helpers used by the multimaster states.  Everything
# below this line belongs to the states' logic; the audit lives above it.
# ---------------------------------------------------------------------------
