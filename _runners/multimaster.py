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

import logging
import os

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
# Fleet audit (salt-run multimaster.audit).  Everything below this line
# belongs to the audit; sync/status live above it.
# ---------------------------------------------------------------------------
